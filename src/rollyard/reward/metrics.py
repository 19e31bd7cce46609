"""Per-step reward metrics beyond the mean: each hook's own statistics and the share of flat groups."""

from __future__ import annotations

from statistics import mean, pstdev
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollyard.types import Sample


def per_hook(samples: list[Sample], names: list[str]) -> dict[str, float]:
    """``rewards/<name>/mean`` and ``/std`` of each hook over the samples it scored (with several hooks;
    TRL's names), and ``rewards/<name>/<key>``: the mean of a verl ``compute_score`` dict's extra key."""
    out: dict[str, float] = {}
    extras: dict[str, list[float]] = {}
    for s in samples:
        for key, v in getattr(s, "reward_extras", {}).items():
            extras.setdefault(key, []).append(v)
    out.update({f"rewards/{key}": mean(vs) for key, vs in extras.items()})
    if len(names) < 2:
        return out
    for i, name in enumerate(names):
        values = [s.reward_parts[i] for s in samples if len(s.reward_parts) > i and s.reward_parts[i] is not None]
        if values:
            out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = mean(values), pstdev(values)
    return out


def frac_zero_std(samples: list[Sample]) -> float:
    """Share of GRPO groups whose rewards are all equal (zero advantage: no learning signal); TRL's
    ``frac_reward_zero_std``."""
    groups: dict[str, list[float]] = {}
    for s in samples:
        groups.setdefault(s.request_id, []).append(s.reward)
    if not groups:
        return 0.0
    return sum(max(g) == min(g) for g in groups.values()) / len(groups)
