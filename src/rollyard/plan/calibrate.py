"""`rollyard plan --calibrate-from RUN_DIR`: a plan priced with rates measured on the machine a run used.

A budget to hold runs to needs rates of *this* machine; the defaults are H100-class and mean nothing
for a CPU run. Calibration reads a baseline run (run.json, spans, lengths) and sets the plan's
rates so that the plan, on the baseline's own shape, prices every phase at the baseline's mean over
the steps after the first (``review.steady``: the first step carries the engine's start-up, ~5-10 s for
a vLLM engine here, which no per-step budget prices; review holds runs to the same steady state):

- rollout: the decode model's rates, ``rollout.mem_bandwidth`` and ``rollout.peak_flops`` by one factor,
  solved so the model's synchronous round equals the measured mean (every term of the round is 1 / rate,
  so the solution is exact); a plan with more prompts or longer responses then scales by the decode model;
- train: ``trainer.flops_per_gpu`` solved so that the estimated train phase (every pass the run made: its epochs,
  recompute and bubble, ``hardware.trainer_terms``) equals the measured mean; each term goes as 1 / rate, so the
  solution is exact, and the train estimate then scales with tokens;
- reference, the teacher's forward and sampling (``phases.teacher_s``, ``teacher_sample_s``: the run-implied
  plan's, ``review.plan_from_run``), reward, algorithm: the measured seconds, given (the plan has no model to
  scale them);
- sync: the term-by-term model of one sync (``bytes.sync_costs``: pause/resume, per tensor, per
  bucket, cast and engine copy rates, for the run's ``rollout.backend`` and device) written out
  explicitly, and ``sync.fixed_s``, what the measured sync seconds leave beyond them (terms that
  price more than was measured are scaled down to it first; see ``sync_terms``);
- ``budget.tolerance``: from the baseline's own step-to-step noise (``spread``: three standard
  errors of the difference of two N-step means, for the noisiest phase of at least 5% of the step;
  never below the default 0.2). On a quiet machine that is tight; on a shared one it is honest.

The calibrated plan is ordinary plan inputs (``--out`` writes them as plan.yaml), so `review RUN
--plan DIR/plan.yaml --check` is a gate on any machine: it fails when a phase leaves the budget.
"""

from __future__ import annotations

from pathlib import Path

from rollyard.plan import bytes as B
from rollyard.plan import hardware as H
from rollyard.plan.inputs import PlanInputs
from rollyard.plan.planner import make_plan
from rollyard.plan.review import phase_seconds, plan_from_run, read_run, steady

MIN_SHARE = 0.05  # phases below this share of the step do not set the tolerance (timer noise dominates)
MIN_TOLERANCE = 0.2  # the plan's default budget.tolerance


def spread(per_step: dict[str, list[float]]) -> float:
    """Three standard errors of the difference of two N-step means, relative to the mean, for the
    noisiest phase holding at least MIN_SHARE of the step: 3 x sqrt(2) x (std / mean) / sqrt(N).

    A run like the baseline (same shape, same machine, same noise) has phase means whose difference
    from the baseline's is within that bound with ~99.7% probability (normal approximation); the
    gate fails runs outside it. A single-step baseline has no spread: the default tolerance stands."""
    means = {r: sum(v) / len(v) for r, v in per_step.items() if v}
    total = sum(means.values()) or 1.0
    out = 0.0
    for role, vals in per_step.items():
        m, n = means.get(role, 0.0), len(vals)
        if m > 0 and m / total >= MIN_SHARE and n > 1:
            std = (sum((x - m) ** 2 for x in vals) / (n - 1)) ** 0.5
            out = max(out, 3 * 2 ** 0.5 * (std / m) / n ** 0.5)
    return out


SYNC_TIMES = ("pause_s", "send_per_tensor_s", "load_per_tensor_s", "per_bucket_s")  # seconds per item
SYNC_RATES = ("cast_bw", "load_bw")  # bytes per second


