"""What every fast forward shares: :class:`FastForward`, the native engine's prefill and decode and the trainer's
forward over an HF decoder module's own weights, written once; a family's file (``llama.py``, ``gemma3.py``) says
only what differs, and ``families.py`` routes a model to it.

Why a fast forward exists: on a CPU with a tiny policy, a decode step is bound by per-op Python overhead, not
FLOPs. Once per weight version the weights that are always used together are fused into copies:

- ``wqkv``: rows ``[q | k | v]``, one matmul (and ``bqkv``, the biases). RoPE is ``qk * cos + swap_halves(qk) *
  sin_signed`` (``rotate_half`` as one cat of the two halves with the sign folded into the sin table; a last-dim
  gather measured up to ~4x slower on CPU at training shapes). The attention scale ``head_dim ** -0.5`` sits in the
  q rows, or, with per-head q/k norms (``qkn``), in the q part of their weights.
- ``wgu``: ``[gate | up]``, so the MLP is one matmul, the family's activation, and one matmul for down.

The fused tensors are copies: ``refresh()`` must run after any weight change (the engine calls it from
``load_weights``). On a CPU where oneDNN is the faster GEMM (``rollyard.model.gemm``), the projections large enough
to repay its per-call cost are stored prepacked in oneDNN's layout; bf16 matmuls on a CPU with AVX512-BF16 take
``rollyard.model.kernels``' bf16 matmul instead (its layout P, written from the module's weights in one pass), and fp32
matmuls its fp32 matmul (layout Q; AVX-512 or AVX2 builds).

KV cache layout (owned by the engine): ``kv[layer, 0|1, slot, kv_head, position, head_dim]``; a slot's entries at
positions >= its length are garbage (finite: the buffer is zero-initialised) and masked out. On a CPU the decode
attention computes in fp32 (CPU bf16 batched matmuls copy their strided cache views and run ~2x slower than fp32 at
these shapes); the cache (``kv_dtype``) is fp32, or bf16 where the matmuls are bf16 and the compiled attention
kernel reads bf16 (half the bytes a decode step reads: SmolLM2-135M at batch 32, ~110 positions, attention 5.0 -> 3.7
ms a step). ``mm_dtype`` is the matmuls' dtype, that of the fused copies
(``compute_dtype``, rollout.precision; else the module's, and a family may upcast narrow bf16 models:
``CPU_BF16_MIN_HIDDEN``); ``dtype`` the activations' (fp32 on CPU: a matmul's input is cast to ``mm_dtype`` and
its output back), ``weight_dtype`` the module's. On CPU the decode step's attention, RMSNorms and
(without q/k norms) RoPE with the cache write run through ``rollyard.model.kernels`` (compiled at first use; torch's
ops where it cannot be built).

Layer kinds: ``kinds[l]`` names layer ``l``'s RoPE and attention (``None``: the one kind of a family without
variants; Gemma 3: ``config.layer_types``). A ``"sliding_attention"`` layer sees only the last ``window`` keys; every
other layer sees every earlier key. Each kind has its own RoPE table (``rotary_emb(..., layer_type=kind)``).

A family subclass sets ``MODEL_TYPES``, ``unsupported_reason`` (a static method), the norms of a layer in order
(``NORMS``), its activation (``_act``), the residual wiring after attention (``block``: its matmuls through
``self._mm``, which reads every layout ``refresh`` may write) and, for training, ``train_layer``; the rest are class
attributes with the Llama family's values as defaults.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rollyard.model import gemm as cpu_gemm
from rollyard.model import kernels as cpu_kernels
from rollyard.model.gemm import pack, packed_linear
from rollyard.model.hugepages import Arena
from rollyard.model.segments import SegmentPlan, segment_plans, segmented_attention

SLIDING = "sliding_attention"


def read_shapes(fwd, model) -> torch.Tensor:
    """Set a fast forward's ``model`` and its shapes from a decoder module (``model.model.layers``): ``L`` layers,
    ``H`` / ``KVH`` query / key-value heads, ``hd`` head dim, ``D`` hidden, ``I`` MLP width, ``context``, attention
    ``scale``, ``device`` and ``weight_dtype``. Returns the first parameter (its device and dtype)."""
    fwd.model = model
    cfg, inner = model.config, model.model
    attn = inner.layers[0].self_attn
    fwd.L = len(inner.layers)
    fwd.H = cfg.num_attention_heads
    fwd.KVH = getattr(cfg, "num_key_value_heads", None) or fwd.H
    fwd.hd = attn.head_dim
    fwd.D = cfg.hidden_size
    fwd.I = inner.layers[0].mlp.gate_proj.weight.shape[0]
    fwd.context = int(cfg.max_position_embeddings)
    fwd.scale = float(attn.scaling)
    p = next(model.parameters())
    fwd.device, fwd.weight_dtype = p.device, p.dtype
    return p


def eps_of(norm) -> float:
    """An HF RMSNorm module's epsilon (``variance_epsilon`` in the Llama family, ``eps`` in Gemma's)."""
    eps = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if eps is None else eps)


def decoder_reason(model) -> str | None:
    """What every fast forward needs of the module's layout, or why it does not have it."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no .model.layers / .model.rotary_emb"
    return None


