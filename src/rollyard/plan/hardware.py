"""Equal hardware: every placement priced on the same G accelerators (runbook step 6's rate matching).

Phase times are functions of the GPUs a pool gets:

- rollout on g GPUs: the decode model of ``mechanisms`` (synchronous round or bubble-free floor, each
  the roofline of HBM reads and FLOPs plus the engine's work per step) on the real per-replica batch. A
  measured ``phases.rollout_s`` (a synchronous round on ``phases.gpus``) sets the level: what it takes
  beyond the roofline is the engine's work per decode step (``measured_step_overhead``), paid by every
  decode step on any pool; a measurement faster than the roofline (the stated rates are too low) scales
  the model instead (measured x model(g) / model(measured GPUs));
- trainer on g GPUs: estimated from FLOPs (6 x P_active x tokens for fwd+bwd, 2 x P_active x tokens
  for a reference forward, at peak x MFU); a measured time scales to other pool sizes by Amdahl's law
  with ``trainer.serial_fraction`` (``mechanisms.amdahl_s``; 0 = time x GPUs constant);
- reward: CPU verifiers, independent of the GPU split (on the rollout side unless streamed);
- algorithm (advantages, loss bookkeeping): a given time on the trainer side, independent of the split.

``split_table`` evaluates colocated on G, and disaggregated and async at every split of G into whole
engine replicas (on large pools, a grid refined around its best: ``search_splits``), and reports the
best split of each.
"""

from __future__ import annotations

from dataclasses import replace

from rollyard.plan import mechanisms as M
from rollyard.plan.inputs import STEP_OVERHEAD_S, PlanError, PlanInputs


def active_params(p: PlanInputs) -> float:
    """Parameters that do FLOPs per token (MoE: active; dense: all)."""
    return p.policy.active_params or p.policy.params


def weight_bytes(p: PlanInputs) -> float:
    """Bytes of the rollout copy of the weights (all experts: every one is resident and synced)."""
    return p.policy.params * p.policy.bytes_per_param


def sequences(p: PlanInputs) -> int:
    return p.rollout.prompts * p.rollout.samples


def trainer_gpus(p: PlanInputs) -> int:
    return p.trainer.gpus or p.trainer.dp


def mean_bounds(p: PlanInputs) -> list[tuple[str, float]]:
    """The most generated tokens per response each measured phase allows, as (what, tokens): a phase
    measured at t s on g GPUs did at most t x g x peak FLOPs (``M.tokens_at_peak``), at the plan's own
    FLOPs per token (decode and reference forward 2 x P_active, train 6 x P_active: forward + backward
    without recompute, the fewest a train step does). The trainer's phases process every sequence's
    prompt and response, so their bound less ``rollout.prompt_tokens`` is the response's; the rollout
    round's counts generated tokens only (a prompt's prefill may be shared by its samples)."""
    ph, tr, ro = p.phases, p.trainer, p.rollout
    seqs, fpt = sequences(p), 2 * active_params(p)
    tg, rg = ph.gpus or trainer_gpus(p), ph.gpus or ro.gpus
    # Positions the trainer computes (train_tokens): the prompt per sample or once per group; a train step
    # computes the share of samples it does not skip (so its FLOPs per sequence are k x fpt x that share).
    prompt = ro.prompt_tokens * (ro.prompts / seqs if tr.prefix_shared else 1.0)
    kept = 1.0 - tr.zero_advantage_share
    measured = [("phases.rollout_s", ph.rollout_s, 1, rg, ro.peak_flops or tr.peak_flops, 0.0),
                ("phases.reference_s", ph.reference_s if ph.use_reference else None, 1, tg, tr.peak_flops, prompt),
                ("phases.train_s", ph.train_s, 3 * kept, tg, tr.peak_flops, prompt)]
    measured += [(f"phases.train_s_measured[{g}]", t, 3 * kept, g, tr.peak_flops, prompt)
                 for g, t in sorted(ph.train_s_measured.items())]
    return [(f"{what} = {t:g} s on {g} GPUs at {peak:.3g} FLOP/s", M.tokens_at_peak(t, g, peak, k * fpt) / seqs - prompt)
            for what, t, k, g, peak, prompt in measured if t]


