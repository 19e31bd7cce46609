"""Gemma 3 (text: ``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``) on the fast path: what it adds to
``fast.FastForward`` (the native engine's prefill and decode, and the trainer's forward :func:`train_hidden`).

Where Gemma 3 differs from the Llama family (``llama.py``), and what this file does about it:

- **RMSNorm on (1 + w)**, four per layer: ``x + post_attn_norm(attn(input_norm(x)))``, then
  ``x + post_ff_norm(mlp(pre_ff_norm(x)))``. The fused copies hold ``1 + w`` (one fp32 RMSNorm with a weight,
  as HF computes it); the residual add cannot ride in the o / down matmul, since the norm sits between.
- **QK-norm** per head (``q_norm`` / ``k_norm``, also on 1 + w) before RoPE, with the attention scale
  ``query_pre_attn_scalar ** -0.5`` folded into the q part of the norm weights.
- **GeGLU** MLP: ``gelu_tanh(gate) * up`` over one ``[gate | up]`` matmul.
- **Embeddings scaled by sqrt(hidden)** (HF's ``embed_scale``, in the weights' dtype) after the lookup; the
  **tied head** reads the same tensor (no copy: at a 262,144-token vocabulary it is 168M of Gemma-3-270M's 268M
  parameters). An optional ``final_logit_softcapping`` is applied as HF does.
- **Sliding-window attention** on the ``sliding_attention`` layers (``config.layer_types``, the layer kinds): a
  query at position ``i`` sees keys ``j`` with ``i - window < j <= i`` (HF's ``sliding_window_overlay``);
  ``full_attention`` layers see every earlier key. Each layer type has its own RoPE table (``rope_local_base_freq``
  on sliding layers), grown with the positions reached. The engine's cache keeps the common layout (every position
  of every layer): a decode step's sliding layers read only the last ``window`` positions of it (a slice when every
  row is at one position, else a mask), so the window costs nothing below ``window`` tokens (512 for Gemma-3-270M,
  longer than RL responses here) and bounds the attention above it. A ring buffer for the sliding layers would save
  cache memory past ``window`` tokens; not done.
- bf16 weights compute in bf16 (no narrow-model upcast), and the compiled decode attention runs with fp32 compute
  only.

Training: padded rows, or per-token ``position_ids`` with ``segments`` (the trainer's prefix-shared layout): the
window is taken on positions, so it holds in any layout. ``unsupported_reason(model)``: what this file does not
implement (then the HF forward runs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollyard.model import kernels as cpu_kernels
from rollyard.model.fast import FastForward, decoder_reason, heads, train_attention, train_mlp

MODEL_TYPES = ("gemma3_text",)
LAYER_TYPES = ("sliding_attention", "full_attention")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def is_gemma3(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) in MODEL_TYPES


def unsupported_reason(model) -> str | None:
    """``None`` if ``model`` (a Gemma 3 text model) can use this fast path, else why not."""
    cfg = model.config
    if not is_gemma3(model):
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {MODEL_TYPES}"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act not in GELU_TANH:
        return f"hidden_activation {act!r} (this path implements gelu_pytorch_tanh)"
    bad = sorted(set(cfg.layer_types) - set(LAYER_TYPES))
    if bad:
        return f"layer type {bad[0]!r}"
    reason = decoder_reason(model)
    if reason:
        return reason
    if not hasattr(model.model.embed_tokens, "embed_scale"):
        return "embeddings without embed_scale"
    return None


def _one_plus(t: torch.Tensor) -> torch.Tensor:
    return (1.0 + t.float()).contiguous()


def _geglu(gu: torch.Tensor) -> torch.Tensor:
    I = gu.shape[-1] // 2
    return F.gelu(gu[..., :I], approximate="tanh") * gu[..., I:]


class Gemma3Fast(FastForward):
    """Prefill and decode over a Gemma 3 module's weights (``FastForward``'s interface and cache layout); the
    family's training forward (:meth:`train_hidden`, module-level :func:`train_hidden`)."""

    MODEL_TYPES = MODEL_TYPES
    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    PACK_HEAD = False  # the tied head is the embedding itself: a 262k x 640 fp32 copy would be 0.67 GB
    GROW_TABLES = True
    unsupported_reason = staticmethod(unsupported_reason)

    @classmethod
    def layer_kinds(cls, model) -> list[str | None]:
        return list(model.config.layer_types)

    @classmethod
    def window_of(cls, model) -> int | None:
        return getattr(model.config, "sliding_window", None)

    def _norm_scale(self, w: torch.Tensor) -> torch.Tensor:
        return _one_plus(w)

    def _act(self, gu: torch.Tensor) -> torch.Tensor:
        return _geglu(gu)

    def block(self, x: torch.Tensor, o: torch.Tensor, w: dict) -> torch.Tensor:
        x = x + self._rms(self._mm(o, w["wo"], w["bo"]), *w["post_attention_layernorm"])
        h = self._rms(x, *w["pre_feedforward_layernorm"])
        d = self._mm(self._act(self._mm(h, w["wgu"])), w["wd"])
        return x + self._rms(d, *w["post_feedforward_layernorm"])

    @classmethod
    def train_norm(cls, x: torch.Tensor, norm) -> torch.Tensor:
        return cpu_kernels.train_rms_norm(x, 1.0 + norm.weight, norm.eps)

    @classmethod
    def train_qk_norm(cls, attn) -> tuple[torch.Tensor, float, float]:
        H, KVH, hd = heads(attn)  # the attention scale sits in q's norm weights
        nw = torch.cat((((1.0 + attn.q_norm.weight) * float(attn.scaling)).expand(H, hd),
                        (1.0 + attn.k_norm.weight).expand(KVH, hd)))
        return nw, attn.q_norm.eps, 1.0

    @classmethod
    def train_layer(cls, x, layer, cos, sin, mask=None) -> torch.Tensor:
        o = train_attention(cls.train_norm(x, layer.input_layernorm), layer.self_attn, cos, sin, mask,
                            cls.train_qk_norm(layer.self_attn))
        x = x + cls.train_norm(o, layer.post_attention_layernorm)
        d = train_mlp(cls.train_norm(x, layer.pre_feedforward_layernorm), layer.mlp, _geglu)
        return x + cls.train_norm(d, layer.post_feedforward_layernorm)


train_hidden = Gemma3Fast.train_hidden
