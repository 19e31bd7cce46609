"""The compiled CPU kernels (rollyard.model.kernels): decode attention and RMSNorm against float64
references, attention inside the decode engine's forward against torch's path, and the fallbacks:
no compiler, the off switch, the must-have switch."""

import math
import shutil

import pytest
import torch

from rollyard.model import kernels as cpu_kernels
from rollyard.model.llama import LlamaFast
from rollyard.model.loading import build_preset, char_tokenizer

HAVE_CXX = shutil.which("g++") is not None
needs_cxx = pytest.mark.skipif(not HAVE_CXX, reason="no g++ on this machine: the kernel cannot be built")


def _attention_fp64(q, K, V, lens):
    """Row by row, head by head, in float64: softmax(q . k_w for w < n) weighted sum of v_w."""
    B, H, hd = q.shape
    KVH = K.shape[1]
    G = H // KVH
    out = torch.empty(B, H, hd, dtype=torch.float64)
    for b in range(B):
        n = K.shape[2] if lens is None else int(lens[b])
        for h in range(H):
            k, v = K[b, h // G, :n].double(), V[b, h // G, :n].double()
            p = torch.softmax(k @ q[b, h].double(), dim=0)
            out[b, h] = p @ v
    return out.reshape(B, H * hd)


def _case(G, hd, B=7, KVH=3, W=37, seed=0):
    """q with a row stride wider than its heads (like the engine's q|k slice), K / V strided views
    of a wider cache, lengths from 1 to W."""
    gen = torch.Generator().manual_seed(seed)
    qk = torch.randn(B, KVH * G + KVH, hd, generator=gen) * hd ** -0.25
    q = qk[:, :KVH * G]
    cache = torch.randn(2, B + 2, KVH, W + 11, hd, generator=gen)
    K, V = cache[0, :B, :, :W], cache[1, :B, :, :W]
    lens = torch.tensor([1, W, 2, 17, W - 1, 16, 33][:B], dtype=torch.int64)
    return q, K, V, lens


@needs_cxx
@pytest.mark.parametrize("G,hd", [(1, 16), (2, 24), (2, 32), (3, 40), (4, 8), (7, 64), (8, 128), (5, 32), (4, 256)])
def test_kernel_matches_fp64_attention(G, hd):
    assert cpu_kernels.attention_supported(3 * G, 3, hd), cpu_kernels._STATE
    q, K, V, lens = _case(G, hd)
    for n in (None, lens):
        got = cpu_kernels.attend(q, K, V, n)
        want = _attention_fp64(q, K, V, n)
        err = float((got.double() - want).abs().max())
        assert err < 2e-6, f"G={G} hd={hd} lens={'all' if n is None else 'varied'}: max error {err:.2e}"


@needs_cxx
@pytest.mark.parametrize("G,hd", [(3, 64), (2, 24), (4, 256)])
def test_kernel_over_a_bf16_cache_is_fp64_attention_of_the_caches_values(G, hd):
    """A bf16 cache (the engine's with bf16 matmuls): K and V widened exactly, the arithmetic fp32."""
    assert cpu_kernels.attention_supported(3 * G, 3, hd), cpu_kernels._STATE
    q, K, V, lens = _case(G, hd)
    K16, V16 = K.to(torch.bfloat16), V.to(torch.bfloat16)
    for n in (None, lens):
        got = cpu_kernels.attend(q, K16, V16, n)
        want = _attention_fp64(q, K16.float(), V16.float(), n)
        err = float((got.double() - want).abs().max())
        assert err < 2e-6, f"G={G} hd={hd} lens={'all' if n is None else 'varied'}: max error {err:.2e}"
        assert float((got - cpu_kernels.attend(q, K, V, n)).abs().max()) > 0  # the cache's rounding is seen


@needs_cxx
def test_kernel_threads_split_rows_without_changing_results():
    q, K, V, lens = _case(2, 32, B=7)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.attend(q, K, V, lens)
        torch.set_num_threads(2)
        two = cpu_kernels.attend(q, K, V, lens)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


@needs_cxx
def test_rms_norm_matches_fp64():
    assert cpu_kernels.kernel() is not None
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(9, 300, generator=gen) * 4
    cases = [wide[:, :256], torch.randn(2, 5, 24, generator=gen), torch.randn(32, 17, generator=gen)]
    for x in cases:  # strided rows, 3-D, a width with no full vector
        d = x.shape[-1]
        w = torch.rand(d, generator=gen) + 0.5
        for weight in (w, None):
            want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
            want = want * (1.0 if weight is None else weight.double())
            got = cpu_kernels.rms_norm(x, weight, 1e-5)
            assert got.shape == x.shape
            err = float((got.double() - want).abs().max())
            assert err < 1e-5, (tuple(x.shape), weight is None, err)


def _fwd_bwd(fn, inputs, dtype):
    xs = [t.detach().to(dtype).requires_grad_() for t in inputs]
    y = fn(*xs)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    y.backward(g)
    return y.double(), [t.grad.double() for t in xs]


@needs_cxx
def test_training_rms_norm_and_swiglu_forward_and_backward_match_fp64():
    import torch.nn.functional as F

    assert cpu_kernels.kernel() is not None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 11, 256, generator=gen, dtype=torch.float64) * 2
    w = torch.rand(256, generator=gen, dtype=torch.float64) + 0.5
    gu = torch.randn(3, 11, 2 * 320, generator=gen, dtype=torch.float64) * 3
    cases = [
        (lambda x, w: F.rms_norm(x, (256,), w, 1e-6), lambda x, w: cpu_kernels.train_rms_norm(x, w, 1e-6), (x, w)),
        (lambda x, w: F.rms_norm(x, (256,), w, 1e-6),  # a strided view in: the kernel copies it first
         lambda x, w: cpu_kernels.train_rms_norm(x.transpose(0, 1).transpose(0, 1), w, 1e-6), (x, w)),
        (lambda gu: F.silu(gu[..., :320]) * gu[..., 320:], cpu_kernels.train_swiglu, (gu,)),
    ]
    for ref, fn, inputs in cases:
        (want, want_grads), (got, got_grads) = _fwd_bwd(ref, inputs, torch.float64), _fwd_bwd(fn, inputs, torch.float32)
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) < 1e-6 * scale
        for a, b in zip(got_grads, want_grads):
            assert float((a - b).abs().max()) < 1e-5 * float(b.abs().max())


