"""Checkpoints are atomic, complete, and restore model, optimizer, RNG and state."""

import os

import pytest
import torch

from rollyard import checkpoint
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.telemetry import rundir


def _model_and_opt():
    model = build_preset("tiny", char_tokenizer(), max_position_embeddings=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss
    loss.backward()
    opt.step()
    return model, opt


def test_save_load_round_trip(tmp_path):
    model, opt = _model_and_opt()
    state = checkpoint.TrainState(step=3, version=3, cursor={"epoch": 1, "index": 5, "size": 10, "seed": 0})
    torch.manual_seed(123)
    path = checkpoint.save(tmp_path, state, model, opt, extra_rng={"engine": torch.Generator().manual_seed(9).get_state()})
    expected_draw = torch.rand(3)

    model2, opt2 = _model_and_opt()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)
    torch.manual_seed(999)
    got, extra = checkpoint.load(path, model2, opt2)
    assert got == state
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n
    assert model2.lm_head.weight.data_ptr() == model2.model.embed_tokens.weight.data_ptr()  # still tied
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)
    assert torch.equal(torch.rand(3), expected_draw)  # RNG restored
    assert torch.equal(extra["engine"], torch.Generator().manual_seed(9).get_state())


def test_a_tied_head_is_held_and_written_once_and_tied_back_on_load(tmp_path):
    """The tiny preset ties its LM head to the embedding (as SmolLM2 and Gemma 3 do): the snapshot holds that
    tensor once and the file holds it once (Gemma 3: 0.67 GB less in memory and on disk); load ties it back.
    A copy=True snapshot holds the live model tensors (no copy: stage_model writes them before the next step)."""
    model, opt = _model_and_opt()
    assert checkpoint.tied_aliases(model) == {"lm_head.weight"}
    snap = checkpoint.snapshot(checkpoint.TrainState(step=1), model, opt, copy=True)
    assert "lm_head.weight" not in snap.model and "model.embed_tokens.weight" in snap.model
    ptrs = [t.untyped_storage().data_ptr() for t in snap.model.values()]
    assert len(set(ptrs)) == len(ptrs)  # each its own storage: the live model's, not a copy
    assert set(ptrs) <= {p.untyped_storage().data_ptr() for p in model.state_dict().values()}
    assert "model.embed_tokens.weight" in checkpoint.model_tensors(model)
    assert not set(ptrs) & {t.untyped_storage().data_ptr() for t in checkpoint.model_tensors(model).values()}
    with pytest.raises(RuntimeError, match="stage_model"):  # the live model is staged before it is written
        checkpoint.write(tmp_path / "unstaged", snap)
    checkpoint.stage_model(tmp_path, snap)
    assert snap.model == {} and (snap.staged / checkpoint.MODEL).is_file()
    snap.model = {k: v.clone() for k, v in checkpoint.model_tensors(model).items()}  # for the checks below
    untied = build_preset("tiny", char_tokenizer(), max_position_embeddings=32)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert checkpoint.tied_aliases(untied) == set()  # an untied head is its own tensor: written as before
    assert "lm_head.weight" in checkpoint.model_tensors(untied)
    path = checkpoint.write(tmp_path, snap)
    written = checkpoint.load_file(str(path / checkpoint.MODEL))
    assert written.keys() == snap.model.keys() and all(torch.equal(written[k], snap.model[k]) for k in written)
    model2, opt2 = _model_and_opt()
    with torch.no_grad():
        model2.model.embed_tokens.weight.add_(1.0)
    checkpoint.load(path, model2, opt2)
    assert model2.lm_head.weight is model2.model.embed_tokens.weight
    assert torch.equal(model2.lm_head.weight, model.lm_head.weight)


def test_crash_mid_write_keeps_previous(tmp_path, monkeypatch):
    model, opt = _model_and_opt()
    first = checkpoint.save(tmp_path, checkpoint.TrainState(step=1), model, opt)

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    try:
        checkpoint.save(tmp_path, checkpoint.TrainState(step=2), model, opt)
    except OSError:
        pass
    assert checkpoint.latest(tmp_path) == first
    assert not (tmp_path / "checkpoints" / "step_000002.tmp").exists()  # a failed write cleans up after itself
    (tmp_path / "checkpoints" / "step_000002.tmp").mkdir()  # what a process killed mid-write leaves
    assert checkpoint.latest(tmp_path) == first  # ... is never read
    monkeypatch.undo()
    second = checkpoint.save(tmp_path, checkpoint.TrainState(step=2), model, opt)
    assert checkpoint.latest(tmp_path) == second
    assert not (tmp_path / "checkpoints" / "step_000002.tmp").exists()


def test_keeps_newest(tmp_path):
    model, opt = _model_and_opt()
    for step in range(1, 5):
        checkpoint.save(tmp_path, checkpoint.TrainState(step=step), model, opt, keep=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000003", "step_000004"]


def test_a_staged_model_holds_the_snapshots_step_and_a_failed_stage_is_the_writes_error(tmp_path, monkeypatch):
    """copy=True: the model file is written from the live tensors by stage_model (Writer.submit, on the caller's
    thread); an optimizer step after it does not reach the checkpoint. A stage that fails is raised by the write
    (one CheckpointWriteError, step_N.tmp removed), as a failure of the write itself is."""
    model, opt = _model_and_opt()
    want = {k: v.clone() for k, v in checkpoint.model_tensors(model).items()}
    snap = checkpoint.snapshot(checkpoint.TrainState(step=1), model, opt, copy=True)
    checkpoint.stage_model(tmp_path, snap)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    path = checkpoint.write(tmp_path, snap)
    written = checkpoint.load_file(str(path / checkpoint.MODEL))
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)
    assert checkpoint.verify(path) is None

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    snap = checkpoint.snapshot(checkpoint.TrainState(step=2), model, opt, copy=True)
    monkeypatch.setattr(checkpoint, "save_file", boom)
    checkpoint.stage_model(tmp_path, snap)  # never raises: kept for the write
    monkeypatch.undo()
    with pytest.raises(checkpoint.CheckpointWriteError, match="disk is full"):
        checkpoint.write(tmp_path, snap)
    assert sorted(p.name for p in (tmp_path / rundir.CHECKPOINTS).iterdir()) == ["step_000001"]
