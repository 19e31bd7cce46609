"""The LM head's token logprobs with a hand-written backward that holds one weight gradient.

``trainer.chunked_token_logprobs`` under autograd checkpoints each ``chunk`` of rows: its backward recomputes the
chunk's logits, runs autograd through ``logsumexp`` / ``gather`` (several ``[chunk, V]`` buffers) and hands the
head weight a fresh ``[V, D]`` gradient per chunk, which autograd then adds to the one it holds. At a 262,144-token
vocabulary (Gemma 3) each of those is 0.67 GB in fp32: two weight-sized gradients and a few logits buffers at once
were the trainer's peak (measured on Gemma-3-270M's head alone, 768 rows, chunk 256: 2.15 GB above the weights).

:class:`HeadLogprobs` does the same arithmetic with the gradient written where it ends: ``d logp_i / d z_ij =
(1[j = y_i] - p_ij) / T`` for ``z = h W^T / T``, so a chunk's logits are recomputed once, turned into their gradient
in place (``exp``, scale, one scatter-add for the targets), and ``W``'s gradient is accumulated into one buffer with
``addmm_`` (1.35 GB above the weights on the same case). Where the compiled kernels run (fp32 on CPU), the entropy and
the softmax part of the gradient (``-g * exp(z - logz)``) are one pass over a chunk's logits each
(``kernels.softmax_entropy`` / ``softmax_grad_``) instead of three, and the log-partition two
(``kernels.logsumexp_at``): the log-probs, the entropy and the gradients equal the checkpointed path's to float
rounding (``tests/test_trainer_head.py``).

Used for a plain ``nn.Linear`` head without bias, soft cap or a truncated support (top-p / top-k), outside autocast;
every other head keeps the checkpointed path.

Under bf16 autocast on a CPU (:class:`HeadLogprobsBf16`) the checkpointed path's backward held, at once, a bf16
copy of the head (the recomputed cast), the head's bf16 gradient and its fp32 conversion: at Gemma 3's 262k x 640
head 0.34 + 0.34 + 0.67 GB, the trainer's peak. :class:`HeadLogprobsBf16` frees the bf16 copy before the weight's
gradient is made. Where the compiled kernels run, a chunk's softmax statistics and its logits' gradient are read from
the bf16 product itself (``kernels.logsumexp_at_bf16`` / ``softmax_entropy_bf16`` / ``logprob_grad_bf16_``): no fp32
copy of the logits (SmolLM2's 256-row chunk: 50 MB made, page-faulted and read several times, a chunk, each pass),
the gradient written over the product in bf16, the last chunk's product and the bf16 weight kept from the forward
for the backward; the values are autograd's to float rounding (its entropy's sum is a bf16 bmm: this one's is
fp32). SmolLM2's head forward and backward at 168 / 339 / 493 rows went 141 / 246 / 412 -> 94 / 175 / 210 ms on an
AVX512-BF16 EPYC. Elsewhere it runs the very operations autograd runs, kernel for kernel and in the same order (the
weights the same bit for bit, ``tests/test_trainer_head_bf16.py``).
"""

from __future__ import annotations

import time

import torch

from rollyard.model import gemm as cpu_gemm
from rollyard.model import kernels as cpu_kernels


