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
    scope: str = "group",
) -> torch.Tensor:
    """Per-sample advantage ``(r - mean_g) / (std_g + eps)`` (or ``r - mean_g`` without std); with
    ``scope="batch"`` the std is the whole batch's (TRL ``scale_rewards="batch"``), the mean still the group's.

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
    if normalize_std and scope == "batch":
        std = r.std() if r.numel() > 1 else torch.zeros((), dtype=torch.float64)
        centred = centred / (std + eps)
    elif normalize_std:
        ss = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, g, centred * centred)
        std = (ss / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std[g] + eps)
    return centred.masked_fill(flat, 0.0).to(rewards.dtype)


def normalize_then_sum(parts: torch.Tensor, weights: torch.Tensor, group_index: torch.Tensor,
                       eps: float = 1e-6) -> torch.Tensor:
    """TRL's ``multi_objective_aggregation="normalize_then_sum"``: ``parts [N, K]`` (one column per reward
    function; NaN where it did not score) each normalised within its group ``(r - mean_g) / (std_g + eps)``, summed
    with ``weights [K]``, and the sum normalised over the batch ``(x - mean) / (std + eps)``. Returns ``[N]``; a
    sample no function scored gets 0."""
    p = parts.double()
    _, g = torch.unique(group_index, return_inverse=True)
    G = int(g.max()) + 1 if g.numel() else 0
    seen = ~torch.isnan(p)
    x = torch.nan_to_num(p, nan=0.0)
    count = torch.zeros(G, p.shape[1], dtype=torch.float64).index_add_(0, g, seen.double())
    mean = torch.zeros(G, p.shape[1], dtype=torch.float64).index_add_(0, g, x) / count.clamp(min=1)
    dev = torch.where(seen, x - mean[g], torch.zeros_like(x))
    std = (torch.zeros(G, p.shape[1], dtype=torch.float64).index_add_(0, g, dev * dev)
           / (count - 1).clamp(min=1)).sqrt()
    norm = torch.where(seen, dev / (std[g] + eps), torch.zeros_like(x))
    total = (norm * weights.double()[None, :]).sum(1)
    scored = seen.any(1)
    t = total[scored]
    if t.numel() > 1:
        total = torch.where(scored, (total - t.mean()) / (t.std() + eps), torch.zeros_like(total))
    else:
        total = torch.zeros_like(total)
    return total.float()


def overlong_penalty(length: int, max_len: int, buffer: int, penalty: float) -> float:
    """DAPO's overlong reward shaping: 0 up to ``max_len - buffer`` tokens, then falling linearly to ``-penalty`` at
    ``max_len`` (``-penalty x (length - (max_len - buffer)) / buffer``); 0 when ``buffer`` is 0."""
    if buffer <= 0:
        return 0.0
    excess = length - (max_len - buffer)
    return -penalty * min(max(excess, 0), buffer) / buffer


def assign_advantages(samples: list[Sample], normalize_std: bool = True, eps: float = 1e-6, scope: str = "group",
                      multi_objective: str = "sum_then_normalize", weights: list[float] | None = None) -> None:
    """GRPO over ``Sample``s: set each one's ``advantage`` against its group (same ``request_id``)."""
    if not samples:
        return
    groups: dict[str, int] = {}
    index = torch.tensor([groups.setdefault(s.request_id, len(groups)) for s in samples])
    if multi_objective == "normalize_then_sum" and all(s.reward_parts for s in samples):
        k = len(samples[0].reward_parts)
        parts = torch.tensor([[float("nan") if v is None else v for v in s.reward_parts] for s in samples],
                             dtype=torch.float64)
        w = torch.tensor(weights if weights else [1.0] * k, dtype=torch.float64)
        adv = normalize_then_sum(parts, w, index, eps if eps else 1e-4)
    else:
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        adv = grpo_advantages(rewards, index, normalize_std=normalize_std, eps=eps, scope=scope)
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
