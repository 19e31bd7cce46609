"""Policy-gradient loss terms: PPO clip, k3 KL, truncated importance sampling, aggregation.

Every function takes per-token tensors flattened over a packed batch: shape ``[T]`` where T is
the number of *completion* tokens in the batch (prompt tokens carry no loss), plus
``seq_index: LongTensor[T]`` naming the sequence each token belongs to (any non-negative
labels; only used by ``seq-mean``). Three log-probabilities meet here:

- ``logp``: the policy being trained, pi_theta (carries gradient);
- ``old_logp``: the trainer's pi_old, the weights the batch is attributed to (detached);
- ``rollout_logp``: mu, what the rollout engine computed at sampling time. In an async
  placement the engine may lag the trainer by several versions, and even on-policy its kernels
  differ from the trainer's, so mu != pi_old. TIS reweights by ``min(pi_old / mu, cap)``.

The aggregation denominators (``num_tokens``, ``num_seqs``) are arguments so that a caller
accumulating gradients over micro-batches can pass the totals of the whole optimizer batch:
a per-micro-batch mean would weight tokens of short micro-batches more.
"""

from __future__ import annotations

from typing import Literal

import torch

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean")
Agg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean"]


def aggregate(
    per_token: torch.Tensor,
    seq_index: torch.Tensor,
    agg: Agg = "token-mean",
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    mask: torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token ``[T]`` quantity to a scalar (verl's ``loss_agg_mode`` names; TRL's loss types in brackets).

    - ``token-mean`` (dapo, bnpo, cispo, vespo): ``sum_t x_t / num_tokens`` (default: T). Every token weighs the same.
    - ``seq-mean-token-mean`` (grpo, sapo; ``seq-mean`` is its old name): ``sum_s mean_{t in s} x_t / num_seqs``
      (default: sequences present). Every sequence weighs the same, whatever its length.
    - ``seq-mean-token-sum`` (luspo): ``sum_s sum_{t in s} x_t / num_seqs``.
    - ``seq-mean-token-sum-norm`` (dr_grpo): ``sum_t x_t / (num_seqs * max_len)``, ``max_len`` the response cap: no
      length normalisation that would favour long wrong answers.

    A sequence must not be split across calls that share denominators. ``mask [T]`` (1 trained, 0 not: a multi-turn
    sample's tool tokens) leaves tokens out of the counts: the caller has already zeroed them in ``per_token``.
    """
    if agg == "token-mean":
        n = (per_token.numel() if mask is None else int(mask.sum())) if num_tokens is None else num_tokens
        return per_token.sum() / max(n, 1)
    if agg not in AGGS:
        raise ValueError(f"unknown loss aggregation {agg!r}: expected one of {AGGS}")
    if per_token.numel() == 0:
        return per_token.sum()
    S = int(seq_index.max()) + 1
    sums = torch.zeros(S, dtype=per_token.dtype, device=per_token.device).index_add(0, seq_index, per_token)
    counts = torch.bincount(seq_index, weights=mask, minlength=S).to(per_token.dtype)
    present = torch.bincount(seq_index, minlength=S) > 0
    n = int(present.sum()) if num_seqs is None else num_seqs
    if agg == "seq-mean-token-sum-norm":
        if not max_len:
            raise ValueError("seq-mean-token-sum-norm needs max_len (the response token cap)")
        return sums.sum() / (max(n, 1) * max_len)
    if agg == "seq-mean-token-sum":
        return sums[present].sum() / max(n, 1)
    return (sums[present] / counts[present].clamp(min=1.0)).sum() / max(n, 1)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    seq_index: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: Agg = "token-mean",
    tis_weight: torch.Tensor | None = None,
    num_tokens: int | None = None,
    num_seqs: int | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, to minimise; all inputs ``[T]`` (``advantages`` per token).

    ``ratio = exp(logp - old_logp)``; per token
    ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) * tis_weight``,
    aggregated by :func:`aggregate`. ``clip_high > clip_low`` is DAPO's clip-higher: a rare token
    with positive advantage may grow further before the clip stops it.

    Returns ``(loss, stats)``; stats are detached scalars: ``clipped_tokens`` (tokens where the
    clip is active, i.e. the clipped term is the smaller one and carries no gradient),
    ``clip_frac`` (that over T), ``ratio_mean``. ``mask [T]`` (0: a tool token) keeps tokens out of
    the loss and the clip count.
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if tis_weight is not None:
        per_token = per_token * tis_weight
    if mask is not None:
        per_token = per_token * mask
    loss = aggregate(per_token, seq_index, agg, num_tokens, num_seqs, mask)
    with torch.no_grad():
        active = ((ratio > 1.0 + clip_high) & (advantages > 0)) | ((ratio < 1.0 - clip_low) & (advantages < 0))
        if mask is not None:
            active &= mask > 0
        n_clip = active.sum()
        stats = {
            "clipped_tokens": n_clip,
            "clip_frac": n_clip / max(ratio.numel(), 1),
            "ratio_mean": ratio.mean() if ratio.numel() else ratio.sum(),
        }
    return loss, stats


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(ref - logp) - (ref - logp) - 1``.

    Unbiased for tokens sampled from pi, always >= 0, differentiable in ``logp``. ``[T] -> [T]``.
    """
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(pi_old / mu, cap)`` per token, detached. ``[T] -> [T]``.

    Corrects for tokens sampled from mu (the rollout engine's distribution, possibly several
    weight versions behind) while the loss is attributed to pi_old. Truncating at ``cap`` bounds
    the variance a single badly mismatched token can add.
    """
    return torch.exp(old_logp.detach() - rollout_logp.detach()).clamp(max=cap)
