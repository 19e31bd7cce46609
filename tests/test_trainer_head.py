"""trainer/head.py: the LM head's logprobs with a hand-written backward (one weight-sized gradient) give the
checkpointed autograd path's values and gradients, to float rounding, and are what ``chunked_token_logprobs``
uses for a plain head; a head it does not cover (soft cap, top-p) keeps the autograd path."""

from __future__ import annotations

import time

import pytest
import torch

from rollyard.trainer import head as head_grad
from rollyard.trainer import trainer


def _case(N=37, D=24, V=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lm = torch.nn.Linear(D, V, bias=False).to(dtype)
    with torch.no_grad():
        lm.weight.copy_(torch.randn(V, D, generator=g) * 0.5)
    h = (torch.randn(N, D, generator=g)).to(dtype).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    w = torch.randn(N, generator=g)  # a weighted sum: every row's gradient differs
    return lm, h, y, w


def _autograd_reference(lm, h, y, T):
    """log_softmax over the full logits, plain autograd (no chunks)."""
    logits = (h @ lm.weight.t()).float() / T
    lp = torch.log_softmax(logits, -1).gather(1, y[:, None])[:, 0]
    p = torch.softmax(logits, -1)
    return lp, -(p * torch.log_softmax(logits, -1)).sum(-1)


@pytest.mark.parametrize("T, chunk", [(1.0, 8), (0.7, 37), (1.3, 1000)])
def test_values_and_gradients_equal_autograd(T, chunk):
    lm, h, y, w = _case()
    lp, ent = trainer.chunked_token_logprobs(h, lm, y, temperature=T, chunk=chunk, with_entropy=True)
    assert lp.grad_fn is not None and type(lp.grad_fn).__name__ == "HeadLogprobsBackward"  # the new path ran
    (lp * w).sum().backward()
    gh, gw = h.grad.clone(), lm.weight.grad.clone()
    h.grad = lm.weight.grad = None
    ref, ref_ent = _autograd_reference(lm, h, y, T)
    (ref * w).sum().backward()
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-4, atol=1e-4)  # logz - sum p z: a difference of O(logz) terms
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, lm.weight.grad, rtol=1e-5, atol=1e-5)
    assert gw.abs().max() > 1e-2  # a gradient worth comparing


@pytest.mark.parametrize("chunk, chunks", [(8, 5), (37, 1), (1000, 1)])
def test_the_backward_recomputes_every_chunk_but_the_last(monkeypatch, chunk, chunks):
    """The forward keeps its last chunk's logits for the backward, which takes that chunk first: one product fewer
    (a batch within one chunk recomputes none), the same values and gradients as autograd's."""
    lm, h, y, w = _case()
    real, calls = head_grad._logits, []
    monkeypatch.setattr(head_grad, "_logits", lambda *a: calls.append(torch.is_grad_enabled()) or real(*a))
    lp, _ = trainer.chunked_token_logprobs(h, lm, y, chunk=chunk, with_entropy=True)
    forward = len(calls)
    (lp * w).sum().backward()
    assert (forward, len(calls) - forward) == (chunks, chunks - 1)
    gh, gw = h.grad.clone(), lm.weight.grad.clone()
    h.grad = lm.weight.grad = None
    ref, _ = _autograd_reference(lm, h, y, 1.0)
    (ref * w).sum().backward()
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, lm.weight.grad, rtol=1e-5, atol=1e-5)


def test_a_frozen_head_gets_no_gradient_and_the_input_still_does():
    lm, h, y, w = _case(seed=1)
    lm.weight.requires_grad_(False)
    lp, _ = trainer.chunked_token_logprobs(h, lm, y, chunk=5)
    (lp * w).sum().backward()
    assert lm.weight.grad is None and h.grad.abs().max() > 0
    got = h.grad.clone()
    h.grad = None
    ref, _ = _autograd_reference(lm, h, y, 1.0)
    (ref * w).sum().backward()
    torch.testing.assert_close(got, h.grad, rtol=1e-5, atol=1e-5)


def test_other_heads_keep_the_checkpointed_path():
    lm, h, y, _ = _case(seed=2)
    assert head_grad.applies(lm, h, None, False)
    assert not head_grad.applies(lm, h, 30.0, False)  # soft cap
    assert not head_grad.applies(lm, h, None, True)  # top-p / top-k support
    biased = torch.nn.Linear(24, 101)
    assert not head_grad.applies(biased, h, None, False)
    lp, _ = trainer.chunked_token_logprobs(h, lm, y, chunk=8, top_p=0.9)
    assert type(lp.grad_fn).__name__ != "HeadLogprobsBackward"
    with torch.no_grad():  # no gradient wanted: the plain chunked forward
        lp, _ = trainer.chunked_token_logprobs(h, lm, y, chunk=8)
    assert lp.grad_fn is None


