"""Keep freed CPU memory in the process for reuse instead of handing it back to the kernel.

A training step allocates and frees hundreds of MB of activations. With glibc's defaults, blocks
above a (moving) threshold come from ``mmap`` and go back to the kernel when freed, and a freed
top of the heap is trimmed, so the next step touches fresh pages again: on the ``small`` preset's
fp32 trainer step (2 threads, 32 x 80 tokens) this machine counted ~20-45k minor page faults per
step and the trainer's step ran ~20% slower than with the thresholds set here (~250 faults).
:func:`keep_freed_memory` sets glibc's mmap threshold to 16 MiB and turns trimming off, once per
process; the trainer calls it when it trains on the CPU. The cost: the process keeps its peak
heap, as PyTorch's caching allocator does on a GPU. ``ROLLYARD_KEEP_FREED=0`` leaves malloc
alone; on a C library other than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import sys

from rollyard.config import env_flag

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
# Blocks below this come from the heap and are reused; larger ones are mmap-ed and returned when freed.
# 1 GiB kept every block in the heap: on a real model (SmolLM2-135M, 4 x 8 samples of 24 tokens, logits
# chunks of 50 MB and larger activations) the fragmented heap grew ~0.4 GB per step (4.3 -> 12.3 GB over
# 20 steps) at the same step time as malloc left alone (4.1 -> 5.4 GB over 8 steps). 64 MiB still kept
# those logits chunks in the heap: 4.55 GB peak by step 11 against 4.05 GB at 16 MiB (the tiny presets'
# tensors are all below it), at the same train-step time (8.2 vs 8.1 s; with a trim per step, 2026-11-26).
MMAP_THRESHOLD = 16 << 20
TRIM_THRESHOLD = (1 << 31) - 1  # the largest accepted: never trim the heap's top
_STATE: list[bool] = []  # [whether the thresholds were set], once per process


def keep_freed_memory() -> bool:
    """Set the thresholds (once per process); ``True`` if they are set. ``ValueError`` for a bad
    ``ROLLYARD_KEEP_FREED``."""
    flag = env_flag("ROLLYARD_KEEP_FREED")
    if _STATE:
        return _STATE[0]
    done = False
    if flag == "1" and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None)
            libc.gnu_get_libc_version  # glibc only: musl's mallopt ignores these parameters  # noqa: B018
            done = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                    and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
        except (OSError, AttributeError):
            done = False
    _STATE.append(done)
    return done


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33's struct mallinfo2 (malloc.h)
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def free_heap_bytes() -> int | None:
    """Bytes the heap holds free (glibc ``mallinfo2().fordblks``, every arena), or None where it cannot tell."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return int(fn().fordblks)


# What a phase switch may leave free in the kept heap before it is trimmed: at or under it the next phase reuses the
# pages (no fault, no zeroing); over it the trim hands them back. SmolLM2-135M's example (4 x 8 samples, bf16, 2-core
# AMD EPYC, 20 steps, 2026-11-29) leaves 0.45-0.75 GB free after each train phase; trimming every switch cost ~0.2 s a
# step (36 ms of malloc_trim, the rest re-faulting the engine's fused copies and the next train phase's activations:
# median step 1.69 -> 1.50 s, sync 0.12 -> 0.06 s without it) for a trainer-phase peak 0.1 GB lower.
SWITCH_FREE_BYTES = 1 << 30


def release_freed_memory(above: int = 0) -> bool:
    """Hand the heap's free pages back to the kernel (glibc ``malloc_trim``) where :func:`keep_freed_memory`
    keeps them, when it holds more than ``above`` bytes free: at a colocated phase switch (trainer -> rollout,
    ``above=SWITCH_FREE_BYTES``: the next phase reuses what is under it) and before a memory-heavy phase that cannot
    reuse it (a checkpoint's snapshot, whose tensors are mmap-ed; the evaluation's engine; ``above=0``). On
    SmolLM2-135M's example (docs/real-models.md) a trim at every switch kept the heap from creeping ~0.17 GB per step
    (3.5 -> 4.7 GB peak over 8 steps) when every block stayed in the heap; one trim took 0.6-1.2 GB back each time.
    ``True`` if it ran."""
    if not (_STATE and _STATE[0]):
        return False
    if above > 0 and (free := free_heap_bytes()) is not None and free <= above:
        return False
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
