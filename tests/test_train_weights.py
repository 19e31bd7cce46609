"""model/train_weights.py: the training forward's weights cast and stacked once per step under autocast."""

import contextlib
import copy

import pytest
import torch

from rollyard.model import fast, train_weights
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample

TOK = char_tokenizer()


def _parts(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(r, 24, generator=g)) for r in (24, 8, 8)]


def _grads_through(stack, parts, x):
    for p in parts:
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, stack(parts))
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), [p.grad.clone() for p in parts]


def test_the_cast_stack_gives_autocasts_values_and_gradients_bit_for_bit():
    """Under bf16 autocast: the same output and the same fp32 gradient of every part as autocast's own cast of
    torch.cat (a cast is elementwise, the gradient's rows go back to their parts), inside a step's cache and outside."""
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(3))
    parts = _parts()
    want_y, want_g = _grads_through(lambda ps: torch.cat(ps), parts, x)
    for ctx in (contextlib.nullcontext(), train_weights.step_cache()):
        with ctx:
            got_y, got_g = _grads_through(lambda ps: train_weights.weight(*ps), parts, x)
        assert got_y.dtype == torch.bfloat16 and torch.equal(got_y, want_y)
        for a, b in zip(got_g, want_g):
            assert a.dtype == torch.float32 and torch.equal(a, b)


def test_inside_a_step_each_stack_is_built_once_and_outside_every_call(monkeypatch):
    built = []
    real = train_weights._stacked
    monkeypatch.setattr(train_weights, "_stacked", lambda d, ps: built.append(len(ps)) or real(d, ps))
    parts = _parts()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with train_weights.step_cache():
            a, b = train_weights.weight(*parts), train_weights.weight(*parts)
            c = train_weights.weight(parts[0])
            assert a.data_ptr() == b.data_ptr() and a is not b and c.data_ptr() != a.data_ptr()
        assert built == [3, 1]
        train_weights.weight(*parts)
        train_weights.weight(*parts)
    assert built == [3, 1, 3, 3]
    assert train_weights.weight(*parts).dtype == torch.float32  # no autocast: the plain fp32 stack
    assert train_weights.weight(parts[0]) is parts[0]


def _samples(seed: int, n: int = 12) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(4, len(TOK), (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(4, len(TOK), (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(id=f"s{i}", request_id=f"r{i // 3}", prompt_ids=p, completion_ids=c, logprobs=[-1.0] * len(c),
                          versions=[0] * len(c), finish_reason="stop", advantage=float(torch.randn(1, generator=g))))
    return out


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_bf16_trainer_step_is_the_same_with_the_step_cache_as_with_autocasts_own_casts(monkeypatch, checkpointing):
    """A bf16 trainer step over several micro-batches (activation checkpointing recomputes each layer in the
    backward): the accumulated gradients with the weights cast once per step equal, bit for bit, those of the
    training forward that stacks fp32 weights per call and lets autocast cast them (the forward before the cache)."""
    model = build_preset("tiny", TOK, seed=4, max_position_embeddings=128)
    kw = dict(lr=1e-3, precision="bf16", micro_batch_tokens=48, activation_checkpointing=checkpointing)
    grads = []
    for plain in (False, True):
        if plain:  # autocast casts every call: stack in fp32 as the forward did, no cache
            monkeypatch.setattr(fast.train_weights, "weight", lambda *ps: ps[0] if len(ps) == 1 else torch.cat(ps))
            monkeypatch.setattr(train_weights, "step_cache", contextlib.nullcontext)
        t = Trainer(copy.deepcopy(model), **kw)
        acc = t.accumulate_gradients(_samples(5))
        assert acc["micro_batches"] >= 2
        grads.append({n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None})
    cached, plain = grads
    assert cached.keys() == plain.keys() and len(cached) > 10
    for n in cached:
        assert torch.equal(cached[n], plain[n]), n
