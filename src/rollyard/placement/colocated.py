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
from rollyard.placement.side import RolloutSide
from rollyard.placement.streamed import InRound
from rollyard.rollout.rounds import make_book, run_round
from rollyard.sync import canary
from rollyard.sync.check import compare_weights
from rollyard.sync.factory import SyncPlan
from rollyard.sync.session import LocalReceiver, SyncSession, rollout_copy


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False) -> dict:
    run, r, extra_rng = start(cfg, run_dir, resume)  # resolves the settings first (a bad sync setting fails there)
    return grpo.train(run, r, LocalRollout(run, r, run.settings.plan, extra_rng))


class LocalRollout(RolloutSide):
    """The rollout side in the trainer's process: one engine, loaded through a ``LocalReceiver``; each step one
    round of the book on it (``rounds.run_round``)."""

    def __init__(self, run: RunRecord, r: Roles, plan: SyncPlan, extra_rng: dict):
        cfg = run.cfg
        self.run, self.r = run, r
        s = cfg.sync
        self.session = SyncSession(plan, r.model, s.every, s.check_every, s.bucket_mb, s.canary_every)
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
        if why := canary.not_measured(self.engine, plan.mode == "inprocess"):
            run.log(why)

    def take(self, step: int, version: int) -> grpo.Taken:
        """One round. Plain: scored and trained after it by the step; tail (``policy.streamed``): each complete group
        scored (streaming rewards) and its gradient accumulated inside the round, the optimizer step at its end."""
        run, engine, tel = self.run, self.engine, self.run.telemetry
        trainer = InRound(run, self.r, step) if self.book.policy.streamed else None
        rewards, on_group = (self.r.rewards, trainer.add) if trainer else (None, None)
        cpu = time.process_time()  # the engine's CPU time (its intra-op threads too): bench/placements.py
        with tel.span("rollout", step, version=engine.version) as rec:
            rnd = run_round(self.book, engine, rewards, step, on_group)
            rec.update(requests=[q.id for q in rnd.requests])
        # a round that trains inside holds the trainer's CPU time too: there, tail/train_in_round_s says it
        extra = {} if trainer else {"rollout/engine_cpu_s": time.process_time() - cpu}
        if (side := engine.drain()) is not None:  # work beside decoding, as the engine names it: forwarded
            extra[SIDE_WORK] = side  # the run record takes its counters and percentiles (run.py)
            for span in side.spans(step, side.name):
                tel.record(span)
        run.dead_letter(rnd.dead, step)
        tel.traffic(step, "prompts", 4 * sum(len(q.prompt_ids) for q in rnd.requests))
        tel.traffic(step, "samples", sum(s.payload_bytes() for s in rnd.samples))
        if trainer is None:
            return grpo.Taken(rnd.complete, rnd.samples, extra)
        train_metrics = trainer.finish()
        self.book.measure(train_in_round_s=trainer.train_s)
        return grpo.Taken(rnd.complete, trainer.scored, extra, train_metrics)

    @contextlib.contextmanager
    def trainer_turn(self):
        """The engine's memory is the trainer's while the trainer steps: the native engine frees its KV cache and
        fused weight copies (SmolLM2-135M: 0.79 + 0.54 GB off the step's peak), vLLM on a GPU sleeps.

        With activation checkpointing the pages the step freed stay in the process for the engine and the next step
        to reuse, unless they pass ``memory.SWITCH_FREE_BYTES`` (then ``malloc_trim`` hands them back): trimming at
        every switch cost ~0.2 s a step on SmolLM2's example (the engine's copies and the next step's activations
        faulted in again; median step 1.69 -> 1.50 s without it, 2026-11-29) for a trainer-phase peak 0.1 GB lower,
        and the checkpoint's snapshot, the run's peak, trims first (``RunRecord.save_checkpoint``). Without
        checkpointing they are the next step's activations: trimming them cost ~2 s of re-faulting per step (train
        8.1 vs 6.2 s, 2026-11-26) for the same run peak (4.78 vs 4.83 GB: the trainer phase is the peak either way),
        so they stay."""
        self.engine.sleep()
        try:
            yield
        finally:
            if self.run.cfg.trainer.activation_checkpointing:  # the step's freed pages, past a bound, before the engine wakes
                cpu_memory.release_freed_memory(above=cpu_memory.SWITCH_FREE_BYTES)
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
        return self.book.metrics()

    def checkpoint(self) -> dict:
        self.book.save(self.run.state.extra)
        return {"engine": self.engine.generator.get_state()}

    def stop(self) -> None:
        self.engine.sleep()  # the run's eval after builds its own engine: this one's memory first
        self.engine.close()
