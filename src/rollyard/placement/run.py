"""What every placement shares: the run record, the driver-side role handles, start and finish.

``RunRecord`` is placement-independent: the run directory, the config, the telemetry sink, dead
letters, the checkpoint state (``TrainState``) and the summary. It knows nothing of where the
roles run. ``Roles`` are the handles the driver process holds (the trainer, the verifier pool,
the reference model, the prompt feed); a placement adds its own rollout handles (a local engine,
or Ray actors) and drives them.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, pstdev
from typing import Any

import torch

from rollyard import checkpoint, roles, runguard, signals, staleness
from rollyard.accounting import PromptLedger
from rollyard.checkpoint_writer import Writer
from rollyard.config import RunConfig, dump_config
from rollyard.evaluate import (
    accuracy_signal,
    cadence_note,
    no_signal_reason,
    train_reward_is_correctness,
)
from rollyard.model import cpu, kernels
from rollyard.model import memory as cpu_memory
from rollyard.model.choices import choices as model_choices
from rollyard.model.loading import PRESETS, export, num_params, source_dtype
from rollyard.placement import reference as reference_placement
from rollyard.placement import teacher as teacher_placement
from rollyard.reward import metrics as reward_metrics
from rollyard.reward.dispatcher import RewardDispatcher
from rollyard.reward.failures import RewardFailures
from rollyard.reward.hooks import MESSAGES_KEY
from rollyard.rollout.scheduler import PromptFeed, PromptStream
from rollyard.sft import warm_start
from rollyard.sync.factory import DTYPES, sync_facts
from rollyard.tasks.base import DataError, Prompt
from rollyard.tasks.dataset import check_context
from rollyard.telemetry import rundir, sessions
from rollyard.telemetry.alarms import Alarms, first_canary_max
from rollyard.telemetry.report import console, fmt_accuracy, print_summary, role_shares
from rollyard.telemetry.side import SideWork, latency_metrics
from rollyard.telemetry.telemetry import Telemetry
from rollyard.telemetry.tracking import Tracking, completion_records, trainer_names
from rollyard.trainer.precision import precision_choice, rollout_precision
from rollyard.trainer.trainer import Trainer
from rollyard.types import Request, Sample
from rollyard.waits import NoAnswer

SIDE_WORK = "side_work"  # a step's ``SideWork`` (telemetry/side.py), placement -> run record (popped there, never a metric)


@dataclass(frozen=True)
class Roles:
    """Driver-side role handles. ``model`` is the trainer's policy (the one that is checkpointed)."""

    model: Any
    tokenizer: Any
    context: int
    trainer: Trainer
    rewards: RewardDispatcher
    reference: Any  # the reference scorer by reference.placement (placement/reference.py), None when kl_coef == 0
    feed: PromptFeed
    held_out: list[Prompt]
    held_out_rewards: Any = None  # the held-out eval's correctness signal (roles.eval_rewards); None: no eval
    teacher: Any = None  # the distillation teacher by teacher.placement (placement/teacher.py), None under algo.objective=rl


