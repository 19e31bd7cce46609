"""Linear layers on x86 CPUs through oneDNN instead of MKL, where that is the faster kernel.

torch's CPU ``F.linear`` / ``mm`` in fp32 call MKL's sgemm. On an AMD EPYC with AVX-512 (this
project's reference machine) MKL runs ~90 GFLOP/s per core at every shape tried, while oneDNN's
matmul, which ships in every x86 torch wheel and which torch.compile's CPU backend emits as
``torch.ops.mkldnn._linear_pointwise``, runs ~200 GFLOP/s (1024^3, 2176x256x1280 and the
trainer's other shapes), and ~2x MKL at decode shapes (32 rows) too. Both compute in IEEE fp32
(errors against an fp64 reference are of the same order). The two round differently, so the
choice must not depend on timing (two runs of one seed must compute the same numbers, loaded or
not): :func:`enabled` picks oneDNN on x86 CPUs with AVX-512 (where it measured ~2x MKL; on AVX2-only
CPUs MKL was as fast), checked once per process to give F.linear's result on a fixed case, and MKL
elsewhere. ``bench/engine.py`` times the two side by side.

- :func:`linear`: ``F.linear`` semantics, with autograd (a custom Function whose backward runs
  the input and weight gradients through oneDNN as well); falls back to ``F.linear`` for
  anything but fp32 CPU tensors outside autocast.
- :func:`pack` / :func:`packed_linear`: a weight reordered once into oneDNN's blocked layout (the
  decode engine repacks at each weight refresh), for no-grad calls in fp32 or bf16; bf16 CPU
  matmuls already run on oneDNN, the prepacked weight saves its per-call reorder.

``ROLLYARD_ONEDNN=0`` turns all of it off (``F.linear`` everywhere); ``=1`` uses oneDNN wherever it
is available, whatever the CPU, except for bf16 weights on a CPU where oneDNN's bf16 path refuses to
run (AVX2 without AVX-NE-CONVERT: :func:`rollyard.model.cpu.onednn_bf16`). The CPU's features come from
:mod:`rollyard.model.cpu` (``ROLLYARD_CPU_ISA`` narrows them).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from rollyard.config import env_flag
from rollyard.model import cpu
from rollyard.model import kernels as cpu_kernels

# oneDNN's fixed cost per call is ~15 us against MKL's ~5-8 us (2 threads): below about this many
# multiply-adds (rows x in x out) MKL wins. 32 decode rows x 96 x 512 measured about even.
MIN_MACS = 1 << 21
# pack() does not know the row count; it assumes a decode batch of this many rows.
PACK_ROWS = 32
_CHOICE: dict[tuple[str, str], bool] = {}  # (ROLLYARD_ONEDNN, ROLLYARD_CPU_ISA) -> choice


def _op_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops, "mkldnn")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _lp(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def cpu_has_avx512() -> bool:
    """Whether the CPU feature set (:mod:`rollyard.model.cpu`, narrowed by ``ROLLYARD_CPU_ISA``) has AVX-512."""
    return cpu.avx512()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16 in the feature set); without it
    bf16 autocast on a CPU is emulated and slower than fp32."""
    return cpu.native_bf16()


def _agrees() -> bool:
    """oneDNN gives F.linear's result on a fixed trainer-like case (a broken build must not be used)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g)
    w = torch.randn(768, 256, generator=g) / 16
    try:
        got, ref = _lp(x, w), F.linear(x, w)
    except RuntimeError:
        return False
    return bool(torch.allclose(got, ref, rtol=1e-4, atol=1e-4))


def enabled() -> bool:
    """Whether fp32 CPU linear layers go through oneDNN in this process: by the setting, the CPU's
    features and a correctness check, never by timing (decided once per process)."""
    flag = env_flag("ROLLYARD_ONEDNN")
    if flag == "0" or not _op_available():
        return False
    key = (flag, cpu.level())
    if key not in _CHOICE:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            _CHOICE[key] = (flag == "1" or cpu_has_avx512()) and _agrees()
    return _CHOICE[key]


class _Recompute(threading.local):
    """Whether this thread is inside an activation checkpoint's recompute (:func:`recomputing`)."""

    active = False


RECOMPUTE = _Recompute()


