"""Per-sequence reductions over a packed token stream.

Every tensor here is ``[T]``, the completion tokens of a micro-batch laid end to end; ``seq_index [T]`` names the
sequence each token belongs to (labels 0..S-1; a sequence never spans two micro-batches) and ``mask [T]`` is 1 for a
token in the loss and 0 for one that is context only (a tool's output, a masked truncated completion).
"""

from __future__ import annotations

import torch


def seq_sum(x: torch.Tensor, seq_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[S]``: each sequence's sum of ``x * mask``."""
    S = int(seq_index.max()) + 1 if seq_index.numel() else 0
    return torch.zeros(S, dtype=x.dtype, device=x.device).index_add(0, seq_index, x * mask)


def seq_count(seq_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[S]``: each sequence's number of tokens in the loss."""
    S = int(seq_index.max()) + 1 if seq_index.numel() else 0
    return torch.zeros(S, dtype=mask.dtype, device=mask.device).index_add(0, seq_index, mask)


def seq_mean(x: torch.Tensor, seq_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[S]``: each sequence's mean of ``x`` over its loss tokens (0 for a sequence with none)."""
    return seq_sum(x, seq_index, mask) / seq_count(seq_index, mask).clamp(min=1.0)


def broadcast(per_seq: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """``[S] -> [T]``: each token gets its sequence's value."""
    return per_seq.index_select(0, seq_index)
