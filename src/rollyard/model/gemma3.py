"""Gemma 3 (text: ``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``) on the fast path: the native engine's
prefill and decode (:class:`Gemma3Fast`, the interface of ``llama.LlamaFast``) and the trainer's forward
(:func:`train_hidden`), over the HF module's own weights.

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
- **Sliding-window attention** on the ``sliding_attention`` layers (``config.layer_types``): a query at position
  ``i`` sees keys ``j`` with ``i - window < j <= i`` (HF's ``sliding_window_overlay``); ``full_attention`` layers
  see every earlier key. Each layer type has its own RoPE table (``rope_local_base_freq`` on sliding layers).
  The engine's cache keeps the Llama layout (every position of every layer): a decode step's sliding layers
  read only the last ``window`` positions of it (a slice when every row is at one position, else a mask), so
  the window costs nothing below ``window`` tokens (512 for Gemma-3-270M, longer than RL responses here) and
  bounds the attention above it. A ring buffer for the sliding layers would save cache memory past ``window``
  tokens; not done.

Training (:func:`train_hidden`): padded rows, or per-token ``position_ids`` with ``segments`` (the trainer's
prefix-shared layout, as ``llama.train_hidden`` takes them): the window is taken on positions, so it holds in
any layout. ``unsupported_reason(model)``: what this file does not implement (the engine falls back to HF).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rollyard.model import gemm as cpu_gemm
from rollyard.model import kernels as cpu_kernels
from rollyard.model.gemm import pack, packed_linear
from rollyard.model.shapes import read_shapes

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
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no .model.layers / .model.rotary_emb"
    if not hasattr(inner.embed_tokens, "embed_scale"):
        return "embeddings without embed_scale"
    return None


def window_of(model) -> int | None:
    return getattr(model.config, "sliding_window", None)


def rope_tables(inner, T: int, like: torch.Tensor, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos [T, hd]`` and ``sin`` (rotate_half's sign folded in) of ``layer_type``'s RoPE."""
    with torch.no_grad():
        cos, sin = inner.rotary_emb(like, torch.arange(T, device=like.device)[None], layer_type=layer_type)
        cos, sin = cos[0].to(like.dtype), sin[0].to(like.dtype)
        half = cos.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.contiguous(), sin.contiguous()


def _rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = qk.shape[-1] // 2
    return torch.addcmul(qk * cos, torch.cat((qk[..., half:], qk[..., :half]), dim=-1), sin)


def _one_plus(t: torch.Tensor) -> torch.Tensor:
    return (1.0 + t.float()).contiguous()


