"""The fast forward's weight refresh: after a weight change, held or after a sleep, its fused copies equal, bit for
bit, the module's weights stacked and cast by plain torch ops, and what a fast forward built afresh holds; its
logits equal that fresh forward's."""

from __future__ import annotations

import pytest
import torch

from rollyard.model import cpu, families
from rollyard.model import gemm as cpu_gemm
from rollyard.model import kernels as cpu_kernels
from rollyard.model.loading import build_preset, char_tokenizer

TOK = char_tokenizer()
WEIGHTS = ("wqkv", "wo", "wgu", "wd")


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def _dense(t: torch.Tensor) -> torch.Tensor:
    if cpu_kernels.is_packed_bf16(t):
        return cpu_kernels.unpack_bf16(t)
    if cpu_kernels.is_packed_f32(t):
        return cpu_kernels.unpack_f32(t)
    return t.to_dense() if t.is_mkldnn else t


def _packed(t: torch.Tensor) -> bool:
    """Packed for oneDNN or in the kernels' layout P (bf16) or Q (fp32), not a plain copy."""
    return t.is_mkldnn or cpu_kernels.is_packed_bf16(t) or cpu_kernels.is_packed_f32(t)


def _expected(model, dtype: torch.dtype, scale: float) -> list[dict[str, torch.Tensor]]:
    """Each layer's fused weights from the module by plain torch ops (rows stacked, q scaled, then cast)."""
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out.append(dict(wqkv=torch.cat([a.q_proj.weight * scale, a.k_proj.weight, a.v_proj.weight]).to(dtype),
                        wo=a.o_proj.weight.to(dtype), wgu=torch.cat([m.gate_proj.weight, m.up_proj.weight]).to(dtype),
                        wd=m.down_proj.weight.to(dtype)))
    return out


def _change(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _assert_copies(fwd, model, dtype: torch.dtype) -> None:
    fresh = families.fast_forward(model, dtype)
    for got, new, want in zip(fwd.layers, fresh.layers, _expected(model, dtype, fwd.scale), strict=True):
        for k in WEIGHTS:
            assert torch.equal(_dense(got[k]), want[k]), k
            assert torch.equal(_dense(got[k]), _dense(new[k])), k
            assert got[k].is_mkldnn == new[k].is_mkldnn
            assert cpu_kernels.is_packed_bf16(got[k]) == cpu_kernels.is_packed_bf16(new[k])
            assert cpu_kernels.is_packed_f32(got[k]) == cpu_kernels.is_packed_f32(new[k])
    assert torch.equal(_dense(fwd.lm_head), model.lm_head.weight.to(dtype))
    ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
    logits = []
    for f in (fwd, fresh):
        kv = f.new_cache(1, 8)
        logits.append(f.prefill(ids, kv, torch.tensor([0]), torch.tensor([5])))
    assert torch.equal(logits[0], logits[1])


def _dtypes() -> list[torch.dtype]:
    return [torch.float32] + ([torch.bfloat16] if cpu.onednn_bf16() else [])


@pytest.mark.parametrize("onednn", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("asleep", [False, True])
def test_refresh_after_a_weight_change_equals_the_weights_and_a_fresh_build(onednn, dtype, asleep, monkeypatch):
    if onednn == "1" and not cpu_gemm._op_available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setenv("ROLLYARD_ONEDNN", onednn)
    model = build_preset("small", TOK, seed=0, max_position_embeddings=64).eval()
    fwd = families.fast_forward(model, dtype)
    # the case under test: copies packed (for oneDNN, or in the kernels' layouts whatever ROLLYARD_ONEDNN says),
    # or plain
    shape = fwd.model.model.layers[0].mlp.up_proj.weight.shape
    kernel = dtype == torch.bfloat16 and cpu_kernels.bf16_packs(*shape)
    kernel_f32 = dtype == torch.float32 and cpu_kernels.f32_packs(*shape)
    packs = (onednn == "1" and dtype in _dtypes()) or kernel or kernel_f32
    assert _packed(fwd.layers[0]["wgu"]) == packs
    assert cpu_kernels.is_packed_bf16(fwd.layers[0]["wgu"]) == kernel
    assert cpu_kernels.is_packed_f32(fwd.layers[0]["wgu"]) == kernel_f32
    for seed in (1, 2):  # twice: the second refresh reuses what the first left behind
        _change(model, seed)
        if asleep:  # the colocated trainer's turn: copies dropped, rebuilt by the sync
            fwd.release()
            assert fwd.released and fwd.layers == []
        fwd.refresh()
        assert not fwd.released
        _assert_copies(fwd, model, dtype)
