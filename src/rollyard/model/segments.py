"""Attention of the prefix-shared layout computed per segment (CPU training forward).

A prefix-shared row (``trainer/packing.py`` ``prefix_shared``) holds one group's prompt prefix followed by its
members' completions. Each member's tokens see the prefix and their own earlier tokens only
(``model/fast.py`` ``prefix_shared_mask``), but a dense masked attention over the row computes every (query, key)
pair of the row: ``(S + n_1 + ... + n_m)^2`` where the member needs ``n_k (S + n_k)``. With long completions the
waste grows with the group: 8 completions of 64 tokens after a 5-token prompt compute 7x the pairs they need,
and the scores tensor is as many times larger.

:func:`segment_plans` gathers each segment's queries and keys into rows of their own (``Block``): the prefixes
(queries and keys the prefix, causal) and the members (queries the member's tokens, keys the prefix and the
member), each padded to its block's longest; :func:`segmented_attention` runs the same scaled scores, additive
mask and fp32 softmax per block and scatters the outputs back. The pairs that are masked in the dense form are
simply not computed, so the result is the dense form's up to the summation order. Pad positions (segment -1)
attend to nothing and come out zero (nothing reads them). Where the padding of uneven members would cost more
pairs than the dense row, or save too few to pay for the gathers, the plan is ``None`` and the dense mask stays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Gathering the segments costs about as much per position (one gather of q, k, v and the output each way) as
# ~100 (query, key) pairs of the dense path cost. Measured per layer, forward and backward, on SmolLM2's heads (2
# threads, fp32): 4 rows of a 45-token prompt and 8 completions each of <= 24 tokens (64k pairs saved over 700
# positions) 7.5 ms dense against 7.4 segmented, and a whole trainer step 3% slower segmented; <= 48 tokens (292k
# over 1324) 24-32 against 15-16 ms; <= 128 tokens 229-276 against 66 ms.
MIN_SAVED_PAIRS_PER_POSITION = 128
# One more block (its gathers, two matmuls, a softmax each way: ~20 small ops a layer) costs about what this many
# (query, key) pairs a head do; members of very different lengths go into several blocks where that pads less.
# Measured per layer, forward and backward, SmolLM2's heads, 4 x 8 completions of 5-200 tokens after 45-token
# prompts: one block for all members 182 ms, blocks at 4096 / 8192 / 16384 / 32768 pairs 81 / 71 / 65 / 66 ms; 5-100
# tokens: at 8192 / 16384 / 65536 pairs 23.3 / 22.2 / 24.5 ms.
BLOCK_PAIRS = 16384


@dataclass(frozen=True)
class Block:
    """Rows of gathered segments, all padded to ``Q`` queries and ``K`` keys.

    ``q [R, Q]``, ``k [R, K]``: the positions (``b * T + t``) gathered per row (padding repeats the row's first
    key); ``mask [R, 1, 1, Q, K]``: additive fp32 (0 or -inf), broadcast over K/V heads and the query heads
    sharing one; ``real [R, Q]``: which gathered queries are real.
    """

    q: torch.Tensor
    k: torch.Tensor
    mask: torch.Tensor
    real: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.q.shape[0], self.q.shape[1], self.k.shape[1]


@dataclass(frozen=True)
class SegmentPlan:
    """A micro-batch's attention as blocks of gathered segments (one mask kind: full or sliding). ``index``
    memoizes the flat gather indices per head layout (:func:`_indices`)."""

    blocks: tuple[Block, ...]
    T: int
    pairs: int  # (query, key) pairs computed per head, padding included
    index: dict = field(default_factory=dict, compare=False, repr=False)


def _runs(segments: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """``(row, segment, start, end)`` of each maximal run of one segment id in a row (flat positions)."""
    B, T = segments.shape
    flat = segments.reshape(-1)
    at = torch.arange(B * T)
    new = torch.ones(B * T, dtype=torch.bool)
    new[1:] = (flat[1:] != flat[:-1]) | (at[1:] % T == 0)
    starts = at[new].tolist()
    ends = starts[1:] + [B * T]
    ids = flat[new].tolist()
    return [(s // T, seg, s, e) for s, e, seg in zip(starts, ends, ids)]


def _pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [R, L], valid [R, L])``: each row's positions, padded with its first position (so a padding query is
    a copy of the row's first, never read back)."""
    L = max(len(r) for r in rows)
    index = torch.tensor([r + [r[0]] * (L - len(r)) for r in rows], dtype=torch.long)
    valid = torch.tensor([[True] * len(r) + [False] * (L - len(r)) for r in rows], dtype=torch.bool)
    return index, valid