@dataclass
class RunRecord:
    cfg: RunConfig
    run_dir: Path
    telemetry: Telemetry
    state: checkpoint.TrainState
    started: float = field(default_factory=time.time)
    deadletters: int = 0
    flags: dict[str, int] = field(default_factory=lambda: {"timeouts": 0, "errors": 0})
    totals: dict[str, float] = field(default_factory=dict)  # run-wide counters a placement adds to the summary
    side_seconds: dict[str, list[float]] = field(default_factory=dict)  # by role: every call beside decoding (summary)
    reward_failures: RewardFailures | None = None
    settings: roles.Settings | None = None  # resolved once at start-up (device, sync plan, staleness bound)
    writer: Writer | None = None  # the background checkpoint writer (checkpoint_async); None: checkpoints written now
    _clock: float = field(default_factory=time.time)

    def log(self, msg: str) -> None:
        console.print(msg)

    @property
    def correctness(self) -> bool:
        """The reward says correct / not: a built-in task's verifier, or ``reward.correctness``."""
        return train_reward_is_correctness(self.cfg)

    def settle_rewards(self, step: int, samples: list[Sample]) -> list[Sample]:
        """The samples to train on (failed verifier calls counted, recorded, left out by default)."""
        trained, values = self.reward_failures.settle(step, samples)
        self.telemetry.note(step, values)
        return trained

    def eval_during(self, r: Roles, step: int) -> None:
        """Held-out eval after ``step`` (of the policy step ``step + 1`` starts from: see ``evaluate``)."""
        acc = evaluate(self, r)
        if acc is not None:  # none: no held-out set or no correctness signal (said once at start-up)
            self.log(f"after step {step}: held-out greedy accuracy {fmt_accuracy(acc)}")

    def dead_letter(self, records: list[dict], step: int | None = None) -> None:
        if not records:
            return
        with open(self.run_dir / rundir.DEADLETTER, "a") as f:
            f.writelines(json.dumps({"step": step, **rec}) + "\n" for rec in records)
        self.deadletters += len(records)
        for rec in records[:3]:
            self.log(f"[yellow]dead-lettered {rec.get('source')}: {rec.get('reason')}[/yellow]")

    def begin(self) -> None:
        """Start the step clock: ``time/step`` is wall clock between optimizer steps."""
        self._clock = time.time()

    def count(self, key: str, n: float = 1) -> None:
        self.totals[key] = self.totals.get(key, 0) + n

    def end_step(self, step: int, r: Roles, requests: list[Request], samples: list[Sample],
                 train_metrics: dict[str, float], trained_at: int, extra: dict[str, Any] | None = None) -> dict:
        """Write the step's metrics and ledger; return the row. ``trained_at``: the trainer version
        that consumed ``samples`` (their staleness is measured against it, here, where they are used)."""
        now = time.time()
        extra = dict(extra or {})
        side: SideWork | None = extra.pop(SIDE_WORK, None)  # the engines' work beside decoding, from any placement
        if side is not None:
            self.side_seconds.setdefault(side.role, []).extend(side.seconds)
            extra.update({**side.counts, **latency_metrics(side.seconds, f"{side.name}/latency_")})
        rewards = [s.reward for s in samples if s.reward is not None] or [0.0]
        lengths = [len(s.completion_ids) for s in samples] or [0]
        flags = [s.reward_flag or "" for s in samples]
        self.flags["timeouts"] += sum(f == "timeout" for f in flags)
        self.flags["errors"] += sum(f.startswith("error") for f in flags)
        times = self.telemetry.step_seconds.get(step, {})
        lag = staleness.lags(trained_at, [s.version for s in samples])
        values: dict[str, Any] = {
            "version": self.state.version,
            "reward": mean(rewards), "reward_std": pstdev(rewards),  # TRL's names where TRL has one
            # a share of "correct" samples only where the reward is a correctness signal
            **({"reward/accuracy": sum(r > 0.5 for r in rewards) / len(rewards)} if self.correctness else {}),
            "reward/timeouts": sum(f == "timeout" for f in flags),
            "reward/errors": sum(f.startswith("error") for f in flags),
            "completions/mean_length": mean(lengths), "completions/min_length": min(lengths),
            "completions/max_length": max(lengths),
            "completions/clipped_ratio": sum(s.finish_reason == "length" for s in samples) / max(len(samples), 1),
            "tokens/generated": sum(lengths),
            # Rollout seconds of this step (async: worker spans may reach the driver after it).
            **({"tokens/per_s_rollout": sum(lengths) / times["rollout"]} if times.get("rollout") else {}),
            rundir.STALENESS_MAX: max(lag, default=0),
            "staleness/mean": mean(lag) if lag else 0.0,
            "staleness/hist": staleness.histogram(lag),
            "staleness/mixed_samples": sum(len(set(s.versions)) > 1 for s in samples),  # spanned a weight update
            "deadletter/total": self.deadletters,
            rundir.STEP_TIME: now - self._clock,
            **(extra or {}),
        }
        started, self._clock = self._clock, now
        values.update(trainer_names(train_metrics))
        values.update({"learning_rate": r.trainer.optimizer.param_groups[0]["lr"],
                       "frac_reward_zero_std": reward_metrics.frac_zero_std(samples),
                       **reward_metrics.per_hook(samples, r.rewards.names)})
        every = self.cfg.log.completions_every
        if every and step % every == 0:
            self.telemetry.completions(step, completion_records(step, samples, r.tokenizer))
        self.telemetry.lengths(step, lengths, [len(q.prompt_ids) for q in requests])
        if side is not None and f"{side.name}/bytes" in side.counts:  # counted by the engine where calls go and come
            self.telemetry.traffic(step, side.name, int(side.counts[f"{side.name}/bytes"]),
                                   count=int(side.counts.get(f"{side.name}/calls", 0)))
        return self.telemetry.end_step(step, values, window=(started, now))

    def close_step(self, step: int, r: Roles, progress, requests: list[Request], samples: list[Sample],
                   train_metrics: dict[str, float], trained_at: int, extra: dict[str, Any] | None = None,
                   extra_rng=None) -> None:
        """The end of every driver's step: advance, eval when due (in this step's row, where the
        reward-hacking alarm compares it), collect a finished background checkpoint write (waiting for it when
        the next checkpoint is due), write the row, checkpoint when due or stopping, and stop on a signal.
        ``extra_rng``: a callable returning the driver's extra RNG state to checkpoint."""
        self.state.step = step + 1
        r.rewards.trainer_state = {"global_step": self.state.step, "max_steps": self.cfg.steps}  # TRL's trainer_state
        if self.cfg.eval_every and self.state.step % self.cfg.eval_every == 0 and self.state.step < self.cfg.steps:
            t0 = time.time()
            self.eval_during(r, step)
            self.telemetry.note(step, {"eval/seconds": time.time() - t0})  # in this step's wall time (alarms skip it)
        due = (self.state.step % self.cfg.checkpoint_every == 0 or self.state.step == self.cfg.steps
               or signals.stop_requested())
        failed, waited = self._collect_write(step, due)  # in this step's row, written next
        progress.update(self.end_step(step, r, requests, samples, train_metrics, trained_at=trained_at, extra=extra))
        if failed is not None:
            raise failed  # the run ends in one line (exit 2); the previous checkpoint is the latest valid one
        if due:
            t0 = time.time()
            self.save_checkpoint(r, extra_rng() if extra_rng else None)
            # the critical path's seconds (a write still in flight waited for, the snapshot or the synchronous
            # write), after this row was written: the next step's wall time holds them (alarms skip that step)
            self.telemetry.note(self.state.step, {"checkpoint/seconds": waited + time.time() - t0})
        if self.state.step < self.cfg.steps:  # a signal in the last step: the run finishes (model/ is exported)
            if signals.stop_requested():
                self.finish_checkpoint()  # "checkpoint written at step N" is said once it is on disk
            signals.raise_if_stopping(self.state.step)

    def save_checkpoint(self, r: Roles, extra_rng: dict | None = None) -> None:
        """Checkpoint ``state.step``: written now (``checkpoint_async=false``, or the run's last one: the run's end
        waits for it either way, so it is written from the live tensors with no copy, the copies being a background
        write's peak: Gemma-3-270M's model and AdamW state, 2.14 GB), or snapshotted now and written by the
        background writer (the previous write collected first: at most one in flight)."""
        self.state.cursor = r.feed.state()
        cpu_memory.release_freed_memory()  # the snapshot's tensors are mmap-ed: the heap's free pages cannot hold them
        if self.writer is None or self.state.step >= self.cfg.steps or signals.stop_requested():
            self.finish_checkpoint()
            try:
                checkpoint.save(self.run_dir, self.state, r.model, r.trainer.optimizer,
                                keep=self.cfg.keep_checkpoints, extra_rng=extra_rng)
            except checkpoint.CheckpointWriteError:
                raise
            except Exception as e:  # noqa: BLE001 - a library's own failure: one line, as a background write says it
                raise checkpoint.write_failed(self.run_dir, self.state.step, e) from None
            return
        self.finish_checkpoint()
        snap = checkpoint.snapshot(self.state, r.model, r.trainer.optimizer, extra_rng, copy=True)
        self.writer.submit(self.run_dir, snap, self.cfg.keep_checkpoints)

    def _collect_write(self, step: int, due: bool) -> tuple[checkpoint.CheckpointWriteError | None, float]:
        """The background write in flight, collected when the next checkpoint is ``due`` (waited for) or as soon as
        it has failed: its seconds in ``step``'s row (``checkpoint/write_seconds``; ``checkpoint/failed`` for a
        failure). Returns its error (raised once the row is written) and the seconds this step waited for it."""
        if self.writer is None or not ((due and self.writer.in_flight) or self.writer.failed):
            return None, 0.0
        t0 = time.time()
        done = self.writer.wait()
        self.count("checkpoint_write_seconds", done.seconds)
        values: dict[str, float] = {"checkpoint/write_seconds": done.seconds}
        if done.error is not None:
            values["checkpoint/failed"] = 1
            self.count("checkpoint_failures")
        self.telemetry.note(step, values)
        return done.error, time.time() - t0

    def finish_checkpoint(self) -> None:
        """Wait (bounded, said) for the background write in flight, if any; raise its CheckpointWriteError."""
        done = self.writer.wait() if self.writer is not None else None
        if done is not None:
            self.count("checkpoint_write_seconds", done.seconds)
            if done.error is not None:
                self.count("checkpoint_failures")
                raise done.error

    def settle_checkpoint(self) -> None:
        """The run is ending on an error or a signal: the write in flight finishes first (the run directory's
        latest checkpoint is then what the error's line says); its own failure is said, not put in the place of
        the error that ends the run."""
        try:
            self.finish_checkpoint()
        except (checkpoint.CheckpointWriteError, NoAnswer) as e:
            print(f"rollyard: error: {e}", file=sys.stderr, flush=True)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _prompts(cfg: RunConfig, run: Path, tokenizer, context: int, deadletter: list[dict]) -> tuple[list, list]:
    """The train and held-out prompts; every malformed line's reason in ``deadletter`` (on disk too when no line
    is usable); a prompt longer than the context is one line."""
    try:
        train_prompts, held_out = roles.prompts(cfg, deadletter, tokenizer)
    except DataError:
        with open(run / rundir.DEADLETTER, "a") as f:  # every line malformed: the reasons go on disk too
            f.writelines(json.dumps({"step": None, **rec}) + "\n" for rec in deadletter)
        raise
    check_context(train_prompts, tokenizer, context, cfg.data.path or f"data.task={cfg.data.task}",
                  preset=cfg.model.name in PRESETS)
    return train_prompts, held_out


