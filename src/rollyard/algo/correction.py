"""The rollout-mismatch correction: tokens were sampled from mu (the rollout engine, maybe versions behind, always
with other kernels) while the loss is attributed to pi_old. One function per mode (TRL's
``vllm_importance_sampling_mode``), each ``[T] -> [T]`` detached, multiplying every token's policy term:

- ``token_truncate``: ``clamp(pi_old / mu, floor, cap)`` per token (truncated IS; rollyard's default, cap 2);
- ``token_mask``: ``pi_old / mu`` per token, 0 where it falls outside ``[floor, cap]``;
- ``sequence_truncate`` / ``sequence_mask``: the same on the sequence's ratio ``prod_t pi_old / mu`` (a sum of log
  differences over its loss tokens), broadcast to its tokens (TRL's default with vLLM: ``sequence_mask``, cap 3);
- ``none``: no correction (weight 1).

A bound of ``None`` is no bound. A token whose rollout log-probability is NaN (an engine that could not score it) gets
a zero log difference: weight 1, no correction. :func:`off_policy_mask` is DeepSeek-V3.2's off-policy sequence mask.
"""

from __future__ import annotations

import torch

from rollyard.algo.segments import broadcast, seq_mean, seq_sum

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")


def _token_log_diff(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num((old_logp.detach() - rollout_logp.detach()) * mask, nan=0.0)


def _truncate(r: torch.Tensor, floor: float | None, cap: float | None) -> torch.Tensor:
    return r.clamp(min=floor, max=cap) if (floor is not None or cap is not None) else r


def _mask(r: torch.Tensor, floor: float | None, cap: float | None) -> torch.Tensor:
    lo = -float("inf") if floor is None else floor
    hi = float("inf") if cap is None else cap
    return r.masked_fill((r < lo) | (r > hi), 0.0)


def token_truncate(old_logp, rollout_logp, seq_index, mask, floor=None, cap=2.0) -> torch.Tensor:
    return _truncate(_token_log_diff(old_logp, rollout_logp, mask).exp(), floor, cap)


def token_mask(old_logp, rollout_logp, seq_index, mask, floor=None, cap=2.0) -> torch.Tensor:
    return _mask(_token_log_diff(old_logp, rollout_logp, mask).exp(), floor, cap)


def _sequence_ratio(old_logp, rollout_logp, seq_index, mask) -> torch.Tensor:
    d = _token_log_diff(old_logp, rollout_logp, mask)
    return broadcast(seq_sum(d, seq_index, torch.ones_like(mask)), seq_index).exp()


def sequence_truncate(old_logp, rollout_logp, seq_index, mask, floor=None, cap=2.0) -> torch.Tensor:
    return _truncate(_sequence_ratio(old_logp, rollout_logp, seq_index, mask), floor, cap)


def sequence_mask(old_logp, rollout_logp, seq_index, mask, floor=None, cap=2.0) -> torch.Tensor:
    return _mask(_sequence_ratio(old_logp, rollout_logp, seq_index, mask), floor, cap)


def none(old_logp, rollout_logp, seq_index, mask, floor=None, cap=None) -> torch.Tensor:
    return torch.ones_like(old_logp)


BY_MODE = {"token_truncate": token_truncate, "token_mask": token_mask, "sequence_truncate": sequence_truncate,
           "sequence_mask": sequence_mask, "none": none}


@torch.no_grad()
def off_policy_mask(adv: torch.Tensor, logp: torch.Tensor, sampled_logp: torch.Tensor, seq_index: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[T]`` 1 keep / 0 drop: a sequence is dropped when its advantage is negative and its mean per-token
    ``log mu - log pi_theta`` over its loss tokens exceeds ``threshold`` (its sampler drifted too far to learn
    from what it did wrong). NaN log differences count as 0."""
    kl = torch.nan_to_num(sampled_logp - logp.detach(), nan=0.0)
    keep = (adv >= 0) | (broadcast(seq_mean(kl, seq_index, mask), seq_index) <= threshold)
    return keep.to(logp.dtype)


def high_entropy_threshold(entropies: torch.Tensor, top_quantile: float) -> float:
    """The entropy at or above which a token is among the ``top_quantile`` share of ``entropies`` (every loss token
    of the batch): ``torch.quantile(entropies, 1 - top_quantile)``, linear interpolation. ("Beyond the 80/20 rule":
    the policy gradient on the high-entropy forking tokens only.)"""
    if entropies.numel() == 0:
        return float("inf")
    x = entropies.float()
    if x.numel() <= 1 << 24:  # torch.quantile's own limit
        return float(torch.quantile(x, 1.0 - top_quantile))
    v = x.sort().values
    pos = (1.0 - top_quantile) * (v.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))
