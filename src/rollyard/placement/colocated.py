"""Colocated placement: rollout and trainer share one process and one copy of the weights.

Each step: generate, score, train, sync. Sync is in-process (the engine reads the module the
trainer just stepped): zero bytes on the wire, version + 1. No Ray, nothing to start.
"""

from __future__ import annotations

from pathlib import Path

from rollyard import roles as build
from rollyard.config import RunConfig
from rollyard.placement.run import evaluate, finish, start
from rollyard.placement.score import score
from rollyard.telemetry.report import StepProgress, fmt_accuracy
from rollyard.types import WeightUpdate


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False) -> dict:
    run, r, extra_rng = start(cfg, run_dir, resume)
    tel, trainer, ledger = run.telemetry, r.trainer, r.feed.ledger
    engine = build.engine(cfg, r.model, r.tokenizer, version=run.state.version)
    if "engine" in extra_rng:
        engine.generator.set_state(extra_rng["engine"])
    run.begin()
    with StepProgress(cfg.steps, run.state.step, cfg.progress) as progress:
        for step in range(run.state.step, cfg.steps):
            requests, dead = r.feed.take(cfg.rollout.prompts_per_step, step)
            run.dead_letter(dead, step)
            ledger.hand_out([q.id for q in requests], "local")
            tel.traffic(step, "prompts", 4 * sum(len(q.prompt_ids) for q in requests))

            with tel.span("rollout", step, version=run.state.version, requests=[q.id for q in requests]):
                samples, rejected = engine.generate(requests)
            run.dead_letter([{"source": q.id, "reason": why} for q, why in rejected], step)
            ledger.dead([q.id for q, _ in rejected])
            tel.traffic(step, "samples", sum(s.payload_bytes() for s in samples))

            samples = score(run, r, step, samples)
            with tel.span("train", step):
                train_metrics = trainer.step(samples)
            ledger.trained([q.id for q in requests if ledger.state[q.id] == "in_flight"])

            with tel.span("sync", step, mode="inprocess"):
                run.state.version += 1
                engine.load_weights(WeightUpdate(version=run.state.version, mode="inprocess"))
            tel.traffic(step, "weights", 0)

            run.state.step = step + 1
            progress.update(run.end_step(step, r, requests, samples, train_metrics, trained_at=run.state.version - 1))
            if run.state.step % cfg.checkpoint_every == 0 or run.state.step == cfg.steps:
                run.save_checkpoint(r, {"engine": engine.generator.get_state()})
            if cfg.eval_every and run.state.step % cfg.eval_every == 0 and run.state.step < cfg.steps:
                run.log(f"step {run.state.step}: held-out greedy accuracy {fmt_accuracy(evaluate(run, r))}")
    return finish(run, r)