def _block(queries: list[list[int]], keys: list[list[int]], pos: torch.Tensor,
           window: int | None) -> tuple[Block, Block]:
    """The block of these gathered rows, with the full mask and with the sliding one (``window`` on positions)."""
    qi, qv = _pad(queries)
    ki, kv = _pad(keys)
    pq, pk = pos[qi], pos[ki]
    see = kv[:, None, :] & (pk[:, None, :] <= pq[:, :, None])
    near = see if window is None else see & ((pq[:, :, None] - pk[:, None, :]) < window)

    def made(allowed: torch.Tensor) -> Block:  # a padding query repeats the row's first, which sees itself: no row is
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))  # all -inf (a NaN softmax)
        return Block(q=qi, k=ki, mask=mask[:, None, None], real=qv)

    full = made(see)
    return full, (full if window is None else made(near))


def segment_plans(segments: torch.Tensor, position_ids: torch.Tensor,
                  window: int | None = None) -> tuple[SegmentPlan, SegmentPlan] | None:
    """``(full, sliding)`` plans of prefix-shared rows ``segments [B, T]`` (0: the row's prefix, first in the row;
    k > 0: member k's tokens, contiguous; -1: pad) at ``position_ids [B, T]``, or ``None`` where they would not save
    the dense ``[B, T, T]`` mask :data:`MIN_SAVED_PAIRS_PER_POSITION` (query, key) pairs per position."""
    B, T = segments.shape
    segments, pos = segments.cpu(), position_ids.cpu().reshape(-1)
    prefix: dict[int, list[int]] = {}
    members: list[tuple[int, list[int]]] = []
    for row, seg, start, end in _runs(segments):
        if seg == 0:
            prefix[row] = list(range(start, end))
        elif seg > 0:
            members.append((row, list(range(start, end))))
    if not members or any(row not in prefix for row, _ in members):
        return None
    prefixes = list(prefix.values())
    tails = sorted(((m, prefix[row] + m) for row, m in members), key=lambda t: len(t[0]))
    cuts = length_blocks([len(q) for q, _ in tails], [len(k) for _, k in tails])
    pairs = len(prefixes) * max(map(len, prefixes)) ** 2 + sum(cost for _, _, cost in cuts) - BLOCK_PAIRS * len(cuts)
    if B * T * T - pairs <= MIN_SAVED_PAIRS_PER_POSITION * B * T:
        return None
    blocks = [_block(prefixes, prefixes, pos, window)]
    blocks += [_block([q for q, _ in tails[a:b]], [k for _, k in tails[a:b]], pos, window) for a, b, _ in cuts]
    full = SegmentPlan(tuple(f for f, _ in blocks), T, pairs)
    if window is None:
        return full, full
    return full, SegmentPlan(tuple(n for _, n in blocks), T, pairs, full.index)  # the same gathers: one index memo


