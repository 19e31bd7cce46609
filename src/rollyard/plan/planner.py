"""``make_plan``: inputs -> every figure `rollyard plan` prints (bytes, phases, steps/hour at equal
hardware, decision, memory, what-ifs). Pure: no I/O, well under a second."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rollyard.plan import bytes as B
from rollyard.plan import hardware as H
from rollyard.plan import mechanisms as M
from rollyard.plan import tools as plan_tools
from rollyard.plan.decide import Decision, RateMatch, decide, rate_match
from rollyard.plan.inputs import PLACEMENTS, PlanInputs
from rollyard.plan.phases import Phases, estimate
from rollyard.plan.simulate import SimResult, steady_state
from rollyard.plan.whatif import (
    BudgetWhatIf,
    TailWhatIf,
    bound_by_floor,
    budget_whatif,
    tail_whatif,
)


@dataclass
class Plan:
    inputs: PlanInputs
    bytes: B.StepBytes
    per_hour: dict[str, float]
    sync_times: dict[str, dict[str, float]]
    phases: Phases
    decision: Decision
    edges: list[B.Edge]
    sims: dict[str, SimResult]
    rate: RateMatch
    budget: BudgetWhatIf
    tail: TailWhatIf
    equal: dict[str, dict] = field(default_factory=dict)  # hardware.split_table
    sync_detail: M.SyncTime | None = None
    memory: M.Memory | None = None
    findings: list[str] = field(default_factory=list)
    tools: plan_tools.ToolTime | None = None  # tool waits per step (plan/tools.py); None: not priced

    @property
    def placement(self) -> str:
        return self.decision.placement

    def sync_seconds(self) -> float:
        """One sync of the chosen mode (colocated: the engine reload)."""
        if self.placement == "colocated":
            return B.colocated_reload_seconds(self.inputs)
        return self.sync_times[self.decision.sync_mode][self.inputs.network.sync_link]

    def cadence(self) -> str:
        """Whether the chosen placement can run at the plan's stated steps per hour."""
        stated = B.steps_per_hour_stated(self.inputs)
        sim = self.sims[self.placement].steps_per_hour
        if stated <= sim * (1 + 1e-9):
            return (f"stated cadence {stated:.4g} steps/h is reachable: {self.placement} simulates "
                    f"{sim:.4g} steps/h")
        return (f"stated cadence {stated:.4g} steps/h is NOT reachable: {self.placement} simulates "
                f"{sim:.4g} steps/h ({3600 / sim:.1f} s/step); per-hour wire figures at the simulated rate are "
                f"{sim / stated:.2f}x the stated ones")

    def step_budget(self) -> dict[str, float]:
        """Per-role seconds per step the plan budgets for its placement (the review's yardstick)."""
        return self.phases.seconds()

    def equal_hardware(self) -> dict:
        """placement -> best split on G GPUs, JSON-ready, with speed-up over colocated."""
        base = self.equal["colocated"]["best"].step_s
        out = {}
        for name, t in self.equal.items():
            best = t["best"]
            if best is None:
                continue
            gt = H.trainer_gpus(self.inputs)
            mine = next((r for r in t["all"] if (r.rollout_gpus, r.trainer_gpus) == (self.inputs.rollout.gpus, gt)),
                        None) if name != "colocated" else None
            out[name] = {**best.as_dict(), "vs_colocated": base / best.step_s if best.step_s else None,
                         "configured": ({**mine.as_dict(), "vs_colocated": base / mine.step_s} if mine else None),
                         "splits": [{"rollout_gpus": r.rollout_gpus, "trainer_gpus": r.trainer_gpus,
                                     "step_s": r.step_s} for r in t["all"]]}
        return out

    def as_dict(self) -> dict:
        p = self.inputs
        return {
            "inputs": p.model_dump(mode="json"),
            "bytes": self.bytes.as_dict(),
            "per_hour": self.per_hour,
            "steps_per_hour_stated": B.steps_per_hour_stated(p),
            "tiers": p.tiers(),
            "sync_times": self.sync_times,
            "sync_breakdown": self.sync_detail.as_dict() if self.sync_detail else None,
            "sync_costs": B.sync_costs(p).__dict__,
            "gradient_seconds": self.bytes.gradient_per_rank / p.tiers()[p.network.trainer_link],
            "edges": [e.__dict__ for e in self.edges],
            "phases": {**self.phases.seconds(), "source": self.phases.source, "terms": self.phases.terms},
            "step_budget": self.step_budget(),
            "cadence": self.cadence(),
            "decision": self.decision.as_dict(),
            "simulation": {k: v.as_dict() for k, v in self.sims.items()},
            "equal_hardware": {"gpus": p.total_gpus(), **self.equal_hardware()},
            "memory": self.memory.as_dict() if self.memory else None,
            "findings": self.findings,
            "rate_matching": self.rate.__dict__,
            "budget_whatif": self.budget.as_dict(),
            "tail_whatif": self.tail.as_dict(),
            "tools": self.tools.as_dict() if self.tools else None,
        }