@contextlib.contextmanager
def recomputing():
    """Mark the recompute of a checkpointed block (``torch.utils.checkpoint``'s ``context_fn``, second context):
    a :func:`linear` called with ``tail=True`` there saves its input and weight for the backward and skips the
    product, whose value only the discarded recomputed output would have read."""
    before, RECOMPUTE.active = RECOMPUTE.active, True
    try:
        yield
    finally:
        RECOMPUTE.active = before


def recompute_contexts():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant): nothing in the forward,
    :func:`recomputing` in the recompute."""
    return contextlib.nullcontext(), recomputing()


class _Linear(torch.autograd.Function):
    """``y = x @ w.T + b`` with forward and both gradients on oneDNN; ``tail``: inside a recompute (:func:`recomputing`)
    only what the backward reads is kept and ``y`` is left unwritten (see :func:`linear`)."""

    @staticmethod
    def forward(ctx, x, w, b, tail=False):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        if tail and RECOMPUTE.active:
            return x.new_empty((*x.shape[:-1], w.shape[0]))
        return _lp(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _lp(g, w.t())  # g @ w: w.t() is the [in, out] "weight" of that product
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            gw = weight_grad(g2, x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb, None


def weight_grad(g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """The weight gradient ``g2^T @ x2`` (``g2 [M, N]``, ``x2 [M, K]``) as an ``[N, K]`` contiguous tensor.

    On an Intel CPU with MKL, MKL's sgemm: it reads both operands transposed in place at its peak. oneDNN copies a
    transposed input and reads a transposed weight at a lower rate, the more so the larger that operand is.
    Measured on a 2-core Intel Xeon (AVX-512F), SmolLM2's four weight shapes at 310-4000 rows:
    - MKL ran at 283-343 GFLOP/s everywhere.
    - The oneDNN form this picks elsewhere (:func:`transposed_weight_grad`) ran at 102-304 GFLOP/s. gate|up's
      gradient at 4000 rows was the worst: 102 against 316.
    - A trainer step with completions of 5-200 tokens (1836 positions) went 10.5 -> 9.5 s; one of 5-24 tokens
      went 1.65 -> 1.62 s.
    Elsewhere (an AMD CPU, where MKL runs without its AVX-512 code: oneDNN's fp32 peak was ~2.2x MKL's on the
    AVX512-BF16 EPYC these benches also ran on), the oneDNN form is kept; that choice was not re-measured there.
    """
    if mkl_first():
        return torch.mm(g2.t(), x2)
    # the input transposed by rollyard's kernel (oneDNN's own copy of a transposed input is ~4x slower)
    if transposed_weight_grad(*g2.shape, x2.shape[1]):
        return _lp(cpu_kernels.transposed(x2), g2.t()).t()
    return _lp(cpu_kernels.transposed(g2), x2.t())


# The rows of a weight gradient :func:`add_weight_grad_` takes per oneDNN product: a block's transposed gradient (rows x
# M) and product (rows x K) stay in the caches (SmolLM2's 49152 x 576 head at 256 rows: 36 ms by blocks of 2048 or
# 4096, 59 ms in one product, 68 ms on MKL, on the AVX512-BF16 EPYC), and neither is weight-sized.
GRAD_BLOCK_ROWS = 2048


def _on_onednn(a: torch.Tensor, b: torch.Tensor, macs: int) -> bool:
    """Whether a product of fp32 CPU tensors ``a`` and ``b`` goes to oneDNN rather than MKL: where oneDNN is
    :func:`enabled`, MKL is not the faster (:func:`mkl_first`) and the product clears ``MIN_MACS``."""
    return not mkl_first() and _eligible(a, b) and b.dim() == 2 and macs >= MIN_MACS


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``torch.mm(a, b, out=out)`` (``a [M, K]``, ``b [K, N]``), on oneDNN where :func:`_on_onednn` (``b`` read as
    the transposed weight of ``a @ b``, in place; the ``[M, N]`` product then copied into ``out``): the LM head's
    input gradient, ``dz [rows, V] @ W [V, D]``, 70 -> 40 ms at 256 rows on the AVX512-BF16 EPYC."""
    if not _on_onednn(a, b, a.shape[0] * a.shape[1] * b.shape[1]):
        return torch.mm(a, b, out=out)
    return out.copy_(_lp(a, b.t()))


