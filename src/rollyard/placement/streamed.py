"""One streamed step (rollout.scheduler = tail): round, streaming rewards and trainer, one optimizer step.

A placement's loop calls ``make_scheduler`` once and ``streamed_step`` per step in place of its
generate -> score -> reference -> advantages -> train sequence. Inside the round each complete group
is scored (already, by the streaming reward pool), given reference logprobs and advantages, and
its gradient accumulated while the engine keeps decoding; the optimizer step runs when the round
ends. The scheduler's queue is written into ``state.extra["tail"]`` after every step, so every
checkpoint carries it.
"""

from __future__ import annotations

import time

import torch

from rollyard.algo.advantages import grpo_advantages
from rollyard.reward.dispatcher import UNSCORED, split_unscored
from rollyard.rollout.tail import TailScheduler
from rollyard.trainer.streaming import StreamingStep
from rollyard.types import Request, Sample


def make_scheduler(run, roles) -> TailScheduler:
    """The tail scheduler over the run's prompt stream, its queue restored from the checkpoint if any."""
    cfg, r = run.cfg, run.cfg.rollout
    sched = TailScheduler(roles.feed.stream, roles.tokenizer, prompts=r.prompts_per_step, n=r.samples_per_prompt,
                          max_new_tokens=r.max_new_tokens, context=roles.context, overprovision=cfg.tail.overprovision,
                          extra_samples=cfg.tail.extra_samples, long_every=cfg.tail.long_every)
    sched.restore(run.state.extra.get("tail"))
    return sched


def group_advantages(group: list[Sample], normalize_std: bool) -> None:
    """GRPO advantages of one group (all samples share a request id)."""
    rewards = torch.tensor([s.reward for s in group], dtype=torch.float32)
    for s, a in zip(group, grpo_advantages(rewards, torch.zeros(len(group), dtype=torch.long),
                                           normalize_std=normalize_std).tolist()):
        s.advantage = a


def streamed_step(ctx, roles, engine, step: int, scheduler
                  ) -> tuple[list[Request], list[Sample], dict[str, float], dict[str, float]]:
    """Run one round and its optimizer step; returns ``(requests, samples, train_metrics, round_metrics)``
    (``samples``: every scored sample, as ``score()`` returns them, failed verifier calls included).
    ``ctx``: the run record; ``roles``: the driver's role handles; ``engine``: the local rollout engine."""
    cfg, tel, trainer = ctx.cfg, ctx.telemetry, roles.trainer
    stream = StreamingStep(trainer)
    in_round = {"train_s": 0.0}
    trained: list[Sample] = []
    scored: list[Sample] = []  # every scored sample, failed verifier calls included: the step's metrics count them

    def on_group(group: list[Sample]) -> None:
        t0 = time.perf_counter()
        group, unscored = split_unscored(group)  # a sample no hook scored is left out of the loss
        ctx.dead_letter([{"source": s.id, "reason": UNSCORED} for s in unscored], step)
        scored.extend(group)
        group = ctx.settle_rewards(step, group)  # failed verifier calls (per group; the step row shows the last)
        trained.extend(group)
        if not group:
            return
        if cfg.algo.kl_coef > 0:
            for s, lp in zip(group, trainer.logprobs(group, model=roles.reference)):
                s.ref_logprobs = lp.tolist()
        group_advantages(group, cfg.algo.normalize_std)
        stream.add(group)
        in_round["train_s"] += time.perf_counter() - t0

    with tel.span("rollout", step, version=engine.version):
        rnd = scheduler.next_round(engine, roles.rewards, step, on_group)
    ctx.dead_letter(rnd.dead, step)
    tel.traffic(step, "prompts", 4 * sum(len(q.prompt_ids) for q in rnd.requests))
    tel.traffic(step, "samples", sum(s.payload_bytes() for s in rnd.samples))
    tel.traffic(step, "rewards", 4 * len(scored))
    with tel.span("train", step):
        train_metrics = stream.finish()
    ctx.state.extra["tail"] = scheduler.state()
    by_kind = scheduler.trained
    round_metrics = {
        "tail/long_round": float(rnd.kind == "long"), "tail/deferred": float(len(rnd.deferred)),
        "tail/queue": float(len(scheduler.queue)), "tail/bubble": rnd.bubble,
        "tail/wasted_tokens": float(rnd.wasted_tokens), "tail/decode_steps": float(rnd.decode_steps),
        "tail/train_in_round_s": in_round["train_s"],
        "tail/long_share": by_kind["long"] / max(by_kind["short"] + by_kind["long"], 1),
    }
    return rnd.requests, scored, train_metrics, round_metrics
