"""The rollout's fp32 matmul kernel (``model/kernels.cc``, layout Q): the packed weight is the parts stacked and scaled as
torch scales them, bit for bit; the product is an fp32 matmul's (against fp64, within fp32 summation error), the same
at every thread count, with bias, residual add and strided rows; the decode engine's fp32 forward gives the HF module's
logits through it, and its one-call layer the per-op path's numbers bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import at_line, at_threads, decode_run

from rollyard.model import families
from rollyard.model import kernels as cpu_kernels
from rollyard.model.loading import build_preset, char_tokenizer

pytestmark = pytest.mark.skipif(not cpu_kernels.f32_packs(64, 16),
                                reason="no AVX2 + FMA in this build of the CPU kernels (oneDNN's or MKL's fp32 matmul runs)")

N, K = 192, 80  # 3 column blocks, 5 input blocks of 16


def _parts(g: torch.Generator):
    return [(torch.randn(64, K, generator=g) / 4, 0.3), (torch.randn(128, K, generator=g) / 4, 1.0)]


def _stacked(parts) -> torch.Tensor:
    return torch.cat([torch.mul(t, s) for t, s in parts])


@pytest.mark.parametrize("offset", [0, 1])
def test_the_packed_weight_is_the_parts_stacked_and_scaled_bit_for_bit(offset):
    """At a 64-byte line (``offset`` 0: streaming stores on an AVX-512 build) and one float past it (plain stores)."""
    parts = _parts(torch.Generator().manual_seed(0))
    p = cpu_kernels.pack_f32(parts, at_line(offset))
    assert cpu_kernels.is_packed_f32(p) and p.shape == (N // 64, K, 64)
    assert torch.equal(cpu_kernels.unpack_f32(p), _stacked(parts))


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 32, 70])
def test_the_product_is_an_fp32_matmuls_at_any_row_count_and_thread_count(rows):
    g = torch.Generator().manual_seed(rows)
    parts = _parts(g)
    p, w = cpu_kernels.pack_f32(parts), _stacked(parts)
    x = torch.randn(rows, K, generator=g)
    bias = torch.randn(N, generator=g)
    want = x.double() @ w.double().T + bias.double()
    outs = at_threads(lambda: cpu_kernels.gemm_f32(x, p, bias))
    assert torch.equal(outs[0], outs[1])  # each output is one thread's chain over K, in order: threads change nothing
    got = outs[0].double()
    # K fused multiply-adds in fp32 and one add: within a few fp32 roundings of the fp64 value at this scale
    bound = (x.double().abs() @ w.double().abs().T + bias.double().abs()) * K * 2.0 ** -24
    assert bool(((got - want).abs() <= bound).all()), float((got - want).abs().max())
    assert float((got - want).abs().max()) > 0 or rows == 1  # an fp32 product, not a wider one
    torch_y = F.linear(x, w, bias).double()
    assert bool(((got - torch_y).abs() <= 2 * bound).all())


def test_a_rows_product_does_not_depend_on_the_rows_beside_it():
    """A row's outputs are the same bits alone (AVX2: the one-row tile over a block's 64 columns) as in a group of 4-6
    or a batch of 70 (the row-group tiles), with a bias and a residual add: a sequence's logits do not depend on what
    else the engine decodes with it."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(128, 80, generator=g) / 4
    p = cpu_kernels.pack_f32([(w, 1.0)])
    bias, x, add = torch.randn(128, generator=g), torch.randn(70, 80, generator=g), torch.randn(70, 128, generator=g)
    full = cpu_kernels.gemm_f32(x, p, bias, add)
    for rows in (1, 2, 4, 5, 6, 7):
        assert torch.equal(cpu_kernels.gemm_f32(x[:rows], p, bias, add[:rows]), full[:rows]), rows
    alone = torch.cat([cpu_kernels.gemm_f32(x[i:i + 1], p, bias, add[i:i + 1]) for i in range(70)])
    assert torch.equal(alone, full)
    want = x.double() @ w.double().T + bias.double() + add.double()
    assert float((full.double() - want).abs().max()) < 1e-4 * float(want.abs().max())  # and it is the product


def test_add_bias_and_strided_or_batched_rows():
    g = torch.Generator().manual_seed(1)
    p = cpu_kernels.pack_f32(_parts(g))
    base = torch.randn(9, 2 * K, generator=g)
    x = base[:, K:]  # rows strided (a view into wider rows)
    assert x.stride(0) == 2 * K
    add, bias = torch.randn(9, N, generator=g), torch.randn(N, generator=g)
    plain = cpu_kernels.gemm_f32(x.contiguous(), p)
    assert torch.equal(cpu_kernels.gemm_f32(x, p), plain)
    assert torch.equal(cpu_kernels.gemm_f32(x, p, bias), plain + bias)  # the bias after the chain
    assert torch.equal(cpu_kernels.gemm_f32(x, p, bias, add), plain + bias + add)  # then the add
    x3 = x.contiguous().view(3, 3, K)
    assert torch.equal(cpu_kernels.gemm_f32(x3, p), plain.view(3, 3, N))


@pytest.mark.parametrize("same", [True, False])
def test_the_fp32_engine_runs_on_the_kernel_gives_the_modules_logits_and_its_fused_layer_the_per_op_path(
        same, monkeypatch):
    """An fp32 fast forward packs its matmuls in layout Q and decodes one call a layer (``kernels.decode_layer``): its
    logits are the HF module's within fp32 rounding, and bit for bit the per-op path's over the same copies, K / V
    cache included, at one shared position and at per-row positions."""
    calls = []
    fused_layer = cpu_kernels.decode_layer
    monkeypatch.setattr(cpu_kernels, "decode_layer", lambda *a: calls.append(1) or fused_layer(*a))
    model = build_preset("small", char_tokenizer(), seed=0, max_position_embeddings=64).eval()
    fwd = families.fast_forward(model)
    assert fwd.mm_dtype == torch.float32 and fwd.kv_dtype == torch.float32
    assert all(cpu_kernels.is_packed_f32(fwd.layers[0][k]) for k in ("wqkv", "wo", "wgu", "wd"))
    assert fwd.fused_layers
    ids = torch.tensor([[5, 9, 14, 3, 22, 7], [8, 8, 2, 40, 1, 0], [3, 1, 4, 1, 5, 9]])
    last = torch.tensor([5, 5, 5]) if same else torch.tensor([5, 3, 4])
    outs = []
    for fused in (True, False):
        fwd.fused_layers = fused
        outs.append(decode_run(fwd, ids, last, same))
    assert len(calls) == 3 * model.config.num_hidden_layers  # the fused run took the one call a layer, the other none
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    with torch.no_grad():  # row 0 against the module, token by token
        seq = torch.cat([ids[0], torch.tensor([3, 4, 5])])
        ref = model(seq[None]).logits[0, 5:9]
    assert float((outs[0][0][:, 0] - ref).abs().max()) < 1e-4 * float(ref.abs().max())


def test_without_the_kernel_the_engine_keeps_onednns_fp32_matmul(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "f32_packs", lambda n, k: False)
    model = build_preset("small", char_tokenizer(), seed=0, max_position_embeddings=64).eval()
    fwd = families.fast_forward(model)
    assert not cpu_kernels.is_packed_f32(fwd.layers[0]["wgu"]) and not fwd.fused_layers