def _dry_run(scorer, prompt) -> None:
    """A bad reward function (or eval.reward) is one line at start-up, not at the first step."""
    scorer.dry_run(prompt.text, {**prompt.meta, **({MESSAGES_KEY: prompt.messages} if prompt.messages else {})})


def _open_roles(cfg: RunConfig, model, tokenizer, context: int, device, train_prompts: list, held_out: list,
                resuming: bool, opened: list) -> tuple:
    """The rewards, the held-out scorer, the warm start, LoRA, the reference, the teacher and the trainer, in that
    order; each that owns processes is appended to ``opened`` as soon as it exists (closed by the caller if a later
    one fails). Returns ``(model, rewards, scorer, reference, teacher, trainer, sft_info)``."""
    rewards = roles.rewards(cfg, tokenizer, model)
    opened.append(rewards)
    _dry_run(rewards, train_prompts[0])
    console.print(f"policy {cfg.model.name}: {num_params(model) / 1e6:.2f}M parameters, context {context}, device {device}"
                  + (f" (CPU class {cpu.cpu_class()})" if str(device).startswith("cpu") else ""))
    sft_info: dict = {}
    scorer = roles.eval_rewards(cfg, tokenizer, model, rewards)  # held-out correctness (evaluate.accuracy_signal)
    if scorer is not None and scorer is not rewards:
        opened.append(scorer)
        if held_out:
            _dry_run(scorer, held_out[0])
    if not resuming and cfg.sft.auto and cfg.model.name in PRESETS:
        model, sft_info = warm_start(model, tokenizer, train_prompts, held_out, scorer or rewards, cfg, context, device,
                                     console.print)
    model = roles.with_lora(cfg, model)  # after the warm start: SFT trains (and caches) the full model
    reference = reference_placement.build(cfg, model)  # reference.placement: inline, pool or fused
    opened += [reference] if hasattr(reference, "close") else []
    teacher = teacher_placement.build(cfg, tokenizer, device, train_prompts)  # algo.objective != rl
    opened += [teacher] if hasattr(teacher, "close") else []
    if teacher is not None:
        console.print(f"teacher {cfg.teacher.model}: {teacher.params / 1e6:.2f}M "
                      f"parameters, {cfg.teacher.placement}, algo.objective={cfg.algo.objective}")
    trainer = roles.trainer(cfg, model, device)
    opened += [trainer] if hasattr(trainer, "close") else []  # dp ranks
    return model, rewards, scorer, reference, teacher, trainer, sft_info


