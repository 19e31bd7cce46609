"""trainer/head.py's HeadLogprobsBf16: under CPU bf16 autocast the LM head's logprobs and gradients are the
checkpointed autograd path's: bit for bit where the compiled kernels do not run (then it runs autograd's operations),
to float rounding where they do (the softmax statistics and the gradient read from the bf16 product, no fp32 copy);
and so are the weights after optimizer steps of a tied-embedding model."""

from __future__ import annotations

import pytest
import torch

from rollyard.model import kernels as cpu_kernels
from rollyard.trainer import head as head_grad
from rollyard.trainer import logprobs


@pytest.fixture
def no_kernels(monkeypatch):
    """A process where the compiled kernels are not loaded (another compiler, a build that failed)."""
    monkeypatch.setitem(cpu_kernels._STATE, "lib", None)


@pytest.fixture
def with_kernels():
    if cpu_kernels.kernel() is None:
        pytest.skip("the compiled CPU kernels do not load here")


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
def test_bf16_values_and_gradients_are_autograds_bit_for_bit(no_kernels, T, chunk, h_dtype):
    lm, h, y, w = _case(h_dtype=h_dtype)
    new = _run(lm, h, y, w, T, chunk, new=True)
    old = _run(lm, h, y, w, T, chunk, new=False)
    for a, b in zip(new, old):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert new[3].abs().max() > 1e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("T, chunk, h_dtype", [(1.0, 8, torch.float32), (0.7, 37, torch.float32),
                                               (1.3, 1000, torch.float32), (1.0, 10, torch.bfloat16)])
def test_with_the_kernels_values_and_gradients_are_autograds_to_rounding(with_kernels, T, chunk, h_dtype):
    """The kernels' path (the statistics and the gradient from the bf16 product, its last chunk kept for the
    backward): autograd's log-probs to fp32 rounding, the entropy nearer exact arithmetic than autograd's, its
    gradients to a bf16 rounding of a few of the logits' gradients (the exp rounds unlike torch's, so an element may
    round to the neighbouring bf16)."""
    lm, h, y, w = _case(N=37, D=24, V=1001, h_dtype=h_dtype)  # V: 62 vectors of 16 and a tail of 9
    new = _run(lm, h, y, w, T, chunk, new=True)
    old = _run(lm, h, y, w, T, chunk, new=False)
    assert _rel(new[0], old[0]) < 1e-5
    # the entropy against exact arithmetic on the same bf16 logits (autograd's path takes its sum in a bf16 bmm)
    z = (h.detach().to(torch.bfloat16) @ lm.weight.detach().to(torch.bfloat16).t()).double() / T
    exact = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    assert _rel(new[1], exact) < 1e-5 and _rel(old[1], exact) > _rel(new[1], exact)
    assert _rel(new[2], old[2]) < 1e-3 and _rel(new[3], old[3]) < 1e-3
    assert new[3].abs().max() > 1e-2 and new[2].dtype == old[2].dtype and new[3].dtype == old[3].dtype


def test_a_dropped_chunk_is_seen(no_kernels):
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
def test_weights_after_three_steps_are_the_old_paths_bit_for_bit(no_kernels, precision, micro_batch_tokens, chunk,
                                                                  monkeypatch):
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


def test_with_the_kernels_the_weights_after_three_steps_are_the_old_paths_to_rounding(with_kernels, monkeypatch):
    """Three optimizer steps of a tied-embedding model through the kernels' bf16 head, several micro-batches and
    head chunks: every weight within a few bf16 roundings of autograd's path, and the steps moved them."""
    from rollyard.model.loading import build_preset, char_tokenizer
    before = build_preset("tiny", char_tokenizer(), seed=0, max_position_embeddings=32).state_dict()
    new, m_new = _train("bf16", True, 40, 7, monkeypatch)
    old, m_old = _train("bf16", False, 40, 7, monkeypatch)
    assert m_new["micro_batches"] == m_old["micro_batches"] > 1
    moved = max((old[k].double() - before[k].double()).abs().max().item() for k in old)
    off = max((new[k].double() - old[k].double()).abs().max().item() for k in old)
    assert moved > 1e-2 and off < 0.05 * moved, (moved, off)
