"""Pack variable-length (prompt, completion) sequences into one-row micro-batches.

A micro-batch is a single row ``[1, L]``: the sequences concatenated, ``position_ids``
restarting at 0 for each. With no ``attention_mask`` and no KV cache, transformers derives a
block-diagonal causal mask from the restarting positions (``masking_utils.
find_packed_sequence_indices``), so no token attends across a sequence boundary and no padding
is computed. tests/test_trainer.py checks both: packed == unpacked, and editing one sequence
leaves its pack-mates' logprobs unchanged.

Each sequence contributes ``len(prompt) + len(completion) - 1`` input tokens: the last
completion token is only ever a target. Completion token ``j`` is predicted by the hidden state
at input position ``len(prompt) - 1 + j``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    """One packed row and where its loss tokens are.

    ``input_ids``/``position_ids``: ``[1, L]``. ``rows``: ``[N]`` positions in the row whose
    hidden state predicts a completion token; ``targets``: ``[N]`` those tokens;
    ``seq_index``: ``[N]`` the member (0..len(members)-1) each target belongs to.
    ``members``: indices into the caller's sequence list, in pack order;
    ``lengths``: completion lengths of the members (so per-member slices of an ``[N]`` tensor
    are ``split(lengths)``).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor
    seq_index: torch.Tensor
    members: list[int]
    lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


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


def pack(sequences: list[tuple[list[int], list[int]]], max_tokens: int) -> list[MicroBatch]:
    """Pack ``(prompt_ids, completion_ids)`` pairs into micro-batches of <= ``max_tokens`` tokens.

    Pairs with an empty completion have nothing to score and appear in no micro-batch. A pair
    with an empty prompt cannot have its first token scored and is rejected.
    """
    for i, (p, c) in enumerate(sequences):
        if c and not p:
            raise ValueError(
                f"sequence {i} has an empty prompt: the first completion token is predicted from the "
                f"last prompt token, so a prompt needs at least one token (e.g. BOS)"
            )
    lengths = [len(p) + len(c) - 1 if c else 0 for p, c in sequences]
    out = []
    for members in plan_bins(lengths, max_tokens):
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        targets: list[int] = []
        seq_index: list[int] = []
        comp_lengths = []
        for k, i in enumerate(members):
            p, c = sequences[i]
            start = len(ids)
            seq = list(p) + list(c[:-1])
            ids.extend(seq)
            pos.extend(range(len(seq)))
            rows.extend(range(start + len(p) - 1, start + len(seq)))
            targets.extend(c)
            seq_index.extend([k] * len(c))
            comp_lengths.append(len(c))
        out.append(MicroBatch(
            input_ids=torch.tensor([ids], dtype=torch.long),
            position_ids=torch.tensor([pos], dtype=torch.long),
            rows=torch.tensor(rows, dtype=torch.long),
            targets=torch.tensor(targets, dtype=torch.long),
            seq_index=torch.tensor(seq_index, dtype=torch.long),
            members=members,
            lengths=comp_lengths,
        ))
    return out
