"""A small functional forward for the Llama / Qwen2 / Qwen3 / Mistral family over an HF module's own weights.

Why it exists: on a CPU with a tiny policy, a decode step is bound by per-op Python overhead, not
FLOPs. This forward does one decode step in ~16 ops per layer (HF's modules do several times
more) by fusing, once per weight version, the weights that are always used together:

- ``W_qkv``: rows ``[q | k | v]``, one matmul. RoPE is ``qk * cos + swap_halves(qk) * sin_signed``
  (``rotate_half`` as one cat of the two halves with the sign folded into the sin table; a
  last-dim gather measured up to ~4x slower on CPU at training shapes). The attention scale ``head_dim ** -0.5`` is folded into the q rows. (Folding
  rotate_half into extra weight rows instead saves the swap but costs ~15% more FLOPs.)
- ``W_gu``: ``[gate | up]``, so the MLP is one matmul, silu, mul, and one matmul-plus-residual for down.
- Qwen3's per-head ``q_norm`` / ``k_norm`` (RMSNorm over ``head_dim`` before RoPE): one
  ``rms_norm`` over the q and k heads together and one multiply by their stacked weights; the
  attention scale is folded into the q part of those weights instead of into ``W_qkv``.

The fused tensors are copies: ``refresh()`` must run after any weight change (the engine calls it
from ``load_weights``). On a CPU where oneDNN is the faster GEMM (``rollyard.model.gemm``), the
projections large enough to repay its per-call cost (and the LM head) are stored prepacked in
oneDNN's layout, and the o / down projections add the residual inside the kernel. Norm weights and
embeddings are read from the module.

KV cache layout (owned by the engine): ``kv[layer, 0|1, slot, kv_head, position, head_dim]``;
a slot's entries at positions >= its length are garbage (finite: the buffer is zero-initialised)
and masked out. With bf16 weights on a CPU the cache and the decode attention are fp32
(``kv_dtype``): CPU bf16 batched matmuls copy their strided cache views and run ~2x slower than
fp32 at these shapes, while the weight matmuls, where bf16 pays, stay bf16, unless the model is
narrower than ``CPU_BF16_MIN_HIDDEN``: then the fused copies are the bf16 weights upcast to fp32
(``dtype``, the compute dtype; ``weight_dtype`` is the module's).

On CPU the decode step's attention and RMSNorms run through ``rollyard.model.kernels`` (compiled
at first use; torch's ops where it cannot be built).

``unsupported_reason(model)`` says why a model cannot take this path (the engine then uses the
HF forward); the engine also checks this forward against the HF forward's logits at start-up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rollyard.model import gemm as cpu_gemm
from rollyard.model import gemma3
from rollyard.model import kernels as cpu_kernels
from rollyard.model.gemm import pack, packed_linear
from rollyard.model.shapes import read_shapes

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
# On CPU, bf16 weights of a model narrower than this compute in fp32: at hidden 96 a bf16 decode
# step measured ~1.4x slower than fp32 (small matmuls and elementwise ops pay bf16's conversions
# and gain nothing), at 256 ~1.3x faster (2 threads, batch 32).
CPU_BF16_MIN_HIDDEN = 256


def unsupported_reason(model) -> str | None:
    """``None`` if ``model`` can use the fast path, else why not."""
    if gemma3.is_gemma3(model):  # Gemma 3: its own fast forward (model/gemma3.py)
        return gemma3.unsupported_reason(model)
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED:
        return f"model_type {mtype!r} is not one of {SUPPORTED}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (fast path implements silu)"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True) and window < cfg.max_position_embeddings:
        return f"sliding-window attention ({window} < context {cfg.max_position_embeddings})"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no .model.layers / .model.rotary_emb"
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        return "sliding-window attention layers"
    attn = inner.layers[0].self_attn
    if hasattr(attn, "q_norm") != hasattr(attn, "k_norm"):
        return "attention has only one of q_norm / k_norm"
    if getattr(inner.layers[0].mlp, "down_proj", None) is None:
        return "MLP is not gate/up/down"
    return None


class LlamaFast:
    """Prefill and decode over ``model``'s weights; see the module docstring for the fusions."""

    def __init__(self, model):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"fast path unsupported: {reason}")
        p = read_shapes(self, model)
        attn = model.model.layers[0].self_attn
        cpu_bf16 = p.device.type == "cpu" and p.dtype == torch.bfloat16
        # Compute dtype: bf16 weights of a narrow model on CPU are upcast once per refresh (see the
        # module docstring); the values are the bf16 weights', only the arithmetic is wider.
        self.dtype = torch.float32 if cpu_bf16 and self.D < CPU_BF16_MIN_HIDDEN else p.dtype
        self.kv_dtype = torch.float32 if cpu_bf16 else p.dtype
        # rollyard.model.kernels: decode attention (fp32 cache on CPU) and RMSNorm (fp32 compute on CPU).
        on_cpu = p.device.type == "cpu"
        self.attn_kernel = (on_cpu and self.kv_dtype == torch.float32
                            and cpu_kernels.attention_supported(self.H, self.KVH, self.hd))
        self.norm_kernel = on_cpu and self.dtype == torch.float32 and cpu_kernels.kernel() is not None
        # RoPE + the cache write of a decode step in one call (all fp32; not with Qwen3's q/k norms).
        self.rope_kernel = self.attn_kernel and self.norm_kernel and not hasattr(attn, "q_norm")
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Rebuild the fused weight copies and RoPE tables from the module (after any weight change)."""
        inner = self.model.model
        H, KVH, hd = self.H, self.KVH, self.hd
        c = self._c
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            qkn, qk_eps = self._qk_norm(a)
            scale = 1.0 if qkn is not None else self.scale  # with q_norm, the scale sits in its weight
            q = c(a.q_proj.weight) * scale
            w = torch.cat((q, c(a.k_proj.weight), c(a.v_proj.weight))).contiguous()
            b = None
            if a.q_proj.bias is not None:
                b = torch.cat((c(a.q_proj.bias) * scale, c(a.k_proj.bias), c(a.v_proj.bias))).contiguous()
            gu = torch.cat((c(m.gate_proj.weight), c(m.up_proj.weight)))
            self.layers.append(dict(
                ln1=c(layer.input_layernorm.weight), eps1=layer.input_layernorm.variance_epsilon,
                ln2=c(layer.post_attention_layernorm.weight), eps2=layer.post_attention_layernorm.variance_epsilon,
                wqkv=pack(w), bqkv=b, qkn=qkn, qk_eps=qk_eps,
                wo=pack(c(a.o_proj.weight)), bo=c(a.o_proj.bias),
                wgu=pack(gu), wd=pack(c(m.down_proj.weight)),
            ))
        self.embed = c(inner.embed_tokens.weight)
        self.norm_w, self.norm_eps = c(inner.norm.weight), inner.norm.variance_epsilon
        self.lm_head = pack(c(self.model.lm_head.weight))
        self.lm_bias = c(getattr(self.model.lm_head, "bias", None))
        self.cos, self.sin = _rope_tables(inner, self.context, torch.zeros(1, device=self.device, dtype=self.dtype))
        self.n_qk = (H + KVH) * hd

    def release(self) -> None:
        """Drop the fused weight copies (``refresh`` rebuilds them): the colocated engine's sleep."""
        self.layers, self.lm_head = [], None

    @property
    def released(self) -> bool:
        return self.lm_head is None

    def _c(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` in the compute dtype (the module's own tensor when that is its dtype already)."""
        return None if t is None else t.to(self.dtype)

    def _qk_norm(self, attn) -> tuple[torch.Tensor | None, float]:
        """Qwen3: ``[H + KVH, hd]`` per-head norm weights (q rows times the attention scale), eps."""
        if not hasattr(attn, "q_norm"):
            return None, 0.0
        q = (self._c(attn.q_norm.weight) * self.scale).expand(self.H, self.hd)
        k = self._c(attn.k_norm.weight).expand(self.KVH, self.hd)
        return torch.cat((q, k)).contiguous(), float(attn.q_norm.variance_epsilon)

    def _norm_qk(self, qk: torch.Tensor, w: dict) -> torch.Tensor:
        if w["qkn"] is None:
            return qk
        return F.rms_norm(qk, (self.hd,), eps=w["qk_eps"]) * w["qkn"]

    def new_cache(self, slots: int, width: int) -> torch.Tensor:
        # Zeros, not empty: masked positions still enter p @ V (as 0 * value), so they must be finite.
        return torch.zeros(self.L, 2, slots, self.KVH, width, self.hd, device=self.device, dtype=self.kv_dtype)

    def _rms(self, x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
        if self.norm_kernel:
            return cpu_kernels.rms_norm(x, w, eps)
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        if self.norm_kernel:  # the same condition: fp32 compute on CPU with the kernels loaded
            return cpu_kernels.swiglu(gu)
        return F.silu(gu[..., :self.I]) * gu[..., self.I:]

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        x = self._rms(x, self.norm_w, self.norm_eps)
        return packed_linear(x, self.lm_head, self.lm_bias)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Run prompts ``tokens`` [G, P] (right-padded) and write their K/V into ``kv`` at ``slots`` [G].

        Returns logits [G, V] at positions ``last`` [G] (each prompt's last real token). Padded
        positions come after the real ones, so causal attention keeps them out of the real ones.
        """
        G, P = tokens.shape
        H, KVH, hd, n = self.H, self.KVH, self.hd, self.n_qk
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[:P, None], self.sin[:P, None]  # [P, 1, hd]
        for l, w in enumerate(self.layers):
            h = self._rms(x, w["ln1"], w["eps1"])
            y = packed_linear(h, w["wqkv"], w["bqkv"])
            qk = self._norm_qk(y[..., :n].view(G, P, H + KVH, hd), w)
            qk = _rope(qk, cos, sin)
            v = y[..., n:].view(G, P, KVH, hd).transpose(1, 2)
            q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
            kv[l, 0, slots, :, :P] = k.to(kv.dtype)
            kv[l, 1, slots, :, :P] = v.to(kv.dtype)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0, enable_gqa=KVH != H)
            o = o.transpose(1, 2).reshape(G, P, H * hd)
            x = packed_linear(o, w["wo"], w["bo"], add=x)
            h = self._rms(x, w["ln2"], w["eps2"])
            gu = packed_linear(h, w["wgu"])
            x = packed_linear(self._swiglu(gu), w["wd"], add=x)
        return self._head(x[torch.arange(G, device=x.device), last])

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor | None, kv: torch.Tensor, width: int,
               same_pos: int | None = None) -> torch.Tensor:
        """One decode step for slots ``0..B-1``: ``tokens`` [B] at positions ``pos`` [B].

        Writes each slot's new K/V at its position, attends over positions ``<= pos`` (of the
        first ``width`` cache positions; ``width > max(pos)``) and returns logits [B, V].
        ``same_pos``: the caller's promise that every slot is at this position (uniform lengths,
        the common GRPO case): K/V are written with a plain slice and no mask is built, since
        ``width == same_pos + 1`` leaves nothing to mask; ``pos`` is then unused (may be None).
        """
        B = tokens.shape[0]
        x = F.embedding(tokens, self.embed)
        # The cache's views for this step, cut once for all layers (per-layer tensor indexing is
        # a measurable share of a small model's decode step): what each layer reads ([B, KVH, W,
        # hd], strided, no copy) and where it writes its new K / V.
        reads = kv[:, :, :B, :, :width].unbind(0)
        if same_pos is not None:
            assert width == same_pos + 1, (width, same_pos)
            rope_at, mask = (None, same_pos), None
        else:
            rope_at = (pos.to(torch.int64).contiguous(), 0)
            if self.attn_kernel:
                mask = rope_at[0] + 1  # the kernel takes each row's length, not a mask
            else:
                ar = torch.arange(width, device=tokens.device)
                mask = torch.where(ar[None] > pos[:, None], float("-inf"), 0.0).to(self.kv_dtype)[:, None, None]  # [B,1,1,W]
        if self.rope_kernel:  # RoPE and the K / V writes in one kernel call per layer, at rope_at
            cos = sin = writes = at = None
        elif same_pos is not None:
            cos, sin = self.cos[same_pos:same_pos + 1], self.sin[same_pos:same_pos + 1]  # [1, hd]
            writes, at = kv[:, :, :B, :, same_pos].unbind(0), None  # per layer [2, B, KVH, hd]
        else:
            cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [B, 1, hd]
            writes, at = None, (torch.arange(B, device=tokens.device), slice(None), pos)
        return self._head(self._decode_layers(x, cos, sin, mask, kv, reads, writes, at, rope_at))

    def _decode_layers(self, x, cos, sin, mask, kv, reads, writes, at, rope_at) -> torch.Tensor:
        """Where the new K / V go: ``writes``, per layer a ``[2, B, KVH, hd]`` view at the one
        shared position, or else the index ``at = (rows, :, pos)`` into a layer's ``[slots, KVH, W, hd]``;
        with ``rope_kernel``, the kernel writes them at ``rope_at = (pos or None, same_pos)``.
        ``mask``: ``None`` (every row sees all ``W``), else the additive mask ``[B, 1, 1, W]``, or with
        the compiled kernel (``attn_kernel``) each row's length ``[B]``."""
        B = x.shape[0]
        H, KVH, hd, n = self.H, self.KVH, self.hd, self.n_qk
        G = H // KVH
        for l, w in enumerate(self.layers):
            h = self._rms(x, w["ln1"], w["eps1"])
            y = packed_linear(h, w["wqkv"], w["bqkv"])
            if self.rope_kernel:
                q = cpu_kernels.decode_rope_write(y, self.cos, self.sin, *rope_at, kv[l], H, KVH).view(B, H, hd)
            else:
                qk = _rope(self._norm_qk(y[:, :n].view(B, H + KVH, hd), w), cos, sin)
                q, k, v = qk[:, :H], qk[:, H:], y[:, n:].view(B, KVH, hd)
                if writes is not None:
                    writes[l][0].copy_(k)
                    writes[l][1].copy_(v)
                else:
                    layer = kv[l]
                    layer[0][at] = k.to(kv.dtype)
                    layer[1][at] = v.to(kv.dtype)
            K, V = reads[l]
            if self.attn_kernel:
                o = cpu_kernels.attend(q.to(K.dtype), K, V, mask).to(x.dtype)
            else:
                s = torch.matmul(q.reshape(B, KVH, G, hd).to(K.dtype), K.transpose(-1, -2))
                if mask is not None:
                    s = s + mask
                o = torch.matmul(torch.softmax(s, dim=-1), V).reshape(B, H * hd).to(x.dtype)
            x = packed_linear(o, w["wo"], w["bo"], add=x)
            h = self._rms(x, w["ln2"], w["eps2"])
            gu = packed_linear(h, w["wgu"])
            x = packed_linear(self._swiglu(gu), w["wd"], add=x)
        return x


def _rope_tables(inner, T: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos [T, hd]`` and ``sin`` with rotate_half's sign folded in (``like``: dtype and device)."""
    with torch.no_grad():
        cos, sin = inner.rotary_emb(like, torch.arange(T, device=like.device)[None])
        cos, sin = cos[0].to(like.dtype), sin[0].to(like.dtype)
        half = cos.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.contiguous(), sin.contiguous()


def _rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``qk * cos + rotate_half(qk) * sin`` over the last dim, with the sign folded into ``sin``."""
    half = qk.shape[-1] // 2
    return torch.addcmul(qk * cos, torch.cat((qk[..., half:], qk[..., :half]), dim=-1), sin)


def _qkv_rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, H: int, KVH: int):
    """The compiled split + RoPE (``cpu_kernels.train_qkv_rope``) for ``cos, sin [T, hd]``, or per row for
    per-row positions (``[B, T, hd]``: the prefix-shared layout); ``None`` where it cannot run."""
    if cos.dim() == 2:
        return cpu_kernels.train_qkv_rope(y, cos, sin, H, KVH)
    parts = [cpu_kernels.train_qkv_rope(y[r:r + 1], cos[r], sin[r], H, KVH) for r in range(y.shape[0])]
    if any(p is None for p in parts):
        return None
    return tuple(torch.cat(t) for t in zip(*parts))


def _attention_block(x: torch.Tensor, layer, cos, sin, mask=None) -> torch.Tensor:
    """One layer's attention (fused q|k|v matmul, RoPE, :func:`causal_attention`), with autograd.
    ``cos, sin``: ``[T, hd]``, or ``[B, T, hd]`` with per-row positions; ``mask``: see :func:`train_hidden`."""
    a = layer.self_attn
    B, T, _ = x.shape
    hd = a.head_dim
    H, KVH = a.q_proj.weight.shape[0] // hd, a.k_proj.weight.shape[0] // hd
    h = cpu_kernels.train_rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
    w = torch.cat((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))
    b = None if a.q_proj.bias is None else torch.cat((a.q_proj.bias, a.k_proj.bias, a.v_proj.bias))
    y = cpu_gemm.linear(h, w, b)
    fused = None if hasattr(a, "q_norm") else _qkv_rope(y, cos, sin, H, KVH)
    if fused is not None:  # q already [B, KVH, G * T, hd]
        o = grouped_causal_attention(*fused, float(a.scaling), mask).view(B, H, T, hd)
    else:
        qk = y[..., :(H + KVH) * hd].view(B, T, H + KVH, hd)
        if hasattr(a, "q_norm"):
            nw = torch.cat((a.q_norm.weight.expand(H, hd), a.k_norm.weight.expand(KVH, hd)))
            qk = F.rms_norm(qk, (hd,), eps=a.q_norm.variance_epsilon) * nw
        qk = _rope(qk, cos.unsqueeze(-2), sin.unsqueeze(-2))
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
        v = y[..., (H + KVH) * hd:].view(B, T, KVH, hd).transpose(1, 2)
        o = causal_attention(q, k, v, float(a.scaling), mask)
    return x + cpu_gemm.linear(o.transpose(1, 2).reshape(B, T, H * hd), a.o_proj.weight, a.o_proj.bias)


def prefix_shared_mask(segments: torch.Tensor) -> torch.Tensor:
    """Which keys each query may see in the prefix-shared layout (``trainer/packing.py``), ``[B, 1, T, T]``
    bool from ``segments [B, T]`` (0: the row's shared prompt prefix, k > 0: member k's suffix, -1: pad):
    causal, and only the prefix's keys or the query's own segment's. So a member's token sees the one copy
    of the prompt and its own earlier tokens, as it would alone; every row sees at least itself."""
    T = segments.shape[1]
    ar = torch.arange(T, device=segments.device)
    causal = ar[None, :] <= ar[:, None]  # [query, key]
    same = (segments[:, None, :] == 0) | (segments[:, None, :] == segments[:, :, None])
    return (causal & same)[:, None]


_MASKS: dict[tuple, torch.Tensor] = {}


def _grouped_causal_mask(T: int, G: int, device) -> torch.Tensor:
    """Additive fp32 mask ``[G * T, T]``: row ``g * T + i`` may see keys ``0..i``."""
    key = (T, G, str(device))
    m = _MASKS.get(key)
    if m is None:
        if len(_MASKS) > 64:
            _MASKS.clear()
        m = torch.full((T, T), float("-inf"), device=device).triu_(1).repeat(G, 1)
        _MASKS[key] = m
    return m


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention ``q [B, H, T, hd]`` over ``k, v [B, KVH, T, hd]`` (GQA), with autograd.

    On CUDA this is SDPA (flash). On CPU, SDPA's kernels are slow at the short rows RL trains on
    (flash's backward in bf16 especially; the math kernel expands K/V per query head and runs a
    "safe" softmax with extra passes), so the CPU path is three plain ops: the query heads that
    share a K/V head are stacked along the query axis (``[B, KVH, G * T, hd]``: no K/V copies),
    one matmul for the scores, an fp32 softmax under a cached additive causal mask, one matmul.
    Every row sees at least its own key, so no row is fully masked. ``mask``: instead of the causal
    mask, the train forward's (:func:`train_hidden`): ``[B, 1, T, T]`` bool on CUDA, additive fp32 on CPU.
    """
    B, H, T, hd = q.shape
    KVH = k.shape[1]
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=KVH != H)
    return grouped_causal_attention(q.reshape(B, KVH, H // KVH * T, hd), k, v, scale, mask).view(B, H, T, hd)


def grouped_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`causal_attention`'s CPU path with the query heads already stacked: ``q [B, KVH, G * T,
    hd]`` (row ``g * T + i``: head ``kv * G + g`` at position ``i``), ``k, v [B, KVH, T, hd]``;
    returns ``[B, KVH, G * T, hd]``. ``mask``: an additive fp32 ``[B, 1, T, T]`` instead of the causal one."""
    B, KVH, GT, _ = q.shape
    T = k.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2))
    if mask is None:
        s = torch.add(_grouped_causal_mask(T, GT // T, q.device), s, alpha=scale)  # mask + scale * s, fp32
    else:  # the same per row for each of the G stacked query heads
        s = torch.add(mask[:, :, None], s.view(B, KVH, GT // T, T, T), alpha=scale).view(B, KVH, GT, T)
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(p, v)


def _mlp_block(x: torch.Tensor, layer) -> torch.Tensor:
    m, n = layer.mlp, layer.post_attention_layernorm
    h = cpu_kernels.train_rms_norm(x, n.weight, n.variance_epsilon)
    gu = cpu_gemm.linear(h, torch.cat((m.gate_proj.weight, m.up_proj.weight)))
    return x + cpu_gemm.linear(cpu_kernels.train_swiglu(gu), m.down_proj.weight)


def train_hidden(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 segments: torch.Tensor | None = None) -> torch.Tensor:
    """Final-norm hidden states ``[B, T, D]`` of right-padded rows ``input_ids [B, T]`` (positions
    0..T-1, causal), differentiable w.r.t. the module's own parameters. Or, the prefix-shared layout
    (``trainer/packing.py``): ``position_ids [B, T]`` per token and ``segments [B, T]`` for the
    attention mask (:func:`prefix_shared_mask`).

    The trainer's padded micro-batches run through this instead of the HF module forward when
    :func:`train_forward_matches` holds: the same math in fewer ops (q|k|v and gate|up
    concatenated per call, so gradients reach the original weights; fused ``rms_norm``; RoPE's
    half swap as one cat; on CPU :func:`causal_attention`; on CPU in fp32 the RMSNorms, SwiGLU
    and q|k|v split + RoPE through ``rollyard.model.kernels``). No dropout (the family has none in training).
    """
    if gemma3.is_gemma3(model):  # Gemma 3: model/gemma3.py
        return gemma3.train_hidden(model, input_ids, position_ids, segments)
    inner = model.model
    x = F.embedding(input_ids, inner.embed_tokens.weight, inner.embed_tokens.padding_idx)
    mask = None
    if position_ids is None:
        cos, sin = _rope_tables(inner, input_ids.shape[1], x)
    else:
        cos, sin = _rope_tables(inner, int(position_ids.max()) + 1, x)
        cos, sin = cos[position_ids], sin[position_ids]  # [B, T, hd]
    if segments is not None:
        mask = prefix_shared_mask(segments)
        if x.device.type == "cpu":  # additive, once for all layers (grouped_causal_attention)
            mask = torch.zeros(mask.shape, device=x.device).masked_fill_(~mask, float("-inf"))
    # The module's gradient checkpointing (``model.gradient_checkpointing_enable()``; the trainer's
    # ``activation_checkpointing``): keep each layer's input only and recompute the layer in the backward.
    recompute = getattr(inner, "gradient_checkpointing", False) and torch.is_grad_enabled()
    for layer in inner.layers:
        if recompute:
            x = checkpoint(_layer, x, layer, cos, sin, mask, use_reentrant=False)
        else:
            x = _layer(x, layer, cos, sin, mask)
    return cpu_kernels.train_rms_norm(x, inner.norm.weight, inner.norm.variance_epsilon)


def _layer(x: torch.Tensor, layer, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
    return _mlp_block(_attention_block(x, layer, cos, sin, mask), layer)


_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def train_unsupported_reason(model) -> str | None:
    """``None`` if :func:`train_hidden` computes what the module would, else why not.

    Beyond :func:`unsupported_reason`: ``train_hidden`` reads the projections' ``.weight``
    directly and never calls a module, so anything that works through module calls would be
    skipped without a trace: a PEFT adapter wrapping a projection (its LoRA factors would get no
    gradient), FSDP's per-layer all-gather hooks (sharded weights; the ranks would hang), or any
    other forward hook (gradient checkpointing it honours: see :func:`train_hidden`). A numeric check alone cannot see an adapter
    whose B factor is still zero.
    """
    reason = unsupported_reason(model)
    if reason:
        return reason
    if getattr(model.config, "attention_dropout", 0.0):
        return "attention dropout"
    for i, layer in enumerate(model.model.layers):
        for m in layer.modules():
            if m._forward_hooks or m._forward_pre_hooks:
                return f"layer {i} has forward hooks ({type(m).__name__}: FSDP or another wrapper)"
        for name in _PROJECTIONS:
            mod = layer.get_submodule(name)
            if type(mod) is not torch.nn.Linear:
                return (f"layer {i} {name} is {type(mod).__module__}.{type(mod).__qualname__}, not a plain "
                        f"torch.nn.Linear (an adapter?)")
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "sharded (DTensor) parameters"
    return None


@torch.no_grad()
def train_forward_matches(model, tol: float = 1e-4) -> bool:
    """Whether :func:`train_hidden` may stand in for the HF decoder: nothing it would bypass
    (:func:`train_unsupported_reason`), and equal outputs on a short random batch (relative max error)."""
    if train_unsupported_reason(model) is not None:
        return False
    dev = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)).to(dev)
    # In the weights' own precision: a caller's bf16 autocast would put both sides' rounding
    # (~1e-2) above ``tol`` and fail the check for the wrong reason.
    with torch.autocast(dev.type, enabled=False):
        try:
            got = train_hidden(model, ids).float()
        except cpu_kernels.KernelsRequired:
            raise
        except (RuntimeError, ValueError, TypeError, AttributeError, IndexError):  # an unexpected family variant
            return False
        ref = model.model(input_ids=ids, use_cache=False).last_hidden_state.float()
    return bool(((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)) < tol)
