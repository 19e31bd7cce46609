"""Checkpoints are atomic, complete, and restore model, optimizer, RNG and state."""

import os

import torch

from rollyard import checkpoint
from rollyard.model.loading import build_preset, char_tokenizer


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
    """The tiny preset ties its LM head to the embedding (as SmolLM2 and Gemma 3 do): the snapshot clones that
    tensor once and the file holds it once (Gemma 3: 0.67 GB less in memory and on disk); load ties it back."""
    model, opt = _model_and_opt()
    assert checkpoint.tied_aliases(model) == {"lm_head.weight"}
    snap = checkpoint.snapshot(checkpoint.TrainState(step=1), model, opt, copy=True)
    assert "lm_head.weight" not in snap.model and "model.embed_tokens.weight" in snap.model
    ptrs = [t.untyped_storage().data_ptr() for t in snap.model.values()]
    assert len(set(ptrs)) == len(ptrs)  # each its own storage, none the live model's
    assert not set(ptrs) & {p.untyped_storage().data_ptr() for p in model.parameters()}
    untied = build_preset("tiny", char_tokenizer(), max_position_embeddings=32)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert checkpoint.tied_aliases(untied) == set()  # an untied head is its own tensor: written as before
    assert "lm_head.weight" in checkpoint.model_tensors(untied)
    names = set(snap.model)
    path = checkpoint.write(tmp_path, snap)
    assert snap.model == {} and snap.optim == {}  # a background write's copies let go of once written
    written = checkpoint.load_file(str(path / checkpoint.MODEL))
    assert written.keys() == names
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


def test_a_write_that_ends_before_the_model_changes_reads_the_live_tensors():
    """``model_tensors(copy=False)`` (the synchronous save, and the run's last checkpoint) hands over each parameter
    alone on its storage as the live tensor, no copy; a view into a larger storage is copied (safetensors writes
    whole storages); the tied alias is left out either way."""
    model, _ = _model_and_opt()
    live = dict(model.named_parameters())
    got = checkpoint.model_tensors(model, copy=False)
    assert "lm_head.weight" not in got
    assert all(got[n].data_ptr() == live[n].data_ptr() for n in got if n in live)
    copied = checkpoint.model_tensors(model)
    assert all(copied[n].data_ptr() != live[n].data_ptr() and torch.equal(copied[n], live[n]) for n in copied if n in live)
    w = model.model.layers[0].mlp.down_proj.weight
    big = torch.nn.Parameter(torch.cat([w.detach().flatten(), torch.zeros(7)]))
    model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(big.detach()[:w.numel()].view_as(w))
    got = checkpoint.model_tensors(model, copy=False)
    view = got["model.layers.0.mlp.down_proj.weight"]
    assert view.untyped_storage().nbytes() == view.numel() * view.element_size() and torch.equal(view, w)