def bounded_mean(p: PlanInputs) -> tuple[PlanInputs, str | None]:
    """``p`` with ``rollout.avg_tokens`` no larger than the tightest of ``mean_bounds``, and the finding
    that says so (None when the stated mean fits every measured phase). A stated mean above a bound
    cannot have run in the measured time at the GPUs' peak, so the plan prices the bound: the longest
    mean the measurements allow. Raises PlanError when a bound leaves no room for one response token."""
    bounds = mean_bounds(p)
    if not bounds:
        return p, None
    what, cap = min(bounds, key=lambda b: b[1])
    ro = p.rollout
    if cap >= ro.avg_tokens:
        return p, None
    if cap < 1:
        raise PlanError(f"{what} leaves {cap:.3g} generated tokens per response for "
                        f"{sequences(p)} sequences of {ro.prompt_tokens:g} prompt tokens: no GPU runs above its peak; "
                        f"fix: check that phase time, phases.gpus, trainer.peak_flops and the batch "
                        f"(rollout.prompts, rollout.samples, rollout.prompt_tokens)")
    note = (f"rollout.avg_tokens = {ro.avg_tokens:g} is more than the measured phases allow: {what} "
            f"holds at most {cap:.0f} generated tokens per response ({sequences(p)} sequences of "
            f"{ro.prompt_tokens:g} prompt tokens at {2 * active_params(p):.3g} FLOP per token forward); the plan "
            f"prices {cap:.0f} (state a mean the measurements allow, or a run's lengths with --lengths-from)")
    return p.model_copy(update={"rollout": ro.model_copy(update={"avg_tokens": cap})}), note


def longest(p: PlanInputs, lengths: list[int] | None = None) -> float:
    """Expected longest response of one step (the synchronous barrier)."""
    return M.expected_longest(sequences(p), mean=p.rollout.avg_tokens, sigma=p.tail.sigma,
                              cap=p.tail.max_tokens, lengths=lengths)


def step_overhead(p: PlanInputs) -> float:
    """The engine's work per decode step: the plan's figure, else the backend's published one on a GPU
    (``inputs.STEP_OVERHEAD_S``), 0 on a CPU."""
    ro = p.rollout
    if ro.step_overhead_s is not None:
        return ro.step_overhead_s
    return STEP_OVERHEAD_S[ro.backend] if ro.device == "gpu" else 0.0


def decode_on(p: PlanInputs, gpus: int, lengths: list[int] | None = None) -> M.Decode:
    ro = p.rollout
    # Measured lengths may hold empty responses; a decode of zero mean tokens has nothing to price.
    mean = max(sum(lengths) / len(lengths), 1.0) if lengths else ro.avg_tokens
    return M.replica_decode(sequences_total=sequences(p), gpus=gpus, tp=ro.tp, mean_len=mean,
                            longest=longest(p, lengths), concurrency=ro.concurrency, weight_bytes=weight_bytes(p),
                            kv_bytes_per_token=ro.kv_bytes_per_token, prompt_tokens=ro.prompt_tokens,
                            mem_bw=ro.mem_bandwidth, flops_per_token=2 * active_params(p),
                            peak_flops=ro.peak_flops or p.trainer.peak_flops, step_overhead_s=step_overhead(p))


SCHEDULES = {"round": M.round_steps, "continuous": M.continuous_steps, "balanced": M.balanced_steps}


def _modelled_rollout(p: PlanInputs, gpus: int, schedule: str, lengths: list[int] | None,
                      overhead_s: float | None = None) -> float:
    """The decode model's seconds on ``gpus`` GPUs; ``overhead_s`` replaces ``rollout.step_overhead_s``."""
    ro = p.rollout
    if ro.bytes_per_decoded_token is not None:  # a stated per-token cost: no schedule to model
        return sequences(p) * ro.avg_tokens * ro.bytes_per_decoded_token / (ro.mem_bandwidth * gpus)
    d = decode_on(p, gpus, lengths)
    if overhead_s is not None:
        d = replace(d, step_overhead_s=overhead_s)
    return d.round_s(SCHEDULES[schedule](d))


