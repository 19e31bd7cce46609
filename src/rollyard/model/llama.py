"""The Llama family (Llama, Qwen2, Qwen3, Mistral) on the fast path: what it adds to ``fast.FastForward``.

- One RMSNorm before attention and one before the MLP, each residual added inside the o / down matmul (oneDNN's
  packed path adds it in the kernel).
- SwiGLU MLP: ``silu(gate) * up`` over the fused ``[gate | up]`` matmul (compiled on fp32 CPU).
- Qwen3's per-head ``q_norm`` / ``k_norm`` (RMSNorm over ``head_dim`` before RoPE): one ``rms_norm`` over the q and k
  heads together and one multiply by their stacked weights, the attention scale folded into the q part (folding
  rotate_half into extra weight rows instead would save the swap but cost ~15% more FLOPs).
- bf16 weights of a model narrower than ``CPU_BF16_MIN_HIDDEN`` compute in fp32 on CPU (the fused copies are the
  bf16 weights upcast once per refresh).

``unsupported_reason(model)`` says why a model of the family cannot take this path (then the HF forward runs);
the engine also checks this forward against the HF forward's logits at start-up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollyard.model import kernels as cpu_kernels
from rollyard.model.fast import FastForward, decoder_reason, train_attention, train_mlp

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
# On CPU, bf16 weights of a model narrower than this compute in fp32: at hidden 96 a bf16 decode
# step measured ~1.4x slower than fp32 (small matmuls and elementwise ops pay bf16's conversions
# and gain nothing), at 256 ~1.3x faster (2 threads, batch 32).
CPU_BF16_MIN_HIDDEN = 256


def unsupported_reason(model) -> str | None:
    """``None`` if ``model`` (of a Llama-family ``model_type``) can use the fast path, else why not."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED:
        return f"model_type {mtype!r} is not one of {SUPPORTED}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (fast path implements silu)"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True) and window < cfg.max_position_embeddings:
        return f"sliding-window attention ({window} < context {cfg.max_position_embeddings})"
    reason = decoder_reason(model)
    if reason:
        return reason
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        return "sliding-window attention layers"
    attn = model.model.layers[0].self_attn
    if hasattr(attn, "q_norm") != hasattr(attn, "k_norm"):
        return "attention has only one of q_norm / k_norm"
    if getattr(model.model.layers[0].mlp, "down_proj", None) is None:
        return "MLP is not gate/up/down"
    return None


class LlamaFast(FastForward):
    """Prefill and decode over a Llama-family module's weights; the family's training forward
    (:meth:`train_hidden`, module-level :func:`train_hidden`)."""

    MODEL_TYPES = SUPPORTED
    CPU_BF16_MIN_HIDDEN = CPU_BF16_MIN_HIDDEN
    FUSED_LAYER = True  # kernels.cc rollyard_decode_layer_bf16 / _f32 is this family's block (without q/k norms)
    unsupported_reason = staticmethod(unsupported_reason)

    def _act(self, gu: torch.Tensor) -> torch.Tensor:
        if self.norm_kernel:  # the same condition: fp32 compute on CPU with the kernels loaded
            return cpu_kernels.swiglu(gu)
        return F.silu(gu[..., :self.I]) * gu[..., self.I:]

    def block(self, x: torch.Tensor, o: torch.Tensor, w: dict) -> torch.Tensor:
        x = self._mm(o, w["wo"], w["bo"], add=x)
        h = self._rms(x, *w["post_attention_layernorm"])
        return self._mm(self._act(self._mm(h, w["wgu"])), w["wd"], add=x)

    @classmethod
    def train_layer(cls, x, layer, cos, sin, mask=None) -> torch.Tensor:
        a = layer.self_attn
        x = x + train_attention(cls.train_norm(x, layer.input_layernorm), a, cos, sin, mask, cls.train_qk_norm(a))
        return x + train_mlp(cls.train_norm(x, layer.post_attention_layernorm), layer.mlp, cpu_kernels.train_swiglu,
                             tail=True)


train_hidden = LlamaFast.train_hidden