def shape_given(p: PlanInputs) -> bool:
    """The model's shape is stated (layers, hidden, vocab), so activations can be priced."""
    return None not in (p.policy.layers, p.policy.hidden, p.policy.vocab)


def memory_findings(p: PlanInputs, placement: str) -> tuple[M.Memory, list[str]]:
    """Memory per GPU of each role and what does not fit (a finding for the decision record).

    KV cache is paged, so it holds what the sequences in flight use: a full-length mean response
    (prompt + avg_tokens) each."""
    d = H.decode_on(p, p.rollout.gpus)
    in_flight = min(p.rollout.concurrency, d.sequences)
    where = p.phases.reference_placement  # the trainer holds a copy inline (and colocated, where no pool runs)
    ref_held = p.phases.use_reference and (where == "inline" or (where == "pool" and placement == "colocated"))
    teacher_held = p.phases.teacher_placement == "inline" or placement == "colocated"  # as the reference's copy
    mem = M.memory(params=p.policy.params, train_bytes_per_param=p.cluster.train_bytes_per_param,
                   trainer_gpus=H.trainer_gpus(p), sharded=p.trainer.sharding == "fsdp",
                   weight_bytes=H.weight_bytes(p), tp=p.rollout.tp, in_flight=in_flight,
                   kv_bytes_per_token=p.rollout.kv_bytes_per_token,
                   context=p.rollout.prompt_tokens + p.rollout.avg_tokens, gpu_memory=p.cluster.gpu_memory,
                   model_bytes_per_param=p.policy.bytes_per_param, reference=ref_held,
                   micro_batch_tokens=p.trainer.micro_batch_tokens if shape_given(p) else 0.0,
                   layers=p.policy.layers or 0, hidden=p.policy.hidden or 0, vocab=p.policy.vocab or 0,
                   checkpointing=p.trainer.activation_checkpointing,
                   logits_tokens=p.trainer.logits_tokens,
                   teacher_params=p.phases.teacher_params if teacher_held else 0.0)
    cap = p.cluster.gpu_memory
    out = []
    if mem.trainer_per_gpu > cap:
        out.append(f"trainer does not fit: {B.fmt_bytes(mem.trainer_per_gpu)} of training state per GPU "
                   f"({p.cluster.train_bytes_per_param:g} B/param, {p.trainer.sharding}) > {B.fmt_bytes(cap)}; "
                   f"shard it (trainer.sharding = fsdp) or add trainer GPUs")
    elif mem.trainer_total_per_gpu > cap:
        ckpt = mem.trainer_total_per_gpu - mem.activations_per_gpu + mem.activations_ckpt_per_gpu
        fix = ("turn on activation checkpointing (trainer.activation_checkpointing = true: "
               f"{B.fmt_bytes(ckpt)} per GPU)" if not p.trainer.activation_checkpointing and ckpt <= cap else
               "lower trainer.micro_batch_tokens, shard over more GPUs, or hold the reference elsewhere")
        out.append(f"trainer does not fit: model {B.fmt_bytes(mem.trainer_model_per_gpu)} + optimizer "
                   f"{B.fmt_bytes(mem.trainer_optimizer_per_gpu)} + reference {B.fmt_bytes(mem.reference_per_gpu)} + "
                   f"activations {B.fmt_bytes(mem.activations_per_gpu)} ({p.trainer.micro_batch_tokens} tokens per "
                   f"micro-batch, checkpointing {'on' if p.trainer.activation_checkpointing else 'off'}) = "
                   f"{B.fmt_bytes(mem.trainer_total_per_gpu)} per GPU > {B.fmt_bytes(cap)}; {fix}")
    if mem.rollout_per_gpu > cap:
        fit = max(0.0, (cap - mem.rollout_weights_per_gpu)) * p.rollout.tp / (
            (p.rollout.prompt_tokens + p.rollout.avg_tokens) * p.rollout.kv_bytes_per_token or 1)
        out.append(f"rollout does not fit: weights {B.fmt_bytes(mem.rollout_weights_per_gpu)} + KV cache "
                   f"{B.fmt_bytes(mem.kv_per_gpu)} per GPU ({in_flight:g} sequences at "
                   f"{p.rollout.prompt_tokens + p.rollout.avg_tokens:g} tokens, paged) > {B.fmt_bytes(cap)}; about "
                   f"{fit:.0f} sequences fit per replica (set rollout.concurrency) or raise rollout.tp")
    if placement == "colocated" and mem.trainer_total_per_gpu + mem.rollout_per_gpu > cap >= max(
            mem.trainer_total_per_gpu, mem.rollout_per_gpu):
        out.append(f"colocated: trainer {B.fmt_bytes(mem.trainer_total_per_gpu)} + rollout "
                   f"{B.fmt_bytes(mem.rollout_per_gpu)} per GPU exceed {B.fmt_bytes(cap)}: one of them must be "
                   f"offloaded between phases (that copy is step time the plan does not price)")
    return mem, out


