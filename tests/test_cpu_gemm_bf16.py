"""The rollout's bf16 matmul kernel (``model/kernels.cc``, layout P): the packed weight is the parts stacked, scaled
and cast as torch casts them, bit for bit; the product is the bf16 matmul's (fp64 reference, rounded to bf16), at
every row count and thread count, with bias, residual add and strided rows; the decode engine's forward gives the
same logits through it as through oneDNN, within bf16's rounding. On a CPU without AVX512-BF16 the same tests run the
widening kernel (bf16 weights made fp32 in registers or a 64-input chunk at a time, fp32 FMAs), with
``ROLLYARD_CPU_ISA=avx2`` its AVX2 build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import at_line, at_threads, decode_run

from rollyard.model import families
from rollyard.model import kernels as cpu_kernels
from rollyard.model.loading import build_preset, char_tokenizer

pytestmark = pytest.mark.skipif(not cpu_kernels.bf16_packs(64, 32),
                                reason="neither AVX512-BF16 nor AVX-512F nor AVX2 + FMA in this build of the CPU kernels "
                                       "(oneDNN's bf16 matmul runs)")

N, K = 192, 96  # 3 column blocks, 3 input blocks


def _parts(g: torch.Generator):
    a = torch.randn(64, K, generator=g) / 4  # fp32, scaled
    b = (torch.randn(64, K, generator=g) / 4).bfloat16()  # bf16 as it is
    c = torch.randn(64, K, generator=g) / 4  # fp32 as it is
    return [(a, 0.125), (b, 1.0), (c, 1.0)]


def _stacked(parts) -> torch.Tensor:
    return torch.cat([torch.mul(t, s).bfloat16() if s != 1.0 else t.bfloat16() for t, s in parts])


@pytest.mark.parametrize("offset", [0, 1])
def test_the_packed_weight_is_the_parts_stacked_scaled_and_cast_bit_for_bit(offset):
    g = torch.Generator().manual_seed(0)
    parts = _parts(g)
    p = cpu_kernels.pack_bf16(parts, at_line(offset))
    assert cpu_kernels.is_packed_bf16(p) and p.shape == (N // 64, K // 32, 16, 64, 2)
    w = cpu_kernels.unpack_bf16(p)
    assert torch.equal(w.view(torch.int16), _stacked(parts).view(torch.int16))
    # a scaled bf16 part: product in fp32, then rounded (torch's mul of a bf16 tensor by a float)
    b = parts[1][0]
    got = cpu_kernels.unpack_bf16(cpu_kernels.pack_bf16([(b, 0.3)]))
    assert torch.equal(got.view(torch.int16), (b.float() * 0.3).bfloat16().view(torch.int16))


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp64 product of the bf16-rounded operands (plus bias), rounded to bf16 as a bf16 matmul's output."""
    y = x.bfloat16().double() @ w.double().T
    if bias is not None:
        y = y + bias.double()
    return y.bfloat16().float()


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 32, 70])
def test_the_product_is_the_bf16_matmuls_at_any_row_count_and_thread_count(rows):
    g = torch.Generator().manual_seed(rows)
    parts = _parts(g)
    p, w = cpu_kernels.pack_bf16(parts), _stacked(parts)
    x = torch.randn(rows, K, generator=g)
    bias = torch.randn(N, generator=g).bfloat16()
    want = _reference(x, w, bias)
    outs = at_threads(lambda: cpu_kernels.gemm_bf16(x, p, bias))
    assert torch.equal(outs[0], outs[1])  # each output is one thread's chain over K, in order: threads change nothing
    got = outs[0]
    assert torch.equal(got, got.bfloat16().float())  # rounded to bf16
    # fp32 accumulation against fp64 may land one bf16 step apart; nothing further
    ulp = want.abs().clamp_min(1e-6) * 2.0 ** -7
    assert bool(((got - want).abs() <= ulp).all()), float((got - want).abs().max())
    assert float((got - want).abs().max()) < float(want.abs().max()) * 2.0 ** -7
    # torch's bf16 matmul agrees as closely
    torch_y = F.linear(x.bfloat16(), w, bias).float()
    assert bool(((got - torch_y).abs() <= want.abs().clamp_min(1e-6) * 2.0 ** -6).all())


def test_a_rows_product_does_not_depend_on_the_rows_beside_it():
    """A row's outputs are the same bits whether it is multiplied alone, in a group of 5 or in a batch of 32 or 70
    (where a CPU without AVX512-BF16 takes the chunked path past 5 rows, and the one-group tile up to 5): a sequence's
    logits do not depend on what else the engine decodes with it. Over 3 chunks of inputs (K = 160: 64, 64, 32)."""
    g = torch.Generator().manual_seed(7)
    k = 160
    w = torch.randn(128, k, generator=g) / 4
    p = cpu_kernels.pack_bf16([(w, 1.0)])
    bias = torch.randn(128, generator=g)
    x = torch.randn(70, k, generator=g)
    full = cpu_kernels.gemm_bf16(x, p, bias)
    for rows in (1, 2, 5, 6, 7, 32):
        part = cpu_kernels.gemm_bf16(x[:rows], p, bias)
        assert torch.equal(part, full[:rows]), rows
    alone = torch.cat([cpu_kernels.gemm_bf16(x[i:i + 1], p, bias) for i in range(70)])
    assert torch.equal(alone, full)
    ref = (x.bfloat16().double() @ w.bfloat16().double().T + bias.double()).bfloat16().float()
    assert bool(((full - ref).abs() <= ref.abs().clamp_min(1e-6) * 2.0 ** -7).all())  # and it is the product


