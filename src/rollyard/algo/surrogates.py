"""The per-token policy-gradient surrogates, one function per objective (to minimise, before masks and weights).

Inputs are ``[T]`` over a packed micro-batch: ``w`` the policy ratio at the chosen level (``exp`` of
:mod:`rollyard.algo.ratios`, carrying the gradient), ``adv`` the advantage broadcast per token, ``logp`` the trainer's
log-probabilities (carrying the gradient). Each returns ``[T]``.

- :func:`ppo_clip`: ``-min(w A, clip(w, 1 - low, 1 + high) A)``; ``delta`` caps ``w`` itself from above first (the
  two-sided clip of "GRPO with a second bound": a negative-advantage token with a huge ratio no longer gets an
  unbounded update). GRPO, DAPO (clip-higher: ``high > low``), Dr. GRPO, GSPO (with a sequence-level ``w``).
- :func:`cispo`: ``-sg[min(w, cap)] A logp`` (MiniMax-M1): the ratio is clipped but detached, so every token keeps a
  gradient, scaled by its clipped ratio. ``cap`` is the ratio's absolute upper bound (TRL's ``epsilon_high``).
- :func:`sapo`: ``-sigma(tau (w - 1)) 4 / tau A`` with ``tau`` = ``t_pos`` where ``A > 0`` else ``t_neg`` (soft
  adaptive policy optimisation: a smooth gate in place of the hard clip).
- :func:`vespo`: ``-phi A logp`` with ``phi`` the detached gamma weight of the sequence's importance ratio
  (:func:`vespo_weights`).
"""

from __future__ import annotations

import math

import torch

from rollyard.algo.segments import broadcast, seq_sum

OBJECTIVES = ("ppo_clip", "cispo", "sapo", "vespo")


def ppo_clip(w: torch.Tensor, adv: torch.Tensor, clip_low: float, clip_high: float,
             delta: float | None = None) -> torch.Tensor:
    clipped = w.clamp(1.0 - clip_low, 1.0 + clip_high)
    if delta is not None:
        w = w.clamp(max=delta)
    return -torch.minimum(w * adv, clipped * adv)


def cispo(w: torch.Tensor, adv: torch.Tensor, logp: torch.Tensor, cap: float) -> torch.Tensor:
    return -w.clamp(max=cap).detach() * adv * logp


def sapo(w: torch.Tensor, adv: torch.Tensor, t_pos: float, t_neg: float) -> torch.Tensor:
    tau = torch.where(adv > 0, torch.full_like(w, t_pos), torch.full_like(w, t_neg))
    return -torch.sigmoid(tau * (w - 1.0)) * 4.0 / tau * adv


def vespo(phi: torch.Tensor, adv: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    return -phi * adv * logp


@torch.no_grad()
def vespo_weights(adv: torch.Tensor, log_ratio: torch.Tensor, seq_index: torch.Tensor, mask: torch.Tensor,
                  is_weight: torch.Tensor | None, k_pos: float, lambda_pos: float, k_neg: float,
                  lambda_neg: float) -> torch.Tensor:
    """``phi [T]``: per sequence ``phi(W) = exp(lambda + k log W - lambda W)`` (``phi(1) = 1``), where
    ``log W = sum_t log_ratio_t (+ sum_t log is_weight_t)`` over the sequence's loss tokens, each term and the sum
    clamped to ``[log 1e-8, 20]``; ``k, lambda`` are the ``_pos`` pair for ``A >= 0``, else ``_neg``. Detached."""
    floor = math.log(1e-8)
    log_w = seq_sum(log_ratio.clamp(-20.0, 20.0), seq_index, mask)
    if is_weight is not None:  # the rollout correction joins the sequence's weight in log space
        log_w = log_w + seq_sum(is_weight.log().clamp(floor, 20.0), seq_index, torch.ones_like(mask))
    log_w = log_w.clamp(floor, 20.0)
    a = torch.zeros_like(log_w).index_reduce(0, seq_index, adv, "amax", include_self=False)
    pos = a >= 0
    k = torch.where(pos, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(pos, torch.full_like(log_w, lambda_pos), torch.full_like(log_w, lambda_neg)).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return broadcast(phi, seq_index)