def add_weight_grad_(acc: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``acc.addmm_(g2.t(), x2)`` (``acc [N, K]`` += ``g2 [M, N]^T @ x2 [M, K]``), in place with no ``[N, K]``
    temporary: on MKL where it reads the transposed operand at its peak (:func:`mkl_first`), else on oneDNN by
    blocks of ``GRAD_BLOCK_ROWS`` rows of ``acc`` (each block's ``g2`` columns transposed by rollyard's kernel, the
    product added into its rows): the LM head's weight gradient, 68 -> 36 ms at 256 rows on the EPYC above."""
    M, N = g2.shape
    if not _on_onednn(x2, g2, M * N * x2.shape[1]) or g2.stride(1) != 1:
        return acc.addmm_(g2.t(), x2)
    xt = x2.t()
    for n0 in range(0, N, GRAD_BLOCK_ROWS):
        acc[n0:n0 + GRAD_BLOCK_ROWS].add_(_lp(cpu_kernels.transposed(g2[:, n0:n0 + GRAD_BLOCK_ROWS]), xt))
    return acc


def mkl_first() -> bool:
    """An Intel CPU with MKL: where MKL's sgemm, reading transposed operands in place, takes the weight gradients
    (:func:`weight_grad`) and the products by parts (:func:`parts_in_place`)."""
    return cpu.vendor() == "GenuineIntel" and torch.backends.mkl.is_available()


def parts_in_place() -> bool:
    """Whether :func:`linear_parts` multiplies by each part into its columns of the output (MKL's sgemm writes a
    column block of a row-major output in place): where :func:`mkl_first`."""
    return mkl_first()


def by_parts(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`linear_parts` takes inputs of ``dtype`` on ``device`` by parts here (else over the
    concatenated weight, which a product under autograd then keeps for its backward)."""
    return (parts_in_place() and torch.device(device).type == "cpu" and dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and enabled())


def _parts_product(x2: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``x2 [M, K] @ cat(parts).T`` written part by part into one ``[M, sum N_i]`` output."""
    y = x2.new_empty((x2.shape[0], sum(w.shape[0] for w in parts)))
    at = 0
    for w in parts:
        torch.mm(x2, w.t(), out=y[:, at:at + w.shape[0]])
        at += w.shape[0]
    return y


class _PartsLinear(torch.autograd.Function):
    """``x @ cat(parts).T`` without the concatenated weight, forward and both gradients by parts (:func:`linear_parts`)."""

    @staticmethod
    def forward(ctx, x, *parts):
        ctx.save_for_backward(x, *parts)
        return _parts_product(x.reshape(-1, x.shape[-1]), parts).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, g):
        x, *parts = ctx.saved_tensors
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        gx, grads, at = None, [], 0
        for i, w in enumerate(parts):
            gi = g2[:, at:at + w.shape[0]]
            at += w.shape[0]
            if ctx.needs_input_grad[0]:
                gx = torch.mm(gi, w) if gx is None else gx.addmm_(gi, w)
            grads.append(weight_grad(gi, x2) if ctx.needs_input_grad[1 + i] else None)
        return (None if gx is None else gx.view(x.shape)), *grads


def _bf16_autocast(x: torch.Tensor) -> bool:
    """``x`` is on a CPU inside bf16 autocast (the trainer's ``precision=bf16`` there)."""
    return (x.device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16)


def linear_parts(x: torch.Tensor, parts: tuple[torch.Tensor, ...], b: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(x, torch.cat(parts), b)`` (a layer's q|k|v or gate|up weights side by side) without concatenating
    the weights in every call, where :func:`parts_in_place`: each part's product written into its columns of the
    output, and in the backward each part's weight gradient and its share of the input's, all on MKL. The copy it
    saves is the weights' bytes a call, twice a step under activation checkpointing (SmolLM2-135M's 30 layers: 0.55
    GB a pass). At 294 rows on a 2-core Intel Xeon: gate|up 4.72 -> 3.88 ms, q|k|v 1.73 -> 1.12 ms against oneDNN
    over the concatenation (1.0x-1.1x oneDNN's product alone). Under bf16 autocast on a CPU: the parts cast to bf16,
    then concatenated (the bits autocast's cast of the fp32 concatenation gives, at 6 bytes moved per weight instead
    of 14). Elsewhere, and for anything but fp32 CPU tensors: :func:`linear` over the concatenated weight."""
    first = parts[0]
    if _bf16_autocast(x) and all(w.dtype == torch.float32 for w in parts):
        # each part cast as autocast would cast their concatenation (the same bits), then concatenated at half the
        # bytes: gate|up's forward and backward at 180 rows of SmolLM2 4.3 -> 3.1 ms (AVX512-BF16 EPYC)
        return linear(x, torch.cat([w.to(torch.bfloat16) for w in parts]), b)
    if not (by_parts(x.dtype, x.device) and _eligible(x, first)
            and all(w.dtype == first.dtype and w.dim() == 2 and w.shape[1] == first.shape[1] for w in parts)):
        return linear(x, torch.cat(parts), b)
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in parts)):
        y = _PartsLinear.apply(x, *parts)
    else:
        y = _parts_product(x.reshape(-1, x.shape[-1]), parts).view(*x.shape[:-1], -1)
    return y if b is None else y + b


def transposed_weight_grad(M: int, N: int, K: int) -> bool:
    """Whether the weight gradient ``g^T @ x`` (``g [M, N]``, ``x [M, K]``) is better taken as ``(x^T @ g)^T``, by the
    elements copied: oneDNN copies a transposed *input* to contiguous but reads a transposed weight in place, so
    ``g^T @ x`` copies ``g`` (M x N), and ``(x^T @ g)^T`` copies ``x`` (M x K) and leaves a transposed ``[N, K]`` that
    autograd copies again into the parameter's layout (N x K) when it stores the gradient. A step's micro-batch of
    310 rows through SmolLM2's gate|up (N 3072, K 576): 0.95M against 1.95M elements (the transposed form had cost
    ~0.1 s of a 2 s trainer step in those copies); 2144 rows x 256 -> 1280: 2.7M against 0.88M (5.4 ms against 7.7
    ms)."""
    return M * N > M * K + N * K


def _eligible(x: torch.Tensor, w: torch.Tensor) -> bool:
    """fp32 dense CPU tensors (no tensor subclass such as a DTensor), outside autocast."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.layout == torch.strided and type(w.data) is torch.Tensor and type(x.data) is torch.Tensor
            and not torch.is_autocast_enabled("cpu") and x.dim() >= 2 and enabled())


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, tail: bool = False) -> torch.Tensor:
    """``F.linear(x, w, b)``, on oneDNN for fp32 CPU tensors when :func:`enabled` (autograd included).

    ``tail``: the caller's block ends in this product, added to a residual that nothing saves (a Llama layer's
    ``down_proj``): an activation checkpoint's recompute, which keeps only the tensors the backward reads and
    discards its outputs, then saves ``x`` and ``w`` and skips the product (SmolLM2-135M's train step, 294 rows:
    30 of its 60 ``down_proj`` forwards, ~64 of ~1900 ms). Elsewhere the product is computed."""
    if not _eligible(x, w) or x.numel() * w.shape[0] < MIN_MACS:
        return F.linear(x, w, b)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return _Linear.apply(x, w, b, tail)
    return _lp(x, w, b)


