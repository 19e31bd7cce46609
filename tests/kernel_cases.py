"""Helpers the CPU kernel tests share: a call at several thread counts, a short prefill + decode run."""

from __future__ import annotations

import torch


def at_threads(fn, counts=(1, 2)) -> list:
    """``fn()`` once under each of ``counts`` torch threads, the process's own count restored after."""
    n = torch.get_num_threads()
    try:
        outs = []
        for threads in counts:
            torch.set_num_threads(threads)
            outs.append(fn())
        return outs
    finally:
        torch.set_num_threads(n)


def decode_run(fwd, ids: torch.Tensor, last: torch.Tensor, same: bool):
    """``(logits [4, 3, V], cache)``: the prefill of ``ids`` (3 rows) in slots 0-2 and 3 decode steps after it, every
    row at one shared position (``same``) or at its own (``last + 1``...)."""
    kv = fwd.new_cache(3, 16)
    steps = [fwd.prefill(ids, kv, torch.tensor([0, 1, 2]), last)]
    for t in range(3):
        tok = torch.tensor([3 + t, 4, 5])
        if same:
            steps.append(fwd.decode(tok, None, kv, 7 + t, same_pos=6 + t))
        else:
            pos = last + 1 + t
            steps.append(fwd.decode(tok, pos, kv, int(pos.max()) + 1))
    return torch.stack(steps), kv


def at_line(offset: int):
    """An ``empty`` for the packs whose tensor starts ``offset`` elements past a 64-byte line: at 0 the pack writes
    with streaming stores (an AVX-512 build), elsewhere with plain ones."""
    def empty(shape, dtype):
        numel = int(torch.Size(shape).numel())
        flat = torch.empty(numel + 64, dtype=dtype)
        skip = (-flat.data_ptr() % 64) // flat.element_size() + offset
        out = flat[skip:skip + numel].view(shape)
        assert (out.data_ptr() % 64 == 0) == (offset == 0)
        return out
    return empty