@needs_cxx
@pytest.mark.parametrize("H,KVH,hd", [(8, 4, 32), (4, 4, 24), (6, 2, 16)])
def test_qkv_rope_split_matches_fp64_forward_and_backward(H, KVH, hd):
    """q|k|v split + RoPE into attention's layouts against the same math written with plain torch
    ops in float64 (rotate_half with its own sign, not the folded table)."""
    assert cpu_kernels.kernel() is not None
    B, T, G = 3, 9, H // KVH
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(B, T, (H + 2 * KVH) * hd, generator=gen, dtype=torch.float64)
    ang = torch.rand(T, hd // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    folded = torch.cat((-sin[:, :hd // 2], sin[:, hd // 2:]), -1)

    def ref(y):
        def rope(x):  # x [B, T, heads, hd]
            rot = torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), -1)
            return x * cos[:, None] + rot * sin[:, None]
        q = rope(y[..., :H * hd].view(B, T, H, hd)).permute(0, 2, 1, 3)  # [B, H, T, hd]
        k = rope(y[..., H * hd:(H + KVH) * hd].view(B, T, KVH, hd)).permute(0, 2, 1, 3)
        v = y[..., (H + KVH) * hd:].view(B, T, KVH, hd).permute(0, 2, 1, 3)
        return q.reshape(B, KVH, G * T, hd), k, v

    grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in ((B, KVH, G * T, hd), (B, KVH, T, hd),
                                                                          (B, KVH, T, hd))]
    y64, y32 = y.clone().requires_grad_(), y.float().requires_grad_()
    want = ref(y64)
    got = cpu_kernels.train_qkv_rope(y32, cos.float(), folded.float().contiguous(), H, KVH)
    sum((o * g).sum() for o, g in zip(want, grads)).backward()
    sum((o * g.float()).sum() for o, g in zip(got, grads)).backward()
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.is_contiguous()
        assert float((a.double() - b).abs().max()) < 1e-5
    assert float((y32.grad.double() - y64.grad).abs().max()) < 1e-5