def _first_eval(rec: RunRecord, handles: Roles, cfg: RunConfig, sft_info: dict) -> None:
    """Held-out accuracy before RL (once per run: a resume keeps the first session's)."""
    state = rec.state
    if state.eval_before is not None:
        return
    state.eval_before = evaluate(rec, handles)
    state.extra.update(sft_info)
    console.print(f"held-out greedy accuracy before RL: {fmt_accuracy(state.eval_before)} "
                  f"({held_out_count(cfg, handles.held_out)}, scored by {accuracy_signal(cfg)})"
                  if handles.held_out_rewards else no_signal_reason(cfg))
    if handles.held_out_rewards is not None and handles.held_out and (note := cadence_note(cfg)):
        console.print(note)


def start(cfg: RunConfig, run_dir: str | Path, resume: bool, info: dict | None = None
          ) -> tuple[RunRecord, Roles, dict]:
    """Set up the run record and the driver-side roles; returns ``(run, roles, extra_rng)``.

    With ``resume``, ``cfg`` is the run's saved config (plus CLI overrides) and the prompt ledger's
    live prompts are queued again. ``info``: placement facts for run.json (see ``run_info``).
    """
    settings = roles.settings(cfg)  # once, before any start-up work: every rollout side and Ray actor is handed these
    run = Path(run_dir)
    ckpt = runguard.open_run(cfg, run, resume, log=console.print)  # checks and lock; nothing on disk changed yet
    tracking = Tracking(run, cfg.log, cfg.model_dump(mode="json"))  # first: a missing package fails fast
    _seed_everything(cfg.seed)
    device = settings.device
    deadletter: list[dict] = []
    model, tokenizer, context = roles.policy(cfg, device)
    train_prompts, held_out = _prompts(cfg, run, tokenizer, context, deadletter)
    opened: list = []  # what owns processes, closed again when start-up fails
    try:
        precision = _precisions(cfg, model, settings)  # (a precision this device cannot run stops here, one line)
        model, rewards, scorer, reference, teacher, trainer, sft_info = _open_roles(
            cfg, model, tokenizer, context, device, train_prompts, held_out, ckpt is not None, opened)
        r = cfg.rollout
        feed = PromptFeed(PromptStream(train_prompts, seed=cfg.data.seed, shuffle=cfg.data.shuffle), PromptLedger(),
                          tokenizer, r.samples_per_prompt, r.max_new_tokens, context,
                          max_prompt=(cfg.data.max_prompt_tokens, cfg.data.prompt_truncation))
        state = checkpoint.TrainState()
        extra_rng: dict = {}
        if ckpt is not None:
            state, extra_rng = checkpoint.load(ckpt, model, trainer.optimizer)
            runguard.cut_back(run, ckpt, log=console.print)  # only now that the checkpoint loaded
            feed.restore(state.cursor)
            console.print(f"resuming {run} from {ckpt.name}: step {state.step}, weight version {state.version}"
                          + (f", {len(feed.ledger.queued())} live prompts requeued" if feed.ledger.queued() else ""))
        rec = RunRecord(cfg, run, Telemetry(run, tracking=tracking if tracking.active else None,
                                            alarms=Alarms(regression_z=cfg.eval.regression_z,
                                                          canary_first_max=first_canary_max(precision.get("rollout_precision") or settings.plan.dtype))), state,
                        settings=settings, writer=Writer() if cfg.checkpoint_async else None)
        rewards.trainer_state = {"global_step": state.step, "max_steps": cfg.steps}
        handles = Roles(model, tokenizer, context, trainer, rewards, reference, feed, held_out, scorer, teacher)
        rec.reward_failures = RewardFailures(run, cfg.reward.on_failure, cfg.reward.max_failure_frac, console.print, state.step)
        rec.deadletters = sessions.whole_run(run)["deadletters"]  # a resumed run counts the earlier sessions' too
        rec.dead_letter(deadletter)
        if ckpt is not None:  # a resume distils from the teacher the run started with (its weights' hash)
            teacher_placement.check_resume(_read_info(run), teacher)
        teacher_info = {} if teacher is None else {"teacher_params": teacher.params, "teacher": teacher.facts}
        (run / rundir.RUN_INFO).write_text(json.dumps({**run_info(cfg, model, settings), **precision, **teacher_info,
                                                       **(info or {})}, indent=1))
        _renote_eval(rec)
        _first_eval(rec, handles, cfg, sft_info)
        dump_config(cfg, run / rundir.CONFIG)  # only once start-up succeeded: a failed resume leaves it as it was
        return rec, handles, extra_rng
    except BaseException:  # a refused start (resume of another model's checkpoint, a bad hook) leaves nothing running
        for handle in reversed(opened):
            with contextlib.suppress(Exception):
                handle.close()
        rundir.unlock(run)
        raise


