"""The one GRPO step, for every placement: take -> score -> train -> publish -> close.

A placement only chooses its rollout side (``colocated.LocalRollout``: an engine in this process;
``pool.RolloutPool``: Ray actors, disaggregated or async with its staleness bound) and calls
``train(run, roles, side)``. A side implements ``placement/side.py``'s ``RolloutSide`` (take, trainer_turn,
session, publish, check, canary, metrics, checkpoint, stop).

The publish rule is the session's: a version newer than the last published and a multiple of
``sync.every``. A skipped optimizer step (non-finite loss) makes no version, so no placement
publishes after it; the next update that lands on a multiple of ``sync.every`` does.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from rollyard.algo.advantages import assign_advantages, overlong_penalty
from rollyard.algo.support import Support
from rollyard.model import families
from rollyard.placement import teacher as teacher_placement
from rollyard.placement.run import Roles, RunRecord, finish
from rollyard.reward.dispatcher import UNSCORED, split_unscored
from rollyard.sync import canary
from rollyard.telemetry.report import StepProgress
from rollyard.trainer.dp import after_step
from rollyard.trainer.optimize import optimize
from rollyard.trainer.settings import trainer_kwargs
from rollyard.types import Request, Sample


@dataclass
class Taken:
    """What a rollout side hands the step."""

    requests: list[Request]
    samples: list[Sample]
    extra: dict = field(default_factory=dict)  # the side's per-step metrics (engine CPU, tail counters)
    train_metrics: dict | None = None  # set when the side already trained on them (tail batching)


def train(run: RunRecord, r: Roles, side) -> dict:
    """Every remaining step of the run over ``side``; returns the summary. The side is stopped at the end."""
    cfg = run.cfg
    try:
        run.begin()
        if not cfg.sync.canary_every:
            run.log("logprob canary: off (sync.canary_every=0): no canary/logprob_gap, its alarm unarmed")
        with StepProgress(cfg.steps, run.state.step, cfg.progress, cfg.log.progress_every) as progress:
            for step in range(run.state.step, cfg.steps):
                grpo_step(run, r, side, step, progress)
        run.finish_checkpoint()  # the last checkpoint's background write is on disk (or its failure raised)
    except BaseException:  # a run that stops mid-way (an error, a signal) leaves no verifier worker behind
        run.settle_checkpoint()  # ... nor a checkpoint write in flight
        for pool in {id(p): p for p in (r.rewards, r.held_out_rewards) if p is not None}.values():
            with contextlib.suppress(Exception):
                pool.close()
        raise
    finally:
        side.stop()
        for scorer in (r.reference, r.teacher):
            if scorer is not None:
                scorer.stop()
    return finish(run, r)


def grpo_step(run: RunRecord, r: Roles, side, step: int, progress) -> None:
    trained_at = run.state.version  # the version that trains this step's samples
    got = side.take(step, trained_at)
    samples, train_metrics = got.samples, got.train_metrics
    if train_metrics is None:
        samples, trained = score(run, r, step, samples)
        if run.cfg.algo.dynamic_sampling:
            got, samples, trained = fill_with_signal(run, r, side, step, got, samples, trained)
        t, a = run.cfg.trainer, run.cfg.algo
        with side.trainer_turn(), run.telemetry.span("train", step, requests=[q.id for q in got.requests]):
            train_metrics = optimize(r.trainer, trained, t.epochs, t.mini_batches, a.top_entropy_quantile,
                                     getattr(r.trainer, "loss_mask", None))
    after_step(run.telemetry, step, r.trainer)  # dp ranks: the gradients edge; fsdp: the gather for the publish
    ledger = r.feed.ledger  # rejected prompts are dead already; a tail round's come from its own queue
    ledger.trained([q.id for q in got.requests if ledger.state.get(q.id) in ("in_flight", "deferred")])
    # a version per optimizer step that was not skipped (a non-finite loss makes none)
    applied = train_metrics.get("applied", 0.0 if train_metrics.get("skipped") else 1.0)
    before = run.state.version
    run.state.version += int(applied)
    if r.reference is not None and run.cfg.reference.sync_every:
        r.reference.follow(r.trainer, before, run.state.version, run.cfg.reference)
    checked = publish(run, side, step)
    run.close_step(step, r, progress, got.requests, samples, train_metrics, trained_at,
                   extra={**got.extra, **side.metrics(), "sync/checked": checked,
                          **(r.reference.metrics() if r.reference is not None else {}),
                          **(r.teacher.metrics() if r.teacher is not None else {})}, extra_rng=side.checkpoint)


def fill_with_signal(run: RunRecord, r: Roles, side, step: int, got: Taken, samples: list[Sample],
                     trained: list[Sample]) -> tuple[Taken, list[Sample], list[Sample]]:
    """DAPO's dynamic sampling: keep the groups whose rewards differ (a group of equal rewards has advantage 0
    everywhere: no signal) and take more rounds from ``side`` until ``rollout.prompts_per_step`` groups are kept or
    ``algo.dynamic_sampling_rounds`` rounds were drawn. Every group drawn is accounted for (trained on, or counted in
    ``dynamic/dropped_groups``). The step trains the first ``prompts_per_step`` groups kept, as verl trims its batch:
    the batch (and so the step's learning rate per sample) stays the configured one; a last round's groups with
    signal beyond it are consumed untrained, counted in ``dynamic/surplus_groups``."""
    cfg = run.cfg
    requests, extra = list(got.requests), dict(got.extra)
    kept, dropped = with_signal(trained)
    rounds = 1
    while len({s.request_id for s in kept}) < cfg.rollout.prompts_per_step and rounds < cfg.algo.dynamic_sampling_rounds:
        more = side.take(step, run.state.version)
        rounds += 1
        scored, t = score(run, r, step, more.samples)
        requests += more.requests
        samples = samples + scored
        k, d = with_signal(t)
        kept, dropped = kept + k, dropped + d
    kept, surplus = first_groups(kept, cfg.rollout.prompts_per_step)
    groups = len({s.request_id for s in kept})
    extra.update({"dynamic/rounds": float(rounds), "dynamic/kept_groups": float(groups),
                  "dynamic/dropped_groups": float(dropped), "dynamic/surplus_groups": float(surplus),
                  "dynamic/short": float(groups < cfg.rollout.prompts_per_step)})
    return Taken(requests, samples, extra), samples, kept


def first_groups(samples: list[Sample], k: int) -> tuple[list[Sample], int]:
    """``(the samples of the first k groups, in the order drawn; how many groups were left out)``."""
    order = list(dict.fromkeys(s.request_id for s in samples))
    keep = set(order[:k])
    return [s for s in samples if s.request_id in keep], max(0, len(order) - k)


def with_signal(samples: list[Sample]) -> tuple[list[Sample], int]:
    """``(samples of the groups whose rewards are not all equal, the number of groups left out)``."""
    by_group: dict[str, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.request_id, []).append(s)
    kept = [s for g in by_group.values() if len({x.reward for x in g}) > 1 for s in g]
    return kept, sum(1 for g in by_group.values() if len({x.reward for x in g}) <= 1)


def publish(run: RunRecord, side, step: int) -> int:
    """Publish by the one rule, then check when due; returns 1 if the rollout side was checked."""
    session, version = side.session, run.state.version
    if not session.due(version):
        return 0
    with run.telemetry.span("sync", step, mode=session.mode, transport=session.transport, version=version) as span:
        nbytes = side.publish(step, version)
        span.update(bytes=nbytes, values=sum(t.numel() for t in session.last.tensors.values()))
    run.telemetry.traffic(step, "weights", nbytes)
    run.count("sync/bytes", nbytes)
    if session.canary_due():
        with run.telemetry.span("canary", step, version=version):  # its own seconds (time/canary), not the step's gap
            note = logprob_canary(side, version)
        run.telemetry.note(step, note)
    if not session.check_due():
        return 0
    side.check(step, version)
    return 1


def logprob_canary(side, version: int) -> dict[str, float]:
    """The trainer's model and the rollout side score the fixed probe right after the sync (``sync/canary.py``):
    ``canary/logprob_gap`` at equal versions and ``canary/lag`` of the latest answered canary (a Ray side
    answers without holding the step up: its row may carry the previous sync's); none without a copy. The
    trainer's side scores on the support its ratio is taken over (``trainer_kwargs``: every rank's), the
    rollout side on the one its engine samples from."""
    r, kw = side.r, trainer_kwargs(side.run.cfg)
    probe = canary.probe(r.model.config.vocab_size, r.context)
    under = Support.of(kw["temperature"], kw["top_p"], kw["top_k"])
    return side.canary(version, probe, canary.score(r.model, probe, under, families.completion_logits))


def settle(run: RunRecord, step: int, samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """``(scored, trained)``: samples no verifier scored are dead-lettered and left out of both;
    failed verifier calls are counted and, by default, left out of ``trained``."""
    samples, unscored = split_unscored(samples)
    run.dead_letter([{"source": s.id, "reason": UNSCORED} for s in unscored], step)
    return samples, run.settle_rewards(step, samples)


def add_reference(r: Roles, samples: list[Sample], step: int = 0, telemetry=None) -> None:
    """Reference logprobs for the KL term (none when ``algo.kl_coef == 0``: no reference model), by the
    reference's placement (``placement/reference.py``); spans its actors recorded go to ``telemetry``."""
    if r.reference is not None:
        for span in r.reference.fill(r.trainer, samples, step):
            if telemetry is not None:
                telemetry.record(span)


def score(run: RunRecord, r: Roles, step: int, samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """reward -> reference -> advantages, with their spans and edges. Returns ``(scored, trained)``:
    every scored sample (for the step's metrics) and those to train on, advantages set."""
    with run.telemetry.span("reward", step):
        samples = r.rewards.score(samples)
    samples, trained = score_rewarded(run, r, step, samples)
    edges(run, r, step, samples, trained)
    return samples, trained


def score_rewarded(run: RunRecord, r: Roles, step: int, samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """The scoring after the verifiers, with its spans: settle (``settle``), reference and teacher logprobs, advantages (GRPO:
    per group). The plain step calls it once over the step's samples; a streamed round (``streamed.py``) once per
    complete group while the rest decodes. Returns ``(scored, trained)``; the edges are the caller's (``edges``)."""
    tel, cfg = run.telemetry, run.cfg
    samples, trained = settle(run, step, samples)
    if r.reference is not None and trained:  # (a streamed group whose every verifier call failed has none)
        with tel.span("reference", step, placement=cfg.reference.placement):  # the trainer's wait for it
            add_reference(r, trained, step, tel)
    if r.teacher is not None and trained:  # the distillation teacher's log-probs (placement/teacher.py)
        if cfg.algo.objective == "gkd":  # GKD's lmbda: some groups train on the dataset's reference completion
            trained = teacher_placement.with_references(r.teacher, r.trainer, trained, cfg.seed, cfg.algo.gkd_lmbda,
                                                        cfg.rollout.max_new_tokens, r.context, run.state.version,
                                                        telemetry=tel, step=step)  # seq_kd: span teacher_sample
        with tel.span("teacher", step, placement=cfg.teacher.placement):
            for span in r.teacher.fill(r.trainer, trained, step):
                tel.record(span)
    a = cfg.algo
    with tel.span("algorithm", step):
        for s in trained:  # DAPO's overlong shaping (0 when algo.overlong_buffer = 0)
            s.reward += overlong_penalty(len(s.completion_ids), cfg.rollout.max_new_tokens, a.overlong_buffer,
                                         a.overlong_penalty)
        assign_advantages(trained, a.normalize_std, a.std_eps, a.std_scope, a.multi_objective, cfg.reward.weights)
    return samples, trained


def edges(run: RunRecord, r: Roles, step: int, scored: list[Sample], trained: list[Sample]) -> None:
    """The step's scoring edges: a reward per scored sample, a reference (and a teacher) logprob per trained completion
    token."""
    run.telemetry.traffic(step, "rewards", 4 * len(scored))
    if r.reference is not None:  # its logprobs travel to the trainer
        run.telemetry.traffic(step, "ref_logprobs", 4 * sum(len(s.completion_ids) for s in trained))
    if r.teacher is not None:  # the teacher's too (algo.objective=distill | rl+distill); under gkd its top-k as well:
        k = run.cfg.algo.gkd_top_k if run.cfg.algo.objective == "gkd" else 0  # an int32 id + fp32 log-prob each
        run.telemetry.traffic(step, "teacher_logprobs", (4 + 8 * k) * sum(len(s.completion_ids) for s in trained))


no_turn = contextlib.nullcontext  # a side whose rollout holds nothing the trainer needs while it steps
