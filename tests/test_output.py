"""What a run prints: without a terminal one complete line per step (or every log.progress_every
steps), full role names, nothing wrapped, no third-party progress bars; on a terminal the live bar."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys

import pytest

from rollyard.cli import main
from rollyard.telemetry import rundir
from rollyard.telemetry.report import step_line

TINY = ["model.context=48", "data.train_size=32", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "sft.auto=false", "reward.num_workers=1",
        "log.plots=false"]
ANSI = re.compile(r"\x1b\[")


def test_step_line_names_every_role_in_full():
    row = {"step": 3, "time/rollout": 0.4, "time/reward": 0.05, "time/train": 0.2, "time/sync": 0.0,
           "time/fsdp_gather": 0.01, "time/step": 0.7, "reward": 0.41, "reward/accuracy": 0.38}
    assert step_line(row) == ("rollout 0.400s | reward 0.050s | train 0.200s | sync 0.000s | fsdp_gather 0.010s | "
                              "step 0.70s | mean reward 0.41, accuracy 38%")


def test_without_a_terminal_one_complete_line_every_n_steps(tmp_path, capsys):
    assert main(["train", *TINY, "steps=5", "log.progress_every=2", f"out_dir={tmp_path / 'run'}"]) == 0
    out, err = capsys.readouterr()
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == ["step 1 (2/5)", "step 3 (4/5)", "step 4 (5/5)"]  # and the last
    for line in steps:  # one line each, longer than 80 columns and not wrapped, full role names
        assert len(line) > 80 and " rollout " in f" {line.split(': ', 1)[1]}" and "| train " in line
        assert line.rstrip().endswith("%")
    assert not ANSI.search(out) and "\r" not in out and "Writing model shards" not in out + err
    assert out.count(steps[-1]) == 1  # no repeated last line
    assert "run directory:" in out and "model/, metrics.jsonl" in out.split("run directory:")[1].splitlines()[0]
    # the summary's last rows: the step's wall time, and what of it no role of the driver's accounts for
    assert "in no role (driver)" in out and "of the step" in out and "step (wall)" in out
    rows = list(rundir.read_jsonl(tmp_path / "run" / rundir.METRICS))
    spans = [s for s in rundir.read_jsonl(tmp_path / "run" / rundir.SPANS) if s["worker"] == "driver"]
    for row in rows:  # colocated: a step's spans all lie in its window, so its time in them is their union
        mine = sorted((s["start"], s["end"]) for s in spans if s["step"] == row["step"])
        union, reached = 0.0, float("-inf")
        for a, b in mine:
            union += max(0.0, b - max(a, reached))
            reached = max(reached, b)
        assert 0.0 <= row[rundir.OUTSIDE_ROLES] <= row["time/step"]
        assert row[rundir.OUTSIDE_ROLES] == pytest.approx(row["time/step"] - union, abs=1e-3)


def test_a_terminal_keeps_the_live_view(tmp_path):
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "OMP_NUM_THREADS": "1"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "rollyard.cli", "train", *TINY, "steps=3",
                             f"out_dir={tmp_path / 'run'}"], stdin=slave, stdout=slave, stderr=slave, env=env,
                            close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=120) == 0
    shown = b"".join(chunks).decode(errors="replace")
    assert ANSI.search(shown) and "3/3" in shown and "RL" in shown  # rich's live bar, redrawn in place
    assert not re.search(r"^step \d+ \(\d+/3\):", shown, re.M)  # no per-step log lines on a terminal