def _precisions(cfg: RunConfig, model, settings: roles.Settings) -> dict:
    """The trainer's and the native engine's matmul precisions with why (run.json's keys), said at start-up."""
    device = torch.device(settings.device)
    out = dict(zip(("precision", "precision_reason"), precision_choice(cfg.trainer.precision, model, device)))
    console.print(f"trainer precision {out['precision']} ({out['precision_reason']})" + kernels_said(settings.device))
    if cfg.rollout.backend == "native":
        chosen, why = rollout_precision(cfg.rollout.precision, model, device)
        out.update(rollout_precision=chosen or {v: k for k, v in DTYPES.items()}[settings.plan.dtype],
                   rollout_precision_reason=why)
        console.print(f"rollout precision {out['rollout_precision']} ({why})")
    return out


def _read_info(run: Path) -> dict | None:
    """The run's run.json as the last session wrote it (None: none, or unreadable)."""
    try:
        return json.loads((run / rundir.RUN_INFO).read_text())
    except (OSError, ValueError):
        return None


def held_out_count(cfg: RunConfig, held_out: list[Prompt]) -> str:
    """``"200 prompts"``, saying so when a built-in task's eval split holds fewer than data.eval_size."""
    n = len(held_out)
    short = not cfg.data.eval_path and cfg.data.task and n < cfg.data.eval_size
    return f"{n} prompts" + (f": the whole {cfg.data.task} eval split, data.eval_size={cfg.data.eval_size} asks for "
                             f"more" if short else "")


