"""The weights a training forward multiplies with, cast and stacked once per optimizer step under autocast.

Under bf16 autocast every ``F.linear`` casts its fp32 weight to bf16, and the fast training forward first stacks
q|k|v and gate|up into one fp32 weight per call (``model/fast.py``): with activation checkpointing each layer's
forward runs twice (the forward, then its recompute in the backward), so a step over ``m`` micro-batches reads and
writes every weight ``2m`` times over, 14 B per parameter each time (an fp32 stack, then its bf16 cast). Inside
:func:`step_cache` (the trainer's forward and backward of one optimizer step, weights unchanged) :func:`weight`
builds each bf16 stack once, in one pass per part (6 B per parameter), and hands the same copy to every call.

The values are autocast's: a cast is elementwise, so stacking the casts is casting the stack, and the gradient of
each part is the stacked gradient's rows cast to the part's dtype, as autograd's cast and cat backwards give them.
Outside autocast, or outside :func:`step_cache`, :func:`weight` is the plain stack (or the weight itself), as
before. The cache holds one bf16 copy of the weights for the step (SmolLM2-135M: 0.27 GB), while the engine's own
copies are released for the trainer's step (``placement/colocated.trainer_turn``).
"""

from __future__ import annotations

import contextlib

import torch

_CACHE: list[dict | None] = [None]  # the open step's copies, keyed by (dtype, the parts' ids)


@contextlib.contextmanager
def step_cache():
    """Cache the casts of :func:`weight` until the block ends (one optimizer step's forwards and backwards: the
    weights must not change inside it). Nested blocks share the outer one's cache."""
    outer = _CACHE[0]
    if outer is None:
        _CACHE[0] = {}
    try:
        yield
    finally:
        if outer is None:
            _CACHE[0] = None


def weight(*parts: torch.Tensor) -> torch.Tensor:
    """The rows of ``parts`` stacked (one part: the part), differentiable w.r.t. each part; under autocast in its
    dtype, cast once per :func:`step_cache` block."""
    device = parts[0].device.type
    if not torch.is_autocast_enabled(device):
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    dtype = torch.get_autocast_dtype(device)
    if all(p.dtype == dtype for p in parts):
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    return _CastStack.apply(dtype, *parts)


def _stacked(dtype: torch.dtype, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``parts`` cast to ``dtype`` and stacked by rows, each part read once and written once."""
    out = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=dtype, device=parts[0].device)
    row = 0
    for p in parts:
        out[row:row + p.shape[0]].copy_(p)
        row += p.shape[0]
    return out


class _CastStack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dtype, *parts):
        ctx.rows, ctx.dtypes = [p.shape[0] for p in parts], [p.dtype for p in parts]
        cache, key = _CACHE[0], (dtype, *(id(p) for p in parts))
        w = None if cache is None else cache.get(key)
        if w is None:
            w = _stacked(dtype, parts)
            if cache is not None:
                cache[key] = w
        return w.view_as(w)  # a tensor of its own per call (the graph node is this call's), the cached storage

    @staticmethod
    def backward(ctx, grad):
        out, row = [], 0
        for n, dtype, needed in zip(ctx.rows, ctx.dtypes, ctx.needs_input_grad[1:]):
            out.append(grad[row:row + n].to(dtype) if needed else None)
            row += n
        return (None, *out)