class Clock:
    """Seconds spent in :class:`HeadLogprobs`, forward and backward, since the last :meth:`take` (the trainer's
    ``lm_head_s`` metric: the LM head's share of a train step, 63% of Gemma-3-270M's multiply-adds)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


CLOCK = Clock()


def _chunk_stats(logits, targets, with_entropy: bool, lps: list, logzs: list, ents: list,
                 one_pass: bool = False) -> None:
    """One chunk's forward: its targets' log-probs, its log-partition and (``with_entropy``) its entropy, ``H = logz -
    sum_v p_v * z_v`` (as ``logprobs._entropy`` without a gradient), appended to the lists. ``one_pass``: the
    log-partition and the entropy through ``kernels.logsumexp_at`` / ``softmax_entropy`` where they run (two reads of
    the logits and one, no ``[rows, V]`` buffer; their exp rounds unlike torch's, so the bf16 head, which keeps
    autograd's bits, does not take them)."""
    both = cpu_kernels.logsumexp_at(logits, targets) if one_pass else None
    if both is None:
        logz = torch.logsumexp(logits, dim=-1)
        both = logz, logits.gather(-1, targets[:, None]).squeeze(-1) - logz
    logz = both[0]
    lps.append(both[1])
    logzs.append(logz)
    if with_entropy:
        ent = cpu_kernels.softmax_entropy(logits, logz) if one_pass else None  # one pass, no [rows, V] buffer
        if ent is None:
            p = (logits - logz[:, None]).exp_()
            ent = logz - torch.bmm(p[:, None, :], logits[:, :, None]).view(-1)
        ents.append(ent)


def _saved(ctx, hidden, weight, targets, temperature: float, chunk: int, lps: list, logzs: list, ents: list,
           with_entropy: bool, t0: float):
    """The forward's end, shared by both heads: what the backward reads saved, the outputs ``(logp, entropy)``."""
    ctx.save_for_backward(hidden, weight, targets, torch.cat(logzs))
    ctx.temperature, ctx.chunk = temperature, chunk
    ctx.leaf = weight if weight.is_leaf and weight.requires_grad else None  # the parameter, for its .grad
    ent = torch.cat(ents) if with_entropy else hidden.new_zeros(0, dtype=torch.float32)
    ctx.mark_non_differentiable(ent)
    out = torch.cat(lps), ent
    CLOCK.seconds += time.perf_counter() - t0
    return out


class HeadLogprobs(torch.autograd.Function):
    """``(logp [N], entropy [N] or empty)`` of ``hidden [N, D]`` under ``log_softmax(hidden @ weight.T / T)`` at
    ``targets``, ``chunk`` rows at a time; entropy carries no gradient.

    The last chunk's logits are kept from the forward to the backward, which takes that chunk first (then the others
    from the last, each recomputed): the buffer the backward would have allocated to recompute it, held a little
    longer (over the loss, before the head's backward, which runs first), so one ``[chunk, D] x [D, V]`` product fewer
    a step at no more memory (a batch within one chunk recomputes nothing: SmolLM2's step at 216 completion tokens,
    ~50 ms of its head's ~240)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, with_entropy: bool):
        t0 = time.perf_counter()
        lps, logzs, ents = [], [], []
        z = None
        for s in range(0, hidden.shape[0], chunk):
            z = _logits(hidden[s:s + chunk], weight, temperature)
            _chunk_stats(z, targets[s:s + chunk], with_entropy, lps, logzs, ents, one_pass=True)
        ctx.last = z if any(ctx.needs_input_grad[:2]) else None  # the last chunk's logits, for the backward
        return _saved(ctx, hidden, weight, targets, temperature, chunk, lps, logzs, ents, with_entropy, t0)

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        t0 = time.perf_counter()
        hidden, weight, targets, logz = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # a later micro-batch adds into the gradient held, not into a second weight-sized buffer
        into = _held_grad(ctx.leaf) if ctx.needs_input_grad[1] else None
        grad_w = into if into is not None else torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        kept, ctx.last = ctx.last, None
        for s in reversed(range(0, hidden.shape[0], chunk)):  # the last chunk first: its logits kept by the forward
            h, g = hidden[s:s + chunk], grad_lp[s:s + chunk].float() / T
            z, kept = (kept, None) if kept is not None else (_logits(h, weight, T), None)
            dz = cpu_kernels.softmax_grad_(z, logz[s:s + chunk], g)  # -g p, in one pass where the kernel runs
            if dz is None:
                dz = z.sub_(logz[s:s + chunk, None]).exp_().mul_(-g[:, None])
            dz = dz.scatter_add_(1, targets[s:s + chunk, None], g[:, None]).to(hidden.dtype)  # + g at the target
            if grad_h is not None:
                cpu_gemm.mm_into(dz, weight, grad_h[s:s + chunk])
            if grad_w is not None:
                cpu_gemm.add_weight_grad_(grad_w, dz, h)
        CLOCK.seconds += time.perf_counter() - t0
        return grad_h, (None if into is not None else _give(ctx.leaf, grad_w)), None, None, None, None


def _give(weight: torch.Tensor | None, grad: torch.Tensor | None) -> torch.Tensor | None:
    """What a backward returns for ``weight``: None once ``grad`` is set as ``weight.grad`` itself, where the
    parameter holds no gradient yet (the first micro-batch of a step), else ``grad`` for autograd to accumulate.

    Returned, the gradient of a tied head meets the embedding lookup's rows in autograd's input buffer, which adds
    them out of place (``head + rows``: one more weight-sized buffer, 0.67 GB for Gemma 3's 262k x 640 table, the
    trainer's peak on Gemma-3-270M, measured 4.84 GB against 4.17 GB after the backward in a trainer-only step).
    Set as ``.grad``, the rows are added into it in place by the weight's ``AccumulateGrad`` (``.grad += rows``):
    the same single addition per element, so the same bits. Only where autograd would have taken ``grad`` as the
    ``.grad`` as it is (a leaf parameter without gradient or hooks, outside a double backward, a contiguous
    gradient of its shape and dtype); a held gradient keeps autograd's order, ``.grad + (head + rows)``."""
    if grad is None or weight is None or weight.grad is not None or torch.is_grad_enabled():
        return grad
    if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return grad  # a hook on the weight's gradient sees what autograd accumulates: leave it to autograd
    if grad.shape != weight.shape or grad.dtype != weight.dtype or not (grad.is_contiguous() and weight.is_contiguous()):
        return grad
    weight.grad = grad
    return None


def _held_grad(weight: torch.Tensor | None) -> torch.Tensor | None:
    """``weight.grad`` when this backward may add into it in place: a leaf parameter that already holds a dense
    gradient of its own shape and dtype (a second micro-batch of one step), outside a double backward.

    Autograd would add the returned gradient into ``.grad`` itself, with the returned weight-sized buffer alive
    meanwhile: at Gemma 3's 262k x 640 head, 0.67 GB on top of the one held (the trainer's peak, on the steps
    that pack two micro-batches, measured 5.7 GB against 4.8 GB with one). Returning no gradient for the weight
    leaves its tied uses (the embedding lookup) to accumulate as before."""
    g = None if weight is None else weight.grad
    if g is None or torch.is_grad_enabled() or g.is_sparse or g.shape != weight.shape or g.dtype != weight.dtype:
        return None
    if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return None  # a hook on the weight's gradient sees what autograd accumulates: leave it to autograd
    return g


class HeadLogprobsBf16(torch.autograd.Function):
    """:class:`HeadLogprobs` under CPU bf16 autocast: the checkpointed path's arithmetic, in one pass over each
    chunk's bf16 product where the compiled kernels run (module docstring), op for op elsewhere.

    Autograd's backward of one chunk of ``chunked_token_logprobs`` (``z = (h16 @ w16.T).float() / T``, ``lp =
    z[y] - logsumexp(z)``), written out: ``dz_T = (-g) * exp(z - logz) + scatter(g at y)`` (the logsumexp and the
    gather backward, summed), ``dz = dz_T / T`` cast to bf16, ``dh = (dz16 @ w16)`` cast to ``h``'s dtype, ``dw16 =
    dz16.T @ h16``; the chunks' ``dw16`` summed in bf16, last chunk first (the weight's autocast cast is one node
    that all chunks feed), then cast to fp32. The bf16 weight ``w16`` lives only while the logits are computed and
    ``dh`` taken: the weight's gradient is made after it is freed (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, with_entropy: bool):
        t0 = time.perf_counter()
        # under the caller's autocast, as the checkpointed path (its entropy's bmm runs in bf16)
        w16 = weight.detach().to(torch.bfloat16)  # autocast's cast of the weight (round to nearest even)
        lps, logzs, ents = [], [], []
        z16 = None
        for s in range(0, hidden.shape[0], chunk):
            h, y = hidden[s:s + chunk], targets[s:s + chunk]
            z16 = _product16(h, w16)
            if not _chunk_stats16(z16, y, temperature, with_entropy, lps, logzs, ents):
                z16 = None  # the kernels do not run here: autograd's operations
                _chunk_stats(_logits16(h, w16, temperature), y, with_entropy, lps, logzs, ents)
        # the last chunk's bf16 logits and the bf16 weight, for the backward (the kernels' path: the backward comes
        # right after, over the loss; it frees the weight before the weight's gradient is made, as it would its own)
        keep = z16 is not None and any(ctx.needs_input_grad[:2])
        ctx.last, ctx.w16 = (z16, w16) if keep else (None, None)
        del w16
        return _saved(ctx, hidden, weight, targets, temperature, chunk, lps, logzs, ents, with_entropy, t0)

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        t0 = time.perf_counter()
        hidden, weight, targets, logz = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        starts = list(range(0, hidden.shape[0], chunk))
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dzs = []
        kept, w16, ctx.last, ctx.w16 = ctx.last, ctx.w16, None, None
        with torch.autocast("cpu", enabled=False):
            w16 = weight.to(torch.bfloat16) if w16 is None else w16
            for s in reversed(starts):  # autograd's order: the last chunk's branch first
                h16 = hidden[s:s + chunk].to(torch.bfloat16)
                g, y = grad_lp[s:s + chunk], targets[s:s + chunk]
                z16, kept = (kept, None) if kept is not None else (_product16(h16, w16), None)
                dz = cpu_kernels.logprob_grad_bf16_(z16, logz[s:s + chunk], g.contiguous(), y, 1.0 / T)
                if dz is None:  # autograd's operations
                    dz = _logits16(h16, w16, T).sub_(logz[s:s + chunk, None]).exp_().mul_(g.neg()[:, None])
                    # + g at the target; + 0.0: the gather's gradient is a zero-filled buffer (-0.0 + 0.0 is +0.0)
                    dz = dz.scatter_add_(1, y[:, None], g[:, None]).add_(0.0)
                    if T != 1.0:
                        dz = dz.div_(T)
                    dz = dz.to(torch.bfloat16)
                if grad_h is not None:
                    grad_h[s:s + chunk] = torch.mm(dz, w16)  # cast to h's dtype on the copy
                dzs.append((s, dz) if ctx.needs_input_grad[1] else None)
            del w16  # freed before the weight-sized gradient is made
            if grad_h is not None and len(starts) > 1:
                grad_h.add_(0.0)  # the chunks' gradients meet in zero-filled buffers (-0.0 + 0.0 is +0.0)
            grad_w = _weight_grad(dzs, hidden, chunk, weight.shape) if ctx.needs_input_grad[1] else None
            dzs.clear()
        CLOCK.seconds += time.perf_counter() - t0
        return grad_h, _give(ctx.leaf, grad_w), None, None, None, None


def _weight_grad(dzs, hidden: torch.Tensor, chunk: int, shape) -> torch.Tensor:
    """The head weight's fp32 gradient ``[V, D]``: the chunks' ``dz16.T @ h16`` (autograd's ``mm_mat2_backward``)
    summed in bf16 in ``dzs``' order, then cast to fp32, all inside the fp32 result's own buffer. The bf16 sum
    lives in the buffer's upper half and each further chunk's product in its lower half; the cast then runs front
    to back, a block of rows at a time, each block read before it is written: fp32 rows ``[a, b)`` take bytes
    ``[4aD, 4bD)``, below the bf16 rows not yet read (from ``2VD + 2bD`` on) since ``b <= V``. So no bf16 [V, D]
    buffer beside the fp32 one (0.34 GB for Gemma 3's head), and the same bits as the separate buffers."""
    V, D = shape
    out = torch.empty(V, D, dtype=torch.float32, device=hidden.device)
    halves = out.view(-1).view(torch.bfloat16)  # 2 V D bf16 slots
    acc, part = halves[V * D:].view(V, D), halves[:V * D].view(V, D)
    for i, (s, dz) in enumerate(dzs):
        h16 = hidden[s:s + chunk].to(torch.bfloat16)
        if i == 0:
            torch.mm(dz.t(), h16, out=acc)
        else:
            torch.mm(dz.t(), h16, out=part)
            acc.add_(part)
    rows = max(1, (16 << 20) // (4 * D))  # 16 MiB of fp32 rows a block
    for a in range(0, V, rows):
        out[a:a + rows] = acc[a:a + rows].clone()
    return out


def _product16(h: torch.Tensor, w16: torch.Tensor) -> torch.Tensor:
    """One chunk's bf16 product ``h @ w16.T`` (``[rows, V]``), as autocast's ``F.linear`` computes it."""
    with torch.no_grad():
        return torch.nn.functional.linear(h.to(torch.bfloat16), w16)


def _chunk_stats16(z16: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, lps: list,
                   logzs: list, ents: list) -> bool:
    """:func:`_chunk_stats` of ``z16.float() / T`` read from the bf16 product itself (``kernels.logsumexp_at_bf16``,
    ``softmax_entropy_bf16``: no fp32 ``[rows, V]`` copy); False (nothing appended) where the kernels do not run."""
    both = cpu_kernels.logsumexp_at_bf16(z16, targets, 1.0 / temperature)
    ent = None if both is None or not with_entropy else cpu_kernels.softmax_entropy_bf16(z16, both[0], 1.0 / temperature)
    if both is None or (with_entropy and ent is None):
        return False
    logzs.append(both[0])
    lps.append(both[1])
    if with_entropy:
        ents.append(ent)
    return True


def _logits16(h: torch.Tensor, w16: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk's logits as the autocast path computes them: ``F.linear`` in bf16, then fp32, then ``/ T``."""
    z = _product16(h, w16).float()
    return z.div_(temperature) if temperature != 1.0 else z


def _logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        z = cpu_gemm.linear(h, weight).float()
    return z.div_(temperature) if temperature != 1.0 else z


def applies(lm_head: torch.nn.Module, hidden: torch.Tensor, softcap: float | None, truncated: bool) -> bool:
    """Whether :class:`HeadLogprobs` computes this head (module docstring)."""
    return (type(lm_head) is torch.nn.Linear and lm_head.bias is None and not softcap and not truncated
            and not (lm_head._forward_hooks or lm_head._forward_pre_hooks)
            and not torch.is_autocast_enabled(hidden.device.type) and hidden.dtype == lm_head.weight.dtype)


def applies_bf16(lm_head: torch.nn.Module, hidden: torch.Tensor, softcap: float | None, truncated: bool,
                 fp32_head: bool) -> bool:
    """Whether :class:`HeadLogprobsBf16` computes this head: as :func:`applies`, but under CPU bf16 autocast with an
    fp32 weight (the trainer's ``precision=bf16``) and no fp32 head."""
    return (type(lm_head) is torch.nn.Linear and lm_head.bias is None and not softcap and not truncated
            and not fp32_head and not (lm_head._forward_hooks or lm_head._forward_pre_hooks)
            and hidden.device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16 and lm_head.weight.dtype == torch.float32
            and hidden.dtype in (torch.float32, torch.bfloat16))
