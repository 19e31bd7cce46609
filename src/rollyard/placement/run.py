"""What every placement driver shares: start a run (or resume it), account a step, finish.

A driver's loop stays short because the bookkeeping lives here: the run directory, the resolved
config, the warm start, eval before/after, the dead-letter file, per-step metrics, checkpoints,
the exported model and the summary.
"""

from __future__ import annotations

import copy
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, pstdev
from typing import Any

import torch

from rollyard import checkpoint, roles, runguard
from rollyard.config import RunConfig, dump_config
from rollyard.evaluate import greedy_accuracy
from rollyard.models import PRESETS, export, num_params, source_dtype
from rollyard.reward import metrics as reward_metrics
from rollyard.reward.dispatcher import RewardDispatcher
from rollyard.reward.failures import RewardFailures
from rollyard.rollout.engine import RolloutEngine
from rollyard.rollout.scheduler import PromptStream
from rollyard.sft import warm_start
from rollyard.tasks.base import Prompt
from rollyard.telemetry import rundir, sessions
from rollyard.telemetry.report import console, fmt_accuracy, print_summary, role_shares
from rollyard.telemetry.telemetry import Telemetry
from rollyard.telemetry.tracking import Tracking, completion_records
from rollyard.trainer.trainer import Trainer
from rollyard.types import Request, Sample


@dataclass
class RunContext:
    cfg: RunConfig
    run_dir: Path
    model: Any
    tokenizer: Any
    context: int
    device: str
    engine: RolloutEngine
    trainer: Trainer
    rewards: RewardDispatcher
    reference: Any
    stream: PromptStream
    held_out: list[Prompt]
    telemetry: Telemetry
    state: checkpoint.TrainState
    started: float = field(default_factory=time.time)
    deadletters: int = 0
    flags: dict[str, int] = field(default_factory=lambda: {"timeouts": 0, "errors": 0})
    reward_failures: RewardFailures | None = None

    def log(self, msg: str) -> None:
        console.print(msg)

    def evaluate(self) -> float | None:
        """Held-out greedy accuracy now (recorded in eval.jsonl); None when there is no held-out set."""
        acc = greedy_accuracy(self.model, self.tokenizer, self.held_out, self.rewards,
                              self.cfg.rollout.max_new_tokens, self.context)
        if acc is not None:
            self.telemetry.evaluation(self.state.step, acc)
        return acc

    def settle_rewards(self, step: int, samples: list[Sample]) -> list[Sample]:
        """The samples to train on (failed verifier calls counted, recorded, left out by default)."""
        trained, values = self.reward_failures.settle(step, samples)
        self.telemetry.note(step, values)
        return trained

    def eval_during(self, step: int) -> None:
        """Held-out eval after ``step``, also written into its metrics row (``eval/accuracy``)."""
        acc = self.evaluate()
        if acc is not None:
            self.telemetry.note(step, {"eval/accuracy": acc})
        self.log(f"step {step}: held-out greedy accuracy {fmt_accuracy(acc)}")

    def dead_letter(self, records: list[dict], step: int | None = None) -> None:
        if not records:
            return
        with open(self.run_dir / rundir.DEADLETTER, "a") as f:
            for rec in records:
                f.write(json.dumps({"step": step, **rec}) + "\n")
        self.deadletters += len(records)
        for rec in records[:3]:
            self.log(f"[yellow]dead-lettered {rec.get('source')}: {rec.get('reason')}[/yellow]")

    def end_step(self, step: int, requests: list[Request], samples: list[Sample], train_metrics: dict[str, float]) -> dict:
        """Write the step's metrics (rewards, lengths, canaries, staleness) and ledger; return the row."""
        rewards = [s.reward for s in samples if s.reward is not None] or [0.0]
        lengths = [len(s.completion_ids) for s in samples] or [0]
        flags = [s.reward_flag or "" for s in samples]
        self.flags["timeouts"] += sum(f == "timeout" for f in flags)
        self.flags["errors"] += sum(f.startswith("error") for f in flags)
        times = self.telemetry.step_seconds.get(step, {})
        values: dict[str, Any] = {
            "version": self.state.version,
            "reward/mean": mean(rewards), "reward/std": pstdev(rewards),
            "reward/accuracy": sum(r > 0.5 for r in rewards) / len(rewards),
            "reward/timeouts": sum(f == "timeout" for f in flags),
            "reward/errors": sum(f.startswith("error") for f in flags),
            "length/mean": mean(lengths), "length/min": min(lengths), "length/max": max(lengths),
            "length/clipped_frac": sum(s.finish_reason == "length" for s in samples) / max(len(samples), 1),
            "tokens/generated": sum(lengths),
            "tokens/per_s_rollout": sum(lengths) / max(times.get("rollout", 0.0), 1e-9),
            rundir.STALENESS_MAX: max((self.state.version - 1 - s.version for s in samples), default=0),
            "deadletter/total": self.deadletters,
            rundir.STEP_TIME: sum(times.values()),
        }
        values.update({f"train/{k}": v for k, v in train_metrics.items()})
        values.update({"train/lr": self.trainer.optimizer.param_groups[0]["lr"],
                       "frac_reward_zero_std": reward_metrics.frac_zero_std(samples),
                       **reward_metrics.per_hook(samples, self.rewards.names)})
        every = self.cfg.log.completions_every
        if every and step % every == 0:
            self.telemetry.completions(step, completion_records(step, samples, self.tokenizer))
        self.telemetry.lengths(step, lengths, [len(q.prompt_ids) for q in requests])
        return self.telemetry.end_step(step, values)

    def save_checkpoint(self) -> Path:
        self.state.cursor = self.stream.state()
        return checkpoint.save(self.run_dir, self.state, self.model, self.trainer.optimizer,
                               keep=self.cfg.keep_checkpoints, extra_rng=self.engine_rng())

    def engine_rng(self) -> dict:
        gen = getattr(self.engine, "generator", None)
        return {"engine": gen.get_state()} if isinstance(gen, torch.Generator) else {}


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def start(cfg: RunConfig, run_dir: str | Path, resume: bool) -> RunContext:
    """Set up every role; with ``resume``, ``cfg`` is the run's saved config (plus CLI overrides)."""
    run = Path(run_dir)
    ckpt = runguard.open_run(cfg, run, resume, log=console.print)  # checks, lock, records cut to the checkpoint
    tracking = Tracking(run, cfg.log, cfg.model_dump(mode="json"))  # first: a missing package fails fast
    _seed_everything(cfg.seed)
    device = roles.device_of(cfg)
    deadletter: list[dict] = []
    model, tokenizer, context = roles.policy(cfg, device)
    train_prompts, held_out = roles.prompts(cfg, deadletter, tokenizer)
    rewards = roles.rewards(cfg, tokenizer, model)
    console.print(f"policy {cfg.model.name}: {num_params(model) / 1e6:.2f}M parameters, context {context}, device {device}")
    sft_info: dict = {}
    if ckpt is None and cfg.sft.auto and cfg.model.name in PRESETS:
        model, sft_info = warm_start(model, tokenizer, train_prompts, held_out, rewards, cfg, context, device, console.print)
    reference = None
    if cfg.algo.kl_coef > 0:
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    trainer = roles.trainer(cfg, model, device)
    stream = PromptStream(train_prompts, seed=cfg.data.seed)
    state = checkpoint.TrainState()
    extra_rng: dict = {}
    if ckpt is not None:
        state, extra_rng = checkpoint.load(ckpt, model, trainer.optimizer)
        stream.restore(state.cursor)
        console.print(f"resuming {run} from {ckpt.name}: step {state.step}, weight version {state.version}")
    engine = roles.engine(cfg, model, tokenizer, version=state.version)
    if "engine" in extra_rng and isinstance(getattr(engine, "generator", None), torch.Generator):
        engine.generator.set_state(extra_rng["engine"])
    ctx = RunContext(cfg, run, model, tokenizer, context, device, engine, trainer, rewards, reference, stream,
                     held_out, Telemetry(run, tracking=tracking if tracking.active else None), state)
    ctx.reward_failures = RewardFailures(run, cfg.reward.on_failure, cfg.reward.max_failure_frac, console.print, state.step)
    ctx.deadletters = sessions.whole_run(run)["deadletters"]  # a resumed run counts the earlier sessions' too
    ctx.dead_letter(deadletter)
    (run / rundir.RUN_INFO).write_text(json.dumps(run_info(cfg, model), indent=1))
    if state.eval_before is None:
        state.eval_before = ctx.evaluate()
        state.extra.update(sft_info)
        console.print(f"held-out greedy accuracy before RL: {fmt_accuracy(state.eval_before)} ({len(held_out)} prompts)")
    dump_config(cfg, run / rundir.CONFIG)  # only once start-up succeeded: a failed resume leaves it as it was
    return ctx