def measured_step_overhead(p: PlanInputs, lengths: list[int] | None = None) -> float | None:
    """The engine's work per decode step that a measured round implies: what ``phases.rollout_s`` takes
    beyond the decode roofline on its GPUs, over the round's decode steps. None when no round is given,
    when the model has no steps (a stated per-token cost), or when the measurement is faster than the
    roofline (then the stated rates are too low, and the model is scaled to the measurement instead)."""
    ro, given = p.rollout, p.phases.rollout_s
    if given is None or ro.bytes_per_decoded_token is not None:
        return None
    ref = p.phases.gpus or ro.gpus  # the given time is a synchronous round on these GPUs
    d = replace(decode_on(p, ref, lengths), step_overhead_s=0.0)
    roofline, steps = d.round_s(M.round_steps(d)), M.round_steps(d)
    return (given - roofline) / steps if given >= roofline and steps > 0 else None


def rollout_s(p: PlanInputs, gpus: int, *, continuous: bool = False, balanced: bool = False,
              lengths: list[int] | None = None) -> float:
    """Rollout seconds per step on ``gpus`` GPUs: a synchronous round (default), the bubble-free
    floor of continuous batching with partial rollout (``continuous``), or a round of mean-length
    responses (``balanced``). A measured round sets the engine's work per step (``measured_step_overhead``)."""
    schedule = "continuous" if continuous else "balanced" if balanced else "round"
    if p.phases.rollout_s is None:
        return _modelled_rollout(p, gpus, schedule, lengths)
    overhead = measured_step_overhead(p, lengths)
    if overhead is not None:
        return _modelled_rollout(p, gpus, schedule, lengths, overhead)
    model = _modelled_rollout(p, gpus, schedule, lengths)
    ref = p.phases.gpus or p.rollout.gpus
    den = _modelled_rollout(p, ref, "round", lengths)
    return p.phases.rollout_s * model / den if den > 0 else p.phases.rollout_s


def train_tokens(p: PlanInputs, skipping: bool = True) -> float:
    """Positions the trainer computes per step: every sample's response, and each prompt once per group
    (``trainer.prefix_shared``) or once per sample; ``skipping``: less the samples it leaves out
    (``trainer.zero_advantage_share``; a reference or old-logprob forward scores every sample)."""
    t, ro = p.trainer, p.rollout
    prompts = ro.prompts if t.prefix_shared else sequences(p)
    kept = 1.0 - t.zero_advantage_share if skipping else 1.0
    return kept * (prompts * ro.prompt_tokens + sequences(p) * ro.avg_tokens)


def trainer_flops(p: PlanInputs) -> float:
    """Sustained training FLOP/s per GPU: the stated ``trainer.flops_per_gpu``, else peak x MFU."""
    t = p.trainer
    return t.flops_per_gpu if t.flops_per_gpu is not None else t.peak_flops * t.mfu


def _flop_seconds(p: PlanInputs, flops_per_token_param: float, given: float | None, gpus: int,
                  skipping: bool = True) -> float:
    if given is not None:  # measured on phases.gpus: Amdahl's law to this pool
        return M.amdahl_s(given, p.phases.gpus or trainer_gpus(p), gpus, p.trainer.serial_fraction)
    return flops_per_token_param * active_params(p) * train_tokens(p, skipping) / (trainer_flops(p) * gpus)


def train_s(p: PlanInputs, gpus: int) -> float:
    """Forward + backward + optimizer on ``gpus`` GPUs (6 x P_active x tokens FLOPs).

    Measured times at several pool sizes (``phases.train_s_measured`` and the given ``train_s``)
    win over scaling: between two measured sizes the time is interpolated linearly, beyond them it
    scales from the nearest end by Amdahl's law (``trainer.serial_fraction``).
    """
    points = dict(p.phases.train_s_measured)
    if p.phases.train_s is not None:
        points.setdefault(p.phases.gpus or trainer_gpus(p), p.phases.train_s)
    if len(points) < 2 and gpus not in points:
        return _flop_seconds(p, 6, p.phases.train_s, gpus)
    gs = sorted(points)
    s = p.trainer.serial_fraction
    if gpus <= gs[0]:
        return M.amdahl_s(points[gs[0]], gs[0], gpus, s)
    if gpus >= gs[-1]:
        return M.amdahl_s(points[gs[-1]], gs[-1], gpus, s)
    hi = next(g for g in gs if g >= gpus)
    lo = max(g for g in gs if g <= gpus)
    if hi == lo:
        return points[lo]
    return points[lo] + (points[hi] - points[lo]) * (gpus - lo) / (hi - lo)


