"""oneDNN linear layers (``rollyard.model.gemm``): same values and gradients as ``F.linear``."""

import pytest
import torch
import torch.nn.functional as F

from rollyard.model import cpu
from rollyard.model import gemm as cpu_gemm

pytestmark = pytest.mark.skipif(not cpu_gemm._op_available(), reason="torch built without oneDNN")


@pytest.fixture
def onednn(monkeypatch):
    monkeypatch.setenv("ROLLYARD_ONEDNN", "1")  # use it regardless of this machine's timing


def _leaf(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).float().requires_grad_()


@pytest.mark.parametrize("bias", [False, True])
# (rows, out): wider and narrower than the input at 280 rows (g^T @ x), and wide at 1280 rows ((x^T @ g)^T)
@pytest.mark.parametrize("rows,out", [(70, 384), (70, 128), (320, 1024)])
# the weight gradient on MKL (an Intel CPU) or in oneDNN's two forms (elsewhere), whatever this machine is
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_linear_values_and_gradients_match_f_linear(onednn, monkeypatch, bias, rows, out, vendor):
    monkeypatch.setattr(cpu, "vendor", lambda: vendor)
    # 3-D input as the trainer passes it; big enough to clear MIN_MACS.
    x, w = _leaf(4, rows, 256, seed=1), _leaf(out, 256, scale=0.05, seed=2)
    b = _leaf(out, seed=3) if bias else None
    g = torch.randn(4, rows, out, generator=torch.Generator().manual_seed(4))
    assert x.numel() * w.shape[0] >= cpu_gemm.MIN_MACS
    assert cpu_gemm.transposed_weight_grad(4 * rows, out, 256) == (rows == 320)

    y = cpu_gemm.linear(x, w, b)
    assert y.grad_fn is not None and "_Linear" in type(y.grad_fn).__name__  # the oneDNN Function ran
    (y * g).sum().backward()
    got = [y.detach(), x.grad, w.grad] + ([b.grad] if bias else [])

    # Reference in fp64: both kernels are judged against exact arithmetic, not against each other.
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    bd = b.detach().double().requires_grad_() if bias else None
    yd = F.linear(xd, wd, bd)
    (yd * g.double()).sum().backward()
    ref = [yd.detach(), xd.grad, wd.grad] + ([bd.grad] if bias else [])
    for name, a, r in zip(["y", "dx", "dw", "db"], got, ref):
        err = ((a.double() - r).abs().max() / r.abs().max()).item()
        assert err < 1e-5, (name, err)
    assert w.grad.is_contiguous()  # stored in the parameter's layout, whichever form computed it


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("outs", [(1536, 1536), (576, 192, 192)])  # gate|up, q|k|v (SmolLM2's)
def test_linear_parts_equals_linear_over_the_concatenation_and_keeps_no_copy(onednn, monkeypatch, bias, outs):
    """``linear_parts``: each part's product written into its columns in place (MKL), forward and both gradients
    by parts: the values and gradients of ``linear`` over ``torch.cat(parts)``, and what its backward keeps is the
    input and the parameters themselves (no weight-sized concatenation); without grad the same values. Forced on
    (``parts_in_place``) so that every CPU class runs it; where it is off, the concatenation's ``linear`` runs."""
    monkeypatch.setattr(cpu_gemm, "parts_in_place", lambda: True)
    parts = [_leaf(n, 576, scale=0.05, seed=i) for i, n in enumerate(outs)]
    x = _leaf(2, 147, 576, seed=9)
    b = _leaf(sum(outs), seed=10) if bias else None
    g = torch.randn(2, 147, sum(outs), generator=torch.Generator().manual_seed(11))
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = cpu_gemm.linear_parts(x, tuple(parts), b)
    assert type(y.grad_fn).__name__ in ("AddBackward0", "_PartsLinearBackward")  # the parts path ran
    (y * g).sum().backward()
    got = [t.grad.clone() for t in (x, *parts)] + ([b.grad.clone()] if bias else [])
    for t in (x, *parts, *([b] if bias else [])):
        t.grad = None
    ref = F.linear(x, torch.cat(parts), b)
    (ref * g).sum().backward()
    want = [t.grad for t in (x, *parts)] + ([b.grad] if bias else [])
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-4)
    params = {p.data_ptr() for p in parts}
    weight_sized = [t for t in kept if t.numel() >= parts[0].numel() and t.data_ptr() not in params]
    assert weight_sized == [], [tuple(t.shape) for t in weight_sized]
    with torch.no_grad():
        torch.testing.assert_close(cpu_gemm.linear_parts(x, tuple(parts), b), ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(cpu_gemm, "parts_in_place", lambda: False)  # off: the concatenation's product
    assert type(cpu_gemm.linear_parts(x, tuple(parts)).grad_fn).__name__ == "_LinearBackward"


def test_the_weight_gradients_form_copies_fewer_elements():
    """``g^T @ x`` copies g (rows x out); ``(x^T @ g)^T`` copies x (rows x in) and then the transposed gradient
    (out x in). Counted by hand for the trainer's shapes."""
    # SmolLM2's gate|up at a 310-row micro-batch: 952,320 against 178,560 + 1,769,472
    assert not cpu_gemm.transposed_weight_grad(310, 3072, 576)
    # the same weight at 4096 rows: 12,582,912 against 2,359,296 + 1,769,472
    assert cpu_gemm.transposed_weight_grad(4096, 3072, 576)
    # a narrower output never transposes: 2144 x 256 <= 2144 x 1280 + ...
    assert not cpu_gemm.transposed_weight_grad(2144, 256, 1280)
    assert cpu_gemm.transposed_weight_grad(2144, 1280, 256)  # 2,744,320 against 548,864 + 327,680


def test_linear_falls_back_outside_fp32(onednn):
    x, w = torch.randn(64, 256), torch.randn(512, 256)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_gemm.linear(x, w).dtype == torch.bfloat16  # autocast still applies
    xb = x.bfloat16().requires_grad_()
    y = cpu_gemm.linear(xb, w.bfloat16())
    assert "_Linear" not in type(y.grad_fn).__name__


def test_switched_off_by_env(monkeypatch):
    monkeypatch.setenv("ROLLYARD_ONEDNN", "0")
    assert not cpu_gemm.enabled()
    w = torch.randn(512, 256)
    assert cpu_gemm.pack(w) is w
    x = torch.randn(64, 256, requires_grad=True)
    assert "_Linear" not in type(cpu_gemm.linear(x, w).grad_fn).__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_with_fused_residual(onednn, dtype):
    if dtype == torch.bfloat16 and not cpu.onednn_bf16():
        pytest.skip("oneDNN's bf16 packing needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, which this CPU "
                    f"(feature set {sorted(cpu.features())}) lacks: test_bf16_pack_falls_back covers it")
    w = (torch.randn(512, 256) * 0.05).to(dtype)
    b = torch.randn(512).to(dtype)
    p = cpu_gemm.pack(w)
    assert p.is_mkldnn
    x, r = torch.randn(32, 256).to(dtype), torch.randn(32, 512).to(dtype)
    ref = (r.double() + F.linear(x.double(), w.double(), b.double()))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got in (cpu_gemm.packed_linear(x, p, b, add=r), r + cpu_gemm.packed_linear(x, p, b)):
        assert got.dtype == dtype
        assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < tol
    small = torch.randn(64, 96)  # under MIN_MACS at PACK_ROWS rows: left to MKL, plain tensor
    assert cpu_gemm.pack(small) is small


def test_bf16_pack_falls_back_where_onednn_bf16_cannot_run(onednn, monkeypatch):
    """With ROLLYARD_CPU_ISA=avx2 (as on an AVX2-only CPU) a bf16 weight is not packed for oneDNN, which
    would refuse it there, even with ROLLYARD_ONEDNN=1; the product still multiplies it (plain F.linear)."""
    monkeypatch.setenv("ROLLYARD_CPU_ISA", "avx2")
    assert not cpu.onednn_bf16() and not cpu.avx512() and not cpu.native_bf16()
    w = (torch.randn(512, 256) * 0.05).bfloat16()
    p = cpu_gemm.pack(w)
    assert p is w and not p.is_mkldnn
    x, r = torch.randn(32, 256).bfloat16(), torch.randn(32, 512).bfloat16()
    got = cpu_gemm.packed_linear(x, p, add=r)
    ref = r.double() + F.linear(x.double(), w.double())
    assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 2e-2
    w32 = torch.randn(512, 256) * 0.05  # fp32 packing runs on every x86 CPU oneDNN supports
    assert cpu_gemm.pack(w32).is_mkldnn


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])  # MKL in place, or oneDNN by blocks
def test_the_heads_products_into_place_match_fp64(onednn, monkeypatch, vendor):
    """``mm_into`` and ``add_weight_grad_`` (the LM head's input and weight gradients, written where they end): the
    values of exact arithmetic, the weight gradient added into the tensor given (several row blocks of oneDNN's
    form: 5000 rows at 2048 a block, the last one short) and the input gradient into a row block of a larger one."""
    monkeypatch.setattr(cpu, "vendor", lambda: vendor)
    g = torch.Generator().manual_seed(0)
    dz, h, w = torch.randn(96, 5000, generator=g), torch.randn(96, 128, generator=g), torch.randn(5000, 128, generator=g)
    assert dz.shape[0] * dz.shape[1] * h.shape[1] >= cpu_gemm.MIN_MACS > 0
    acc = torch.randn(5000, 128, generator=g)
    before, ptr = acc.clone(), acc.data_ptr()
    assert cpu_gemm.add_weight_grad_(acc, dz, h) is acc and acc.data_ptr() == ptr
    want = before.double() + dz.double().t() @ h.double()
    assert ((acc.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    big = torch.zeros(200, 128)
    cpu_gemm.mm_into(dz, w, big[50:146])
    want = dz.double() @ w.double()
    assert ((big[50:146].double() - want).abs().max() / want.abs().max()).item() < 1e-5
    assert big[:50].abs().max() == 0 and big[146:].abs().max() == 0  # only its rows written


def test_linear_parts_under_bf16_autocast_is_autocasts_product_over_the_concatenation_bit_for_bit():
    """Under CPU bf16 autocast the parts are cast, then concatenated: the output and every gradient are the bits
    of autocast's product over the fp32 concatenation (the values it replaces), and the output is bf16."""
    outs, D = (96, 32, 32), 64
    ws = [_leaf(o, D, scale=0.05, seed=10 + i) for i, o in enumerate(outs)]
    x, b = _leaf(3, 40, D, seed=20), _leaf(sum(outs), seed=21)
    g = torch.randn(3, 40, sum(outs), generator=torch.Generator().manual_seed(22))

    def run(fn):
        for t in (x, b, *ws):
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn()
        (y.float() * g).sum().backward()
        return [y.detach(), x.grad, b.grad, *(w.grad for w in ws)]

    got = run(lambda: cpu_gemm.linear_parts(x, tuple(ws), b))
    ref = run(lambda: F.linear(x, torch.cat(ws), b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cats = _nodes(cpu_gemm.linear_parts(x, tuple(ws), b).grad_fn, "CatBackward0")
    assert len(cats) == 1 and [type(n).__name__ for n, _ in cats[0].next_functions] == ["ToCopyBackward0"] * 3
    assert got[0].dtype == torch.bfloat16
    for a, r in zip(got, ref):
        assert a.dtype == r.dtype and torch.equal(a, r)
    assert all(w.grad.abs().max() > 0 for w in ws)


def _nodes(fn, name: str) -> list:
    """The autograd graph's nodes named ``name`` reachable from ``fn``."""
    seen, out, todo = set(), [], [fn]
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        out += [n] if type(n).__name__ == name else []
        todo += [m for m, _ in n.next_functions]
    return out
