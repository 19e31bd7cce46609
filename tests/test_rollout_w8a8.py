"""rollout.precision=w8a8: int8 weights (int8's quantization, kernels.cc layout V) times each matmul's input quantized
per row and group of 64 inputs, summed exactly in int32. A matmul equals an independent reference built from the
definition (exact integer sums per group, then the scales), on every row count, thread count and ISA; the fused
decode layer is the per-op path's numbers; the engine's forward stays near transformers' forward over the held
weights and is not int8's. A weight change reaching the copies, the one-line errors and the run's report are
test_rollout_int8.py's, parametrized over both."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollyard.model import families
from rollyard.model import kernels as cpu_kernels
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.rollout import native

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cpu_kernels.q8_packs(64, 16), reason="no compiled CPU kernels here")]

TOK = char_tokenizer()


def _weights(k: int = 96) -> tuple[torch.Tensor, torch.Tensor, float]:
    g = torch.Generator().manual_seed(k)
    a, c = torch.randn(128, k, generator=g), torch.randn(64, k, generator=g) * 3
    a[5] = 0  # a zero row: scale 0, weights 0
    a[9, 7] = 40.0  # an outlier sets its group's scale
    return a, c, 0.3


def _reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    """The definition, in other ops: per group of 64 inputs, the exact sum of xq * q (float64 holds it), times the
    fp32 product sw * sx, added into the fp32 running sum with one rounding; then + bias, then + add."""
    k = x.shape[1]
    amax = torch.stack([x[:, g0:g0 + 64].abs().amax(dim=1) for g0 in range(0, k, 64)], dim=1)
    sx = amax / 127
    out = torch.zeros(x.shape[0], q.shape[0])
    for g, g0 in enumerate(range(0, k, 64)):
        inv = torch.where(sx[:, g] > 0, 1 / torch.where(sx[:, g] > 0, sx[:, g], 1), 0)
        xq = torch.round(x[:, g0:g0 + 64] * inv[:, None]).clamp(-127, 127)
        dot = xq.double() @ q[:, g0:g0 + 64].double().T  # integers below 2^21: exact
        t = sx[:, g, None] * s[None, :, g]
        out = (dot * t.double() + out.double()).float()
    return out + b + add


def test_the_packed_weights_are_int8s_quantization_with_their_sums():
    a, c, scale = _weights()
    p = cpu_kernels.pack_w8a8([(a, scale), (c, 1.0)])
    assert cpu_kernels.is_packed_w8a8(p) and not cpu_kernels.is_packed_q8(p) and p.shape == (3, 2, 4608)
    q, s = cpu_kernels.unpack_w8a8(p, 96)
    want_q, want_s = cpu_kernels.quantize_q8(torch.cat((torch.mul(a, scale), c)))
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
    assert torch.equal(q, cpu_kernels.unpack_q8(cpu_kernels.pack_q8([(a, scale), (c, 1.0)]))[0])
    # the last group (inputs 64-95) is zero-padded to 64; each group stores 128 x its columns' weight sums
    sums = p[:, :, 4352:].contiguous().view(torch.int32).permute(0, 2, 1).reshape(192, 2)
    assert torch.equal(sums[:, 0], 128 * q[:, :64].int().sum(1)) and torch.equal(sums[:, 1], 128 * q[:, 64:].int().sum(1))
    assert not p[:, 1, :4096].view(3, 16, 4, 16, 4)[:, 8:].any()


def test_the_inputs_rounding_is_its_definition():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 96, generator=g)
    x[1] = 0
    x[2, 70] = 50.0
    xq, sx = cpu_kernels.quantize_rows(x)
    assert torch.equal(sx[:, 0], x[:, :64].abs().amax(dim=1) / 127) and torch.equal(sx[:, 1], x[:, 64:].abs().amax(dim=1) / 127)
    assert not xq[1].any() and not sx[1].any()
    assert int(xq[0].abs().max()) == 127 and sx[2, 1] == 50.0 / 127 and sx[2, 0] < sx[2, 1] / 10
    err = (xq.double() * sx.double().repeat_interleave(64, dim=1)[:, :96] - x.double()).abs()
    assert bool((err <= sx.double().repeat_interleave(64, dim=1)[:, :96] * (0.5 + 1e-5)).all())


@pytest.mark.parametrize("k", [96, 576])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 32])
def test_a_matmul_is_the_exact_integer_sums_times_the_scales(rows, k):
    a, c, scale = _weights(k)
    p = cpu_kernels.pack_w8a8([(a, scale), (c, 1.0)])
    q, s = cpu_kernels.quantize_q8(torch.cat((torch.mul(a, scale), c)))
    g = torch.Generator().manual_seed(rows)
    x, add, b = torch.randn(rows, k, generator=g), torch.randn(rows, 192, generator=g), torch.randn(192, generator=g)
    x[0, 3] = 25.0  # an outlier input
    got = cpu_kernels.gemm_w8a8(x, p, b, add)
    assert torch.equal(got, _reference(x, q, s, b, add))
    dense = F.linear(x, cpu_kernels.dequantize_q8(q, s), b) + add  # a matmul, up to the inputs' rounding
    assert float((got - dense).abs().max() / dense.abs().max()) < 3e-2
    # strided rows, each row alone, and two threads: the same numbers
    wide = torch.randn(rows, k + 64, generator=g)
    wide[:, 32:32 + k] = x
    assert torch.equal(cpu_kernels.gemm_w8a8(wide[:, 32:32 + k], p, b, add), got)
    assert torch.equal(torch.cat([cpu_kernels.gemm_w8a8(x[i:i + 1], p, b, add[i:i + 1]) for i in range(rows)]), got)
    torch.set_num_threads(2)
    try:
        assert torch.equal(cpu_kernels.gemm_w8a8(x, p, b, add), got)
    finally:
        torch.set_num_threads(1)


def _model():
    return build_preset("small", TOK, seed=0, max_position_embeddings=64).eval()


def test_the_engine_forward_is_near_transformers_over_the_held_weights_and_fused_is_per_op():
    model = _model()
    fwd = families.fast_forward(model, torch.qint8)
    assert fwd.a8 and fwd.q8 and fwd.fused_layers
    assert all(cpu_kernels.is_packed_w8a8(w[k]) for w in fwd.layers for k in ("wqkv", "wo", "wgu", "wd"))
    held = fwd.dequantized()
    q, s = cpu_kernels.quantize_q8(model.model.layers[2].mlp.down_proj.weight)
    assert torch.equal(held["model.layers.2.mlp.down_proj.weight"], cpu_kernels.dequantize_q8(q, s))
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 30, 11]])
    with torch.no_grad():
        ref = torch.func.functional_call(model, held, (), {"input_ids": ids}, tie_weights=False).logits[0]
    int8 = families.fast_forward(model, torch.int8)

    def run(f, fused: bool) -> torch.Tensor:
        f.fused_layers = fused
        kv = f.new_cache(1, 8)
        out = [f.prefill(ids[:, :4], kv, torch.tensor([0]), torch.tensor([3]))[0]]
        for t in range(4, 8):
            out.append(f.decode(ids[:, t], torch.tensor([t]), kv, t + 1)[0])
        return torch.stack(out)

    got = run(fwd, True)
    assert torch.equal(got, run(fwd, False))  # the fused decode layer: the per-op path's numbers
    rel = float((got - ref[3:]).abs().max() / ref.abs().max())
    assert 1e-5 < rel < 3e-2, rel  # the inputs' rounding shows, within the engine's start-up tolerance
    assert not torch.equal(got, run(int8, True))
    assert native.fast_path_matches(model, native.NativeBackend(model, 4, 256, torch.qint8)) < 0.1

