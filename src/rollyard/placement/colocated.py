"""Colocated placement: rollout and trainer share one process and one copy of the weights.

Each step: generate, score, reference, advantages, train, sync. Sync is in-process (the engine
reads the module the trainer just stepped): zero bytes on the wire, version + 1.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollyard import signals
from rollyard.algo.advantages import grpo_advantages
from rollyard.config import RunConfig
from rollyard.placement.run import RunContext, finish, start
from rollyard.reward.dispatcher import UNSCORED, split_unscored
from rollyard.rollout.scheduler import to_requests
from rollyard.telemetry.report import StepProgress
from rollyard.types import Sample, WeightUpdate


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False) -> dict:
    ctx: RunContext = start(cfg, run_dir, resume)
    tel, engine, trainer = ctx.telemetry, ctx.engine, ctx.trainer
    r = cfg.rollout
    with StepProgress(cfg.steps, ctx.state.step, cfg.progress) as progress:
        for step in range(ctx.state.step, cfg.steps):
            requests, dead = to_requests(ctx.stream.take(r.prompts_per_step), ctx.tokenizer, r.samples_per_prompt,
                                         r.max_new_tokens, ctx.context, suffix=f"@{step}")
            ctx.dead_letter(dead, step)
            tel.traffic(step, "prompts", 4 * sum(len(q.prompt_ids) for q in requests))

            with tel.span("rollout", step, version=ctx.state.version, requests=[q.id for q in requests]):
                samples, rejected = engine.generate(requests)
            ctx.dead_letter([{"source": q.id, "reason": why} for q, why in rejected], step)
            tel.traffic(step, "samples", sum(s.payload_bytes() for s in samples))

            with tel.span("reward", step):
                samples, unscored = split_unscored(ctx.rewards.score(samples))
                trained = ctx.settle_rewards(step, samples)  # failed verifier calls: counted, left out by default
            ctx.dead_letter([{"source": s.id, "reason": UNSCORED} for s in unscored], step)
            tel.traffic(step, "rewards", 4 * len(samples))

            if cfg.algo.kl_coef > 0:
                with tel.span("reference", step):
                    ref = trainer.logprobs(trained, model=ctx.reference)
                    for s, lp in zip(trained, ref):
                        s.ref_logprobs = lp.tolist()
                tel.traffic(step, "ref_logprobs", 4 * sum(len(s.completion_ids) for s in trained))

            with tel.span("algorithm", step):
                assign_advantages(trained, cfg.algo.normalize_std)

            with tel.span("train", step):
                train_metrics = trainer.step(trained)

            with tel.span("sync", step, mode="inprocess"):
                ctx.state.version += 0 if train_metrics.get("skipped") else 1  # a skipped update is no new version
                engine.load_weights(WeightUpdate(version=ctx.state.version, mode="inprocess"))
            tel.traffic(step, "weights", 0)

            ctx.state.step = step + 1
            if cfg.eval_every and ctx.state.step % cfg.eval_every == 0 and ctx.state.step < cfg.steps:
                ctx.eval_during(step)  # in this step's row, where the reward-hacking alarm compares it
            row = ctx.end_step(step, requests, samples, train_metrics)
            progress.update(row)
            if ctx.state.step % cfg.checkpoint_every == 0 or ctx.state.step == cfg.steps or signals.stop_requested():
                ctx.save_checkpoint()
            signals.raise_if_stopping(ctx.state.step)
    return finish(ctx)


def assign_advantages(samples: list[Sample], normalize_std: bool) -> None:
    """GRPO: each sample's advantage is its reward against its group (same request id)."""
    if not samples:
        return
    groups: dict[str, int] = {}
    index = torch.tensor([groups.setdefault(s.request_id, len(groups)) for s in samples])
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    for s, a in zip(samples, grpo_advantages(rewards, index, normalize_std=normalize_std).tolist()):
        s.advantage = a
