"""``--resume`` checks before it cuts: the checkpoint is loaded into the run's model and optimizer
first, and only then are the run's records cut back to it. A refused resume leaves the run
directory byte for byte as it was (the lock file's pid aside)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from rollyard.cli import main
from rollyard.telemetry import rundir

TINY = ["model.context=48", "data.train_size=32", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false",
        "reward.num_workers=1", "log.plots=false"]


def _tree(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file() and p.name != rundir.LOCK}


def test_a_checkpoint_of_another_model_is_refused_in_one_line_and_no_record_is_lost(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "steps=3", "checkpoint_every=2", f"out_dir={run}"]) == 0
    shutil.rmtree(run / rundir.CHECKPOINTS / "step_000003")  # the latest checkpoint is step 2: records run to 3
    (run / rundir.SUMMARY).unlink()
    before = _tree(run)
    assert [r["step"] for r in rundir.read_jsonl(run / rundir.METRICS)] == [0, 1, 2]
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "model.name=small"]) == 2  # the checkpoint is another model's
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match the model" in err[0], err
    assert _tree(run) == before  # nothing cut, nothing written
    assert main(["train", "--resume", str(run)]) == 0  # the run's own model: cut back to step 2, step 2 again
    out = capsys.readouterr().out
    assert "removed records of steps after the checkpoint" in out
    assert [r["step"] for r in rundir.read_jsonl(run / rundir.METRICS)] == [0, 1, 2]


def test_the_start_up_line_states_the_cpu_kernels_as_run_json_does(tmp_path, capsys, monkeypatch):
    """As in a fresh process (the kernels not loaded yet): the line is printed once they are (it said 'not
    loaded' while run.json said 'on')."""
    import json
    import re

    from rollyard.model import kernels

    monkeypatch.setattr(kernels, "_STATE", {})
    monkeypatch.delenv("ROLLYARD_CPU_KERNELS", raising=False)
    assert main(["train", *TINY, "steps=1", f"out_dir={tmp_path / 'run'}"]) == 0
    said = re.search(r"; CPU kernels (.+?), oneDNN linear", capsys.readouterr().out)
    assert said
    recorded = json.loads((tmp_path / "run" / rundir.RUN_INFO).read_text())["kernels"]["cpu_kernels"]
    assert said.group(1) == recorded and recorded != "not loaded"