def test_training_kernels_step_aside_for_autocast_and_odd_widths():
    import torch.nn.functional as F

    gu = torch.randn(4, 2 * 40)  # half width 40: not a multiple of 16
    assert torch.equal(cpu_kernels.train_swiglu(gu), F.silu(gu[:, :40]) * gu[:, 40:])
    x, w = torch.randn(4, 64), torch.rand(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cpu_kernels.train_rms_norm(x, w, 1e-6)
        want = F.rms_norm(x, (64,), w, 1e-6)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_unsupported_shapes_are_refused():
    assert not cpu_kernels.attention_supported(6, 4, 32)  # heads not a multiple of K/V heads
    assert not cpu_kernels.attention_supported(4, 4, 48)  # no kernel for head_dim 48
    assert not cpu_kernels.attention_supported(36, 4, 32)  # G = 9


@needs_cxx
def test_decode_with_kernels_equals_torch():
    """The engine's forward with and without the kernels: uniform-position and per-row-position decode."""
    model = build_preset("small", char_tokenizer(), seed=0, max_position_embeddings=64).eval()
    fwd = LlamaFast(model)
    assert fwd.attn_kernel and fwd.norm_kernel and fwd.rope_kernel
    V = model.config.vocab_size
    ids = torch.randint(0, V, (4, 20), generator=torch.Generator().manual_seed(1))
    outs = []
    for on in (True, False):
        fwd.attn_kernel = fwd.norm_kernel = fwd.rope_kernel = on
        kv = fwd.new_cache(4, 32)
        fwd.prefill(ids[:, :8], kv, torch.arange(4), torch.tensor([7, 3, 7, 5]))
        got = [fwd.decode(ids[:, t], None, kv, t + 1, same_pos=t) for t in range(8, 12)]
        pos = torch.tensor([12, 13, 14, 15])  # rows at different positions: the per-row lengths path
        got += [fwd.decode(ids[:, t], pos + i, kv, int(pos.max()) + i + 1) for i, t in enumerate(range(12, 16))]
        outs.append(torch.stack(got))
    err = float((outs[0] - outs[1]).abs().max())
    assert err < 1e-4, f"kernel vs torch attention: max |logit diff| {err:.2e}"


def test_without_a_compiler_torch_attention_is_used_and_said_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("ROLLYARD_CPU_KERNELS", "auto")
    assert cpu_kernels.kernel() is None and cpu_kernels.kernel() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not used" in err[0] and "torch's ops instead" in err[0], err
    model = build_preset("small", char_tokenizer(), seed=0, max_position_embeddings=64).eval()
    fwd = LlamaFast(model)
    assert not fwd.attn_kernel and not fwd.norm_kernel
    monkeypatch.setenv("ROLLYARD_CPU_KERNELS", "1")
    with pytest.raises(cpu_kernels.KernelsRequired, match="ROLLYARD_CPU_KERNELS=1 but .* unavailable: .*install a C"):
        cpu_kernels.kernel()
    # ... and no fallback swallows it: the engine and the trainer's forward check both raise
    from rollyard.model.families import train_forward_matches
    from rollyard.rollout.engine import RolloutEngine

    with pytest.raises(cpu_kernels.KernelsRequired):
        RolloutEngine(model, eos_token_id=-1)
    with pytest.raises(cpu_kernels.KernelsRequired):
        train_forward_matches(model)


def test_cli_with_kernels_required_and_no_compiler_is_one_line_exit_2(monkeypatch, tmp_path, capsys):
    from rollyard.cli import main

    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("ROLLYARD_CPU_KERNELS", "1")
    assert main(["train", "steps=1", f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("rollyard train: error: ROLLYARD_CPU_KERNELS=1 but") and "unset it" in err[0]
    assert not (tmp_path / "run").exists()


def test_off_switch_keeps_torch_attention(monkeypatch):
    monkeypatch.setenv("ROLLYARD_CPU_KERNELS", "0")
    model = build_preset("small", char_tokenizer(), seed=0, max_position_embeddings=64).eval()
    fwd = LlamaFast(model)
    assert cpu_kernels.kernel() is None and not fwd.attn_kernel and not fwd.norm_kernel


@needs_cxx
def test_attention_choice_does_not_depend_on_timing(monkeypatch):
    """The verdict on a shape is a correctness check only: a kernel made to look 1000x slower than
    torch (by patching the clock) is still chosen, so a loaded machine cannot change the numerics."""
    import time as _time

    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    monkeypatch.setenv("ROLLYARD_CPU_KERNELS", "auto")
    ticks = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(_time, "perf_counter", lambda: float(next(ticks)))
    assert cpu_kernels.attention_supported(8, 8, 128)
    assert cpu_kernels.choices()["decode_attention"] == {"G=1,head_dim=128": True}


def _running_sum_draw(w, r):
    """The engine's draw without the kernel: torch's fp64 cumsum, the target ``r * total``, ``searchsorted``."""
    c = w.double().cumsum(-1)
    return torch.searchsorted(c, r[:, None] * c[:, -1:], right=True).squeeze(1).clamp_(max=w.shape[1] - 1), c


@needs_cxx
@pytest.mark.parametrize("B,V", [(32, 4099), (1, 1), (9, 70), (17, 129), (8, 64), (3, 50000)])
def test_inverse_cdf_draws_the_running_sums_index_bit_for_bit(B, V):
    """The kernel's index and total against torch's fp64 cumsum + searchsorted: random targets, targets placed
    exactly on a running sum (the ``>`` edge), rows with zero weights (never picked), peaked and flat rows, groups
    of rows not a multiple of the kernel's 8, widths not a multiple of its 64-wide blocks, 1 and 2 threads."""
    assert cpu_kernels.kernel() is not None, cpu_kernels._STATE
    gen = torch.Generator().manual_seed(B * 1000 + V)
    n = torch.get_num_threads()
    try:
        for scale in (0.01, 3.0, 40.0):
            logits = torch.randn(B, V, generator=gen) * scale
            logits[:, 1::5] = torch.finfo(torch.float32).min  # outside the support: weight exactly 0
            w = torch.log_softmax(logits, -1).exp()
            want_r = torch.rand(B, generator=gen, dtype=torch.float64)
            ref, c = _running_sum_draw(w, want_r)
            on_edge = (c[:, V // 2] / c[:, -1]).contiguous()  # r * total lands on (or next to) a running sum
            ref_edge, _ = _running_sum_draw(w, on_edge)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                totals = torch.empty(B, dtype=torch.float64)
                got = cpu_kernels.inverse_cdf(w, want_r, totals)
                assert torch.equal(got, ref), (scale, threads, got, ref)
                assert torch.equal(totals, c[:, -1]), (scale, threads)
                assert torch.equal(cpu_kernels.inverse_cdf(w, on_edge), ref_edge), (scale, threads)
                if V > 1:
                    assert not bool((got % 5 == 1).any()), "a zero-weight token was drawn"
    finally:
        torch.set_num_threads(n)


@needs_cxx
@pytest.mark.parametrize("B,V", [(32, 49152), (1, 1), (9, 70), (17, 129), (8, 64), (3, 50000)])
def test_softmax_draw_is_the_inverse_cdf_of_softmax_and_its_logprob(B, V):
    """The rollout's fused draw against a float64 reference built with other ops: the index is the first whose fp64
    running sum of ``exp(z - max z)`` exceeds ``r * total`` (torch's fp64 exp, cumsum, searchsorted), the logprob is
    fp64 ``log_softmax`` at it; peaked, flat and wide rows, widths not a multiple of the 64-wide blocks or the 16
    lanes, rows a stride apart, 1 and 2 threads (the same numbers)."""
    assert cpu_kernels.kernel() is not None, cpu_kernels._STATE
    gen = torch.Generator().manual_seed(B * 1000 + V + 7)
    n = torch.get_num_threads()
    try:
        for scale in (0.01, 3.0, 40.0):
            z = (torch.randn(B, V + 5, generator=gen) * scale)[:, 2:2 + V]  # rows a stride apart
            r = torch.rand(B, generator=gen, dtype=torch.float64)
            zd = z.double()
            c = (zd - zd.max(-1, keepdim=True).values).exp().cumsum(-1)
            want = torch.searchsorted(c, r[:, None] * c[:, -1:], right=True).squeeze(1).clamp(max=V - 1)
            got = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got.append(cpu_kernels.softmax_draw(z, r))
            assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
            tok, lp = got[0]
            assert torch.equal(tok, want), (scale, tok, want)
            ref = torch.log_softmax(zd, -1).gather(1, tok[:, None]).squeeze(1)
            assert (lp.double() - ref).abs().max() < 2e-6 * (1 + ref.abs().max()), (scale, lp, ref)
        z = torch.zeros(B, V)
        z[:, V // 2] = 100.0  # one token holds the mass: always it, at log-probability ~0
        tok, lp = cpu_kernels.softmax_draw(z, torch.rand(B, generator=gen, dtype=torch.float64))
        assert bool((tok == V // 2).all()) and float(lp.abs().max()) < 1e-30 * V + 1e-6
    finally:
        torch.set_num_threads(n)


@needs_cxx
@pytest.mark.parametrize("rows,cols", [(314, 3072), (37, 45), (16, 16), (1, 40), (40, 1), (33, 17)])
def test_transposed_is_the_transpose_at_every_shape_and_row_stride(rows, cols):
    """The weight gradient's input (``model/gemm.py``): the transposed copy, element for element, with the 16 x 16
    blocks' leftover rows and columns, rows a stride apart, and on any thread count."""
    assert cpu_kernels.kernel() is not None
    gen = torch.Generator().manual_seed(rows * 100 + cols)
    wide = torch.randn(rows, cols + 9, generator=gen)
    for t in (wide[:, :cols].contiguous(), wide[:, 5:5 + cols]):
        for threads in (1, 2):
            old = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                got = cpu_kernels.transposed(t)
            finally:
                torch.set_num_threads(old)
            assert got.shape == (cols, rows) and got.is_contiguous()
            assert all(got[j, i] == t[i, j] for i, j in ((0, 0), (rows - 1, cols - 1), (rows // 2, cols // 3)))
            assert torch.equal(got, t.t().contiguous())
    # what the kernel does not take is copied by torch, never misread
    assert torch.equal(cpu_kernels.transposed(wide.double()), wide.double().t().contiguous())
    assert torch.equal(cpu_kernels.transposed(wide.t()), wide)


@needs_cxx
def test_the_gradient_norm_is_torchs_to_float_rounding_for_any_thread_count():
    """``grad_norm``: one pass over every gradient, each tensor's squares summed in double: torch's
    ``get_total_norm`` to float rounding (an fp64 reference closer still), the same bits on 1 and 2 threads (chunks
    summed in a fixed order), inf and nan carried through, and ``None`` for what the kernel does not take."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * s for n, s in ((70_000, 1e-3), (131_072, 2.0), (17, 50.0), (0, 1.0),
                                                         (1, 3.0), (200_003, 1e-6))]
    grads.append(torch.randn(96, 576, generator=g))
    want = torch.nn.utils.get_total_norm(grads)
    exact = torch.cat([t.double().flatten() for t in grads]).norm()
    n = torch.get_num_threads()
    try:
        got = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got.append(cpu_kernels.grad_norm(grads))
    finally:
        torch.set_num_threads(n)
    assert got[0].dtype == torch.float32 and got[0].dim() == 0 and torch.equal(got[0], got[1])
    torch.testing.assert_close(got[0], want, rtol=2e-6, atol=0)
    assert abs(float(got[0]) - float(exact)) <= abs(float(want) - float(exact)) + 1e-6 * float(exact)
    for bad in (float("inf"), float("nan")):
        broken = [t.clone() for t in grads]
        broken[2][5] = bad
        assert math.isnan(float(cpu_kernels.grad_norm(broken))) or float(cpu_kernels.grad_norm(broken)) == bad
    assert cpu_kernels.grad_norm([grads[1].bfloat16()]) is None
    assert cpu_kernels.grad_norm([grads[-1].t()]) is None
    assert cpu_kernels.grad_norm([]) is None


@needs_cxx
def test_inverse_cdf_refuses_what_it_does_not_take():
    """Other dtypes or layouts fall back (None), they are never read wrongly."""
    assert cpu_kernels.kernel() is not None
    w = torch.rand(4, 10)
    r = torch.rand(4, dtype=torch.float64)
    assert cpu_kernels.inverse_cdf(w.double(), r) is None
    assert cpu_kernels.inverse_cdf(w, r.float()) is None
    assert cpu_kernels.inverse_cdf(w.t(), r) is None
    assert cpu_kernels.inverse_cdf(w, r[:3]) is None


@needs_cxx
@pytest.mark.parametrize("temperature,top_p,kernel", [(1.0, 1.0, "softmax_draw"), (0.7, 1.0, "softmax_draw"),
                                                      (0.7, 0.9, "inverse_cdf")])
def test_engine_samples_the_same_tokens_with_and_without_the_draw_kernel(monkeypatch, temperature, top_p, kernel):
    """Two engines of one seed, one drawing through the kernel and one through torch (``log_softmax``, ``exp``,
    cumsum): the same tokens over a whole generation; the logprobs bit for bit where the kernel only draws (a top-p
    support: ``inverse_cdf``), to fp32 rounding where it also computes them (the whole vocabulary: ``softmax_draw``,
    in fp64 where torch's ``log_softmax`` rounds in fp32)."""
    from rollyard.rollout.engine import RolloutEngine
    from rollyard.types import Request

    model = build_preset("tiny", char_tokenizer(), seed=0, max_position_embeddings=64).eval()
    reqs = [Request(f"p{i}", list(range(5 + i, 12 + 2 * i)), n=4, max_new_tokens=20) for i in range(3)]
    outs, used = [], []
    real = getattr(cpu_kernels, kernel)
    for on in (True, False):
        def draw(*a, _on=on, **k):
            got = real(*a, **k) if _on else None
            used.append(got is not None)
            return got
        monkeypatch.setattr(cpu_kernels, kernel, draw)
        eng = RolloutEngine(model, eos_token_id=-1, temperature=temperature, top_p=top_p, seed=3)
        samples, _ = eng.generate(reqs)
        outs.append(sorted((s.id, s.completion_ids, s.logprobs) for s in samples))
        eng.close()
    assert any(used) and not all(used)
    assert [o[:2] for o in outs[0]] == [o[:2] for o in outs[1]]
    if kernel == "inverse_cdf":
        assert outs[0] == outs[1]
    else:
        got, want = (torch.tensor([lp for o in out for lp in o[2]], dtype=torch.float64) for out in outs)
        assert (got - want).abs().max() < 2e-6 * (1 + want.abs().max())


@needs_cxx
@pytest.mark.parametrize("rows,V", [(7, 49152), (3, 45), (1, 16), (5, 1)])
def test_the_heads_softmax_passes_are_torchs_to_float_rounding(rows, V):
    """The LM head's log-partition and target log-probs (``logsumexp_at``), entropy (``softmax_entropy``) and its
    gradient's softmax part (``softmax_grad_``): the fp64
    values to float rounding, over whole 16-wide vectors and a tail, rows a stride apart, on 1 and 2 threads; and
    what they do not take (bf16, a non-contiguous logz) falls back to the caller (``None``, the input untouched)."""
    assert cpu_kernels.kernel() is not None
    gen = torch.Generator().manual_seed(rows * 7 + V)
    wide = torch.randn(rows, V + 3, generator=gen) * 4
    z = wide[:, 2:2 + V]  # rows strided
    logz = torch.logsumexp(z.double(), -1)
    g = torch.randn(rows, generator=gen)
    p = (z.double() - logz[:, None]).exp()
    want_ent = logz - (p * z.double()).sum(-1)
    want_grad = -g.double()[:, None] * p
    targets = torch.randint(0, V, (rows,), generator=gen)
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got_logz, got_lp = cpu_kernels.logsumexp_at(z, targets)
            ent = cpu_kernels.softmax_entropy(z, logz.float())
            zz = z.clone()
            assert cpu_kernels.softmax_grad_(zz, logz.float(), g) is zz
        finally:
            torch.set_num_threads(old)
        scale = float(logz.abs().max()) + 1.0
        assert float((got_logz.double() - logz).abs().max()) < 1e-6 * scale
        want_lp = z.double().gather(1, targets[:, None])[:, 0] - logz
        assert float((got_lp.double() - want_lp).abs().max()) < 2e-6 * scale
        assert float((ent.double() - want_ent).abs().max()) < 1e-5 * scale, (ent, want_ent)
        assert bool(((zz.double() - want_grad).abs() <= 1e-5 * want_grad.abs() + 1e-30).all())
    assert cpu_kernels.softmax_entropy(z.bfloat16(), logz.float()) is None
    assert cpu_kernels.logsumexp_at(z, targets.int()) is None and cpu_kernels.logsumexp_at(z.t(), targets) is None
    if rows > 1:  # g strided (one row is contiguous whatever its stride)
        zz = z.clone()
        assert cpu_kernels.softmax_grad_(zz, logz.float(), wide[:, 0]) is None and torch.equal(zz, z)


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_the_heads_bf16_row_kernels_match_fp64(T):
    """The bf16 head's statistics and gradient read from bf16 logits (strided rows, a width with a tail past the
    16-lane vectors): logsumexp, the target's log-prob, the entropy of fp64 arithmetic on the widened values, the
    gradient ``(1[v = y] - p) g / T`` rounded to bf16 (one rounding: within half a bf16 step of exact), and a NaN
    row's gradient stays NaN."""
    assert cpu_kernels.kernel() is not None
    g = torch.Generator().manual_seed(3)
    rows, V = 6, 1003
    z = (torch.randn(rows, V + 5, generator=g) * 4).to(torch.bfloat16)[:, :V]  # rows strided by V + 5
    y = torch.randint(0, V, (rows,), generator=g)
    zd = z.double() / T
    logz, lp = cpu_kernels.logsumexp_at_bf16(z, y, 1.0 / T)
    want = torch.logsumexp(zd, -1)
    assert (logz.double() - want).abs().max() < 1e-5
    assert (lp.double() - (zd.gather(1, y[:, None])[:, 0] - want)).abs().max() < 1e-5
    p = torch.softmax(zd, -1)
    ent = cpu_kernels.softmax_entropy_bf16(z, logz, 1.0 / T)
    assert (ent.double() + (p * torch.log_softmax(zd, -1)).sum(-1)).abs().max() < 1e-4
    gr = torch.randn(rows, generator=g)
    exact = (torch.zeros(rows, V, dtype=torch.float64).scatter_(1, y[:, None], 1.0) - p) * gr.double()[:, None] / T
    dz = z.clone()
    assert cpu_kernels.logprob_grad_bf16_(dz, logz, gr, y, 1.0 / T) is dz and dz.dtype == torch.bfloat16
    assert ((dz.double() - exact).abs() <= exact.abs() * (2.0 ** -8 + 1e-6)).all()  # fp32's error beside bf16's
    z[2, 7] = float("nan")
    logz, _ = cpu_kernels.logsumexp_at_bf16(z, y, 1.0 / T)
    dz = cpu_kernels.logprob_grad_bf16_(z.clone(), logz, gr, y, 1.0 / T)
    assert torch.isnan(dz[2]).all() and not torch.isnan(dz[[0, 1, 3, 4, 5]]).any()
