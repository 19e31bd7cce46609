"""The policy ratio pi_theta / pi_old at the level the loss clips it (TRL's ``importance_sampling_level``).

All ``[T]`` over a packed micro-batch (:mod:`rollyard.algo.segments`); ``log_ratio = logp - old_logp`` carries the
gradient of ``logp``. Each function returns ``log w [T]``, the log of the weight every token's surrogate uses:

- ``token`` (PPO, GRPO, DAPO): ``log w_t = log_ratio_t``.
- ``sequence`` (GSPO): ``log w_t = mean_{u in seq} log_ratio_u``, the length-normalised sequence ratio, the same for
  every token of a sequence; its gradient reaches every token of the sequence.
- ``sequence_token`` (GSPO-token): the sequence ratio's value, the token's own gradient:
  ``log w_t = sg[mean_u log_ratio_u] + logp_t - sg[logp_t]``.
"""

from __future__ import annotations

import torch

from rollyard.algo.segments import broadcast, seq_mean

LEVELS = ("token", "sequence", "sequence_token")


def token_level(log_ratio: torch.Tensor, seq_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return log_ratio


def sequence_level(log_ratio: torch.Tensor, seq_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return broadcast(seq_mean(log_ratio, seq_index, mask), seq_index)


def sequence_token_level(log_ratio: torch.Tensor, seq_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    seq = broadcast(seq_mean(log_ratio.detach(), seq_index, mask), seq_index)
    return seq + log_ratio - log_ratio.detach()


BY_LEVEL = {"token": token_level, "sequence": sequence_level, "sequence_token": sequence_token_level}