def test_a_train_step_reports_its_seconds_in_the_head(monkeypatch):
    """``lm_head_s`` (trainer.step_metrics): the time the step spent in HeadLogprobs' forward and backward. A head
    made slower by a known amount shows at least that much; a step on the other path reports none."""
    from rollyard.model.loading import build_preset, char_tokenizer
    from rollyard.types import Sample

    tok = char_tokenizer()
    model = build_preset("tiny", tok, seed=0, max_position_embeddings=64)
    samples = [Sample(id=f"s{i}", request_id=f"r{i // 2}", prompt_ids=[5, 6, 7 + i], completion_ids=[8, 9, 10 + i],
                      logprobs=[-1.0] * 3, versions=[0] * 3, finish_reason="stop", advantage=(-1.0) ** i)
               for i in range(4)]
    tr = trainer.Trainer(model, micro_batch_tokens=4096, logprob_chunk=2)
    real = head_grad._logits
    calls = []

    def slow(*a, **k):
        calls.append(1)
        time.sleep(0.02)
        return real(*a, **k)

    monkeypatch.setattr(head_grad, "_logits", slow)
    t0 = time.perf_counter()
    m = tr.step(samples)
    wall = time.perf_counter() - t0
    assert calls and 0.02 * len(calls) <= m["lm_head_s"] <= wall, (len(calls), m["lm_head_s"], wall)
    assert 0 < m["optimizer_s"] and m["lm_head_s"] + m["optimizer_s"] <= wall  # the step's other priced part
    assert "lm_head_s" not in trainer.Trainer(model, micro_batch_tokens=4096, top_p=0.9).step(samples)


def test_a_second_micro_batch_adds_into_the_gradient_held():
    """Two backward passes (two micro-batches of one step) through a tied head: the head weight's gradient is the
    sum of plain autograd's, the embedding lookup's share included, and the second pass adds into the tensor the
    first left (no second weight-sized buffer)."""
    lm, h, y, w = _case(seed=3)
    emb = torch.nn.Embedding(101, 24)
    emb.weight = lm.weight  # tied, as Gemma 3's and SmolLM2's heads are
    ids = torch.randint(0, 101, (37,), generator=torch.Generator().manual_seed(4))

    def micro_batch(k, fn):
        x = emb(ids.roll(k)) + h.detach()  # the embedding's rows reach the weight's gradient too
        lp = fn(x, y.roll(k))
        (lp * w.roll(k)).sum().backward()

    ours = lambda x, t: trainer.chunked_token_logprobs(x, lm, t, chunk=8)[0]  # noqa: E731
    micro_batch(0, ours)
    held = lm.weight.grad
    micro_batch(1, ours)
    assert lm.weight.grad is held  # added in place
    got = lm.weight.grad.clone()
    lm.weight.grad = None
    ref = lambda x, t: _autograd_reference(lm, x, t, 1.0)[0]  # noqa: E731
    micro_batch(0, ref)
    micro_batch(1, ref)
    torch.testing.assert_close(got, lm.weight.grad, rtol=1e-5, atol=1e-5)


def _weight_sized_allocations(fn, nbytes: int) -> int:
    """How many allocations of at least ``nbytes`` bytes ``fn()`` makes (torch's profiler, CPU memory)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(1 for e in prof.events() if e.cpu_memory_usage >= nbytes and e.name.startswith("aten::"))


def test_the_second_backward_allocates_no_weight_sized_buffer():
    lm, h, y, w = _case(N=64, D=32, V=4096, seed=5)  # the weight (512 kB) well above a chunk of logits (8 rows)
    nbytes = lm.weight.numel() * lm.weight.element_size()

    def backward():
        lp, _ = trainer.chunked_token_logprobs(h, lm, y, chunk=8)
        (lp * w).sum().backward()

    assert _weight_sized_allocations(backward, nbytes) >= 1  # the first: the gradient it leaves
    assert _weight_sized_allocations(backward, nbytes) == 0  # the second adds into it
    hooked = []
    lm.weight.register_hook(lambda g: hooked.append(g.shape))
    backward()  # a hook on the weight sees the head's gradient: autograd accumulates it, as without this path
    assert hooked == [lm.weight.shape]


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_the_onednn_gradients_equal_autograd_and_add_into_the_gradient_held(monkeypatch, vendor):
    """A head big enough for oneDNN (``gemm.MIN_MACS``), on a CPU where MKL takes the head's gradients (Intel) or
    where oneDNN does (the weight's by row blocks): autograd's gradients over two micro-batches, the second added into
    the first's tensor with no weight-sized buffer."""
    from rollyard.model import cpu
    from rollyard.model import gemm as cpu_gemm
    if not cpu_gemm._op_available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setenv("ROLLYARD_ONEDNN", "1")
    monkeypatch.setattr(cpu, "vendor", lambda: vendor)
    monkeypatch.setattr(cpu_gemm, "GRAD_BLOCK_ROWS", 1536)  # 5000 rows: three blocks and a short one
    lm, h, y, w = _case(N=64, D=64, V=5000, seed=6)
    assert 64 * 5000 * 64 >= cpu_gemm.MIN_MACS

    def backward(fn, k):
        lp = fn(h, y.roll(k))
        (lp * w.roll(k)).sum().backward()

    ours = lambda x, t: trainer.chunked_token_logprobs(x, lm, t, chunk=24)[0]  # noqa: E731
    backward(ours, 0)
    nbytes = lm.weight.numel() * lm.weight.element_size()
    assert _weight_sized_allocations(lambda: backward(ours, 1), nbytes) == 0
    got_w, got_h = lm.weight.grad.clone(), h.grad.clone()
    lm.weight.grad = h.grad = None
    ref = lambda x, t: _autograd_reference(lm, x, t, 1.0)[0]  # noqa: E731
    backward(ref, 0)
    backward(ref, 1)
    torch.testing.assert_close(got_w, lm.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_h, h.grad, rtol=1e-5, atol=1e-5)