def length_blocks(queries: list[int], keys: list[int], points: int = 64) -> list[tuple[int, int, int]]:
    """Cut members sorted by query count into consecutive blocks ``(start, end, cost)``, the blocks' padded pairs
    (rows x longest queries x longest keys) plus :data:`BLOCK_PAIRS` each as low as it goes: a shortest path over the
    cut points (one block pads every member to the longest; one per member pays the most fixed costs). Over
    ``points`` members the cuts fall between equal runs of members only (``points`` candidates: a bounded search)."""
    n = len(queries)
    at = sorted({round(i * n / points) for i in range(1, points)} | {n}) if n > points else list(range(1, n + 1))
    at = [0] + at

    run_keys = [max(keys[at[a]:at[a + 1]]) for a in range(len(at) - 1)]
    best = [0.0] + [math.inf] * (len(at) - 1)  # best[b]: members 0..at[b]-1 in blocks
    back = [(0, 0)] * len(at)
    for b in range(1, len(at)):
        K = 0
        for a in range(b - 1, -1, -1):  # the last block: members at[a]..at[b]-1, its longest query the last one's
            K = max(K, run_keys[a])
            c = (at[b] - at[a]) * queries[at[b] - 1] * K + BLOCK_PAIRS
            if best[a] + c < best[b]:
                best[b], back[b] = best[a] + c, (a, c)
    cuts, b = [], len(at) - 1
    while b > 0:
        a, c = back[b]
        cuts.append((at[a], at[b], c))
        b = a
    return cuts[::-1]


def _indices(plan: SegmentPlan, B: int, KVH: int, G: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Flat row indices for ``B`` rows of ``KVH`` K/V heads of ``G`` query heads each: per block, the gathered queries'
    (``[B * KVH * G * T]`` rows of ``q``, in the block's ``[R, KVH, G * Q]`` order) and keys' (``[B * KVH * T]``
    rows of ``k``/``v``, in ``[R, KVH, K]`` order); and for each output row, where it is in the blocks' outputs
    laid end to end (a pad position: one zero row after them)."""
    T = plan.T
    kv = torch.arange(KVH)[None, :, None]
    g = torch.arange(G)[None, None, :, None]
    gathers, parts, at = [], [], 0
    for b in plan.blocks:
        R, Q, K = b.shape
        bq, tq, bk, tk = b.q // T, b.q % T, b.k // T, b.k % T
        qrow = ((bq[:, None, None, :] * KVH + kv[..., None]) * G + g) * T + tq[:, None, None, :]  # [R, KVH, G, Q]
        krow = (bk[:, None, :] * KVH + kv) * T + tk[:, None, :]  # [R, KVH, K]
        gathers.append((qrow.reshape(-1), krow.reshape(-1)))
        real = b.real[:, None, None, :].expand(R, KVH, G, Q)
        parts.append((qrow[real], at + torch.arange(R * KVH * G * Q).view(R, KVH, G, Q)[real]))
        at += R * KVH * G * Q
    back = torch.full((B * KVH * G * T,), at, dtype=torch.long)  # row `at`: the zero row
    for rows, src in parts:
        back[rows] = src
    return gathers, back


def segmented_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        plan: SegmentPlan) -> torch.Tensor:
    """Grouped attention (``model/fast.py`` ``grouped_causal_attention``'s layout: ``q [B, KVH, G * T, hd]``,
    ``k, v [B, KVH, T, hd]``; returns ``[B, KVH, G * T, hd]``) over ``plan``'s blocks only, with autograd: one
    gather of each block's queries, keys and values straight from those layouts, one gather of the outputs back."""
    B, KVH, GT, hd = q.shape
    G = GT // plan.T
    if (B, KVH, G) not in plan.index:
        plan.index[(B, KVH, G)] = _indices(plan, B, KVH, G)
    gathers, back = plan.index[(B, KVH, G)]
    qf, kf, vf = q.reshape(-1, hd), k.reshape(-1, hd), v.reshape(-1, hd)
    outs = []
    for b, (qrow, krow) in zip(plan.blocks, gathers):
        R, Q, K = b.shape
        qb = qf.index_select(0, qrow).view(R, KVH, G * Q, hd)
        kb, vb = kf.index_select(0, krow).view(R, KVH, K, hd), vf.index_select(0, krow).view(R, KVH, K, hd)
        s = torch.matmul(qb, kb.transpose(-1, -2)).view(R, KVH, G, Q, K)
        p = torch.softmax(torch.add(b.mask, s, alpha=scale), dim=-1).to(vb.dtype)
        outs.append(torch.matmul(p.view(R, KVH, G * Q, K), vb).view(-1, hd))
    outs.append(q.new_zeros(1, hd))
    return torch.cat(outs).index_select(0, back).view(B, KVH, GT, hd)
