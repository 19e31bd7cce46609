"""A data-parallel trainer rank that dies is named in one line (rank, how, step, resume command), with
no traceback from any rank; a driver killed with -9 leaves no rank behind and no rank traceback.

The runs are real ``rollyard train`` subprocesses in their own session, so every process of the run
(driver, spawned ranks, reward workers) writes to the stderr the test reads and can be found after."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import faults
import pytest

pytestmark = pytest.mark.slow

ARGS = ["model.context=48", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false",
        "reward.num_workers=1", "trainer.dp=2", "checkpoint_every=2", "log.plots=false", "trainer.lr=2e-3"]


def _train(args: list[str], fault_dir: Path | None = None, at: int = 0, slow_writes_s: float = 0.0) -> subprocess.Popen:
    """``rollyard train ARGS`` in a session of its own; ``slow_writes_s``: its background checkpoint writes start
    that late (``faults.slow_checkpoint_writes``)."""
    here = Path(__file__).resolve().parent
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.pathsep.join([str(here.parent / "src"), str(here)])}
    if fault_dir is not None:
        env.update(ROLLYARD_FAULT_DIR=str(fault_dir), ROLLYARD_FAULT_AT=str(at))
    main = ["-m", "rollyard.cli", "train"] if not slow_writes_s else [
        "-c", f"import sys, faults; faults.slow_checkpoint_writes({slow_writes_s}); from rollyard.cli import main; "
              f"sys.exit(main(['train', *sys.argv[1:]]))"]
    return subprocess.Popen([sys.executable, *main, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _session_alive(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # session id; zombies are not running
            out.append(int(entry))
    return out


def test_a_dead_rank_is_one_line_with_the_step_and_the_resume_command(tmp_path):
    run = tmp_path / "run"
    # 8 reward calls a step: call 20 is in step 2, after checkpoint step_000002 was handed to the background writer,
    # whose writes start 4 s late here: the rank dies while step_000002 is not on disk yet, and the line names it
    # (the run's end waits for the write in flight before it says where to resume from)
    proc = _train([*ARGS, "steps=6", f"reward.hook={faults.HOOKS}:kill_dp_rank", f"out_dir={run}"], tmp_path, 20,
                  slow_writes_s=4.0)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("rollyard train: error: data-parallel trainer rank 1 (pid ")
    assert "killed by SIGKILL during step 2" in lines[0]
    assert f"the latest checkpoint is step_000002: resume with rollyard train --resume {run}" in lines[0]
    proc = _train(["--resume", str(run), "steps=3"])  # the command it names works
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert [r["step"] for r in map(__import__("json").loads, (run / "metrics.jsonl").read_text().splitlines())] \
        == [0, 1, 2]


def test_a_driver_killed_with_9_leaves_no_rank_and_no_rank_traceback(tmp_path):
    proc = _train([*ARGS, "steps=6", f"reward.hook={faults.HOOKS}:kill_trainer", f"out_dir={tmp_path / 'run'}"],
                  tmp_path, 12)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -9
    deadline = time.monotonic() + 30
    while _session_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_alive(proc.pid) == []  # rank 1 (and the reward worker) went with the driver
    assert "Traceback" not in err and "Error" not in err, err
