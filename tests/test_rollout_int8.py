"""rollout.precision=int8: the native engine's matmul weights as int8 with an fp32 scale per row and group of 64
inputs (kernels.cc layout R), fp32 arithmetic. The packed bytes are the quantization torch's ops compute; a matmul over them is the fp32
kernel's over the dequantized weights, bit for bit; the engine's forward equals transformers' forward over those
weights; a run says what ran; where it cannot run, one line says why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollyard.config import ConfigError, load_config
from rollyard.model import families
from rollyard.model import kernels as cpu_kernels
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.rollout import native
from rollyard.trainer.precision import engine_dtype, rollout_precision

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cpu_kernels.q8_packs(64, 16), reason="no compiled CPU kernels here")]

TOK = char_tokenizer()


def _weights() -> tuple[torch.Tensor, torch.Tensor, float]:
    g = torch.Generator().manual_seed(0)
    a, c = torch.randn(128, 96, generator=g), torch.randn(64, 96, generator=g) * 3
    a[5] = 0  # a zero row: scale 0, weights 0
    a[9, 7] = 40.0  # an outlier sets its row's scale
    return a, c, 0.3


def test_the_packed_bytes_are_the_row_wise_quantization():
    a, c, scale = _weights()
    p = cpu_kernels.pack_q8([(a, scale), (c, 1.0)])
    q, s = cpu_kernels.unpack_q8(p)
    w = torch.cat((torch.mul(a, scale), c))
    want_q, want_s = cpu_kernels.quantize_q8(w)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
    # what the quantization is, from its definition: inputs 0-63 and 64-95 (a short last group) scaled apart
    assert s.shape == (192, 2)
    for g, cols in enumerate((slice(0, 64), slice(64, 96))):
        assert torch.equal(s[:, g], w[:, cols].abs().amax(dim=1) / 127)
        nonzero = s[:, g] > 0
        assert torch.equal(q[nonzero, cols].abs().amax(dim=1), torch.full((int(nonzero.sum()),), 127, dtype=torch.int8))
        err = (q[:, cols].double() * s[:, g].double()[:, None] - w[:, cols].double()).abs()
        assert bool((err <= s[:, g].double()[:, None] / 2 * (1 + 1e-6)).all())
    assert not q[5].any() and not s[5].any()
    assert s[9, 0] == 40.0 * scale / 127 and s[9, 1] < s[9, 0] / 10  # the outlier scales its own group only


@pytest.mark.parametrize("rows", [1, 5, 7, 32])
def test_a_matmul_is_the_fp32_kernels_over_the_dequantized_weights(rows):
    a, c, scale = _weights()
    p = cpu_kernels.pack_q8([(a, scale), (c, 1.0)])
    w = torch.cat((torch.mul(a, scale), c))
    q, s = cpu_kernels.quantize_q8(w)
    deq = cpu_kernels.dequantize_q8(q, s)
    g = torch.Generator().manual_seed(rows)
    x, add, b = torch.randn(rows, 96, generator=g), torch.randn(rows, 192, generator=g), torch.randn(192, generator=g)
    got = cpu_kernels.gemm_q8(x, p, b, add)
    assert torch.equal(got, cpu_kernels.gemm_f32(x, cpu_kernels.pack_f32([(deq, 1.0)]), b, add))
    want = F.linear(x.double(), deq.double(), b.double()) + add.double()
    assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6
    # strided rows (a view into a wider buffer) give the same numbers
    wide = torch.randn(rows, 160, generator=g)
    wide[:, 32:128] = x
    assert torch.equal(cpu_kernels.gemm_q8(wide[:, 32:128], p, b, add), got)


def _model():
    return build_preset("small", TOK, seed=0, max_position_embeddings=64).eval()


def test_the_engine_forward_is_transformers_forward_over_the_int8_weights():
    model = _model()
    fwd = families.fast_forward(model, torch.int8)
    assert fwd.q8 and fwd.fused_layers
    for w in fwd.layers:
        assert all(cpu_kernels.is_packed_q8(w[k]) for k in ("wqkv", "wo", "wgu", "wd"))
    held = fwd.dequantized()
    # the held weights are the module's, quantized row by row (q's rows with the attention scale folded in first)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    q, s = cpu_kernels.quantize_q8(q_proj * fwd.scale)
    assert torch.allclose(held["model.layers.0.self_attn.q_proj.weight"], cpu_kernels.dequantize_q8(q, s) / fwd.scale,
                          rtol=1e-6, atol=1e-7)
    q, s = cpu_kernels.quantize_q8(model.model.layers[2].mlp.down_proj.weight)
    assert torch.equal(held["model.layers.2.mlp.down_proj.weight"], cpu_kernels.dequantize_q8(q, s))
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 30, 11]])
    with torch.no_grad():
        ref = torch.func.functional_call(model, held, (), {"input_ids": ids}, tie_weights=False).logits[0]
        plain = model(input_ids=ids).logits[0]
    kv = fwd.new_cache(1, 8)
    got = [fwd.prefill(ids[:, :4], kv, torch.tensor([0]), torch.tensor([3]))[0]]
    for t in range(4, 8):
        got.append(fwd.decode(ids[:, t], torch.tensor([t]), kv, t + 1)[0])
    got = torch.stack(got)
    assert float((got - ref[3:]).abs().max() / ref.abs().max()) < 1e-5
    # and it is not the fp32 forward: the quantization moves the logits
    assert float((got - plain[3:]).abs().max() / plain.abs().max()) > 1e-4
    assert native.fast_path_matches(model, native.NativeBackend(model, 4, 256, torch.int8)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.int8, torch.qint8])  # (qint8: rollout.precision=w8a8)
def test_the_engine_runs_int8_after_a_weight_change(dtype):
    from rollyard.rollout.engine import RolloutEngine
    from rollyard.types import Request, WeightUpdate

    model = _model()
    eng = RolloutEngine(model, eos_token_id=-1, pad_token_id=0, max_concurrent=4, max_cache_tokens=256, seed=0,
                        compute_dtype=dtype)
    assert eng.backend.name == "fast" and eng.backend.fwd.q8 and eng.backend.fwd.a8 == (dtype == torch.qint8)
    before = eng.backend.fwd.dequantized()["model.layers.1.mlp.up_proj.weight"].clone()
    with torch.no_grad():  # the trainer's step, shared module (colocated)
        model.model.layers[1].mlp.up_proj.weight.mul_(1.5)
    eng.load_weights(WeightUpdate(version=1, mode="inprocess"))
    after = eng.backend.fwd.dequantized()["model.layers.1.mlp.up_proj.weight"]
    assert not torch.equal(before, after)
    q, s = cpu_kernels.quantize_q8(model.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(after, cpu_kernels.dequantize_q8(q, s))
    samples, rejected = eng.generate([Request("a", [5, 9, 14], n=2, max_new_tokens=6)])
    assert not rejected and all(len(x.completion_ids) == 6 and len(x.logprobs) == 6 for x in samples)


@pytest.mark.parametrize("prec,dtype", [("int8", torch.int8), ("w8a8", torch.qint8)])
def test_int8_where_it_cannot_run_is_one_line(monkeypatch, prec, dtype):
    model = _model()
    assert rollout_precision(prec, model, torch.device("cpu"))[0] == prec
    assert engine_dtype(prec) == dtype
    with pytest.raises(ConfigError, match=rf"rollout.precision={prec} .* on cuda; set rollout.precision=auto"):
        rollout_precision(prec, model, torch.device("cuda"))
    monkeypatch.setattr(cpu_kernels, "q8_packs", lambda n, k: False)
    with pytest.raises(ConfigError, match=rf"precision={prec} needs rollyard's compiled CPU kernels .* set rollout.precision=fp32"):
        rollout_precision(prec, model, torch.device("cpu"))
    from rollyard.placement.rules import check

    cfg = load_config(None, ["rollout.backend=vllm", f"rollout.precision={prec}"])
    with pytest.raises(ConfigError, match=r"rollout.backend=vllm computes in its weights' dtype; drop rollout.precision"):
        check(cfg)


@pytest.mark.parametrize("prec", ["int8", "w8a8"])
def test_a_colocated_run_with_int8_rollouts_says_so_and_its_canary_reads_the_quantization(tmp_path, capsys, prec):
    """The tiny preset (hidden 96): the q|k|v and gate|up weights fit layout R's (w8a8: V's) 64-row blocks and go
    int8, o_proj and down_proj stay fp32 (the per-op path mixes them). The canary reads the quantization (far above
    the fp32 kernels' rounding), within int8's first-sync ceiling: no alarm; the weights really change (rewards)."""
    import json
    from pathlib import Path

    from rollyard.placement import step as grpo
    from rollyard.placement.colocated import LocalRollout
    from rollyard.placement.run import start
    from rollyard.sync.factory import resolve
    from rollyard.telemetry import rundir

    hook = f"reward.hook={Path(__file__).parent / 'dense_reward.py'}:digits"
    cfg = load_config(None, ["model.context=64", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
                             "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "sft.auto=false",
                             "progress=false", "reward.num_workers=1", hook, "steps=4", "log.plots=false",
                             "trainer.lr=5e-3", f"rollout.precision={prec}", f"out_dir={tmp_path / 'r'}"])
    run, r, extra = start(cfg, cfg.out_dir, False)
    side = LocalRollout(run, r, resolve(cfg, "cpu"), extra)
    fwd = side.engine.backend.fwd
    packed = cpu_kernels.is_packed_w8a8 if prec == "w8a8" else cpu_kernels.is_packed_q8
    assert fwd.q8 and fwd.a8 == (prec == "w8a8") and not fwd.fused_layers
    assert packed(fwd.layers[0]["wqkv"]) and packed(fwd.layers[0]["wgu"])
    assert all(fwd.layers[0][k].dtype == torch.float32 for k in ("wo", "wd"))  # (96 rows: no 64-row blocks)
    grpo.train(run, r, side)
    rows = list(rundir.read_jsonl(Path(run.run_dir) / rundir.METRICS))
    assert sum(row["reward"] for row in rows) > 0
    gaps = [row["canary/logprob_gap"] for row in rows]
    assert min(gaps) > 2e-4 and max(gaps) < 2.0, gaps  # (the fp32 kernels: < 1e-5)
    assert not any(row["alarm/logprob_canary"] for row in rows), gaps
    out = capsys.readouterr().out
    assert "ALARM" not in out and f"rollout precision {prec} (set by rollout.precision={prec}" in out
    info = json.loads((Path(run.run_dir) / rundir.RUN_INFO).read_text())
    assert info["rollout_precision"] == prec


def test_gemma3s_layers_on_int8_weights_are_transformers_forward_over_them():
    """Gemma 3's block (QK-norm: no attention scale folded into q's rows, GeGLU, sliding windows) on layout R."""
    from gemma3_files import gemma_tokenizer, tiny_gemma3

    model = tiny_gemma3(gemma_tokenizer())
    backend = native.NativeBackend(model, 4, 256, torch.int8)
    fwd = backend.fwd
    assert fwd.q8 and fwd.qk_norm
    assert all(cpu_kernels.is_packed_q8(w[k]) for w in fwd.layers for k in ("wqkv", "wo", "wgu", "wd"))
    q, s = cpu_kernels.quantize_q8(model.model.layers[3].self_attn.q_proj.weight)
    assert torch.equal(fwd.dequantized()["model.layers.3.self_attn.q_proj.weight"], cpu_kernels.dequantize_q8(q, s))
    assert native.fast_path_matches(model, backend) < 1e-5
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 30, 11, 4, 8]])  # past the window (4)
    with torch.no_grad():
        got = fwd.prefill(ids, fwd.new_cache(1, 10), torch.tensor([0]), torch.tensor([9]))[0]
        plain = model(input_ids=ids).logits[0, 9]
    assert float((got - plain).abs().max() / plain.abs().max()) > 1e-4  # the quantization shows in the logits