def packs(numel: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`pack` copies a weight of ``numel`` elements of ``dtype`` on ``device`` into oneDNN's layout
    (else it returns the weight itself): a caller may then build the weight in a scratch buffer it reuses."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and enabled()
            and (dtype == torch.float32 or cpu.onednn_bf16()) and PACK_ROWS * numel >= MIN_MACS)


def pack(w: torch.Tensor) -> torch.Tensor:
    """``w [out, in]`` ready for :func:`packed_linear`: oneDNN's layout for fp32 / bf16 CPU weights
    when :func:`enabled` and the weight is large enough to repay oneDNN's per-call cost at
    ``PACK_ROWS`` rows (:func:`packs`: a copy, ``w`` may be reused after), else ``w`` itself (no grad; repack
    after any change to ``w``)."""
    if packs(w.numel(), w.dtype, w.device):
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), None)
    return w


def packed_linear(x: torch.Tensor, p: torch.Tensor, b: torch.Tensor | None = None,
                  add: torch.Tensor | None = None) -> torch.Tensor:
    """``add + F.linear(x, w, b)`` for ``p = pack(w)`` (no autograd); the add is fused on oneDNN."""
    if not p.is_mkldnn:
        if add is None:
            return F.linear(x, p, b)
        if x.dim() == 2:
            return torch.addmm(add if b is None else add + b, x, p.t())
        return add + F.linear(x, p, b)
    if add is None:
        return _lp(x, p, b)
    return torch.ops.mkldnn._linear_pointwise.binary(x, add, p, b, "add")