def evaluate(run: RunRecord, r: Roles) -> float | None:
    """Held-out greedy accuracy now; None when there is no held-out set.

    Labelled ``run.state.step``, the optimizer steps done so far, i.e. the step that starts from
    this policy: eval.jsonl's ``step`` and the metrics row that holds ``eval/accuracy`` are the same
    (0: before RL; the eval after the last step has no row)."""
    acc = roles.held_out_accuracy(run.cfg, r.model, r.tokenizer, r.held_out, r.held_out_rewards, r.context)
    if acc is not None:
        run.telemetry.evaluation(run.state.step, acc)
        if run.state.step < run.cfg.steps:  # eval/prompts: the held-out regression alarm's noise
            run.telemetry.note(run.state.step, {"eval/accuracy": acc, "eval/prompts": len(r.held_out)})
    return acc


def _renote_eval(run: RunRecord) -> None:
    """A resumed run: the eval recorded at the checkpoint's step goes into that step's row again."""
    path = run.run_dir / rundir.EVAL
    for e in rundir.read_jsonl(path) if path.exists() and run.state.step < run.cfg.steps else ():
        if e.get("step") == run.state.step and isinstance(e.get("accuracy"), (int, float)):
            run.telemetry.note(run.state.step, {"eval/accuracy": e["accuracy"]})


def kernels_said(device: str) -> str:
    """``"; CPU kernels on, oneDNN linear off"`` for the start-up line on a CPU (run.json's ``kernels`` has why)."""
    if not str(device).startswith("cpu"):
        return ""
    kernels.kernel()  # loaded (or refused, said once) now: this line and run.json state the same thing
    c = model_choices()
    return f"; CPU kernels {c['cpu_kernels']}, oneDNN linear {'on' if c['onednn_linear'] else 'off'}"


