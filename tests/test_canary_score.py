"""The canary's two scores of the probe: the trainer's (its module's forward, the head at the completion only) equals
a full forward's log-softmax at the completion positions, with or without ``logits_to_keep``; the engine's runs its
prefill and a decode step through the fused copies and agrees with the trainer's to the kernels' rounding."""

from __future__ import annotations

import pytest
import torch

from rollyard.model import families
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.sync import canary

TOK = char_tokenizer()
KERNELS = 1e-5  # fp32 kernels' rounding, nats (as tests/test_canary.py)


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


class PlainForward(torch.nn.Module):
    """A module whose forward takes no ``logits_to_keep``: its logits cover every position."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, use_cache=False):
        return self.inner(input_ids=input_ids, use_cache=use_cache)


class CountingForward:
    """A fast forward that counts its prefill and decode calls."""

    def __init__(self, fwd):
        self.fwd, self.calls = fwd, []

    def __getattr__(self, name):
        return getattr(self.fwd, name)

    def prefill(self, *args, **kwargs):
        self.calls.append("prefill")
        return self.fwd.prefill(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self.calls.append("decode")
        return self.fwd.decode(*args, **kwargs)


def _model():
    return build_preset("small", TOK, seed=0, max_position_embeddings=64).eval()


def _full_forward_logprobs(model, probe) -> list[float]:
    ids = torch.tensor([probe.prompt_ids + probe.completion_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    P = len(probe.prompt_ids)
    return [float(lp[P - 1 + i, t]) for i, t in enumerate(probe.completion_ids)]


def test_the_trainer_side_equals_a_full_forward_at_the_completion_positions():
    model = _model()
    probe = canary.probe(model.config.vocab_size, 64)
    assert canary.keeps_logits(model) and not canary.keeps_logits(PlainForward(model))
    want = _full_forward_logprobs(model, probe)
    for m in (model, PlainForward(model)):
        got = canary.score(m, probe)
        assert len(got) == len(probe.completion_ids) and max(abs(a - b) for a, b in zip(got, want)) < KERNELS
    model.train()
    canary.score(model, probe)
    assert model.training  # the mode it was in is restored


def test_the_engine_side_runs_one_prefill_and_one_decode_step_and_reads_the_kernels_rounding():
    model = _model()
    probe = canary.probe(model.config.vocab_size, 64)
    fwd = CountingForward(families.fast_forward(model, torch.float32))
    got = canary.score_fast(fwd, probe)
    assert fwd.calls == ["prefill", "decode"]  # two passes over the weights; the decode kernels are in the probe
    assert max(abs(a - b) for a, b in zip(got, canary.score(model, probe))) < KERNELS
    # the same as scoring token by token (a prefill of the prompt, one decode step per token after the first)
    P, C = len(probe.prompt_ids), probe.completion_ids
    kv = fwd.new_cache(1, P + len(C))
    with torch.no_grad():
        steps = [fwd.prefill(torch.tensor([probe.prompt_ids]), kv, torch.tensor([0]), torch.tensor([P - 1]))[0]]
        steps += [fwd.decode(torch.tensor([t]), torch.tensor([P + i]), kv, P + i + 1)[0] for i, t in enumerate(C[:-1])]
    one_by_one = torch.log_softmax(torch.stack(steps), -1).gather(1, torch.tensor(C)[:, None])[:, 0].tolist()
    assert len(got) == len(C) and max(abs(a - b) for a, b in zip(got, one_by_one)) < KERNELS


def test_the_trainer_side_runs_the_trainers_fast_forward_where_it_matches_and_the_module_elsewhere(monkeypatch):
    model = _model()
    probe = canary.probe(model.config.vocab_size, 64)
    want = _full_forward_logprobs(model, probe)
    calls = []
    real = families.train_hidden
    monkeypatch.setattr(families, "train_hidden", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = canary.score(model, probe, forward=families.completion_logits)
    assert calls and max(abs(a - b) for a, b in zip(got, want)) < KERNELS
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a caller's autocast: the score stays the weights' fp32
        assert canary.score(model, probe, forward=families.completion_logits) == got
    for m in (PlainForward(model), _model()):  # no family; a hook the training forward would bypass
        if not isinstance(m, PlainForward):
            m.model.layers[0].mlp.register_forward_hook(lambda *a: None)
        calls.clear()
        got = canary.score(m, probe, forward=families.completion_logits)
        assert not calls and max(abs(a - b) for a, b in zip(got, want)) < KERNELS
