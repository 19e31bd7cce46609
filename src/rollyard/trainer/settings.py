"""The Trainer's keyword arguments from the run config: one place, so every rank and placement builds the same
trainer, loss and optimizer."""

from __future__ import annotations

from rollyard import schedule
from rollyard.algo import distill
from rollyard.algo.entropy_control import EntropyControl
from rollyard.algo.policy_loss import LossSpec
from rollyard.config import RunConfig, schedule_length


def trainer_kwargs(cfg: RunConfig) -> dict:
    """The Trainer's keyword arguments from the config (one place, so every rank builds the same one)."""
    t, a = cfg.trainer, cfg.algo
    return {"lr": t.lr, "weight_decay": t.weight_decay, "max_grad_norm": t.max_grad_norm,
            "micro_batch_tokens": t.micro_batch_tokens, "temperature": cfg.rollout.temperature or 1.0,
            # greedy rollouts record full logprobs (top-k / top-p do not change an argmax): the trainer's too
            "top_p": cfg.rollout.top_p if cfg.rollout.temperature else 1.0,
            "top_k": cfg.rollout.top_k if cfg.rollout.temperature else 0,
            "logprob_chunk": t.logprob_chunk, "loss": loss_spec(cfg), "mask_truncated": a.mask_truncated,
            "disable_dropout": t.disable_dropout, "lm_head_fp32": t.lm_head_fp32,
            "entropy": EntropyControl(start=a.entropy_coef, adaptive=a.adaptive_entropy, target=a.entropy_target,
                                      delta=a.entropy_coef_delta, low=a.entropy_coef_min, high=a.entropy_coef_max),
            "max_skipped_steps": t.max_skipped_steps, "precision": t.precision,
            "activation_checkpointing": t.activation_checkpointing, "optimizer_state": t.optimizer_state,
            "skip_zero_advantage": t.useful_work, "share_prompts": t.useful_work, **optimizer_settings(cfg)}


def optimizer_settings(cfg: RunConfig) -> dict:
    """AdamW's betas and epsilon, and the learning-rate schedule over the run's optimizer steps (or its steps)."""
    t = cfg.trainer
    total, every = schedule_length(cfg)
    return {"betas": (t.adam_beta1, t.adam_beta2), "eps": t.adam_eps, "lr_schedule": t.lr_schedule,
            "decay_norms_and_biases": t.decay_norms_and_biases,
            "schedule_steps": total, "schedule_every": every, "lr_schedule_kwargs": dict(t.lr_schedule_kwargs),
            "warmup_steps": schedule.warmup_steps(total, t.warmup_steps, t.warmup_ratio, t.warmup_rounding)}


def loss_spec(cfg: RunConfig) -> LossSpec:
    """What the loss computes, from ``algo.*`` (one place: every rank and every placement builds the same)."""
    a = cfg.algo
    return LossSpec(objective=a.policy_loss, agg="seq-mean-token-mean" if a.loss_agg == "seq-mean" else a.loss_agg,
                    level=a.ratio_level, clip_low=a.clip_low, clip_high=a.clip_high, delta=a.delta,
                    sapo_temperature_pos=a.sapo_temperature_pos, sapo_temperature_neg=a.sapo_temperature_neg,
                    vespo=(a.vespo_k_pos, a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg),
                    is_mode=a.tis_mode, is_cap=a.tis_cap, is_floor=a.tis_min,
                    off_policy_threshold=a.off_policy_mask_threshold, kl_coef=a.kl_coef,
                    kl_bias_correction=a.kl_bias_correction, entropy_coef=a.entropy_coef,
                    top_entropy_quantile=a.top_entropy_quantile, max_len=cfg.rollout.max_new_tokens,
                    reward_weight=distill.reward_weight(a.objective),
                    distill_coef=a.distill_coef if a.objective in ("distill", "rl+distill") else 0.0,
                    gkd_beta=a.gkd_beta if a.objective == "gkd" else None)