def run_info(cfg: RunConfig, model) -> dict:
    return {
        "policy_params": num_params(model), "bytes_per_param": next(model.parameters()).element_size(),
        "placement": cfg.placement, "sync_mode": "inprocess", "dp": 1,
        "prompts_per_step": cfg.rollout.prompts_per_step, "samples_per_prompt": cfg.rollout.samples_per_prompt,
        "max_new_tokens": cfg.rollout.max_new_tokens, "staleness_bound": 0, "lora_fraction": None,
        "steps": cfg.steps,
    }


def finish(ctx: RunContext) -> dict:
    """Eval after, export the policy, write summary.json and trace.json, print the tables."""
    after = ctx.evaluate()
    export(ctx.model, ctx.tokenizer, ctx.run_dir / rundir.MODEL, dtype=source_dtype(ctx.cfg.model.name))
    ctx.telemetry.close()
    ctx.rewards.close()
    summary = {
        "eval_before": ctx.state.eval_before, "eval_after": after, "steps": ctx.state.step,
        "version": ctx.state.version, "seconds": time.time() - ctx.started, "deadletters": ctx.deadletters,
        "reward_flags": ctx.flags, **ctx.state.extra,
        "role_seconds_per_step": {r: s for r, s, _ in role_shares(ctx.telemetry.step_seconds)},
    }
    summary.update(sessions.whole_run(ctx.run_dir))  # totals over every session of the run, not just this one
    (ctx.run_dir / rundir.SUMMARY).write_text(rundir.strict_json(summary))
    print_summary(ctx.telemetry.step_seconds, ctx.state.eval_before, after)
    console.print(f"run directory: {ctx.run_dir} (model/, metrics.jsonl, trace.json, traffic.jsonl, checkpoints/)")
    rundir.unlock(ctx.run_dir)
    return summary
