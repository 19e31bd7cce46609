"""Checkpoints written in the background (``checkpoint_async``, the default): the same checkpoint as the
synchronous path, a snapshot rather than the live state, a crash mid-write leaving the previous one whole, and a
failed write ending the run in one line. No timing is asserted: the tests gate the writer instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollyard import checkpoint
from rollyard.checkpoint_writer import Writer
from rollyard.cli import main
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.telemetry import rundir
from rollyard.waits import NoAnswer

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["model.context=48", "data.train_size=32", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "sft.auto=false", "progress=false",
        "reward.num_workers=1", "log.plots=false"]


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rollyard-checkpoint")]


def _contents(ckpt: Path) -> tuple:
    """What a resume reads from checkpoint ``ckpt``: model tensors, optimizer state, RNG states, state.json."""
    return (load_file(str(ckpt / checkpoint.MODEL)), torch.load(ckpt / checkpoint.OPTIM, weights_only=True),
            torch.load(ckpt / checkpoint.RNG, weights_only=True), json.loads((ckpt / checkpoint.STATE).read_text()))


def _assert_same(a, b, where: str = "") -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _rows(run: Path, name: str = rundir.METRICS) -> list[dict]:
    return list(rundir.read_jsonl(run / name))


# ------------------------------------------------------------------ (a) async and sync checkpoints resume alike
def test_a_run_resumed_from_a_background_checkpoint_equals_one_resumed_from_a_synchronous_one(tmp_path):
    runs = {}
    for mode in ("true", "false"):
        run = tmp_path / mode
        assert main(["train", *TINY, "steps=2", "checkpoint_every=1", f"checkpoint_async={mode}", f"out_dir={run}"]) == 0
        assert not _writer_threads()  # joined at the run's end
        runs[mode] = run
    bg, sync = runs["true"], runs["false"]
    assert json.loads((bg / rundir.SUMMARY).read_text())["checkpoint_write_seconds"] > 0  # it ran in the background
    assert "checkpoint_write_seconds" not in json.loads((sync / rundir.SUMMARY).read_text())
    # checkpoint 1's write, collected when checkpoint 2 was due: in row 1, beside the step's own figures
    assert [r["step"] for r in _rows(bg) if "checkpoint/write_seconds" in r] == [1]
    assert not any("checkpoint/write_seconds" in r for r in _rows(sync))
    _assert_same(_contents(bg / rundir.CHECKPOINTS / "step_000002"), _contents(sync / rundir.CHECKPOINTS / "step_000002"))
    for run in (bg, sync):
        assert main(["train", "--resume", str(run), "steps=3"]) == 0
    _assert_same(_contents(bg / rundir.CHECKPOINTS / "step_000003"), _contents(sync / rundir.CHECKPOINTS / "step_000003"))
    for name in (rundir.METRICS, rundir.LENGTHS):  # the same prompts next, the same losses and rewards
        keys = ("step", "reward", "loss", "prompt_lengths", "response_lengths")
        assert ([{k: r.get(k) for k in keys} for r in _rows(bg, name)]
                == [{k: r.get(k) for k in keys} for r in _rows(sync, name)])
    assert [r["step"] for r in _rows(bg)] == [0, 1, 2]


# -------------------------------------------------------- (c) the snapshot is a copy, not the live training state
def _model_and_opt():
    model = build_preset("tiny", char_tokenizer(), max_position_embeddings=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train_step(model, opt) -> None:
    loss = model(torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def _gated(go: threading.Event, started: threading.Event):
    """A ``Writer`` write hook that writes only once ``go`` is set (``started`` says it has the snapshot)."""
    def write(run_dir, snap, keep):
        started.set()
        assert go.wait(timeout=120), "the test never released the writer"
        return checkpoint.write(run_dir, snap, keep)
    return write


def test_the_next_optimizer_step_does_not_reach_a_checkpoint_being_written(tmp_path):
    model, opt = _model_and_opt()
    _train_step(model, opt)
    state = checkpoint.TrainState(step=1, version=1, cursor={"index": 3})
    want_model = {k: v.clone() for k, v in model.state_dict().items() if k not in checkpoint.tied_aliases(model)}
    want_optim = checkpoint._cpu_copy(opt.state_dict())
    go, started = threading.Event(), threading.Event()
    writer = Writer(write=_gated(go, started))
    writer.submit(tmp_path, checkpoint.snapshot(state, model, opt, copy=True), keep=2)
    try:
        assert started.wait(timeout=120)
        _train_step(model, opt)  # in place: the weights and AdamW's moments change while the write is pending
        state.step, state.cursor["index"] = 2, 9
        assert not torch.equal(model.model.embed_tokens.weight, want_model["model.embed_tokens.weight"])
    finally:
        go.set()
    done = writer.wait()
    assert done.error is None and done.path == tmp_path / rundir.CHECKPOINTS / "step_000001" and done.seconds >= 0
    assert checkpoint.verify(done.path) is None
    tensors, optim, _, saved = _contents(done.path)
    _assert_same(tensors, want_model)
    _assert_same(optim, want_optim)
    assert saved["step"] == 1 and saved["cursor"] == {"index": 3}
    assert not _writer_threads()


def test_a_write_that_does_not_finish_is_said_then_bounded(tmp_path, capsys):
    model, opt = _model_and_opt()
    go, started = threading.Event(), threading.Event()
    writer = Writer(write=_gated(go, started), bound_s=1.0, say_after_s=0.2)
    writer.submit(tmp_path, checkpoint.snapshot(checkpoint.TrainState(step=1), model, opt, copy=True), keep=2)
    try:
        with pytest.raises(NoAnswer) as e:
            writer.wait()
        assert "checkpoint step 1" in str(e.value) and f"--resume {tmp_path}" in str(e.value)
        assert "waiting for the checkpoint writer thread" in capsys.readouterr().err
        assert not writer.in_flight and writer.wait() is None  # abandoned: the run's end does not wait again
        assert checkpoint.latest(tmp_path) is None  # nothing published meanwhile
    finally:
        go.set()
        for t in _writer_threads():
            t.join(timeout=60)
    assert not _writer_threads()


# ------------------------------------------------------ (b) a crash during the background write, then the resume
CHILD = """
import sys, threading, time
from pathlib import Path
from rollyard import checkpoint
from rollyard.cli import main