def run_info(cfg: RunConfig, model, settings: roles.Settings) -> dict:
    """run.json: the facts plan/review need (rundir.RUN_INFO_KEYS, sync facts from the sync layer),
    plus the placement's (rundir.RUN_INFO_EXTRA)."""
    colocated = cfg.placement == "colocated"
    facts = sync_facts(cfg, model, settings.plan)
    gpu = settings.device.startswith("cuda")
    return {
        "policy_params": num_params(model), "bytes_per_param": next(model.parameters()).element_size(),
        "placement": cfg.placement, "sync_mode": "inprocess", "dp": cfg.trainer.dp, "sharding": cfg.trainer.sharding,
        "dp_backend": (("nccl" if gpu else "gloo") if cfg.trainer.dp > 1 else None),
        "prompts_per_step": cfg.rollout.prompts_per_step, "samples_per_prompt": cfg.rollout.samples_per_prompt,
        "max_new_tokens": cfg.rollout.max_new_tokens, "lora_fraction": None, "steps": cfg.steps, **facts,
        "staleness_bound": settings.bound,
        "sync_transport": "inprocess" if colocated and facts["sync_mode"] == "inprocess" else
                          (cfg.sync.transport if cfg.sync.transport != "auto" else ("inprocess" if colocated else "ray")),
        "rollout_workers": 0 if colocated else cfg.rollout.workers,
        "inflight": cfg.rollout.inflight if cfg.placement == "async" else "finish",
        "kernels": model_choices(),  # numerics-relevant choices made so far; finish() writes the whole run's
        "device": "gpu" if gpu else "cpu",
        "backend": cfg.rollout.backend, "accuracy_signal": accuracy_signal(cfg),  # what scores the held-out eval (None: no held-out accuracy)
        **roles.rollout_facts(cfg),  # the engine side's (roles.py)
    }


def finish(run: RunRecord, r: Roles) -> dict:
    """Eval after, export the policy, write summary.json and trace.json, print the tables."""
    cpu_memory.release_freed_memory()  # the last step's freed pages, before the eval's engine (model/memory.py)
    after = evaluate(run, r)
    export(r.model, r.tokenizer, run.run_dir / rundir.MODEL, dtype=source_dtype(run.cfg.model.name))
    run.telemetry.close()
    r.rewards.close()
    if r.held_out_rewards is not None and r.held_out_rewards is not r.rewards:  # eval.reward's own pool
        r.held_out_rewards.close()
    if hasattr(r.trainer, "close"):  # dp ranks (trainer/dp.py)
        r.trainer.close()
    summary = {
        "eval_before": run.state.eval_before, "eval_after": after, "steps": run.state.step,
        "version": run.state.version, "seconds": time.time() - run.started, "deadletters": run.deadletters,
        "reward_flags": run.flags, "placement": run.cfg.placement, "prompts": r.feed.ledger.counts(),
        **run.totals, **run.state.extra,
        "role_seconds_per_step": {k: s for k, s, _ in role_shares(run.telemetry.step_seconds)},
        "memory_peak_gb": run.telemetry.memory.run_peaks_gb(),  # this session's measured peak RSS per role (GB)
        **({"memory_gpu_peak_gb": gpu} if (gpu := run.telemetry.memory.run_peaks_gb(gpu=True)) else {}),  # on CUDA
        # this session's calls beside decoding by role, every worker's (p50_s, p90_s, p99_s, max_s, calls)
        **{f"{role}_latency_s": {**latency_metrics(seconds, ""), "calls": len(seconds)}
           for role, seconds in run.side_seconds.items() if seconds},
    }
    summary.update(sessions.whole_run(run.run_dir))  # totals over every session of the run, not just this one
    (run.run_dir / rundir.SUMMARY).write_text(rundir.strict_json(summary))
    info = json.loads((run.run_dir / rundir.RUN_INFO).read_text())  # the kernel choices the whole run made
    (run.run_dir / rundir.RUN_INFO).write_text(json.dumps({**info, "kernels": model_choices()}, indent=1))
    print_summary(run.telemetry.step_seconds, run.state.eval_before, after, run.telemetry.outside)
    console.print(f"run directory: {run.run_dir} (model/, metrics.jsonl, trace.json, traffic.jsonl, checkpoints/)")
    rundir.unlock(run.run_dir)
    return summary
