"""Lay out variable-length (prompt, completion) sequences as micro-batches: packed or padded rows.

Two layouts, both exact (no token sees another sequence or a pad), chosen per micro-batch:

- **packed**: one row ``[1, L]``, the sequences concatenated, ``position_ids`` restarting at 0
  for each. With no ``attention_mask`` and no KV cache, transformers derives a block-diagonal
  causal mask from the restarting positions (``masking_utils.find_packed_sequence_indices``), so
  no token attends across a sequence boundary and no padding is computed; but the attention runs
  over the whole row with a dense ``[L, L]`` mask.
- **padded**: ``[B, T]``, one sequence per row starting at position 0, right-padded to the
  longest (``position_ids`` is ``None``). Pads come after every real token, so plain causal
  attention (no mask tensor at all) keeps them out of the real tokens; pad positions are computed
  and never read. Sequences are sorted by length first, so a micro-batch holds similar lengths.

tests/test_trainer.py checks both against unpacked forwards: equal logprobs and gradients, and
editing one sequence leaves its micro-batch-mates' logprobs unchanged.

Each sequence contributes ``len(prompt) + len(completion) - 1`` input tokens: the last
completion token is only ever a target. Completion token ``j`` is predicted by the hidden state
at input position ``len(prompt) - 1 + j`` of its sequence; ``MicroBatch.rows`` holds those
positions as flat indices into the ``[B * T]`` hidden states.

``plan`` picks, per micro-batch of length-sorted sequences, the layout with the lower estimated
cost (:func:`layout_cost`): many short sequences are cheaper padded (attention over each short
row) than packed (attention over one long row with a dense mask); a few very uneven ones are
cheaper packed (no pad tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("auto", "packed", "padded")
# A packed row's attention runs with a dense [L, L] mask: the unfused math path (mask and scores
# materialized per head, nothing skipped), measured at several times the causal kernel's cost
# per pair on CPU; transformers also builds the mask itself elementwise.
DENSE_MASK_PENALTY = 4.0


@dataclass
class MicroBatch:
    """One micro-batch and where its loss tokens are.

    ``input_ids``: ``[B, T]``; ``position_ids``: ``[1, L]`` (packed, B = 1) or ``None`` (padded:
    each row one sequence from position 0). ``rows``: ``[N]`` flat indices into the ``[B * T]``
    positions whose hidden state predicts a completion token; ``targets``: ``[N]`` those tokens;
    ``seq_index``: ``[N]`` the member (0..len(members)-1) each target belongs to.
    ``members``: indices into the caller's sequence list, in layout order;
    ``lengths``: completion lengths of the members (so per-member slices of an ``[N]`` tensor
    are ``split(lengths)``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    rows: torch.Tensor
    targets: torch.Tensor
    seq_index: torch.Tensor
    members: list[int]
    lengths: list[int]
    segments: torch.Tensor | None = None  # [B, T] "shared" layout (prefix_shared): 0 prompt, k member k's suffix, -1 pad
    real_positions: int = 0  # positions holding a token (pads left out; a shared prompt prefix counted once)

    @property
    def layout(self) -> str:
        if self.segments is not None:
            return "shared"
        return "padded" if self.position_ids is None else "packed"

    @property
    def num_tokens(self) -> int:
        """Positions the forward computes (pads included)."""
        return self.input_ids.numel()


def plan_bins(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: group item indices into bins of total length <= ``max_tokens``.

    An item longer than ``max_tokens`` gets a bin of its own (never truncated). Items of length 0
    are left out.
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
    return bins


def plan_padded_bins(lengths: list[int], max_tokens: int, attn_weight: float = 0.0,
                     group_cost: float | None = None, packed_ok: bool = False) -> list[list[int]]:
    """Item indices, longest first, cut into consecutive groups with ``rows x longest <= max_tokens``
    (an item longer than that gets a group of its own; items of length 0 are left out).

    Where to cut is chosen by dynamic programming over the sorted lengths: the fewest groups (and
    among those the lowest cost) when ``group_cost`` is ``None``, else the lowest total of each
    group's :func:`layout_cost` (padded, or packed where that is cheaper and ``packed_ok``) plus
    ``group_cost`` per group, the fixed cost of one more micro-batch in the same units. Splitting
    a batch of uneven lengths into groups of similar ones saves pad positions and attention
    pairs; ``group_cost`` says when a split stops paying.
    """
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    L = [lengths[i] for i in order]
    best: list[tuple[float, float]] = [(0, 0.0)]  # best[j]: (groups or 0, cost) of the first j items
    cut = [0]
    for j in range(1, len(L) + 1):
        best.append((float("inf"), float("inf")))
        cut.append(j - 1)
        total = 0
        for i in range(j - 1, -1, -1):  # the last group is items i..j-1, its longest L[i]
            rows = j - i
            if rows > 1 and rows * L[i] > max_tokens:
                break  # rows and L[i] only grow as i goes down
            total += L[i]
            cost = rows * L[i] * (1.0 + attn_weight * L[i] / 2)  # layout_cost(..., "padded", ...)
            if packed_ok and rows > 1:
                cost = min(cost, total * (1.0 + DENSE_MASK_PENALTY * attn_weight * total))
            g, c = best[i]
            cand = (g + 1, c + cost) if group_cost is None else (0, c + cost + group_cost)
            if cand < best[j]:
                best[j], cut[j] = cand, i
    groups, j = [], len(L)
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def layout_cost(lengths: list[int], layout: str, attn_weight: float) -> float:
    """Estimated cost of one micro-batch, in units of one token's position-wise work (matmuls).

    ``attn_weight``: the cost of one (query, key) attention pair in the same units. Padded rows
    pay ``B x T`` positions and causal attention over each row (``T^2 / 2`` pairs); a packed row
    pays only real tokens but attention over the whole row with a dense mask: ``L^2`` pairs,
    nothing skipped, each ``DENSE_MASK_PENALTY`` times dearer.
    """
    if layout == "padded":
        T = max(lengths)
        return len(lengths) * T * (1.0 + attn_weight * T / 2)
    L = sum(lengths)
    return L * (1.0 + DENSE_MASK_PENALTY * attn_weight * L)


def _sequence(p: list[int], c: list[int]) -> list[int]:
    return list(p) + list(c[:-1])


def _packed(sequences, members: list[int]) -> MicroBatch:
    ids: list[int] = []
    pos: list[int] = []
    rows: list[int] = []
    targets: list[int] = []
    seq_index: list[int] = []
    for k, i in enumerate(members):
        p, c = sequences[i]
        start = len(ids)
        seq = _sequence(p, c)
        ids.extend(seq)
        pos.extend(range(len(seq)))
        rows.extend(range(start + len(p) - 1, start + len(seq)))
        targets.extend(c)
        seq_index.extend([k] * len(c))
    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        rows=torch.tensor(rows, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        seq_index=torch.tensor(seq_index, dtype=torch.long),
        members=list(members),
        lengths=[len(sequences[i][1]) for i in members],
        real_positions=len(ids),
    )


def _padded(sequences, members: list[int], pad_id: int = 0) -> MicroBatch:
    seqs = [_sequence(*sequences[i]) for i in members]
    T = max(len(s) for s in seqs)
    rows: list[int] = []
    targets: list[int] = []
    seq_index: list[int] = []
    for k, (i, seq) in enumerate(zip(members, seqs)):
        p, c = sequences[i]
        rows.extend(range(k * T + len(p) - 1, k * T + len(seq)))
        targets.extend(c)
        seq_index.extend([k] * len(c))
    return MicroBatch(
        input_ids=torch.tensor([s + [pad_id] * (T - len(s)) for s in seqs], dtype=torch.long),
        position_ids=None,
        rows=torch.tensor(rows, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        seq_index=torch.tensor(seq_index, dtype=torch.long),
        members=list(members),
        lengths=[len(sequences[i][1]) for i in members],
        real_positions=sum(len(s) for s in seqs),
    )


def common_prefix(prompts: list[list[int]]) -> int:
    """Length of the longest token-for-token common prefix of ``prompts``."""
    n = min(len(p) for p in prompts)
    first = prompts[0]
    for other in prompts[1:]:
        k = 0
        while k < n and other[k] == first[k]:
            k += 1
        n = k
    return n


def prompt_units(sequences, keys: list, max_tokens: int) -> list[tuple[int, list[int]]]:
    """``(shared length S, member indices)`` per unit: the sequences of one key (a GRPO group) that share
    their prompts' common prefix (``S >= 1`` tokens, token for token: multi-turn prompts that differ after
    the first turn share only what is identical). A unit longer than ``max_tokens`` is cut into several,
    each with its own copy of the prefix; sequences whose group shares nothing are units of their own
    (``S`` = their prompt). Empty completions are left out."""
    by_key: dict = {}
    for i, (_, c) in enumerate(sequences):
        if c:
            by_key.setdefault(keys[i], []).append(i)
    units = []
    for members in by_key.values():
        S = common_prefix([sequences[i][0] for i in members])
        if S == 0 or len(members) == 1:
            units += [(len(sequences[i][0]), [i]) for i in members]
            continue
        unit, size = [], S
        for i in members:
            n = len(_sequence(*sequences[i])) - S
            if unit and size + n > max_tokens:
                units.append((S, unit))
                unit, size = [], S
            unit.append(i)
            size += n
        units.append((S, unit))
    return units


def _unit_length(sequences, S: int, members: list[int]) -> int:
    return S + sum(len(_sequence(*sequences[i])) - S for i in members)


def _shared(sequences, units: list[tuple[int, list[int]]], pad_id: int = 0) -> MicroBatch:
    """Rows ``[B, T]``, one unit each: the shared prefix once (positions 0..S-1), then each member's
    suffix (its sequence after the prefix, positions S..); ``segments`` says which is which. A
    member's completion token ``j`` is predicted at its sequence position ``len(prompt) - 1 + j``:
    in the prefix (the last shared token, for the first completion token of a member whose prompt is
    the prefix itself) or in its suffix."""
    T = max(_unit_length(sequences, S, m) for S, m in units)
    ids, pos, seg = [], [], []
    rows: list[int] = []
    targets: list[int] = []
    seq_index: list[int] = []
    members: list[int] = []
    for b, (S, unit) in enumerate(units):
        row_ids = list(sequences[unit[0]][0][:S])
        row_pos, row_seg = list(range(S)), [0] * S
        for k, i in enumerate(unit, start=1):
            p, c = sequences[i]
            seq = _sequence(p, c)
            start = len(row_ids)  # where the suffix (sequence position S) lands in the row
            row_ids += seq[S:]
            row_pos += range(S, len(seq))
            row_seg += [k] * (len(seq) - S)
            for j in range(len(c)):
                at = len(p) - 1 + j
                rows.append(b * T + (at if at < S else start + at - S))
            targets.extend(c)
            seq_index.extend([len(members)] * len(c))
            members.append(i)
        pad = T - len(row_ids)
        ids.append(row_ids + [pad_id] * pad)
        pos.append(row_pos + [0] * pad)
        seg.append(row_seg + [-1] * pad)
    return MicroBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        rows=torch.tensor(rows, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        seq_index=torch.tensor(seq_index, dtype=torch.long),
        members=members,
        lengths=[len(sequences[i][1]) for i in members],
        segments=torch.tensor(seg, dtype=torch.long),
        real_positions=sum(len(r) for r in ids) - sum(x < 0 for r in seg for x in r),
    )


def prefix_shared(sequences: list[tuple[list[int], list[int]]], keys: list, max_tokens: int,
                  attn_weight: float = 0.0, group_cost: float | None = None) -> list[MicroBatch]:
    """Micro-batches in the ``shared`` layout: each row one group's prompt prefix followed by its members'
    completions (:func:`prompt_units`; ``keys[i]``: sequence ``i``'s group, e.g. its request id), so the
    prompt's positions are computed once per group; the rows are cut into micro-batches as padded rows
    are (:func:`plan_padded_bins` over the units' lengths). The attention a row needs (each suffix sees
    the prefix and itself, causally; ``rollyard.model.fast.prefix_shared_mask``) is a mask, or on CPU per segment
    (``rollyard.model.segments``), so only a family's fast training forward (``rollyard.model.families``) can run
    this layout."""
    _check(sequences)
    units = prompt_units(sequences, keys, max_tokens)
    lengths = [_unit_length(sequences, S, m) for S, m in units]
    return [_shared(sequences, [units[u] for u in group])
            for group in plan_padded_bins(lengths, max_tokens, attn_weight, group_cost)]


def _check(sequences) -> list[int]:
    for i, (p, c) in enumerate(sequences):
        if c and not p:
            raise ValueError(
                f"sequence {i} has an empty prompt: the first completion token is predicted from the "
                f"last prompt token, so a prompt needs at least one token (e.g. BOS)"
            )
    return [len(p) + len(c) - 1 if c else 0 for p, c in sequences]


def pack(sequences: list[tuple[list[int], list[int]]], max_tokens: int) -> list[MicroBatch]:
    """Pack ``(prompt_ids, completion_ids)`` pairs into packed rows of <= ``max_tokens`` tokens.

    Pairs with an empty completion have nothing to score and appear in no micro-batch. A pair
    with an empty prompt cannot have its first token scored and is rejected.
    """
    lengths = _check(sequences)
    return [_packed(sequences, members) for members in plan_bins(lengths, max_tokens)]


def plan(sequences: list[tuple[list[int], list[int]]], max_tokens: int, layout: str = "auto",
         attn_weight: float = 0.0, group_cost: float | None = None) -> list[MicroBatch]:
    """Micro-batches of ``(prompt_ids, completion_ids)`` pairs, each in its cheaper layout.

    ``layout="packed"`` is :func:`pack`. Otherwise sequences are sorted by length and grouped
    so that ``rows x longest <= max_tokens``, cut where the total estimated cost is lowest
    (:func:`plan_padded_bins`; ``group_cost``: one micro-batch's fixed cost, ``None`` for the
    fewest micro-batches); ``"padded"`` lays every group out padded, ``"auto"`` takes, per group,
    the layout with the lower :func:`layout_cost` (``attn_weight``: one attention pair's cost
    relative to one token's position-wise work).
    Empty completions are left out and empty prompts rejected, as in :func:`pack`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    if layout == "packed":
        return pack(sequences, max_tokens)
    lengths = _check(sequences)
    out = []
    for members in plan_padded_bins(lengths, max_tokens, attn_weight, group_cost, packed_ok=layout == "auto"):
        lens = [lengths[i] for i in members]
        packed_cheaper = (layout == "auto" and len(members) > 1
                          and layout_cost(lens, "packed", attn_weight) < layout_cost(lens, "padded", attn_weight))
        out.append((_packed if packed_cheaper else _padded)(sequences, members))
    return out
