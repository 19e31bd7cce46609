"""Colocated placement: rollout and trainer share one process. No Ray, nothing to start.

Each step: generate, score, train, and every ``sync.every`` steps a sync. By default the engine
reads the module the trainer just stepped (mode ``inprocess``: zero bytes on the wire); with
another mode (``full`` for a bf16 rollout copy, ``lora`` for merged adapter weights) the engine
holds its own copy and the transport's reported bytes go to the ledger. Samples carry the version
the engine holds; it lags the trainer's by up to ``sync.every - 1``.
"""

from __future__ import annotations

import time
from pathlib import Path

from rollyard import roles
from rollyard.config import RunConfig
from rollyard.placement.run import finish, start
from rollyard.placement.score import score
from rollyard.placement.streamed import make_scheduler, streamed_step
from rollyard.sync.check import compare_weights
from rollyard.sync.factory import make_publisher, make_transport, resolve
from rollyard.sync.local import push_pull, rollout_copy
from rollyard.telemetry.report import StepProgress
from rollyard.trainer.dp import after_step


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False) -> dict:
    plan = resolve(cfg, roles.device_of(cfg))  # a sync setting that cannot work fails before any start-up work
    run, r, extra_rng = start(cfg, run_dir, resume)
    tel, trainer, ledger = run.telemetry, r.trainer, r.feed.ledger
    publisher, transport = make_publisher(plan.mode, plan.dtype), make_transport(plan.transport, cfg.sync.bucket_mb)
    # mode inprocess: the engine shares the trainer's module; otherwise its own copy (rollout dtype, LoRA merged)
    model = r.model if plan.mode == "inprocess" else rollout_copy(r.model, plan.dtype)
    engine, syncs = roles.engine(cfg, model, r.tokenizer, version=run.state.version), 0
    if "engine" in extra_rng:
        engine.generator.set_state(extra_rng["engine"])
    # Start-up: one full sync, then the equality check (its bytes are the first step's ledger entry).
    tel.traffic(run.state.step, "weights", push_pull(publisher, transport, r.model, engine, run.state.version, full=True))
    compare_weights(publisher.expected(r.model), engine.model, run.state.version)
    sched = make_scheduler(run, r) if cfg.rollout.scheduler == "tail" else None
    run.begin()
    with StepProgress(cfg.steps, run.state.step, cfg.progress, cfg.log.progress_every) as progress:
        for step in range(run.state.step, cfg.steps):
            round_metrics: dict = {}
            trained_at = run.state.version
            if sched is not None:  # rollout.scheduler=tail: streamed round + streaming trainer (outside the ledger)
                requests, samples, train_metrics, round_metrics = streamed_step(run, r, engine, step, sched)
            else:
                requests, dead = r.feed.take(cfg.rollout.prompts_per_step, step)
                run.dead_letter(dead, step)
                ledger.hand_out([q.id for q in requests], "local")
                tel.traffic(step, "prompts", 4 * sum(len(q.prompt_ids) for q in requests))

                cpu = time.process_time()  # the engine's CPU time (its intra-op threads too): bench/placements.py
                with tel.span("rollout", step, version=engine.version, requests=[q.id for q in requests]):
                    samples, rejected = engine.generate(requests)
                round_metrics["rollout/engine_cpu_s"] = time.process_time() - cpu
                run.dead_letter([{"source": q.id, "reason": why} for q, why in rejected], step)
                ledger.dead([q.id for q, _ in rejected])
                tel.traffic(step, "samples", sum(s.payload_bytes() for s in samples))

                samples, trained = score(run, r, step, samples)
                if hasattr(engine, "sleep"):  # rollout.backend=vllm: its GPU memory is the trainer's for the step
                    engine.sleep()
                with tel.span("train", step):
                    train_metrics = trainer.step(trained)
                if hasattr(engine, "wake_up"):
                    engine.wake_up()
                ledger.trained([q.id for q in requests if ledger.state[q.id] == "in_flight"])
            after_step(tel, step, trainer)  # dp ranks: the gradients edge; fsdp: the gather (span + edge)

            run.state.version += 0 if train_metrics.get("skipped") else 1  # a skipped update is no new version
            nbytes, checked = 0, 0
            if (step + 1) % cfg.sync.every == 0 and engine.version != run.state.version:
                with tel.span("sync", step, mode=plan.mode, transport=plan.transport):
                    nbytes = push_pull(publisher, transport, r.model, engine, run.state.version)
                    syncs += 1
                    if cfg.sync.check_every and syncs % cfg.sync.check_every == 0:
                        compare_weights(publisher.expected(r.model), engine.model, engine.version)
                        checked = 1
                        run.log(f"sync check v{engine.version}: the rollout copy equals the trainer")
            tel.traffic(step, "weights", nbytes)
            round_metrics["sync/checked"] = checked

            run.close_step(step, r, progress, requests, samples, train_metrics, trained_at, extra=round_metrics,
                           extra_rng=lambda: {"engine": engine.generator.get_state()})
    return finish(run, r)
