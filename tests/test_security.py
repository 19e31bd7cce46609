"""Issue 44's probes: nothing a checkpoint holds can run, a full disk is one line, nothing listens beyond
the machine, a tool's output is bounded. Each test plants the attack or the failure for real."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rollyard import checkpoint
from rollyard.cli import main
from rollyard.telemetry import rundir

TINY = ["model.context=48", "data.train_size=32", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "sft.auto=false", "progress=false",
        "reward.num_workers=1", "log.plots=false"]


def _one_line_exit_2(capsys, args: list[str]) -> str:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rollyard {args[0]}: error:") and "Traceback" not in err[0], err
    return err[0]


class _Planted:
    """What an attacker puts in a checkpoint: unpickling it calls os.system (creates ``marker``)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(ckpt: Path, name: str, marker: Path) -> None:
    """Replace ``ckpt/name`` with a pickle that runs code, keeping the real content beside it, and update
    the manifest's size and SHA-256 the way an attacker would (the manifest has no key)."""
    real = torch.load(ckpt / name, weights_only=True)
    torch.save({**real, "planted": _Planted(marker)} if isinstance(real, dict) else _Planted(marker), ckpt / name)
    manifest = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    manifest[name] = checkpoint._fingerprint(ckpt / name)
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", [checkpoint.RNG, checkpoint.OPTIM])
def test_a_planted_checkpoint_file_is_refused_and_nothing_runs(tmp_path, capsys, name):
    run, marker = tmp_path / "run", tmp_path / "pwned"
    assert main(["train", *TINY, "steps=1", "checkpoint_every=1", f"out_dir={run}"]) == 0
    ckpt = checkpoint.latest(run)
    _plant(ckpt, name, marker)
    assert checkpoint.verify(ckpt) is None  # the manifest is no defence: the planted file matches it
    line = _one_line_exit_2(capsys, ["train", "--resume", str(run), "steps=2"])
    assert f"refused to load {ckpt / name}" in line and "posix.system" in line and "nothing from it was run" in line
    assert not marker.exists()
    # the same file under the old loader (weights_only=False) would have run: the probe is live
    torch.load(ckpt / name, weights_only=False)
    assert marker.exists()


def _steps_recorded(run: Path) -> list[int]:
    return [r["step"] for r in rundir.read_jsonl(run / rundir.METRICS) if isinstance(r.get("step"), int)
            and "loss" in r]


def _full_disk_line_then_resume(capsys, run: Path, free_space) -> None:
    """The run stops at step 2's checkpoint with one line; nothing half-written stays; step 1's
    checkpoint is intact; after ``free_space()`` the resume finishes with every step trained once."""
    line = _one_line_exit_2(capsys, ["train", *TINY, "steps=3", "checkpoint_every=1", f"out_dir={run}"])
    root = run / rundir.CHECKPOINTS
    assert "the disk is full: checkpoint step 2 needs about" in line and f"under {root}" in line, line
    assert "is free" in line and f"resume from step_000001 with --resume {run}" in line
    assert sorted(p.name for p in root.iterdir()) == ["step_000001"]  # no step_000002.tmp left behind
    assert checkpoint.verify(root / "step_000001") is None
    free_space()
    assert main(["train", "--resume", str(run)]) == 0
    assert checkpoint.latest(run).name == "step_000003"
    assert _steps_recorded(run) == [0, 1, 2]  # nothing lost, nothing trained twice


def test_a_full_disk_at_a_checkpoint_is_one_line_and_resume_continues(tmp_path, capsys, monkeypatch):
    import faults
    faults.disk_fills_after(monkeypatch, saves=2)  # step 1's checkpoint (optimizer.pt, rng.pt) fits, step 2's not
    _full_disk_line_then_resume(capsys, tmp_path / "run", monkeypatch.undo)


def test_a_full_tmpfs_at_a_checkpoint_is_one_line_and_resume_continues(tmp_path, capsys):
    """The real thing: the run directory on a tmpfs that fills up between two checkpoints."""
    import subprocess
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (and a kernel that allows it here); the injected full disk "
                    "above covers the same path")
    try:
        run = mnt / "run"
        assert main(["train", *TINY, "steps=1", "checkpoint_every=1", f"out_dir={mnt / 'probe'}"]) == 0
        one = sum(f.stat().st_size for f in (mnt / "probe" / rundir.CHECKPOINTS).rglob("*") if f.is_file())
        subprocess.run(["rm", "-rf", str(mnt / "probe")], check=True)
        # room for the run's records and one checkpoint and a half: the second checkpoint does not fit
        filler = mnt / "filler"
        free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
        filler.write_bytes(b"\0" * (free - int(1.5 * one) - (256 << 10)))
        _full_disk_line_then_resume(capsys, run, filler.unlink)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