def _as_placed(p: PlanInputs, ph: Phases, placement: str, lengths: list[int] | None) -> Phases:
    """The phases a placement runs (``_placed``), the rollout with its tool waits (plan/tools.py: a synchronous
    round waits for its slowest sample's tools, an async batch for the mean)."""
    placed = _placed(p, ph, placement, lengths)
    extra = plan_tools.price(p).rollout_extra(placement) if p.tools.calls_per_sample else 0.0
    return replace(placed, rollout=placed.rollout + extra) if extra else placed


def _placed(p: PlanInputs, ph: Phases, placement: str, lengths: list[int] | None) -> Phases:
    """The phases a placement runs: async decodes bubble-free (continuous batching with partial
    rollout) and, with ``async_rollout_logprobs``, runs no old-logprob forward on the trainer (the teacher, a
    separate phase, still scores every sample)."""
    if placement != "colocated":  # a pool scores on its own actors, overlapped: off the trainer's path
        ph = replace(ph, reference=0.0 if p.phases.reference_placement == "pool" else ph.reference,
                     teacher=0.0 if p.phases.teacher_placement == "pool" else ph.teacher)
    if placement == "colocated" and p.trainer.offload:  # the trainer's state leaves the GPUs for generation
        ph = replace(ph, train=ph.train + H.offload_s(p, H.trainer_gpus(p)))
    if placement == "colocated" and p.rollout.sleep_offload:  # the engine's weights leave them for training
        ph = replace(ph, rollout=ph.rollout + H.engine_sleep_s(p))
    if placement != "async":
        return ph
    ref = 0.0 if p.phases.async_rollout_logprobs else ph.reference
    return replace(ph, rollout=H.rollout_s(p, p.rollout.gpus, continuous=True, lengths=lengths), reference=ref)


def critical_path(p: PlanInputs, ph: Phases, placement: str, budget: BudgetWhatIf, sync_s: float) -> BudgetWhatIf:
    """The budget what-if on the chosen placement: new phase times through the same simulator."""
    scale = {r: (budget.after[r] / budget.before[r]) if budget.before.get(r) else 1.0 for r in budget.before}
    s = ph.seconds()
    new = Phases(**{r: s[r] * scale.get(r, 1.0) for r in s}, source=ph.source)
    one_sync = sync_s * scale.get("sync", 1.0)
    before = run_sim(p, ph, placement, sync_s).period_s
    after = run_sim(p, new, placement, one_sync).period_s
    return replace(budget, placement=placement, placement_step_s=before, placement_new_step_s=after,
                   placement_win=before / after if after > 0 else None)