def reference_s(p: PlanInputs, gpus: int) -> float:
    """Reference (or old-logprob) forward on ``gpus`` GPUs (2 x P_active x tokens FLOPs); 0 when unused."""
    if not p.phases.use_reference:
        return 0.0
    return _flop_seconds(p, 2, p.phases.reference_s, gpus, skipping=False)


def reward_on_rollout_side(p: PlanInputs) -> float:
    """Reward seconds the rollout side waits for: 0 when scoring streams under decode."""
    return 0.0 if p.phases.reward_streamed else p.phases.reward_s


def split_table(p: PlanInputs, sync_per_step_s: float, reload_s: float,
                lengths: list[int] | None = None) -> dict[str, dict]:
    """placement -> {"best": PoolSplit, "all": [PoolSplit...]} on G = p.total_gpus() accelerators."""
    G = p.total_gpus()
    reward = reward_on_rollout_side(p)
    stream = p.trainer.minibatches if p.phases.train_streamed else 0
    algo = p.phases.algorithm_s  # advantages / loss bookkeeping: on the trainer side, as in the simulator
    ro, tr = rollout_s(p, G, lengths=lengths) + reward, reference_s(p, G) + train_s(p, G) + algo
    colo = M.PoolSplit("colocated", G, G, ro, tr, reload_s, M.colocated_step_s(ro, 0.0, tr, reload_s))
    out = {"colocated": {"best": colo, "all": [colo]}}
    tp = p.rollout.tp
    for placement in ("disaggregated", "async"):

        def price(replicas: int, placement=placement) -> M.PoolSplit:
            gr, gt = replicas * tp, G - replicas * tp
            if placement == "async":
                ro = rollout_s(p, gr, continuous=True, lengths=lengths) + reward
                tr = (0.0 if p.phases.async_rollout_logprobs else reference_s(p, gt)) + train_s(p, gt) + algo
                step = M.async_step_s(ro, tr, sync_per_step_s, p.sync.staleness_bound, stream)
            else:
                ro = rollout_s(p, gr, lengths=lengths) + reward
                tr = reference_s(p, gt) + train_s(p, gt) + algo
                step = M.disaggregated_step_s(ro, tr, sync_per_step_s, p.sync.staleness_bound, stream)
            return M.PoolSplit(placement, gr, gt, ro, tr, sync_per_step_s, step)

        rows = search_splits(price, (G - 1) // tp, p.rollout.gpus // tp)
        best = min(rows, key=lambda r: r.step_s) if rows else None
        out[placement] = {"best": best, "all": rows}
    return out


def search_splits(price, replicas: int, configured: int) -> list[M.PoolSplit]:
    """The splits priced for a pool of up to ``replicas`` rollout replicas (the trainer keeps the rest):
    every one when there are at most ``M.SPLIT_POINTS``, else an even grid refined around its best
    split, pass after pass, until the neighbours of the best are adjacent (exact when the step time
    falls then rises with the rollout pool's size, as max(rollout, trainer) does), plus the
    configured split. At most ~``SPLIT_POINTS`` x log(replicas) / log(SPLIT_POINTS / 2) prices."""
    if replicas < 1:
        return []
    rows: dict[int, M.PoolSplit] = {}
    lo, hi = 1, replicas
    while True:
        ks = M.grid(lo, hi)
        for k in ks:
            if k not in rows:
                rows[k] = price(k)
        i = min(range(len(ks)), key=lambda j: rows[ks[j]].step_s)
        if len(ks) == hi - lo + 1:
            break
        lo, hi = ks[max(i - 1, 0)], ks[min(i + 1, len(ks) - 1)]
    if 1 <= configured <= replicas and configured not in rows:
        rows[configured] = price(configured)
    return [rows[k] for k in sorted(rows)]
