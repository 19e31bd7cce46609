"""On-policy distillation's per-token advantage (``algo.objective``: ``rl`` | ``distill`` | ``rl+distill``).

The student samples a completion; a frozen teacher scores each sampled token over the same sampling support
(:mod:`rollyard.algo.support`). Per completion token ``t`` (all ``[T]`` over a packed micro-batch)::

    k_t = log pi_old(y_t) - log pi_teacher(y_t)          # the reverse KL's one-sample term at token t
    A_t = reward_weight x A_seq + coef x -k_t            # detached: an advantage, not a loss term

``A_seq`` is the reward's GRPO advantage of the token's sequence (``reward_weight`` 1 for ``rl+distill``, 0 for
``distill``). Each token gets its own term only (no sum over the tokens after it), as on-policy distillation
recipes do. ``pi_old`` is the trainer's log-probability the batch is attributed to (the current weights' for
one update per batch, taken from the training forward itself), so the advantage measures the policy being
trained, not the rollout engine's copy; the rollout's gap stays with the importance-sampling correction.

On-policy (ratio 1, no clip or correction active) the surrogate's gradient per token is
``-A_t grad log pi(y_t) = coef x k_t x grad log pi(y_t)``, the gradient of ``coef x (log pi - log pi_teacher)^2 / 2``
(the k2 estimator of the reverse KL): what ``tests/test_distill.py`` holds the trainer's gradient to.
"""

from __future__ import annotations

import torch

OBJECTIVES = ("rl", "distill", "rl+distill", "gkd")  # gkd: algo/gkd.py (a divergence term, no advantage)


def reward_weight(objective: str) -> float:
    """The GRPO advantage's weight in the per-token advantage: 0 under pure distillation (and GKD)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"algo.objective={objective!r}: expected one of {OBJECTIVES}")
    return 0.0 if objective in ("distill", "gkd") else 1.0


def reverse_kl(old_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """``[T]`` per-token ``log pi_old - log pi_teacher`` of the sampled tokens (detached)."""
    return (old_logp - teacher_logp).detach()


def token_advantage(adv: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor, weight: float,
                    coef: float) -> torch.Tensor:
    """``[T]``: ``weight x adv - coef x (log pi_old - log pi_teacher)``, detached (the module docstring)."""
    return (weight * adv - coef * reverse_kl(old_logp, teacher_logp)).detach()