marker, real, calls = Path(sys.argv[1]), checkpoint.save_file, []

def save_then_hang(tensors, path):  # checkpoint 2's write stops half-way: model file written, the rest never
    real(tensors, path)
    calls.append(path)
    if len(calls) == 2:
        tmp = marker.with_suffix(".tmp")  # written whole, then renamed: the test sees the marker with its text
        tmp.write_text(threading.current_thread().name)
        tmp.rename(marker)
        time.sleep(600)

checkpoint.save_file = save_then_hang
sys.exit(main(["train", *sys.argv[2:]]))
"""


def test_a_crash_during_the_background_write_leaves_the_previous_checkpoint_and_the_resume_picks_it(tmp_path, capsys):
    run, marker = tmp_path / "run", tmp_path / "hung"
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(marker), *TINY, "steps=4", "checkpoint_every=1",
                             f"out_dir={run}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), f"the write never started: rc {proc.poll()}"
    finally:
        proc.kill()  # SIGKILL, mid-write
        _, err = proc.communicate(timeout=60)
    assert marker.read_text() == "rollyard-checkpoint-2"  # it hung in the background writer, not the step
    root = run / rundir.CHECKPOINTS
    assert (root / "step_000002.tmp" / checkpoint.MODEL).exists() and not (root / "step_000002").exists()
    assert checkpoint.latest(run).name == "step_000001" and checkpoint.verify(root / "step_000001") is None
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    assert "from step_000001" in capsys.readouterr().out
    assert [r["step"] for r in _rows(run)] == [0, 1, 2, 3]  # nothing lost, nothing trained twice
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000004"]  # the .tmp cleaned up
    assert not _writer_threads()


# ----------------------------------------------------- (d) a failed background write ends the run in one line
@pytest.mark.parametrize("steps", [4, 2], ids=["mid-run", "at-the-end"])
def test_a_failed_background_write_ends_the_run_in_one_line(tmp_path, capsys, monkeypatch, steps):
    real, calls = checkpoint.save_file, []

    def fail_the_second(tensors, path):  # not a disk error: a library's own failure, in the writer thread
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            raise RuntimeError("boom in the writer")
        real(tensors, path)

    monkeypatch.setattr(checkpoint, "save_file", fail_the_second)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", *TINY, f"steps={steps}", "checkpoint_every=1", f"out_dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rollyard train: error: cannot write checkpoint step 2"), err
    assert "RuntimeError: boom in the writer" in err[0] and f"resume from step_000001 with --resume {run}" in err[0]
    # the run's last checkpoint is written on the main thread, from the live tensors (no copy: the run waits for it)
    assert calls == ["rollyard-checkpoint-1", "rollyard-checkpoint-2" if steps == 4 else "MainThread"]
    assert checkpoint.latest(run).name == "step_000001"
    assert sorted(p.name for p in (run / rundir.CHECKPOINTS).iterdir()) == ["step_000001"]
    if steps == 4:  # found when checkpoint 3 was due: counted in that step's row, then the run ended
        assert [(r["step"], r.get("checkpoint/failed")) for r in _rows(run)] == [(0, None), (1, None), (2, 1)]
        assert [r["step"] for r in _rows(run) if "checkpoint/write_seconds" in r] == [1, 2]
    assert not _writer_threads()
