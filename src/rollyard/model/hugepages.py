"""CPU memory on 2 MiB pages for the weights a decode step streams.

A decode step reads every matmul weight once: SmolLM2-135M's are 0.54 GB in fp32, and at small batch the step is
that read. On 4 KiB pages the stream crosses a page every 4 KiB, ~130k TLB misses a step, each a page walk; on
transparent huge pages (THP) 512 times fewer. Linux's default THP mode (``madvise``) gives huge pages only to
memory advised ``MADV_HUGEPAGE``, which torch's allocator does not do.

:class:`Arena` hands out tensors from anonymous memory mapped in chunks aligned to 2 MiB and advised so. The fast
forward packs its matmul weights into one (``model/fast.py``) and lays them out again in the same memory at every
weight refresh: no fresh pages and no page faults after the first. A chunk that a tensor from before the last
:meth:`Arena.reset` still uses is left to that tensor and replaced, never written over.

Where Linux runs THP ``never``, or on another OS, the memory is ordinary pages: the same numbers at the speed of
``torch.empty``'s. ``ROLLYARD_HUGE_PAGES=0`` turns the advice off (plain ``torch.empty``).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

from rollyard.config import env_flag

HUGE = 2 << 20  # an x86-64 / aarch64 (4 KiB granule) transparent huge page
CHUNK = 64 << 20  # a chunk's default size: bounds the address space a half-used last chunk holds
ALIGN = 64  # each tensor starts on a cache line


def advised() -> bool:
    """Whether this process advises huge pages: Linux's ``madvise`` is there and ``ROLLYARD_HUGE_PAGES`` is not 0."""
    return env_flag("ROLLYARD_HUGE_PAGES") == "1" and hasattr(mmap, "MADV_HUGEPAGE")


class _Chunk:
    """One anonymous mapping: ``size`` usable bytes from ``base`` (its first 2 MiB boundary), ``used`` of them
    handed out."""

    def __init__(self, size: int):
        self.mm = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared: shmem, no THP)
        self.base = -ctypes.addressof(ctypes.c_char.from_buffer(self.mm)) % HUGE
        self.size, self.used = size, 0
        self.mm.madvise(mmap.MADV_HUGEPAGE, self.base, size)

    def idle(self) -> bool:
        """No tensor uses this chunk's memory (each one holds a reference to the mapping; the list holding the
        chunk and ``getrefcount``'s own argument are the other two)."""
        return sys.getrefcount(self.mm) <= 2


class Arena:
    """A bump allocator over :class:`_Chunk` s: :meth:`empty` in order, :meth:`reset` to lay out again from the
    start. Plain ``torch.empty`` where :func:`advised` is false."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._chunks: list[_Chunk] = []
        self._at = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor of ``shape`` and ``dtype``: the next free bytes of the current chunk, else of
        the next (a new one where none is left)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not advised() or nbytes < HUGE // 2:
            return torch.empty(shape, dtype=dtype)
        need = -(-nbytes // ALIGN) * ALIGN
        while self._at < len(self._chunks) and self._chunks[self._at].size - self._chunks[self._at].used < need:
            self._at += 1
        if self._at == len(self._chunks):
            self._chunks.append(_Chunk(max(self.chunk, -(-need // HUGE) * HUGE)))
        c = self._chunks[self._at]
        t = torch.frombuffer(c.mm, dtype=torch.uint8, count=nbytes, offset=c.base + c.used)
        c.used += need
        return t.view(dtype).view(shape)

    def reset(self) -> None:
        """Start over at the first chunk. Chunks whose tensors are all gone are written again; one still in use is
        dropped here (it lives as long as its tensors do) and a new one takes its place when needed."""
        self._chunks = [c for c in self._chunks if c.idle()]
        for c in self._chunks:
            c.used = 0
        self._at = 0

    @property
    def mapped(self) -> int:
        """Bytes of address space this arena holds (touched or not)."""
        return sum(c.size for c in self._chunks)