def _softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3Fast:
    """Prefill and decode over a Gemma 3 module's weights (``llama.LlamaFast``'s interface and cache layout)."""

    def __init__(self, model):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"fast path unsupported: {reason}")
        p = read_shapes(self, model)
        self.window = window_of(model)
        self.types = list(model.config.layer_types)
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        # As llama.LlamaFast: bf16 weights keep an fp32 cache on CPU; compute in the weights' dtype.
        self.dtype = p.dtype
        self.kv_dtype = torch.float32 if p.device.type == "cpu" and p.dtype == torch.bfloat16 else p.dtype
        on_cpu = p.device.type == "cpu"
        self.attn_kernel = (on_cpu and self.kv_dtype == torch.float32 and self.dtype == torch.float32
                            and cpu_kernels.attention_supported(self.H, self.KVH, self.hd))
        self.norm_kernel = on_cpu and self.dtype == torch.float32 and cpu_kernels.kernel() is not None
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Rebuild the fused weight copies from the module (after any weight change)."""
        inner = self.model.model
        c = self._c
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            qkn = torch.cat(((_one_plus(a.q_norm.weight) * self.scale).expand(self.H, self.hd),
                             _one_plus(a.k_norm.weight).expand(self.KVH, self.hd))).to(self.dtype).contiguous()
            b = None
            if a.q_proj.bias is not None:
                b = torch.cat((c(a.q_proj.bias), c(a.k_proj.bias), c(a.v_proj.bias))).contiguous()
            self.layers.append(dict(
                ln_in=c(_one_plus(layer.input_layernorm.weight)), ln_attn=c(_one_plus(layer.post_attention_layernorm.weight)),
                ln_pre=c(_one_plus(layer.pre_feedforward_layernorm.weight)),
                ln_ff=c(_one_plus(layer.post_feedforward_layernorm.weight)), eps=float(layer.input_layernorm.eps),
                wqkv=pack(torch.cat((c(a.q_proj.weight), c(a.k_proj.weight), c(a.v_proj.weight))).contiguous()),
                bqkv=b, qkn=qkn, qk_eps=float(a.q_norm.eps), wo=pack(c(a.o_proj.weight)), bo=c(a.o_proj.bias),
                wgu=pack(torch.cat((c(m.gate_proj.weight), c(m.up_proj.weight)))), wd=pack(c(m.down_proj.weight)),
            ))
        self.embed = c(inner.embed_tokens.weight)
        self.embed_scale = float(inner.embed_tokens.embed_scale.to(self.embed.dtype))
        self.norm_w, self.norm_eps = c(_one_plus(inner.norm.weight)), float(inner.norm.eps)
        # The tied head is the embedding itself: no copy, not repacked (a 262k x 640 fp32 copy is 0.67 GB).
        self.lm_head = c(self.model.lm_head.weight)
        self.lm_bias = c(getattr(self.model.lm_head, "bias", None))
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._T = 0
        self.n_qk = (self.H + self.KVH) * self.hd

    def release(self) -> None:
        """Drop the fused weight copies (``refresh`` rebuilds them): the colocated engine's sleep."""
        self.layers, self.lm_head = [], None

    @property
    def released(self) -> bool:
        return self.lm_head is None

    def _c(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(self.dtype)

    def tables(self, T: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each layer type's RoPE tables for positions ``0..T-1`` at least (grown by doubling: a 32k-context
        model's full tables would be 128 MB at head_dim 256)."""
        if T > self._T:
            self._T = min(max(T, 2 * self._T, 64), max(self.context, T))
            like = torch.zeros(1, device=self.device, dtype=self.dtype)
            self._tables = {t: rope_tables(self.model.model, self._T, like, t) for t in set(self.types)}
        return self._tables

    def new_cache(self, slots: int, width: int) -> torch.Tensor:
        return torch.zeros(self.L, 2, slots, self.KVH, width, self.hd, device=self.device, dtype=self.kv_dtype)

    def _rms(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self.norm_kernel:
            return cpu_kernels.rms_norm(x, w, eps)
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def _geglu(self, gu: torch.Tensor) -> torch.Tensor:
        return F.gelu(gu[..., :self.I], approximate="tanh") * gu[..., self.I:]

    def _mlp(self, x: torch.Tensor, w: dict) -> torch.Tensor:
        h = self._rms(x, w["ln_pre"], w["eps"])
        d = packed_linear(self._geglu(packed_linear(h, w["wgu"])), w["wd"])
        return x + self._rms(d, w["ln_ff"], w["eps"])

    def _qk(self, y: torch.Tensor, shape: tuple, w: dict) -> torch.Tensor:
        qk = y[..., :self.n_qk].view(*shape, self.H + self.KVH, self.hd)
        return F.rms_norm(qk, (self.hd,), eps=w["qk_eps"]) * w["qkn"]

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        x = self._rms(x, self.norm_w, self.norm_eps)
        return _softcap(packed_linear(x, self.lm_head, self.lm_bias), self.softcap)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Run prompts ``tokens`` [G, P] (right-padded), write their K/V into ``kv`` at ``slots`` [G]; logits
        [G, V] at positions ``last`` [G] only (the head of a 262k vocabulary is not run on every position)."""
        G, P = tokens.shape
        H, KVH, hd, n = self.H, self.KVH, self.hd, self.n_qk
        x = F.embedding(tokens, self.embed) * self.embed_scale
        tables = self.tables(P)
        sliding = None
        if self.window is not None and P > self.window:
            ar = torch.arange(P, device=x.device)
            sliding = (ar[None, :] <= ar[:, None]) & (ar[None, :] > ar[:, None] - self.window)  # [query, key]
        for l, w in enumerate(self.layers):
            cos, sin = (t[:P, None] for t in tables[self.types[l]])
            h = self._rms(x, w["ln_in"], w["eps"])
            y = packed_linear(h, w["wqkv"], w["bqkv"])
            qk = _rope(self._qk(y, (G, P), w), cos, sin)
            v = y[..., n:].view(G, P, KVH, hd).transpose(1, 2)
            q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
            kv[l, 0, slots, :, :P] = k.to(kv.dtype)
            kv[l, 1, slots, :, :P] = v.to(kv.dtype)
            mask = sliding if self.types[l] == "sliding_attention" else None
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=1.0,
                                               enable_gqa=KVH != H)
            o = packed_linear(o.transpose(1, 2).reshape(G, P, H * hd), w["wo"], w["bo"])
            x = self._mlp(x + self._rms(o, w["ln_attn"], w["eps"]), w)
        return self._head(x[torch.arange(G, device=x.device), last])

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor | None, kv: torch.Tensor, width: int,
               same_pos: int | None = None) -> torch.Tensor:
        """One decode step for slots ``0..B-1`` (``llama.LlamaFast.decode``'s contract): ``tokens`` [B] at
        positions ``pos`` [B] (or all at ``same_pos``, ``pos`` unused); returns logits [B, V]."""
        B = tokens.shape[0]
        H, KVH, hd, n = self.H, self.KVH, self.hd, self.n_qk
        G = H // KVH
        x = F.embedding(tokens, self.embed) * self.embed_scale
        tables = self.tables(width)
        reads = kv[:, :, :B, :, :width].unbind(0)
        at = torch.arange(B, device=tokens.device)
        if same_pos is not None:
            assert width == same_pos + 1, (width, same_pos)
            rope = {k: (c[same_pos:same_pos + 1], s[same_pos:same_pos + 1]) for k, (c, s) in tables.items()}
            masks = {"full_attention": None, "sliding_attention": None}
            start = max(0, width - self.window) if self.window is not None else 0  # sliding layers read a slice
        else:
            pos = pos.to(torch.int64)
            rope = {k: (c[pos][:, None], s[pos][:, None]) for k, (c, s) in tables.items()}
            masks = self._decode_masks(pos, width)
            start = 0
        for l, w in enumerate(self.layers):
            sliding = self.types[l] == "sliding_attention"
            cos, sin = rope[self.types[l]]
            h = self._rms(x, w["ln_in"], w["eps"])
            y = packed_linear(h, w["wqkv"], w["bqkv"])
            qk = _rope(self._qk(y, (B,), w), cos, sin)
            q, k, v = qk[:, :H], qk[:, H:], y[:, n:].view(B, KVH, hd)
            if same_pos is not None:
                kv[l, 0, :B, :, same_pos] = k.to(kv.dtype)
                kv[l, 1, :B, :, same_pos] = v.to(kv.dtype)
            else:
                kv[l, 0][at, :, pos] = k.to(kv.dtype)
                kv[l, 1][at, :, pos] = v.to(kv.dtype)
            K, V = reads[l]
            if sliding and start:
                K, V = K[:, :, start:], V[:, :, start:]
            mask = masks["sliding_attention" if sliding else "full_attention"]
            if self.attn_kernel and (mask is None or isinstance(mask, tuple)):
                o = cpu_kernels.attend(q.contiguous(), K, V, None if mask is None else mask[0]).to(x.dtype)
            else:
                s = torch.matmul(q.reshape(B, KVH, G, hd).to(K.dtype), K.transpose(-1, -2))
                if mask is not None:
                    s = s + (mask[1] if isinstance(mask, tuple) else mask)
                o = torch.matmul(torch.softmax(s, dim=-1), V).reshape(B, H * hd).to(x.dtype)
            o = packed_linear(o, w["wo"], w["bo"])
            x = self._mlp(x + self._rms(o, w["ln_attn"], w["eps"]), w)
        return self._head(x)

    def _decode_masks(self, pos: torch.Tensor, width: int) -> dict:
        """Per layer type, what hides the keys a row must not see at positions ``pos``: ``(lengths, additive
        mask)`` where a prefix of each row is visible (the kernel takes the lengths), or an additive mask
        ``[B, 1, 1, W]`` where the sliding window also hides the row's oldest keys."""
        ar = torch.arange(width, device=pos.device)
        future = ar[None] > pos[:, None]
        full = (pos + 1, torch.zeros(future.shape, dtype=self.kv_dtype, device=pos.device)
                .masked_fill_(future, float("-inf"))[:, None, None])
        if self.window is None or int(pos.max()) < self.window:
            return {"full_attention": full, "sliding_attention": full}
        hidden = future | (ar[None] <= pos[:, None] - self.window)
        sliding = torch.zeros(hidden.shape, dtype=self.kv_dtype, device=pos.device).masked_fill_(hidden, float("-inf"))
        return {"full_attention": full, "sliding_attention": sliding[:, None, None]}


# ---- training (with autograd) ----------------------------------------------------------------


def _allowed(T: int, position_ids: torch.Tensor | None, segments: torch.Tensor | None, window: int | None,
             device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(full, sliding)`` bool masks ``[B or 1, 1, T, T]`` (query, key) of the rows, None where plain causal
    attention is the mask: causal in row order; with ``segments`` (prefix-shared rows) only the prefix's keys
    (segment 0) or the query's own segment's; on sliding layers also ``pos_q - pos_k < window``."""
    ar = torch.arange(T, device=device)
    base = None
    if segments is not None:
        same = (segments[:, None, :] == 0) | (segments[:, None, :] == segments[:, :, None])
        base = (ar[None, :] <= ar[:, None])[None] & same
    pos = position_ids if position_ids is not None else ar[None]
    if window is None or int(pos.max()) < window:
        return (None if base is None else base[:, None]), (None if base is None else base[:, None])
    near = (pos[:, :, None] - pos[:, None, :]) < window  # [B, query, key]
    causal = base if base is not None else (ar[None, :] <= ar[:, None])[None]
    return (None if base is None else base[:, None]), (causal & near)[:, None]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``q [B, H, T, hd]`` (scaled) over ``k, v [B, KVH, T, hd]``: SDPA with ``mask`` (bool, True: visible) or
    causal; on CPU the query heads of a K/V head stacked (no K/V copies) and an fp32 softmax."""
    B, H, T, hd = q.shape
    KVH = k.shape[1]
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=1.0,
                                              enable_gqa=KVH != H)
    G = H // KVH
    s = torch.matmul(q.reshape(B, KVH, G * T, hd), k.transpose(-1, -2)).view(B, KVH, G, T, T)
    visible = mask[:, :, None] if mask is not None else torch.ones(T, T, dtype=torch.bool, device=q.device).tril_()
    s = s.float().masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype).view(B, KVH, G * T, T)
    return torch.matmul(p, v).view(B, H, T, hd)


def _norm(x: torch.Tensor, n) -> torch.Tensor:
    return cpu_kernels.train_rms_norm(x, 1.0 + n.weight, n.eps)


def _layer(x: torch.Tensor, layer, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    a, m = layer.self_attn, layer.mlp
    B, T, _ = x.shape
    hd = a.head_dim
    H, KVH = a.q_proj.weight.shape[0] // hd, a.k_proj.weight.shape[0] // hd
    h = _norm(x, layer.input_layernorm)
    w = torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))
    b = None if a.q_proj.bias is None else torch.cat((a.q_proj.bias, a.k_proj.bias, a.v_proj.bias))
    y = cpu_gemm.linear(h, w, b)
    nw = torch.cat((((1.0 + a.q_norm.weight) * float(a.scaling)).expand(H, hd), (1.0 + a.k_norm.weight).expand(KVH, hd)))
    qk = F.rms_norm(y[..., :(H + KVH) * hd].view(B, T, H + KVH, hd), (hd,), eps=a.q_norm.eps) * nw
    qk = _rope(qk, cos.unsqueeze(-2), sin.unsqueeze(-2))
    q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
    v = y[..., (H + KVH) * hd:].view(B, T, KVH, hd).transpose(1, 2)
    o = _attend(q, k, v, mask).transpose(1, 2).reshape(B, T, H * hd)
    x = x + _norm(cpu_gemm.linear(o, a.o_proj.weight, a.o_proj.bias), layer.post_attention_layernorm)
    gu = cpu_gemm.linear(_norm(x, layer.pre_feedforward_layernorm), torch.cat((m.gate_proj.weight, m.up_proj.weight)))
    I = m.gate_proj.weight.shape[0]
    d = cpu_gemm.linear(F.gelu(gu[..., :I], approximate="tanh") * gu[..., I:], m.down_proj.weight)
    return x + _norm(d, layer.post_feedforward_layernorm)


def train_hidden(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 segments: torch.Tensor | None = None) -> torch.Tensor:
    """Final-norm hidden states ``[B, T, D]`` of ``input_ids [B, T]`` (``llama.train_hidden``'s contract:
    right-padded rows at positions 0..T-1, or ``position_ids`` and ``segments`` of the prefix-shared layout),
    differentiable w.r.t. the module's own parameters; honours the module's gradient checkpointing."""
    inner = model.model
    e = inner.embed_tokens
    x = F.embedding(input_ids, e.weight, e.padding_idx) * e.embed_scale.to(e.weight.dtype)
    T = input_ids.shape[1]
    n = T if position_ids is None else int(position_ids.max()) + 1
    tables = {}
    for t in set(model.config.layer_types):
        cos, sin = rope_tables(inner, n, x, t)
        tables[t] = (cos[:T], sin[:T]) if position_ids is None else (cos[position_ids], sin[position_ids])
    full, sliding = _allowed(T, position_ids, segments, window_of(model), x.device)
    recompute = getattr(inner, "gradient_checkpointing", False) and torch.is_grad_enabled()
    for layer, kind in zip(inner.layers, model.config.layer_types):
        cos, sin = tables[kind]
        mask = sliding if kind == "sliding_attention" else full
        if recompute:
            x = checkpoint(_layer, x, layer, cos, sin, mask, use_reentrant=False)
        else:
            x = _layer(x, layer, cos, sin, mask)
    return cpu_kernels.train_rms_norm(x, 1.0 + inner.norm.weight, inner.norm.eps)
