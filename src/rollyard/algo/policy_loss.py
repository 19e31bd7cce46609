"""The policy loss of one micro-batch, composed from the pieces chosen once from the config (:class:`LossSpec`).

Per token (all ``[T]`` over a packed micro-batch, :mod:`rollyard.algo.segments`), in TRL 1.16's order::

    A         = adv                                     # per token; with a teacher (algo/distill.py):
                                                        #   reward_weight x adv - distill_coef x (old_logp - teacher)
    log_ratio = logp - old_logp                         # pi_theta / pi_old, carries the gradient
    w         = exp(level(log_ratio))                   # algo/ratios.py: token | sequence (GSPO) | sequence_token
    term      = objective(w, A, logp)                   # algo/surrogates.py: ppo_clip | cispo | sapo | vespo
    term     *= off_policy_mask * entropy_mask          # algo/correction.py (when set)
    term     *= is_weight(pi_old, mu)                   # algo/correction.py: the rollout correction (not vespo:
                                                        #   its weight already holds it)
    term     += kl_coef * k3(logp, ref) [* w]           # [* w]: kl_bias_correction (TRL use_bias_correction_kl)
    loss      = aggregate(term * mask) - entropy_coef * mean_effective(H)
    loss     += aggregate(JSD_beta(support) * mask)     # GKD (algo/gkd.py): over the teacher's top-k, no IS weight

``aggregate`` (algo/loss.py) takes the whole optimizer batch's denominators, so micro-batches add up to the batch's
loss; the entropy bonus is the mean entropy over the tokens the policy term acts on (``mask * entropy_mask``),
its denominator ``entropy_tokens`` the whole batch's too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rollyard.algo import correction, distill, gkd, ratios, surrogates
from rollyard.algo.loss import aggregate, kl_k3


@dataclass(frozen=True)
class LossSpec:
    """What the loss computes; built once from ``algo.*`` (:func:`spec_of`)."""

    objective: str = "ppo_clip"
    agg: str = "token-mean"
    level: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)  # k_pos, lambda_pos, k_neg, lambda_neg
    is_mode: str = "token_truncate"
    is_cap: float | None = 2.0
    is_floor: float | None = None
    off_policy_threshold: float | None = None
    kl_coef: float = 0.0
    kl_bias_correction: bool = False
    entropy_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    max_len: int | None = None  # the response cap, for seq-mean-token-sum-norm (Dr. GRPO)
    reward_weight: float = 1.0  # the sequence advantage's weight in A (0: algo.objective=distill)
    distill_coef: float = 0.0  # the teacher's per-token reverse-KL advantage's weight (0: no teacher; algo/distill.py)
    gkd_beta: float | None = None  # algo.objective=gkd: the generalized JSD's beta over the teacher's top-k (None: off)

    def needs_every_sample(self) -> bool:
        """Whether a zero-advantage sample moves the weights (then it is trained): a KL, entropy or teacher term
        (under distillation a zero reward advantage is not zero signal)."""
        return self.kl_coef > 0 or self.entropy_coef != 0 or self.distill_coef > 0 or self.gkd_beta is not None

    def needs_entropy_grad(self) -> bool:
        return self.entropy_coef != 0


@dataclass
class Batch:
    """One micro-batch's per-token tensors (``[T]``); ``logp`` and ``entropy`` carry the gradient. ``adv`` is per
    token (a sequence's advantage broadcast over its tokens, or any per-token advantage); with ``teacher_logp`` and
    ``LossSpec.distill_coef > 0`` the loss takes :func:`rollyard.algo.distill.token_advantage` of it."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    rollout_logp: torch.Tensor
    adv: torch.Tensor
    seq_index: torch.Tensor
    mask: torch.Tensor
    ref_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    entropy_mask: torch.Tensor | None = None  # 1: among the top-entropy tokens of the batch
    teacher_logp: torch.Tensor | None = None  # the teacher's log-probs of the sampled tokens (distillation)
    support_logp: torch.Tensor | None = None  # [T, k] the policy's log-probs at the teacher's top-k ids (GKD; grad)
    teacher_support_logp: torch.Tensor | None = None  # [T, k] the teacher's log-probs of its top-k ids (GKD)


def policy_loss(spec: LossSpec, b: Batch, num_tokens: int, num_seqs: int, entropy_tokens: int,
                entropy_coef: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, stats)`` of one micro-batch: the loss to ``backward()`` (its share of the batch's), detached stats:
    ``pg_loss``, ``kl_sum`` (k3 summed over loss tokens, when a reference is given), ``clipped`` (tokens whose
    clip is active), ``is_weight [T]`` and ``w [T]`` (the ratio), ``distill_kl_sum`` (``log pi_old - log pi_teacher``
    summed over loss tokens, with a teacher), ``gkd_jsd_sum`` (GKD). ``entropy_coef`` overrides the spec's (the adaptive controller's
    current value)."""
    stats = {}
    if spec.distill_coef > 0 and b.teacher_logp is not None:  # the per-token advantage (algo/distill.py)
        stats["distill_kl_sum"] = (distill.reverse_kl(b.old_logp, b.teacher_logp) * b.mask).sum()
        b = replace(b, adv=distill.token_advantage(b.adv, b.old_logp, b.teacher_logp, spec.reward_weight,
                                                   spec.distill_coef))
    elif spec.reward_weight != 1.0:
        b = replace(b, adv=spec.reward_weight * b.adv)
    log_ratio = b.logp - b.old_logp
    w = ratios.BY_LEVEL[spec.level](log_ratio, b.seq_index, b.mask).exp()
    is_w = correction.BY_MODE[spec.is_mode](b.old_logp, b.rollout_logp, b.seq_index, b.mask, spec.is_floor,
                                            spec.is_cap)
    term = _objective(spec, w, b, log_ratio, is_w)
    if spec.off_policy_threshold is not None:
        term = term * correction.off_policy_mask(b.adv, b.logp, b.rollout_logp, b.seq_index, b.mask,
                                                 spec.off_policy_threshold)
    if b.entropy_mask is not None:
        term = term * b.entropy_mask
    if spec.objective != "vespo":
        term = term * is_w
    kw = dict(num_tokens=num_tokens, num_seqs=num_seqs, mask=b.mask, max_len=spec.max_len)
    pg = aggregate(term * b.mask, b.seq_index, spec.agg, **kw)
    loss = pg
    if b.ref_logp is not None:
        k3 = kl_k3(b.logp, b.ref_logp)
        if spec.kl_coef > 0:
            kl_term = k3 * w if spec.kl_bias_correction else k3
            loss = loss + spec.kl_coef * aggregate(kl_term * b.mask, b.seq_index, spec.agg, **kw)
        stats["kl_sum"] = (k3.detach() * b.mask).sum()
    if spec.gkd_beta is not None:  # the per-position divergence over the teacher's top-k: a loss term, not an advantage
        jsd = gkd.generalized_jsd(b.support_logp, b.teacher_support_logp, spec.gkd_beta)
        loss = loss + aggregate(jsd * b.mask, b.seq_index, spec.agg, **kw)
        stats["gkd_jsd_sum"] = (jsd.detach() * b.mask).sum()
    coef = spec.entropy_coef if entropy_coef is None else entropy_coef
    if coef and b.entropy is not None:
        eff = b.mask if b.entropy_mask is None else b.mask * b.entropy_mask
        loss = loss - coef * (b.entropy * eff).sum() / max(entropy_tokens, 1)
    with torch.no_grad():
        stats.update(pg_loss=pg.detach(), clipped=_clipped(spec, w.detach(), b), is_weight=is_w, w=w.detach())
    return loss, stats


def _objective(spec: LossSpec, w: torch.Tensor, b: Batch, log_ratio: torch.Tensor,
               is_w: torch.Tensor) -> torch.Tensor:
    if spec.objective == "ppo_clip":
        return surrogates.ppo_clip(w, b.adv, spec.clip_low, spec.clip_high, spec.delta)
    if spec.objective == "cispo":
        return surrogates.cispo(w, b.adv, b.logp, spec.clip_high)
    if spec.objective == "sapo":
        return surrogates.sapo(w, b.adv, spec.sapo_temperature_pos, spec.sapo_temperature_neg)
    if spec.objective == "vespo":
        correcting = None if spec.is_mode == "none" else is_w
        phi = surrogates.vespo_weights(b.adv, log_ratio.detach(), b.seq_index, b.mask, correcting, *spec.vespo)
        return surrogates.vespo(phi, b.adv, b.logp)
    raise ValueError(f"unknown policy objective {spec.objective!r}: expected one of {surrogates.OBJECTIVES}")


def _clipped(spec: LossSpec, w: torch.Tensor, b: Batch) -> torch.Tensor:
    """Loss tokens whose clip is active (their surrogate carries no gradient, or, for cispo, a capped one)."""
    if spec.objective == "cispo":
        active = (w > spec.clip_high) & (b.adv > 0)
    elif spec.objective == "ppo_clip":
        active = ((w > 1.0 + spec.clip_high) & (b.adv > 0)) | ((w < 1.0 - spec.clip_low) & (b.adv < 0))
    else:
        return w.new_zeros(())
    return (active & (b.mask > 0)).sum()


def entropy_mask(entropies: list[torch.Tensor], masks: list[torch.Tensor], top_quantile: float) -> list[torch.Tensor]:
    """Per sample ``[len]`` 1/0: its loss tokens among the ``top_quantile`` highest-entropy loss tokens of the whole
    batch (``entropies``, ``masks``: one ``[len]`` tensor per sample, from one no-grad pass of the current weights)."""
    flat = torch.cat([e[m > 0] for e, m in zip(entropies, masks)]) if entropies else torch.zeros(0)
    thr = correction.high_entropy_threshold(flat, top_quantile)
    return [((e * m) >= thr).float() * (m > 0).float() for e, m in zip(entropies, masks)]