def test_add_bias_and_strided_or_batched_rows():
    g = torch.Generator().manual_seed(1)
    parts = _parts(g)
    p = cpu_kernels.pack_bf16(parts)
    base = torch.randn(9, 2 * K, generator=g)
    x = base[:, K:]  # rows strided (a view into wider rows)
    assert x.stride(0) == 2 * K
    add = torch.randn(9, N, generator=g)
    plain = cpu_kernels.gemm_bf16(x.contiguous(), p)
    assert torch.equal(cpu_kernels.gemm_bf16(x, p), plain)
    assert torch.equal(cpu_kernels.gemm_bf16(x, p, None, add), plain + add)  # the add after the rounding, in fp32
    x3 = x.contiguous().view(3, 3, K)
    assert torch.equal(cpu_kernels.gemm_bf16(x3, p), plain.view(3, 3, N))


def test_the_fast_forward_through_the_kernel_gives_onednns_logits_within_bf16_rounding(monkeypatch):
    model = build_preset("small", char_tokenizer(), seed=0, max_position_embeddings=64).eval()
    ids = torch.tensor([[5, 9, 14, 3, 22, 7], [8, 8, 2, 40, 1, 0]])
    logits = []
    for use in (True, False):
        if not use:
            monkeypatch.setattr(cpu_kernels, "bf16_packs", lambda n, k: False)
        fwd = families.fast_forward(model, torch.bfloat16)
        assert cpu_kernels.is_packed_bf16(fwd.layers[0]["wgu"]) == use
        kv = fwd.new_cache(2, 16)
        first = fwd.prefill(ids, kv, torch.tensor([0, 1]), torch.tensor([5, 4]))
        nxt = fwd.decode(torch.tensor([3, 4]), torch.tensor([6, 5]), kv, 7)
        logits.append(torch.cat([first, nxt]))
    with torch.no_grad():
        ref = model(ids).logits[:, -1].float()  # scale of the logits
    diff = float((logits[0] - logits[1]).abs().max())
    assert diff < 0.05 * float(ref.abs().max()), diff  # two bf16 matmuls, summed in different orders
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


@pytest.mark.parametrize("same", [True, False])
def test_a_fused_decode_layer_is_the_per_op_path_bit_for_bit(same, monkeypatch):
    """``kernels.decode_layer`` (one call a layer) against the per-op path over the same copies: logits and the
    K / V it writes are equal, at one shared position and at per-row positions (the masked path)."""
    calls = []
    fused_layer = cpu_kernels.decode_layer
    monkeypatch.setattr(cpu_kernels, "decode_layer", lambda *a: calls.append(1) or fused_layer(*a))
    model = build_preset("small", char_tokenizer(), seed=0, max_position_embeddings=64).eval()
    fwd = families.fast_forward(model, torch.bfloat16)
    assert fwd.fused_layers and fwd.kv_dtype == torch.bfloat16
    ids = torch.tensor([[5, 9, 14, 3, 22, 7], [8, 8, 2, 40, 1, 0], [3, 1, 4, 1, 5, 9]])
    last = torch.tensor([5, 5, 5]) if same else torch.tensor([5, 3, 4])
    outs = []
    for fused in (True, False):
        fwd.fused_layers = fused
        logits, kv = decode_run(fwd, ids, last, same)
        outs.append((logits[1:], kv))  # the decode steps' logits
    assert len(calls) == 3 * model.config.num_hidden_layers  # the fused run took the one call a layer, the other none
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1].view(torch.int16), outs[1][1].view(torch.int16))


def test_gemma3_decodes_over_a_bf16_cache_as_over_an_fp32_one_within_bf16_rounding():
    """Gemma 3 (q/k norms, sliding layers: the per-op path) with bf16 matmuls keeps its cache in bf16 where the
    attention kernel takes its head_dim: a generation past the sliding window, at per-row positions (the sliding
    layers' additive masks take torch's attention over the upcast cache) and at a shared one, gives the logits an fp32
    cache gives, within bf16's rounding, and the HF forward's within the bf16 matmuls'."""
    from gemma3_files import WINDOW, gemma_tokenizer, tiny_gemma3

    model = tiny_gemma3(gemma_tokenizer(), head_dim=16)
    g = torch.Generator().manual_seed(3)
    P = WINDOW + 4
    V = model.config.vocab_size
    ids = torch.randint(V // 2, V, (3, P), generator=g)
    last = torch.tensor([P - 1, P - 3, P - 2])
    runs = []
    for kv_dtype in (torch.bfloat16, torch.float32):
        fwd = families.fast_forward(model, torch.bfloat16)
        assert fwd.kv_dtype == torch.bfloat16  # the attention kernel takes head_dim 16
        fwd.kv_dtype = kv_dtype
        kv = fwd.new_cache(3, P + 8)
        out = [fwd.prefill(ids, kv, torch.tensor([0, 1, 2]), last)]
        for t in range(4):
            out.append(fwd.decode(torch.tensor([V // 2 + t, V // 2 + 9, V // 2 + 20]), last + 1 + t, kv, P + 1 + t))
        runs.append(torch.stack(out))
    scale = float(runs[1].abs().max())
    assert float((runs[0] - runs[1]).abs().max()) < 0.02 * scale
    with torch.no_grad():  # row 0 (its prompt fills the prefill) against the fp32 module, token by token
        seq = torch.cat([ids[0], torch.tensor([V // 2, V // 2 + 1, V // 2 + 2])])
        ref = model(seq[None]).logits[0, P - 1:P + 3]
    assert float((runs[0][:4, 0] - ref).abs().max()) < 0.05 * float(ref.abs().max())
