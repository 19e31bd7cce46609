"""Colocated placement: rollout and trainer share one process. No Ray, nothing to start.

The rollout side is one engine in this process (``LocalRollout``); the step is ``step.py``'s. By
default the engine reads the module the trainer just stepped (mode ``inprocess``: zero bytes on the
wire); with another mode (``full`` for a bf16 rollout copy, ``lora`` for merged adapter weights) the
engine holds its own copy, loaded by the session's transport, and its reported bytes go to the
ledger. Samples carry the version the engine holds; it lags the trainer's by up to ``sync.every - 1``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from rollyard import roles
from rollyard.config import RunConfig
from rollyard.model import memory as cpu_memory
from rollyard.placement import step as grpo
from rollyard.placement.run import SIDE_WORK, Roles, RunRecord, start
from rollyard.placement.streamed import streamed_step
from rollyard.rollout.rounds import STATE_KEY, make_book
from rollyard.sync import canary
from rollyard.sync.check import compare_weights
from rollyard.sync.factory import SyncPlan
from rollyard.sync.session import LocalReceiver, SyncSession, rollout_copy


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False) -> dict:
    run, r, extra_rng = start(cfg, run_dir, resume)  # resolves the settings first (a bad sync setting fails there)
    return grpo.train(run, r, LocalRollout(run, r, run.settings.plan, extra_rng))


class LocalRollout:
    """The rollout side in the trainer's process: one engine, loaded through a ``LocalReceiver``."""

    def __init__(self, run: RunRecord, r: Roles, plan: SyncPlan, extra_rng: dict):
        cfg = run.cfg
        self.run, self.r = run, r
        s = cfg.sync
        self.session = SyncSession(plan, r.model, s.every, s.check_every, s.bucket_mb)
        # mode inprocess: the engine shares the trainer's module; otherwise its own copy (rollout dtype, LoRA merged)
        model = r.model if plan.mode == "inprocess" else rollout_copy(r.model, plan.dtype)
        self.engine = roles.engine(cfg, model, r.tokenizer, version=run.state.version)  # as every side builds one
        self.session.shared = self.engine.model is r.model  # vLLM in mode inprocess still holds a copy: checked
        if "engine" in extra_rng:
            self.engine.generator.set_state(extra_rng["engine"])
        self.receivers = {"local": LocalReceiver(self.engine)}
        # Start-up: one full sync, then the equality check (its bytes are the first step's ledger entry).
        handle, nbytes = self.session.startup(r.model, run.state.version)
        self.receivers["local"].update(handle)
        run.telemetry.traffic(run.state.step, "weights", nbytes)
        compare_weights(self.session.expected(r.model), self.engine.model, run.state.version)
        self.book = make_book(cfg, r.feed)  # the rounds: plain, or RollPacker's short and long (rollout/rounds.py)
        self.book.restore(run.state.extra, run.state.step)
        # tail rounds train inside the round (RollPacker's stream-based training overlaps the tail's decoding)
        self.streamed = self.book.policy.closes_early("short")
        if why := canary.not_measured(self.engine, plan.mode == "inprocess"):
            run.log(why)

    def take(self, step: int, version: int) -> grpo.Taken:
        run, r, engine, tel = self.run, self.r, self.engine, self.run.telemetry
        if self.streamed:  # rollout.scheduler=tail: streamed round + streaming trainer
            requests, samples, train_metrics, extra = streamed_step(run, r, engine, step, self.book)
            return grpo.Taken(requests, samples, extra, train_metrics)
        requests, dead = [], []
        self.book.issue(step, lambda got, lost: (requests.extend(got), dead.extend(lost)))
        run.dead_letter(dead, step)
        r.feed.ledger.hand_out([q.id for q in requests], "local")
        tel.traffic(step, "prompts", 4 * sum(len(q.prompt_ids) for q in requests))
        cpu = time.process_time()  # the engine's CPU time (its intra-op threads too): bench/placements.py
        with tel.span("rollout", step, version=engine.version, requests=[q.id for q in requests]):
            samples, rejected = engine.generate(requests)
        extra = {"rollout/engine_cpu_s": time.process_time() - cpu}
        if (side := engine.drain()) is not None:  # work beside decoding, as the engine names it: forwarded
            extra[SIDE_WORK] = side  # the run record takes its counters and percentiles (run.py)
            for span in side.spans(step, side.name):
                tel.record(span)
        run.dead_letter([{"source": q.id, "reason": why} for q, why in rejected], step)
        for q, _ in rejected:
            self.book.rejected(q.id)
        refused = {q.id for q, _ in rejected}
        self.book.took([q.id for q in requests if q.id not in refused])
        if (state := self.book.state()) is not None:
            run.state.extra[STATE_KEY] = state
        tel.traffic(step, "samples", sum(s.payload_bytes() for s in samples))
        return grpo.Taken(requests, samples, extra)

    @contextlib.contextmanager
    def trainer_turn(self):
        """The engine's memory is the trainer's while the trainer steps: the native engine frees its KV cache and
        fused weight copies (SmolLM2-135M: 0.79 + 0.54 GB off the step's peak), vLLM on a GPU sleeps.

        With activation checkpointing the pages the step freed go back to the kernel before the engine wakes
        (``malloc_trim``): what the trainer leaves is small and fragmented, and without the trim the kept heap
        crept ~0.035 GB per step on SmolLM2's example (2.85 -> 3.55 GB over 20 steps; flat with it, at the same
        train time). Without checkpointing they are the next step's activations: trimming them cost ~2 s of
        re-faulting per step (train 8.1 vs 6.2 s, 2026-11-26) for the same run peak (4.78 vs 4.83 GB: the
        trainer phase is the peak either way), so they stay."""
        self.engine.sleep()
        try:
            yield
        finally:
            if self.run.cfg.trainer.activation_checkpointing:
                cpu_memory.release_freed_memory()  # the step's freed pages, before the engine wakes
            self.engine.wake_up()

    def publish(self, step: int, version: int) -> int:
        nbytes = self.session.publish(self.r.model, version, self.receivers)
        for name in self.session.missed:  # rejected (nothing applied): the last version whole
            nbytes += self.session.catch_up(self.receivers[name])
        return nbytes

    def check(self, step: int, version: int) -> None:
        with self.run.telemetry.span("sync_check", step, version=version):
            compare_weights(self.session.expected(self.r.model), self.engine.model, self.engine.version)
        self.run.log(f"sync check v{self.engine.version}: the rollout copy equals the trainer")

    def canary(self, version: int, probe, trainer_lp: list[float]) -> dict:
        """The engine scores the canary probe through what it samples with (``canary.answer``; in mode inprocess
        the fast path's fused copies of the trainer's module, or vLLM's copy)."""
        lp = canary.answer(self.engine, probe, shared=self.session.mode == "inprocess")
        return {} if lp is None else canary.compare(version, trainer_lp, {"local": (self.engine.version, lp)})

    def metrics(self) -> dict:
        return {}

    def rng_state(self) -> dict:
        return {"engine": self.engine.generator.get_state()}

    def stop(self) -> None:
        self.engine.sleep()  # the run's eval after builds its own engine: this one's memory first
        self.engine.close()