def make_plan(p: PlanInputs, lengths: list[int] | None = None, lengths_source: str | None = None) -> Plan:
    """Price ``p``. ``lengths`` (e.g. a run's lengths.jsonl) feed the bubble and the tail what-if."""
    lengths = lengths or p.tail.lengths or None
    # A stated mean the measured phases cannot hold at peak is priced at the most they allow; measured
    # lengths win over both.
    p, mean_note = (p, None) if lengths else H.bounded_mean(p)
    b = B.step_bytes(p)
    hourly = B.per_hour(p, b)
    times = B.sync_times(p, b)
    link = p.network.sync_link
    reload_s = B.colocated_reload_seconds(p)
    # Placement does not depend on the sync; the sync mode depends on the step it must fit in.
    ph0 = estimate(p, b, 0.0, lengths)
    mode0, _ = _mode(p, b, ph0)
    equal = H.split_table(p, times[mode0][link] / p.sync.every_steps, reload_s, lengths)
    dec = decide(p, b, ph0, equal)
    sync_s = reload_s if dec.placement == "colocated" else times[dec.sync_mode][link]
    detail = B.colocated_breakdown(p, b) if dec.placement == "colocated" else B.sync_breakdown(p, b, dec.sync_mode)
    ph = estimate(p, b, sync_s, lengths, detail, dec.placement)
    equal = H.split_table(p, times[dec.sync_mode][link] / p.sync.every_steps, reload_s, lengths)
    sims = {pl: run_sim(p, _as_placed(p, ph, pl, lengths), pl,
                        reload_s if pl == "colocated" else times[dec.sync_mode][link]) for pl in PLACEMENTS}

    # Budget what-if: shares of the plan's phases unless the plan gives its own; then the same
    # optimizations on the chosen placement's critical path.
    seconds = ph.seconds()
    total = sum(seconds.values())
    shares = p.budget.shares or ({r: s / total for r, s in seconds.items()} if total else {})
    budget = budget_whatif(shares, p.budget.step_s or total, p.budget.optimizations, p.budget.factors)
    if not p.budget.shares and not p.budget.step_s:
        budget = critical_path(p, _as_placed(p, ph, dec.placement, lengths), dec.placement, budget, sync_s)

    t = p.tail
    src = lengths_source or ("tail.lengths" if t.lengths else
                             f"lognormal, mean {p.rollout.avg_tokens:g} tokens, sigma {t.sigma:g}")
    tail = tail_whatif(prompts=p.rollout.prompts, samples=p.rollout.samples, overprovision=t.overprovision,
                       steps=t.steps, seed=t.seed, cap=t.max_tokens, rollout_s=ph.rollout,
                       lengths=lengths, mean=p.rollout.avg_tokens, sigma=t.sigma, source=src)
    tail = bound_by_floor(tail, H.rollout_s(p, p.rollout.gpus, balanced=True, lengths=lengths))
    if tail.plain_rollout_s > 0:
        placed = _as_placed(p, ph, dec.placement, lengths)
        with_tail = replace(placed, rollout=placed.rollout * tail.tail_rollout_s / tail.plain_rollout_s)
        tail = replace(tail, step_speedup=sims[dec.placement].period_s / run_sim(p, with_tail, dec.placement, sync_s).period_s)
    mem, findings = memory_findings(p, dec.placement)
    findings = [mean_note, *findings] if mean_note else findings
    stated = stated_phases_note(p, ph, lengths)
    findings = [stated, *findings] if stated else findings
    return Plan(p, b, hourly, times, ph, dec, B.edges(p, b, dec.placement, dec.sync_mode), sims,
                rate_match(p, ph, equal), budget, tail, equal, detail, mem, findings, plan_tools.price(p))


def stated_phases_note(p: PlanInputs, ph: Phases, lengths: list[int] | None) -> str | None:
    """The finding that says the placement speed-ups rest on stated (modelled) phases, naming each one and
    the rule it came from; None when every GPU phase the speed-ups price is measured (phases.rollout_s,
    phases.train_s, phases.reference_s when a reference runs, phases.teacher_s when a teacher scores)."""
    ps = p.phases
    missing = [("rollout", ps.rollout_s is None and not lengths), ("train", ps.train_s is None and not ps.train_s_measured),
               ("reference", ps.use_reference and ps.reference_s is None),
               ("teacher", ps.teacher_params > 0 and ps.teacher_s is None)]
    named = [f"{role} ({ph.source.get(role, 'estimated')})" for role, gone in missing if gone]
    if not named:
        return None
    return ("the placement speed-ups rest on stated, not measured, phases: " + "; ".join(named)
            + "; give phases.rollout_s, phases.train_s (and phases.reference_s"
            + (", phases.teacher_s" if ps.teacher_params > 0 else "") + ") measured on phases.gpus to price "
              "them from measurements")


def _mode(p: PlanInputs, b: B.StepBytes, ph: Phases) -> tuple[str, str]:
    from rollyard.plan.decide import decide_sync

    return decide_sync(p, b, ph, "disaggregated")


def run_sim(p: PlanInputs, ph: Phases, placement: str, sync_s: float) -> SimResult:
    """Simulate ``placement`` with the plan's phases to steady state; ``sync_s`` is one sync's seconds
    (colocated: the engine reload, serialized in the step)."""
    s = ph.seconds()
    return steady_state(placement, s["rollout"], s["train"], sync_s, draw_steps=p.sim.steps,
                        reward=s["reward"],
                        reference=s["reference"] + s["teacher"] + s["teacher_sample"] + s["algorithm"],
                        staleness_bound=p.sync.staleness_bound, sync_every=p.sync.every_steps)


def predicted_steps_per_hour(placement: str, *, rollout_s: float, train_s: float, sync_s: float = 0.0,
                             reward_s: float = 0.0, reference_s: float = 0.0, staleness_bound: int = 1,
                             sync_every: int = 1) -> float:
    """Stable entry point (bench/placements.py): steady-state steps/hour of ``placement`` from
    measured phase seconds per step (one sync's seconds in ``sync_s``)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; expected one of {', '.join(PLACEMENTS)}")
    return steady_state(placement, rollout_s, train_s, sync_s, reward=reward_s, reference=reference_s,
                        staleness_bound=staleness_bound, sync_every=sync_every).steps_per_hour
