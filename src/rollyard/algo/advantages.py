"""GRPO advantages: each sample's reward against its own group's.

A group is the ``n`` samples of one prompt (one :class:`~rollyard.types.Request`). There is no
value model: the group mean is the baseline, and optionally the group's reward std the scale.
"""

from __future__ import annotations

import torch

from rollyard.types import Sample


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sample advantage ``(r - mean_g) / (std_g + eps)`` (or ``r - mean_g`` without std).

    Shapes: ``rewards`` float ``[N]``, ``group_index`` int ``[N]`` (any integer labels; groups may
    have unequal sizes and need not be contiguous). Returns ``[N]`` in ``rewards``' dtype.

    ``std_g`` is the sample standard deviation (``n - 1`` in the denominator, as in DeepSeekMath's
    GRPO and TRL). A group with one member, or whose rewards are all equal, carries no signal:
    its advantages are exactly 0 (not a rounding residue, not NaN).
    """
    if rewards.dim() != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"grpo_advantages expects rewards [N] and group_index [N]; got {tuple(rewards.shape)} "
            f"and {tuple(group_index.shape)}"
        )
    if rewards.numel() == 0:
        return rewards.clone()
    r = rewards.double()
    _, g = torch.unique(group_index, return_inverse=True)  # labels -> 0..G-1
    G = int(g.max()) + 1
    count = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, g, r) / count
    centred = r - mean[g]
    hi = torch.full((G,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, g, r, "amax")
    lo = torch.full((G,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, g, r, "amin")
    flat = (hi == lo)[g]  # a group of one is flat too
    if normalize_std:
        ss = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, g, centred * centred)
        std = (ss / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std[g] + eps)
    return centred.masked_fill(flat, 0.0).to(rewards.dtype)


def assign_advantages(samples: list[Sample], normalize_std: bool) -> None:
    """GRPO over ``Sample``s: set each one's ``advantage`` against its group (same ``request_id``)."""
    if not samples:
        return
    groups: dict[str, int] = {}
    index = torch.tensor([groups.setdefault(s.request_id, len(groups)) for s in samples])
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    for s, a in zip(samples, grpo_advantages(rewards, index, normalize_std=normalize_std).tolist()):
        s.advantage = a
