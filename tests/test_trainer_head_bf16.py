"""trainer/head.py's HeadLogprobsBf16: under CPU bf16 autocast the LM head's logprobs and gradients are the
checkpointed autograd path's bit for bit, and so are the weights after optimizer steps of a tied-embedding model."""

from __future__ import annotations

import pytest
import torch

from rollyard.trainer import head as head_grad
from rollyard.trainer import logprobs


def _case(N=37, D=24, V=101, seed=0, h_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lm = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        lm.weight.copy_(torch.randn(V, D, generator=g) * 0.5)
    h = torch.randn(N, D, generator=g).to(h_dtype).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    w = torch.randn(N, generator=g)
    return lm, h, y, w


def _run(lm, h, y, w, T, chunk, new: bool, with_entropy=True):
    """(lp, ent, h.grad, weight.grad) through the new Function or the checkpointed autograd path."""
    h.grad = lm.weight.grad = None
    applies = head_grad.applies_bf16
    if not new:
        head_grad.applies_bf16 = lambda *a: False
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, ent = logprobs.chunked_token_logprobs(h, lm, y, temperature=T, chunk=chunk, with_entropy=with_entropy)
    finally:
        head_grad.applies_bf16 = applies
    assert (type(lp.grad_fn).__name__ == "HeadLogprobsBf16Backward") == new
    (lp * w).sum().backward()
    return lp.detach(), ent, h.grad.clone(), lm.weight.grad.clone()


@pytest.mark.parametrize("T, chunk, h_dtype", [(1.0, 8, torch.float32), (0.7, 37, torch.float32),
                                               (1.3, 1000, torch.float32), (1.0, 10, torch.bfloat16)])
def test_bf16_values_and_gradients_are_autograds_bit_for_bit(T, chunk, h_dtype):
    lm, h, y, w = _case(h_dtype=h_dtype)
    new = _run(lm, h, y, w, T, chunk, new=True)
    old = _run(lm, h, y, w, T, chunk, new=False)
    for a, b in zip(new, old):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert new[3].abs().max() > 1e-2


def test_a_dropped_chunk_is_seen():
    """The comparison above is sharp: the weight gradient without one chunk's share differs."""
    lm, h, y, w = _case()
    _, _, _, full = _run(lm, h, y, w, 1.0, 8, new=True)
    w2 = w.clone()
    w2[:8] = 0  # the first chunk contributes nothing
    _, _, _, part = _run(lm, h, y, w2, 1.0, 8, new=True)
    assert not torch.equal(full, part)


def _samples(seed: int, vocab: int):
    import random

    from rollyard.types import Sample
    rng = random.Random(seed)
    out = []
    for i in range(8):
        if i % 4 == 0:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 9))]
        c = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 7))]
        out.append(Sample(id=f"s{i}", request_id=f"r{i // 4}", prompt_ids=prompt, completion_ids=c,
                          logprobs=[-1.0] * len(c), versions=[0] * len(c), finish_reason="stop",
                          advantage=rng.choice([-1.0, 0.5, 1.0])))
    return out


def _train(precision: str, new: bool, micro_batch_tokens: int, logprob_chunk: int, monkeypatch):
    """The weights after three steps, through this module's head (``new``) or the one before it: the checkpointed
    autograd path under bf16 autocast, and in fp32 HeadLogprobs returning its weight gradient to autograd."""
    from rollyard.model.loading import build_preset, char_tokenizer
    from rollyard.trainer.trainer import Trainer
    model = build_preset("tiny", char_tokenizer(), seed=0, max_position_embeddings=32)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as Gemma 3
    tr = Trainer(model, lr=1e-2, precision=precision, micro_batch_tokens=micro_batch_tokens,
                 logprob_chunk=logprob_chunk, optimizer_state="bf16")
    applies, give, ran = head_grad.applies_bf16, head_grad._give, []
    with monkeypatch.context() as mp:
        mp.setattr(head_grad, "applies_bf16", lambda *a: ran.append(applies(*a) and new) or ran[-1])
        mp.setattr(head_grad, "_give", give if new else (lambda weight, grad: grad))
        for step in range(3):
            m = tr.step(_samples(step, model.config.vocab_size))
    assert any(ran) == (new and precision == "bf16")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, m


@pytest.mark.parametrize("precision, micro_batch_tokens, chunk", [
    ("bf16", 4096, 7), ("bf16", 40, 4096), ("fp32", 4096, 7), ("fp32", 40, 7)])
def test_weights_after_three_steps_are_the_old_paths_bit_for_bit(precision, micro_batch_tokens, chunk, monkeypatch):
    """A tied-embedding model (the head's gradient meets the embedding lookup's), three optimizer steps, one or
    several micro-batches, several head chunks: every weight torch.equal to the path before this change's."""
    new, m_new = _train(precision, True, micro_batch_tokens, chunk, monkeypatch)
    old, m_old = _train(precision, False, micro_batch_tokens, chunk, monkeypatch)
    assert m_new["micro_batches"] == m_old["micro_batches"] and (micro_batch_tokens > 100 or m_new["micro_batches"] > 1)
    assert new.keys() == old.keys()
    assert all(torch.equal(new[k], old[k]) for k in new), [k for k in new if not torch.equal(new[k], old[k])]


def test_the_weight_gradient_cast_in_its_own_buffer_is_the_separate_buffers_bit_for_bit():
    """_weight_grad sums the chunks' bf16 products and casts them to fp32 inside the fp32 result (several blocks
    of rows here: V x D = 5000 x 1024, 16 MiB blocks): the same bits as a bf16 sum beside its fp32 cast."""
    g = torch.Generator().manual_seed(5)
    V, D, N, chunk = 5000, 1024, 23, 8
    hidden = torch.randn(N, D, generator=g)
    dzs = [(s, torch.randn(min(chunk, N - s), V, generator=g).to(torch.bfloat16)) for s in (16, 8, 0)]
    want = None
    for s, dz in dzs:
        part = torch.mm(dz.t(), hidden[s:s + chunk].to(torch.bfloat16))
        want = part if want is None else want + part
    got = head_grad._weight_grad(dzs, hidden, chunk, (V, D))
    assert got.dtype == torch.float32 and torch.equal(got, want.float())
