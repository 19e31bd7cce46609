"""Placement rules the typed config cannot see alone (one line each, with the fix), and the error a
Ray placement stops with when its rollout workers keep dying."""

from __future__ import annotations

import time
from collections import deque

from rollyard import staleness
from rollyard.config import ConfigError, RunConfig
from rollyard.placement import reference, teacher

PLACEMENTS = ("colocated", "disaggregated", "async")


class RolloutCrashLoop(RuntimeError):
    """Rollout workers died more often than the restart limit allows within its window; the run stops."""


class RestartWindow:
    """Restarts of rollout workers within a sliding window; more than ``limit`` raise ``RolloutCrashLoop``
    (workers that keep dying are a bug to surface, not to hide)."""

    def __init__(self, limit: int = 3, window_s: float = 600.0):
        self.limit, self.window_s, self.times = limit, window_s, deque()

    def record(self, name: str, err: Exception) -> None:
        now = time.time()
        self.times.append(now)
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) > self.limit:
            raise RolloutCrashLoop(f"rollout workers died {len(self.times)} times within {self.window_s:.0f} s "
                                   f"(limit {self.limit}), last {name} ({type(err).__name__}); stopping rather than "
                                   f"restarting in a loop; see the worker's log above, the latest checkpoint is intact "
                                   f"(--resume)") from err


def check(cfg: RunConfig, ray_cpus: float | None = None) -> None:
    """Raise ``ConfigError`` (one line) for a placement setting that cannot work.

    ``ray_cpus``: the CPUs Ray can give (None: not checked)."""
    if cfg.placement not in PLACEMENTS:
        raise ConfigError(f"placement={cfg.placement!r} is not a placement: expected one of "
                          f"{', '.join(PLACEMENTS)}; set placement=colocated (the default)")
    reference.check(cfg)  # reference.placement: where the reference model can run
    teacher.check(cfg)  # teacher.placement: where the distillation teacher can run
    if cfg.max_staleness < 0:
        raise ConfigError(f"max_staleness must be >= 0 (versions a trained sample may lag), got "
                          f"{cfg.max_staleness}; set max_staleness=0 (on-policy) or more")
    if cfg.rollout.scheduler == "tail" and cfg.trainer.dp > 1:
        raise ConfigError(f"rollout.scheduler=tail runs with one trainer process (colocated streams each group's gradient "
                          f"into it; the Ray placements' tail rounds are not tested with trainer ranks), but "
                          f"trainer.dp={cfg.trainer.dp}; set trainer.dp=1 or rollout.scheduler=plain")
    recipe(cfg)
    if cfg.placement == "colocated":
        return
    if cfg.sync.transport == "inprocess":
        raise ConfigError(f"placement={cfg.placement} runs rollout in other processes, so sync.transport=inprocess "
                          f"cannot reach them; set sync.transport=ray (or auto)")
    if cfg.sync.mode == "inprocess":
        raise ConfigError(f"placement={cfg.placement} gives each rollout worker its own model copy, so "
                          f"sync.mode=inprocess (a shared module) cannot reach it; set sync.mode=full, delta or lora "
                          f"(or auto)")
    from rollyard import roles
    roles.settings(cfg)  # the device and the mode x transport rules, one line each, before Ray starts
    cpus = ray_cpus
    if cpus is not None and cfg.rollout.workers > cpus:
        raise ConfigError(f"rollout.workers={cfg.rollout.workers} needs one CPU each, but Ray can give {cpus:g}; "
                          f"set rollout.workers={max(1, int(cpus))} or fewer")
    k = updates_per_step(cfg)
    lag = staleness.published_lag(cfg.sync.every, k)  # the rollout's weights lag the trainer's by this at a step's start
    if cfg.placement == "async" and lag > cfg.max_staleness:
        per = f" (trainer.epochs x trainer.mini_batches = {k} versions a step)" if k > 1 else ""
        raise ConfigError(f"sync.every={cfg.sync.every} leaves samples up to {lag} versions old{per}, over "
                          f"max_staleness={cfg.max_staleness}: no sample could be trained; set "
                          f"max_staleness={lag} or sync.every={k}")


def updates_per_step(cfg: RunConfig) -> int:
    """Optimizer steps (weight versions) one step makes: ``trainer.epochs x trainer.mini_batches``."""
    return cfg.trainer.epochs * cfg.trainer.mini_batches