def planned_sync(data: dict, lengths: list[int] | None) -> float:
    """Seconds per sync the plan of ``data`` budgets (what review holds the run's sync spans to)."""
    p = PlanInputs.model_validate(data)
    return make_plan(p, lengths).step_budget().get("sync", 0.0) * p.sync.every_steps


def sync_terms(base: PlanInputs, one_sync: float, data: dict, lengths: list[int] | None) -> dict:
    """The sync section's terms, so the plan prices one sync at the measured ``one_sync`` seconds.

    The terms start at the values the run's own plan resolves to (``bytes.sync_costs``: for a CPU
    run, the receiving backend's rates measured by bench/sync.py; native and vLLM differ) and are
    written out explicitly: the calibrated ``rollout.mem_bandwidth`` is a decode rate, not the rate
    of a copy into the engine, and must not reprice them. What the terms leave of the measured sync
    is ``fixed_s``; when they price more than was measured (this machine copied faster than the
    bench's), every time term is scaled down and every rate up by the same factor first, keeping
    their proportions."""
    c = B.sync_costs(base)
    out = {k: getattr(c, k) for k in (*SYNC_TIMES, *SYNC_RATES)}
    out["reload_whole_model"], out["fixed_s"] = c.reload_whole_model, 0.0
    trial = {**data, "sync": {**data["sync"], **out}}
    moving = planned_sync(trial, lengths)
    if moving > one_sync > 0:
        r = one_sync / moving
        out.update({k: out[k] * r for k in SYNC_TIMES})
        out.update({k: out[k] / r for k in SYNC_RATES})
        moving = planned_sync({**data, "sync": {**data["sync"], **out}}, lengths)
    out["fixed_s"] = max(0.0, one_sync - moving)
    return out


def calibrate(run_dir: str | Path) -> tuple[dict, dict]:
    """Plan data (nested dicts, ready for overrides and ``validate_plan``) and what was measured."""
    run = read_run(run_dir)
    base = plan_from_run(run)
    lengths = [n for v in run.lengths.values() for n in v] or None
    per = steady(phase_seconds(run.spans))  # the first step's start-up is not a per-step cost
    secs = {r: sum(v) / len(v) for r, v in per.items() if v}
    data = base.model_dump(mode="json")
    ph = data["phases"]
    ph["gpus"] = None
    ph["train_s_measured"] = {}
    note: dict[str, float] = {}

    rollout = secs.get("rollout", 0.0)
    if rollout > 0:
        ph["rollout_s"] = None
        data["rollout"]["bytes_per_decoded_token"] = None
        modelled = H.rollout_s(PlanInputs.model_validate(data), base.rollout.gpus, lengths=lengths)
        scale = modelled / rollout  # the round's HBM and FLOP bounds both go as 1 / rate: scale them together
        data["rollout"]["mem_bandwidth"] = base.rollout.mem_bandwidth * scale
        data["rollout"]["peak_flops"] = (base.rollout.peak_flops or base.trainer.peak_flops) * scale
        note["rollout_s"] = rollout
    train = secs.get("train", 0.0)
    if train > 0:
        ph["train_s"] = None
        # every train term is work / rate: price it at 1 FLOP/s, then the rate that makes it the measured seconds
        data["trainer"]["flops_per_gpu"] = 1.0
        p = PlanInputs.model_validate(data)
        data["trainer"]["flops_per_gpu"] = H.train_s(p, H.trainer_gpus(p)) / train
        note["train_s"] = train

    every = base.sync.every_steps
    one_sync = secs.get("sync", 0.0) * every
    data["sync"].update(sync_terms(base, one_sync, data, lengths))
    note["sync_s"] = one_sync
    data["budget"]["tolerance"] = round(max(MIN_TOLERANCE, min(spread(per), 10.0)), 3)
    data["name"] = f"calibrated from {run.path.name}"
    return data, note