def rope_tables(inner, T: int, like: torch.Tensor, kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos [T, hd]`` and ``sin`` with rotate_half's sign folded in, of layer kind ``kind``'s RoPE (``None``: the
    module's one RoPE); ``like``: dtype and device.

    HF's rotary module is run first (a dynamic RoPE updates its frequencies for ``T`` there), then, where it is the
    usual ``cos / sin(position x inv_freq) x attention_scaling`` (agreeing with HF's result to 1e-3), the tables are
    recomputed from its fp32 angles with cos / sin in fp64: torch's fp32 ``cos`` was seen, in some processes only, to
    miss single entries of an 8192-position table by 1.5e-4 (4000 ulp) on one CPU, which made the fast path's
    logits differ from HF's by 1.4e-4 instead of 2e-6 and the engine fall back to the slow backend at random."""
    kw = {} if kind is None else {"layer_type": kind}
    rot = inner.rotary_emb
    with torch.no_grad():
        cos, sin = rot(like, torch.arange(T, device=like.device)[None], **kw)
        cos, sin = cos[0].to(like.dtype), sin[0].to(like.dtype)
        prefix = "" if kind is None else f"{kind}_"
        inv, scale = getattr(rot, f"{prefix}inv_freq", None), getattr(rot, f"{prefix}attention_scaling", None)
        if isinstance(inv, torch.Tensor) and isinstance(scale, (int, float)) and 2 * inv.numel() == cos.shape[-1]:
            angles = torch.arange(T, device=like.device, dtype=torch.float32)[:, None] * inv.float()[None]  # HF's
            angles = torch.cat((angles, angles), dim=-1).double()
            c64, s64 = (angles.cos() * scale).to(like.dtype), (angles.sin() * scale).to(like.dtype)
            if max(float((c64 - cos).abs().max()), float((s64 - sin).abs().max())) <= 1e-3:
                cos, sin = c64, s64
        half = cos.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.contiguous(), sin.contiguous()


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``qk * cos + rotate_half(qk) * sin`` over the last dim, with the sign folded into ``sin``."""
    half = qk.shape[-1] // 2
    return torch.addcmul(qk * cos, torch.cat((qk[..., half:], qk[..., :half]), dim=-1), sin)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if cap is None else torch.tanh(logits / cap) * cap


class FastForward:
    """Prefill and decode over ``model``'s weights (see the module docstring), and the class's training forward
    (:meth:`train_hidden`). Subclasses: one per family."""

    MODEL_TYPES: tuple[str, ...] = ()
    # The layer norms, in the order a layer applies them (HF attribute names); each is stored as (weight, eps).
    NORMS: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    # On CPU, bf16 weights of a model narrower than this compute in fp32 (0: never).
    CPU_BF16_MIN_HIDDEN = 0
    # Whether the LM head is copied (and packed for oneDNN) at refresh, or read from the module as it is.
    PACK_HEAD = True
    # RoPE tables: computed for the whole context at refresh, or grown by doubling as positions are reached.
    GROW_TABLES = False
    # Whether ``rollyard.model.kernels.decode_layer`` computes this family's layer (the Llama block) in one call
    # where its kernels all run (:meth:`refresh` sets ``fused_layers``).
    FUSED_LAYER = False

    @staticmethod
    def unsupported_reason(model) -> str | None:
        raise NotImplementedError

    def __init__(self, model, compute_dtype: torch.dtype | None = None):
        reason = self.unsupported_reason(model)
        if reason:
            raise ValueError(f"fast path unsupported: {reason}")
        p = read_shapes(self, model)
        self.kinds = self.layer_kinds(model)
        self.kind_set = set(self.kinds)
        self.window = self.window_of(model)
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.qk_norm = hasattr(model.model.layers[0].self_attn, "q_norm")
        on_cpu = p.device.type == "cpu"
        cpu_bf16 = on_cpu and p.dtype == torch.bfloat16
        # Compute dtype: ``compute_dtype`` when given (rollout.precision: the fused copies are the module's weights
        # cast once per refresh); else the module's, except that bf16 weights of a narrow model on CPU are upcast
        # once per refresh (the values are the bf16 weights', only the arithmetic is wider).
        # torch.int8 (rollout.precision=int8): the matmul weights quantized to int8 (a scale per row and 64 inputs)
        # where the kernels' layout R takes their shape (fp32 arithmetic over the dequantized weights; the rest as fp32);
        # torch.qint8 (w8a8): the same weights in layout V, each matmul's input quantized too (int32 dot products)
        self.a8 = compute_dtype == torch.qint8
        self.q8 = compute_dtype == torch.int8 or self.a8
        if compute_dtype is not None:
            self.mm_dtype = torch.float32 if self.q8 else compute_dtype
        else:
            self.mm_dtype = torch.float32 if cpu_bf16 and self.D < self.CPU_BF16_MIN_HIDDEN else p.dtype
        # On CPU the activations (residual stream, norms, RoPE, attention, logits) are fp32 whatever the matmuls'
        # dtype: the fp32 kernels run, and bf16 rounds only a matmul's weights and inputs (a bf16 SiLU or RMSNorm
        # on CPU measured slower than the fp32 kernels, and rounds the residual stream at every layer).
        self.dtype = torch.float32 if on_cpu else self.mm_dtype
        self.mixed = self.mm_dtype != self.dtype
        self.kv_dtype = torch.float32 if on_cpu else self.dtype
        # rollyard.model.kernels: decode attention (fp32 arithmetic over an fp32 or bf16 cache on CPU) and RMSNorm
        # (fp32 compute on CPU).
        self.attn_kernel = on_cpu and cpu_kernels.attention_supported(self.H, self.KVH, self.hd)
        self.norm_kernel = on_cpu and self.dtype == torch.float32 and cpu_kernels.kernel() is not None
        # RoPE + the cache write of a decode step in one call (all fp32; not with q/k norms).
        self.rope_kernel = self.attn_kernel and self.norm_kernel and not self.qk_norm
        if on_cpu and self.mm_dtype == torch.bfloat16 and self.attn_kernel:
            # bf16 matmuls: the cache holds k and v rounded to bf16, half the bytes each decode step's attention reads
            # (its arithmetic stays fp32). v is a bf16 matmul's output already; k is rounded after RoPE, as the
            # trainer's bf16 attention rounds it.
            self.kv_dtype = torch.bfloat16
        self._scratch: torch.Tensor | None = None  # refresh's staging buffer for what pack copies (_packed)
        # the kernels' packed weights, on huge pages and laid out again in the same memory at each refresh, until the
        # first release (a colocated engine's sleep: see release)
        self._arena: Arena | None = Arena()
        self.refresh()

    # -- the family's choices (defaults: the Llama family's) ---------------------------------------------

    @classmethod
    def layer_kinds(cls, model) -> list[str | None]:
        return [None] * len(model.model.layers)

    @classmethod
    def window_of(cls, model) -> int | None:
        return None

    def _norm_scale(self, w: torch.Tensor) -> torch.Tensor:
        """An RMSNorm's multiplier from its weight (Gemma: ``1 + w``)."""
        return self._c(w)

    def _act(self, gu: torch.Tensor) -> torch.Tensor:
        """The MLP's activation over ``[gate | up]``."""
        raise NotImplementedError

    def block(self, x: torch.Tensor, o: torch.Tensor, w: dict) -> torch.Tensor:
        """The layer's output from its input ``x`` and its attention's ``o [..., H * hd]`` (before ``o_proj``)."""
        raise NotImplementedError

    # -- weights -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def refresh(self) -> None:
        """Rebuild the fused weight copies from the module (after any weight change); the RoPE tables, which no weight
        changes, are built at the first refresh only. The old copies are dropped first: the new ones reuse their
        memory, and a refresh never holds two sets."""
        inner = self.model.model
        self.layers, self.lm_head = [], None
        if self._arena is not None:
            self._arena.reset()  # (the old copies are gone: their memory is written again)
        self.layers = [self._layer_weights(layer) for layer in inner.layers]
        self.embed = inner.embed_tokens.weight.detach()  # the module's own table: rows are cast as they are looked up
        scale = getattr(inner.embed_tokens, "embed_scale", None)
        self.embed_scale = None if scale is None else float(scale.to(self.embed.dtype))
        self.norm_w, self.norm_eps = self._norm(inner.norm)
        head = self.model.lm_head.weight
        # without PACK_HEAD the head is read as it is, unless it is cast anyway: then into the bf16 kernel's layout
        # (the same bytes as the cast; Gemma 3's 262k-row head: 35 -> 22 ms a decode step at batch 32)
        kernel_head = ((head.dtype != self.mm_dtype and self._bf16_kernel(head.shape[0], head.shape[1]))
                       or self._q8_kernel(head.shape[0], head.shape[1]))
        self.lm_head = self._packed((head, 1.0)) if self.PACK_HEAD or kernel_head else self._w(head)
        self.lm_bias = self._w(getattr(self.model.lm_head, "bias", None))
        if not hasattr(self, "_tables"):  # the RoPE tables depend on no weight: built once, kept across refreshes
            self._tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
            self._T = 0
            if not self.GROW_TABLES:
                self.tables(self.context)
        self.n_qk = (self.H + self.KVH) * self.hd
        # a decode step's layers in one call each: every piece on its kernel (bf16 matmuls in layout P, RoPE + cache
        # write, attention over a bf16 cache, RMSNorm, SwiGLU), the per-op path's numbers bit for bit
        packed = (cpu_kernels.is_packed_bf16 if self.kv_dtype == torch.bfloat16 else cpu_kernels.is_packed_w8a8
                  if self.a8 else cpu_kernels.is_packed_q8 if self.q8 else cpu_kernels.is_packed_f32)
        self.fused_layers = (self.FUSED_LAYER and self.rope_kernel and self.kv_dtype in (torch.bfloat16, torch.float32)
                             and all(packed(w[k]) for w in self.layers for k in ("wqkv", "wo", "wgu", "wd")))

    def dequantized(self) -> dict[str, torch.Tensor]:
        """The module's matmul weights as this forward's int8 copies hold them (``q * s``, q's rows divided back by the
        attention scale), by parameter name: a reference forward (``torch.func.functional_call``) over them is what
        the fast path must equal (w8a8: up to its inputs' rounding). Empty unless ``q8`` packed some."""
        out: dict[str, torch.Tensor] = {}
        if not self.q8:
            return out

        def dense(p: torch.Tensor, k: int) -> torch.Tensor | None:
            if cpu_kernels.is_packed_w8a8(p):
                return cpu_kernels.dequantize_q8(*cpu_kernels.unpack_w8a8(p, k))
            return cpu_kernels.dequantize_q8(*cpu_kernels.unpack_q8(p)) if cpu_kernels.is_packed_q8(p) else None

        scale = 1.0 if self.qk_norm else self.scale
        nq, nk = self.H * self.hd, self.KVH * self.hd
        for i, w in enumerate(self.layers):
            at, ml = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            if (d := dense(w["wqkv"], self.D)) is not None:
                out.update({at + "q_proj.weight": d[:nq] / scale, at + "k_proj.weight": d[nq:nq + nk],
                            at + "v_proj.weight": d[nq + nk:]})
            if (d := dense(w["wgu"], self.D)) is not None:
                half = d.shape[0] // 2
                out.update({ml + "gate_proj.weight": d[:half], ml + "up_proj.weight": d[half:]})
            for key, name, k in (("wo", at + "o_proj.weight", nq), ("wd", ml + "down_proj.weight", self.I)):
                if (d := dense(w[key], k)) is not None:
                    out[name] = d
        if self.lm_head is not None and (d := dense(self.lm_head, self.D)) is not None:
            out["lm_head.weight"] = d
        return out

    def _norm(self, n) -> tuple[torch.Tensor, float]:
        return self._c(self._norm_scale(n.weight)), eps_of(n)

    def _layer_weights(self, layer) -> dict:
        a, m, c, fuse, packed = layer.self_attn, layer.mlp, self._w, self._fuse, self._packed
        scale = 1.0 if self.qk_norm else self.scale  # with q/k norms, the scale sits in q's norm weight
        b = None
        if a.q_proj.bias is not None:
            b = fuse((a.q_proj.bias, scale), (a.k_proj.bias, 1.0), (a.v_proj.bias, 1.0))
        qkn, qk_eps = None, 0.0
        if self.qk_norm:  # [H + KVH, hd]: per-head norm weights, q rows times the attention scale
            qkn = torch.cat(((self._norm_scale(a.q_norm.weight) * self.scale).expand(self.H, self.hd),
                             self._norm_scale(a.k_norm.weight).expand(self.KVH, self.hd))).to(self.dtype).contiguous()
            qk_eps = eps_of(a.q_norm)
        out = dict(wqkv=packed((a.q_proj.weight, scale), (a.k_proj.weight, 1.0), (a.v_proj.weight, 1.0)), bqkv=b,
                   qkn=qkn, qk_eps=qk_eps, wo=packed((a.o_proj.weight, 1.0)), bo=c(a.o_proj.bias),
                   wgu=packed((m.gate_proj.weight, 1.0), (m.up_proj.weight, 1.0)), wd=packed((m.down_proj.weight, 1.0)))
        out.update((name, self._norm(getattr(layer, name))) for name in self.NORMS)
        return out

    def _packed(self, *parts: tuple[torch.Tensor, float]) -> torch.Tensor:
        """``pack`` of the rows of ``parts`` stacked in the matmuls' dtype (:meth:`_fuse`). A lone part already in
        that dtype, unscaled, is packed from the module's own tensor. Where the matmuls' dtype differs from the
        module's and ``pack`` copies into oneDNN's layout, the cast is staged in a scratch buffer kept across weights
        and refreshes (its size the largest such weight's; ``release`` drops it), not in fresh memory: SmolLM2-135M's
        bf16 refresh otherwise wrote ~270 MB of casts that the reorder read once and dropped (held: 70-97 -> 54-69
        ms, 2 threads). Stacks in the module's own dtype keep fresh memory, which the allocator recycles from one
        weight to the next: a scratch there measured no faster (fp32 after a release, 69-73 vs 84-95 ms)."""
        first, scale = parts[0]
        if first.dim() == 2 and self._q8_kernel(sum(t.shape[0] for t, _ in parts), first.shape[1]):
            pack_q = cpu_kernels.pack_w8a8 if self.a8 else cpu_kernels.pack_q8
            return pack_q(list(parts), self._empty)  # scale, quantize and layout in one pass
        if first.dim() == 2 and self._bf16_kernel(sum(t.shape[0] for t, _ in parts), first.shape[1]):
            return cpu_kernels.pack_bf16(list(parts), self._empty)  # cast, scale and layout in one pass
        if (first.dim() == 2 and all(t.dtype == torch.float32 for t, _ in parts)
                and self._f32_kernel(sum(t.shape[0] for t, _ in parts), first.shape[1])):
            return cpu_kernels.pack_f32(list(parts), self._empty)  # scale and layout in one pass
        if len(parts) == 1 and scale == 1.0 and first.dtype == self.mm_dtype:
            return pack(first)
        shape = (sum(t.shape[0] for t, _ in parts), *first.shape[1:])
        numel = shape[0] * first[0].numel()
        if first.dtype == self.mm_dtype or not cpu_gemm.packs(numel, self.mm_dtype, first.device):
            return pack(self._fuse(*parts))  # fresh memory: kept as it is (not packed), or recycled once packed
        if self._scratch is None or self._scratch.numel() < numel:
            self._scratch = torch.empty(numel, dtype=self.mm_dtype, device=first.device)
        return pack(self._fuse(*parts, out=self._scratch[:numel].view(shape)))

    def _bf16_kernel(self, n: int, k: int) -> bool:
        """Whether an ``[n, k]`` matmul weight goes into ``rollyard.model.kernels``' bf16 layout (bf16 matmuls over
        fp32 activations, the kernel built and agreeing with torch here, the shape's blocks whole)."""
        return self.mm_dtype == torch.bfloat16 and self.mixed and cpu_kernels.bf16_packs(n, k)

    def _q8_kernel(self, n: int, k: int) -> bool:
        """Whether an ``[n, k]`` matmul weight goes into ``rollyard.model.kernels``' int8 layout (rollout.precision=int8
        on a CPU, the fp32 kernel built and agreeing here, the shape's blocks whole)."""
        return self.q8 and self.device.type == "cpu" and cpu_kernels.q8_packs(n, k)

    def _f32_kernel(self, n: int, k: int) -> bool:
        """Whether an ``[n, k]`` matmul weight goes into ``rollyard.model.kernels``' fp32 layout (fp32 matmuls on a
        CPU, the kernel built (AVX-512, or AVX2 + FMA) and agreeing with an fp64 reference here, the shape's blocks
        whole)."""
        return (self.mm_dtype == torch.float32 and not self.mixed and self.device.type == "cpu"
                and cpu_kernels.f32_packs(n, k))

    def _fuse(self, *parts: tuple[torch.Tensor, float], out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of ``parts`` (a weight or bias and its scale) stacked in the matmuls' dtype, in ``out`` (else
        fresh memory): each part read once and written once, cast and scaled on the way (a sync's refresh is a pass
        over the weights, not four)."""
        first = parts[0][0]
        if out is None:
            out = torch.empty((sum(t.shape[0] for t, _ in parts), *first.shape[1:]), dtype=self.mm_dtype,
                              device=first.device)
        row = 0
        for t, scale in parts:  # (under refresh's no_grad)
            dst = out[row:row + t.shape[0]]
            if scale == 1.0:
                dst.copy_(t)
            else:
                torch.mul(t, scale, out=dst)
            row += t.shape[0]
        return out

    def release(self) -> None:
        """Drop the fused weight copies (``refresh`` rebuilds them): the colocated engine's sleep."""
        self.layers, self.lm_head, self._scratch = [], None, None
        # From here the copies come from torch's allocator, not the arena: an engine that sleeps hands its memory to
        # the trainer's step and back, and the heap the step freed is what a refresh reuses without a page fault. In
        # the colocated example huge pages there cost a fresh 0.54 GB of faults at each wake (sync 0.11 -> 0.13-0.62 s,
        # THP compaction included) and 0.4 GB more peak (the heap the trainer kept, beside the mapped arena).
        self._arena = None

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A packed weight's memory: the arena's while this forward has one, else torch's."""
        return torch.empty(shape, dtype=dtype) if self._arena is None else self._arena.empty(shape, dtype)

    @property
    def released(self) -> bool:
        return self.lm_head is None

    def _c(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` in the activations' dtype (the module's own tensor when that is its dtype already)."""
        return None if t is None else t.to(self.dtype)

    def _w(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A matmul's weight or bias ``t`` in the matmuls' dtype (the module's own tensor when that is its dtype)."""
        return None if t is None else t.to(self.mm_dtype)

    def _mm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
            add: torch.Tensor | None = None) -> torch.Tensor:
        """``add + x @ w.T + b`` for a fused weight ``w`` (``pack``ed): in the matmuls' dtype, returned in the
        activations' (the add then in the activations' dtype too)."""
        if cpu_kernels.is_packed_f32(w):
            return cpu_kernels.gemm_f32(x, w, b, add)
        if cpu_kernels.is_packed_q8(w):
            return cpu_kernels.gemm_q8(x, w, b, add)
        if cpu_kernels.is_packed_w8a8(w):
            return cpu_kernels.gemm_w8a8(x, w, b, add)
        if not self.mixed:
            return packed_linear(x, w, b, add=add)
        if cpu_kernels.is_packed_bf16(w):
            return cpu_kernels.gemm_bf16(x, w, b, add)
        y = packed_linear(x.to(self.mm_dtype), w, b).to(self.dtype)
        return y if add is None else y.add_(add)

    def tables(self, T: int) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """Each layer kind's RoPE tables for positions ``0..T-1`` at least (grown by doubling with
        ``GROW_TABLES``: a 32k-context model's full tables would be 128 MB at head_dim 256)."""
        if T > self._T:
            self._T = min(max(T, 2 * self._T, 64), max(self.context, T))
            like = torch.zeros(1, device=self.device, dtype=self.dtype)
            self._tables = {k: rope_tables(self.model.model, self._T, like, k) for k in self.kind_set}
        return self._tables

    def new_cache(self, slots: int, width: int) -> torch.Tensor:
        # Zeros, not empty: masked positions still enter p @ V (as 0 * value), so they must be finite.
        return torch.zeros(self.L, 2, slots, self.KVH, width, self.hd, device=self.device, dtype=self.kv_dtype)

    # -- the pieces of a step ------------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
        if self.norm_kernel:
            return cpu_kernels.rms_norm(x, w, eps)
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embed)
        x = x if self.embed_scale is None else x * self.embed_scale
        return x.to(self.dtype)

    def _qk(self, y: torch.Tensor, shape: tuple, w: dict) -> torch.Tensor:
        """The q|k heads ``[*shape, H + KVH, hd]`` of the fused projection ``y``, through the q/k norms if any."""
        qk = y[..., :self.n_qk].view(*shape, self.H + self.KVH, self.hd)
        if w["qkn"] is None:
            return qk
        return F.rms_norm(qk, (self.hd,), eps=w["qk_eps"]) * w["qkn"]

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        x = self._rms(x, self.norm_w, self.norm_eps)
        return softcap(self._mm(x, self.lm_head, self.lm_bias), self.softcap)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, last: torch.Tensor,
                start: int = 0) -> torch.Tensor:
        """Run prompts ``tokens`` [G, P] (right-padded) and write their K/V into ``kv`` at ``slots`` [G].

        Returns logits [G, V] at positions ``last`` [G] (each prompt's last real token, counted from ``start``)
        only. Padded positions come after the real ones, so causal attention keeps them out of the real ones.
        ``start``: the tokens sit at positions ``start ..``, after a prefix whose K/V each slot holds already
        (a prompt prefix the rows share, prefilled once: ``rollout/native.py``); they attend to it as read back
        from the cache.
        """
        G, P = tokens.shape
        H, KVH, hd, n = self.H, self.KVH, self.hd, self.n_qk
        x = self._embed(tokens)
        tables = self.tables(start + P)
        masks = self._prefill_masks(start, P, x.device)
        first = self.NORMS[0]
        for l, w in enumerate(self.layers):
            kind = self.kinds[l]
            cos, sin = (t[start:start + P, None] for t in tables[kind])  # [P, 1, hd]
            h = self._rms(x, *w[first])
            y = self._mm(h, w["wqkv"], w["bqkv"])
            qk = rope(self._qk(y, (G, P), w), cos, sin)
            v = y[..., n:].view(G, P, KVH, hd).transpose(1, 2)
            q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
            kv[l, 0, slots, :, start:start + P] = k.to(kv.dtype)
            kv[l, 1, slots, :, start:start + P] = v.to(kv.dtype)
            if start:  # the prefix's K/V from the cache, in the activations' dtype
                k = torch.cat((kv[l, 0, slots, :, :start].to(k.dtype), k), dim=2)
                v = torch.cat((kv[l, 1, slots, :, :start].to(v.dtype), v), dim=2)
            mask = masks[kind]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=1.0,
                                               enable_gqa=KVH != H)
            x = self.block(x, o.transpose(1, 2).reshape(G, P, H * hd), w)
        return self._head(x[torch.arange(G, device=x.device), last])

    def _prefill_masks(self, start: int, P: int, device) -> dict:
        """Per layer kind, the boolean ``[query, key]`` mask of a prefill of ``P`` positions after ``start`` cached
        ones (None: plain causal, ``is_causal``)."""
        q = torch.arange(start, start + P, device=device)[:, None]
        keys = torch.arange(start + P, device=device)[None, :]
        full = None if not start else keys <= q
        sliding = full
        if self.window is not None and start + P > self.window:
            sliding = (keys <= q) & (keys > q - self.window)
        return {kind: (sliding if kind == SLIDING else full) for kind in set(self.kinds)}

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor | None, kv: torch.Tensor, width: int,
               same_pos: int | None = None, share: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step for slots ``0..B-1``: ``tokens`` [B] at positions ``pos`` [B].

        Writes each slot's new K/V at its position, attends over positions ``<= pos`` (of the first ``width``
        cache positions; ``width > max(pos)``) and returns logits [B, V]. ``share``: ``kernels.attend``'s (ignored
        without the kernel: the same numbers). ``same_pos``: the caller's promise that every slot is at this position
        (uniform lengths, the common GRPO case): K/V are written with a plain slice and no mask is built, since
        ``width == same_pos + 1`` leaves nothing to mask (the sliding layers read the cache's last ``window``
        positions); ``pos`` is then unused (may be None)."""
        B = tokens.shape[0]
        x = self._embed(tokens)
        tables = self.tables(width)
        start = 0
        if same_pos is not None:
            assert width == same_pos + 1, (width, same_pos)
            rope_at, masks = (None, same_pos), None
            if self.window is not None:
                start = max(0, width - self.window)  # sliding layers read a slice
        else:
            pos = pos.to(torch.int64).contiguous()
            rope_at, masks = (pos, 0), self._decode_masks(pos, width)
        # Where the new K / V go: ``writes``, per layer a ``[2, B, KVH, hd]`` view at the one shared position, else
        # ``at = (rows, :, pos)`` into a layer's cache; the rope kernel writes them at ``rope_at = (pos, same_pos)``.
        if self.rope_kernel:
            at_pos = writes = at = None
        elif same_pos is not None:
            at_pos = {k: (c[same_pos:same_pos + 1], s[same_pos:same_pos + 1]) for k, (c, s) in tables.items()}
            writes, at = kv[:, :, :B, :, same_pos].unbind(0), None
        else:
            at_pos = {k: (c[pos][:, None], s[pos][:, None]) for k, (c, s) in tables.items()}  # [B, 1, hd]
            writes, at = None, (torch.arange(B, device=tokens.device), slice(None), pos)
        H, KVH, hd, n = self.H, self.KVH, self.hd, self.n_qk
        first = self.NORMS[0]
        if self.fused_layers and kv.dtype == self.kv_dtype and (masks is None or all(
                isinstance(m, tuple) for m in masks.values())):
            return self._head(self._fused_decode(x.contiguous(), tables, rope_at, masks, kv, width, share))
        # what each layer reads ([B, KVH, W, hd] views), cut once for all layers (per-layer indexing costs a share)
        reads = kv[:, :, :B, :, :width].unbind(0)
        for l, w in enumerate(self.layers):
            kind = self.kinds[l]
            h = self._rms(x, *w[first])
            y = self._mm(h, w["wqkv"], w["bqkv"])
            if self.rope_kernel:
                q = cpu_kernels.decode_rope_write(y, *tables[kind], *rope_at, kv[l], H, KVH).view(B, H, hd)
            else:
                qk = rope(self._qk(y, (B,), w), *at_pos[kind])
                q, k, v = qk[:, :H], qk[:, H:], y[:, n:].view(B, KVH, hd)
                if writes is not None:
                    writes[l][0].copy_(k)
                    writes[l][1].copy_(v)
                else:
                    layer = kv[l]
                    layer[0][at] = k.to(kv.dtype)
                    layer[1][at] = v.to(kv.dtype)
            K, V = reads[l]
            if sliced := start and kind == SLIDING:  # (share's positions count from 0: not for a slice)
                K, V = K[:, :, start:], V[:, :, start:]
            x = self.block(x, self._attend(q, K, V, masks and masks[kind], None if sliced else share).to(x.dtype), w)
        return self._head(x)

    def _fused_decode(self, x: torch.Tensor, tables: dict, rope_at: tuple, masks: dict | None, kv: torch.Tensor,
                      width: int, share: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`decode`'s layers, one ``kernels.decode_layer`` call each (``fused_layers``): ``x`` in place."""
        assert kv.is_contiguous()
        for l, w in enumerate(self.layers):
            kind = self.kinds[l]
            cpu_kernels.decode_layer(x, w, *tables[kind], *rope_at, kv, l, self.H, self.KVH,
                                          None if masks is None else masks[kind][0], width, share)
        return x

    def _attend(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask,
                share: torch.Tensor | None = None) -> torch.Tensor:
        """``q [B, H, hd]`` (scaled) over ``K, V [B, KVH, W, hd]``, in the cache's dtype; ``mask``: None (every row
        sees all ``W``), ``(lengths [B], additive [B, 1, 1, W] or None)`` where each row sees a prefix, or an
        additive mask alone (:meth:`_decode_masks`). Returns ``[B, H * hd]``."""
        if self.attn_kernel and (mask is None or isinstance(mask, tuple)):
            return cpu_kernels.attend(q.to(self.dtype), K, V, None if mask is None else mask[0], share)
        B, KVH, _, hd = K.shape
        if K.dtype != self.dtype and K.device.type == "cpu":  # a bf16 cache: attention in fp32, as the kernel's
            K, V = K.to(self.dtype), V.to(self.dtype)
        s = torch.matmul(q.reshape(B, KVH, self.H // KVH, hd).to(K.dtype), K.transpose(-1, -2))
        if mask is not None:
            s = s + (mask[1] if isinstance(mask, tuple) else mask)
        return torch.matmul(torch.softmax(s, dim=-1), V).reshape(B, self.H * hd)

    def _decode_masks(self, pos: torch.Tensor, width: int) -> dict:
        """Per layer kind, what hides the keys a row must not see at positions ``pos``: ``(lengths, additive mask
        or None)`` where a prefix of each row is visible (the kernel takes the lengths; the additive mask ``[B, 1,
        1, W]`` is built only without it), or an additive mask alone where the sliding window also hides the row's
        oldest keys."""
        additive = None
        if not self.attn_kernel:  # (the kernel takes the lengths alone: no mask built, one op less per step)
            ar = torch.arange(width, device=pos.device)
            additive = torch.zeros((pos.shape[0], width), dtype=self.kv_dtype, device=pos.device).masked_fill_(
                ar[None] > pos[:, None], float("-inf"))[:, None, None]
        full = (pos + 1, additive)
        masks = dict.fromkeys(self.kind_set, full)
        if self.window is None or SLIDING not in masks or int(pos.max()) < self.window:
            return masks
        ar = torch.arange(width, device=pos.device)
        hidden = (ar[None] > pos[:, None]) | (ar[None] <= pos[:, None] - self.window)
        masks[SLIDING] = torch.zeros(hidden.shape, dtype=self.kv_dtype, device=pos.device).masked_fill_(
            hidden, float("-inf"))[:, None, None]
        return masks

    # -- training (with autograd) ----------------------------------------------------------------------------

    @classmethod
    def train_norm(cls, x: torch.Tensor, norm) -> torch.Tensor:
        """An RMSNorm module applied with autograd (``rollyard.model.kernels`` on fp32 CPU)."""
        return cpu_kernels.train_rms_norm(x, norm.weight, eps_of(norm))

    @classmethod
    def train_qk_norm(cls, attn) -> tuple[torch.Tensor, float, float] | None:
        """``(weights [H + KVH, hd], eps, attention scale)`` of per-head q/k norms, or None without them."""
        if not hasattr(attn, "q_norm"):
            return None
        H, KVH, hd = heads(attn)
        nw = torch.cat((attn.q_norm.weight.expand(H, hd), attn.k_norm.weight.expand(KVH, hd)))
        return nw, eps_of(attn.q_norm), float(attn.scaling)

    @classmethod
    def train_layer(cls, x: torch.Tensor, layer, cos: torch.Tensor, sin: torch.Tensor, mask) -> torch.Tensor:
        """One decoder layer with autograd over the module's own weights (``cos, sin``, ``mask``: see
        :meth:`train_hidden`)."""
        raise NotImplementedError

    @classmethod
    def train_hidden(cls, model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                     segments: torch.Tensor | None = None, rows_grad: bool = False, kept_layers: int = 0) -> torch.Tensor:
        """Final-norm hidden states ``[B, T, D]`` of right-padded rows ``input_ids [B, T]`` (positions 0..T-1,
        causal), differentiable w.r.t. the module's own parameters. Or, the prefix-shared layout
        (``trainer/packing.py``): ``position_ids [B, T]`` per token and ``segments [B, T]`` for the attention mask
        (:func:`prefix_shared_mask`); a sliding window is taken on positions, so it holds in any layout.

        The trainer's padded micro-batches run through this instead of the HF module forward when
        ``families.train_forward_matches`` holds: the same math in fewer ops (q|k|v and gate|up concatenated per
        call, so gradients reach the original weights; fused ``rms_norm``; RoPE's half swap as one cat; on CPU
        :func:`causal_attention`; on CPU in fp32 the RMSNorms, SwiGLU and q|k|v split + RoPE through
        ``rollyard.model.kernels``). No dropout. Honours the module's gradient checkpointing
        (``model.gradient_checkpointing_enable()``; the trainer's ``activation_checkpointing``): each layer's input
        kept only and the layer recomputed in the backward, but the last ``kept_layers`` (``trainer/recompute.py``).

        ``rows_grad``: the lookup's gradient as the rows it touched (:class:`RowsGradLookup`), for a caller whose
        backward also gives the table a dense gradient in the same pass (an LM head tied to it): the same sums as
        the dense lookup gradient without its ``[V, D]`` buffers. Alone it would leave a sparse ``.grad``.
        """
        inner = model.model
        e = inner.embed_tokens
        x = (RowsGradLookup.apply(input_ids, e.weight, e.padding_idx) if rows_grad
             else F.embedding(input_ids, e.weight, e.padding_idx))
        if getattr(e, "embed_scale", None) is not None:
            x = x * e.embed_scale.to(e.weight.dtype)
        T = input_ids.shape[1]
        n = T if position_ids is None else int(position_ids.max()) + 1
        kinds = cls.layer_kinds(model)
        tables = {}
        for kind in set(kinds):
            cos, sin = rope_tables(inner, n, x, kind)
            tables[kind] = (cos[:T], sin[:T]) if position_ids is None else (cos[position_ids], sin[position_ids])
        plans = None
        if segments is not None and x.device.type == "cpu":  # each segment's pairs only (model/segments.py)
            plans = segment_plans(segments, position_ids, cls.window_of(model))
        full, sliding = plans or attention_masks(T, position_ids, segments, cls.window_of(model), x.device)
        if x.device.type == "cpu" and plans is None:  # additive, once for all layers (grouped_causal_attention)
            full, sliding = (None if m is None else torch.zeros(m.shape, device=x.device).masked_fill_(~m, float("-inf"))
                             for m in (full, sliding))
        recompute = getattr(inner, "gradient_checkpointing", False) and torch.is_grad_enabled()
        first_kept = len(inner.layers) - kept_layers
        for i, (layer, kind) in enumerate(zip(inner.layers, kinds)):
            cos, sin = tables[kind]
            mask = sliding if kind == SLIDING else full
            if recompute and i < first_kept:
                x = checkpoint(cls.train_layer, x, layer, cos, sin, mask, use_reentrant=False,
                               context_fn=cpu_gemm.recompute_contexts)
            else:
                x = cls.train_layer(x, layer, cos, sin, mask)
        return cls.train_norm(x, inner.norm)


# ---- training pieces (with autograd) -------------------------------------------------------------------


class RowsGradLookup(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose weight gradient is the rows the lookup touched: a coalesced
    sparse ``[V, D]`` tensor, each row the sum of its positions' gradients added in position order from zero.

    That is the dense lookup gradient's arithmetic row for row (torch's CPU backward adds each position's gradient
    into a zero-filled ``[V, D]`` buffer in position order), so where autograd adds it to the tied LM head's dense
    gradient the sum is the same, bit for bit, without the zero fill, the ``[V, D]`` buffer (0.11 GB for SmolLM2's
    49152 x 576 table, 0.67 GB for Gemma 3's 262144 x 640) and the dense add. (``F.embedding(sparse=True)`` is not:
    its gradient holds one row per position, added into the head's gradient one by one.)"""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.shape, ctx.padding_idx = weight.shape, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        flat, g = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:  # the padding row takes no gradient
            keep = flat != ctx.padding_idx
            flat, g = flat[keep], g[keep]
        rows, where = torch.unique(flat, sorted=True, return_inverse=True)
        sums = torch.zeros(rows.numel(), g.shape[1], dtype=g.dtype, device=g.device).index_add_(0, where, g)
        return None, torch.sparse_coo_tensor(rows[None], sums, ctx.shape, is_coalesced=True,
                                             check_invariants=False), None



def heads(attn) -> tuple[int, int, int]:
    """``(H, KVH, hd)`` of an attention module, from its projections' shapes."""
    hd = attn.head_dim
    return attn.q_proj.weight.shape[0] // hd, attn.k_proj.weight.shape[0] // hd, hd


def train_attention(h: torch.Tensor, attn, cos: torch.Tensor, sin: torch.Tensor, mask,
                    qk_norm: tuple[torch.Tensor, float, float] | None) -> torch.Tensor:
    """One layer's attention of normed inputs ``h [B, T, D]``, through ``o_proj``: ``[B, T, D]`` (fused q|k|v
    matmul, q/k norms ``qk_norm`` if any, RoPE, :func:`causal_attention`). ``cos, sin``: ``[T, hd]``, or ``[B, T,
    hd]`` with per-row positions; ``mask``: see :meth:`FastForward.train_hidden`."""
    a = attn
    B, T, _ = h.shape
    H, KVH, hd = heads(a)
    b = None if a.q_proj.bias is None else torch.cat((a.q_proj.bias, a.k_proj.bias, a.v_proj.bias))
    y = cpu_gemm.linear_parts(h, (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), b)
    fused = None if qk_norm is not None else _qkv_rope(y, cos, sin, H, KVH)
    if fused is not None:  # q already [B, KVH, G * T, hd]
        o = grouped_causal_attention(*fused, float(a.scaling), mask).view(B, H, T, hd)
    else:
        qk = y[..., :(H + KVH) * hd].view(B, T, H + KVH, hd)
        scale = float(a.scaling)
        if qk_norm is not None:
            nw, eps, scale = qk_norm
            qk = F.rms_norm(qk, (hd,), eps=eps) * nw
        qk = rope(qk, cos.unsqueeze(-2), sin.unsqueeze(-2))
        q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
        v = y[..., (H + KVH) * hd:].view(B, T, KVH, hd).transpose(1, 2)
        o = causal_attention(q, k, v, scale, mask)
    return cpu_gemm.linear(o.transpose(1, 2).reshape(B, T, H * hd), a.o_proj.weight, a.o_proj.bias)


def train_mlp(h: torch.Tensor, mlp, act, tail: bool = False) -> torch.Tensor:
    """``down(act([gate | up](h)))`` with autograd (one matmul for gate and up); ``tail``: the layer adds the result
    to its residual and saves nothing after it (``model.gemm.linear``'s ``tail``: skipped in a recompute)."""
    gu = cpu_gemm.linear_parts(h, (mlp.gate_proj.weight, mlp.up_proj.weight))
    return cpu_gemm.linear(act(gu), mlp.down_proj.weight, tail=tail)


def _qkv_rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, H: int, KVH: int):
    """The compiled split + RoPE (``cpu_kernels.train_qkv_rope``) for ``cos, sin [T, hd]``, or per row for
    per-row positions (``[B, T, hd]``: the prefix-shared layout); ``None`` where it cannot run."""
    if cos.dim() == 2:
        return cpu_kernels.train_qkv_rope(y, cos, sin, H, KVH)
    parts = [cpu_kernels.train_qkv_rope(y[r:r + 1], cos[r], sin[r], H, KVH) for r in range(y.shape[0])]
    if any(p is None for p in parts):
        return None
    return tuple(torch.cat(t) for t in zip(*parts))


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


def attention_masks(T: int, position_ids: torch.Tensor | None, segments: torch.Tensor | None, window: int | None,
                    device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(full, sliding)`` bool masks ``[B or 1, 1, T, T]`` (query, key; True: visible) of the rows, None where
    plain causal attention is the mask: causal in row order; with ``segments`` (prefix-shared rows)
    :func:`prefix_shared_mask`; on sliding layers also ``pos_q - pos_k < window``."""
    base = None if segments is None else prefix_shared_mask(segments)
    pos = position_ids if position_ids is not None else torch.arange(T, device=device)[None]
    if window is None or int(pos.max()) < window:
        return base, base
    ar = torch.arange(T, device=device)
    near = (pos[:, :, None] - pos[:, None, :]) < window  # [B, query, key]
    causal = base[:, 0] if base is not None else (ar[None, :] <= ar[:, None])[None]
    return base, (causal & near)[:, None]


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
    mask, the train forward's (:meth:`FastForward.train_hidden`): ``[B, 1, T, T]`` bool on CUDA, additive fp32 on CPU.
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
    returns ``[B, KVH, G * T, hd]``. ``mask``: an additive fp32 ``[B, 1, T, T]`` instead of the causal one, or
    prefix-shared rows' :class:`~rollyard.model.segments.SegmentPlan` (each segment's pairs only)."""
    if isinstance(mask, SegmentPlan):
        return segmented_attention(q, k, v, scale, mask)
    B, KVH, GT, _ = q.shape
    T = k.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2))
    if mask is None:
        s = torch.add(_grouped_causal_mask(T, GT // T, q.device), s, alpha=scale)  # mask + scale * s, fp32
    else:  # the same per row for each of the G stacked query heads
        s = torch.add(mask[:, :, None], s.view(B, KVH, GT // T, T, T), alpha=scale).view(B, KVH, GT, T)
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(p, v)