def recipe(cfg: RunConfig) -> None:
    """The loss and optimisation settings a placement or scheduler cannot honour: one line each, never ignored."""
    a, t = cfg.algo, cfg.trainer
    streamed = cfg.rollout.scheduler == "tail" and cfg.placement == "colocated"
    if streamed:
        asked = [name for name, on in (
            ("trainer.epochs", t.epochs > 1), ("trainer.mini_batches", t.mini_batches > 1),
            ("algo.top_entropy_quantile", a.top_entropy_quantile < 1.0), ("algo.entropy_coef", a.entropy_coef != 0),
            ("algo.adaptive_entropy", a.adaptive_entropy), ("algo.dynamic_sampling", a.dynamic_sampling)) if on]
        if asked:
            raise ConfigError(f"rollout.scheduler=tail with placement=colocated trains each group as it completes, "
                              f"into one optimizer step over the whole round, but {asked[0]} needs the whole batch "
                              f"before the first update; set rollout.scheduler=plain, or placement=disaggregated, or "
                              f"{asked[0]} back to its default")
    if cfg.rollout.scheduler == "tail" and a.dynamic_sampling:
        raise ConfigError("algo.dynamic_sampling draws extra rounds inside a step, but rollout.scheduler=tail plans "
                          "each step's rounds itself (short and long rounds); set rollout.scheduler=plain or "
                          "algo.dynamic_sampling=false")
    if t.dp > 1 and a.top_entropy_quantile < 1.0:
        raise ConfigError(f"algo.top_entropy_quantile={a.top_entropy_quantile} takes its threshold over every loss "
                          f"token of the batch, which trainer.dp={t.dp} splits over ranks; set trainer.dp=1 or "
                          f"algo.top_entropy_quantile=1.0")
    if a.multi_objective == "normalize_then_sum" and len(cfg.reward.hooks) < 2:
        raise ConfigError(f"algo.multi_objective=normalize_then_sum normalises each reward function apart, but "
                          f"{max(len(cfg.reward.hooks), 1)} reward function is set (reward.hooks); give several in "
                          f"reward.hooks or leave algo.multi_objective=sum_then_normalize")
    inert(cfg)
    if a.overlong_buffer >= cfg.rollout.max_new_tokens:
        raise ConfigError(f"algo.overlong_buffer={a.overlong_buffer} must be below rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens} (the penalty starts that many tokens before the cap); set "
                          f"algo.overlong_buffer={cfg.rollout.max_new_tokens // 4}")


def inert(cfg: RunConfig) -> None:
    """A setting changed from its default where it has no effect (another loss, no correction, no adaptive entropy,
    ...) is refused in one line, never silently ignored."""
    a, t = cfg.algo, cfg.trainer
    rules = [
        (("sapo_temperature_pos", "sapo_temperature_neg"), a.policy_loss == "sapo", "algo.policy_loss=sapo"),
        (("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), a.policy_loss == "vespo",
         "algo.policy_loss=vespo"),
        (("delta",), a.policy_loss == "ppo_clip", "algo.policy_loss=ppo_clip (the others clip otherwise)"),
        (("tis_cap", "tis_min"), a.tis_mode != "none", "algo.tis_mode=token_truncate (or another correction than none)"),
        (("entropy_target", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta"), a.adaptive_entropy,
         "algo.adaptive_entropy=true"),
        (("dynamic_sampling_rounds",), a.dynamic_sampling, "algo.dynamic_sampling=true"),
        (("overlong_penalty",), a.overlong_buffer > 0, "algo.overlong_buffer > 0"),
        (("std_scope",), a.normalize_std, "algo.normalize_std=true"),
    ]
    for names, applies, needs in rules:
        for name in names:
            value, default = getattr(a, name), type(a).model_fields[name].default
            if not applies and value != default:
                raise ConfigError(f"algo.{name}={value} has no effect without {needs}; set {needs.split(' (')[0]} "
                                  f"or drop algo.{name} (default {default})")
    if t.lm_head_fp32 and t.precision == "fp32":
        raise ConfigError("trainer.lm_head_fp32=true computes the head in fp32 under bf16, but trainer.precision=fp32 "
                          "runs every matmul in fp32 already; set trainer.precision=bf16 (or auto) or drop "
                          "trainer.lm_head_fp32")
    if cfg.rollout.backend == "vllm" and cfg.rollout.precision != "auto":
        fix = ("drop rollout.precision (auto): int8 weights are the native engine's"
               if cfg.rollout.precision in ("int8", "w8a8")
               else f"set rollout.dtype={cfg.rollout.precision} for vLLM, or drop rollout.precision (auto)")
        raise ConfigError(f"rollout.precision={cfg.rollout.precision} sets the native engine's compute precision, but "
                          f"rollout.backend=vllm computes in its weights' dtype; {fix}")
    if cfg.reference.mixup_alpha != type(cfg.reference).model_fields["mixup_alpha"].default and not \
            cfg.reference.sync_every:
        raise ConfigError(f"reference.mixup_alpha={cfg.reference.mixup_alpha} has no effect without "
                          f"reference.sync_every > 0 (the reference stays the initial policy); set reference.sync_every "
                          f"(e.g. 64) or drop reference.mixup_alpha")
