"""``make_plan``: inputs -> every figure `rollyard plan` prints (bytes, phases, steps/hour,
decision, what-ifs). Pure: no I/O, milliseconds."""

from __future__ import annotations

from dataclasses import dataclass

from rollyard.plan import bytes as B
from rollyard.plan.decide import Decision, RateMatch, decide, rate_match
from rollyard.plan.inputs import PLACEMENTS, PlanInputs
from rollyard.plan.phases import Phases, estimate
from rollyard.plan.simulate import SimResult, simulate
from rollyard.plan.whatif import BudgetWhatIf, TailWhatIf, budget_whatif, tail_whatif


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

    @property
    def placement(self) -> str:
        return self.decision.placement

    def sync_seconds(self) -> float:
        """One sync of the chosen mode over the sync link (0 when colocated)."""
        if self.placement == "colocated":
            return 0.0
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

    def as_dict(self) -> dict:
        p = self.inputs
        return {
            "inputs": p.model_dump(mode="json"),
            "bytes": self.bytes.as_dict(),
            "per_hour": self.per_hour,
            "steps_per_hour_stated": B.steps_per_hour_stated(p),
            "tiers": p.tiers(),
            "sync_times": self.sync_times,
            "gradient_seconds": self.bytes.gradient_per_rank / p.tiers()[p.network.trainer_link],
            "edges": [e.__dict__ for e in self.edges],
            "phases": {**self.phases.seconds(), "source": self.phases.source},
            "step_budget": self.step_budget(),
            "cadence": self.cadence(),
            "decision": self.decision.as_dict(),
            "simulation": {k: v.as_dict() for k, v in self.sims.items()},
            "rate_matching": self.rate.__dict__,
            "budget_whatif": self.budget.as_dict(),
            "tail_whatif": self.tail.as_dict(),
        }


def make_plan(p: PlanInputs, lengths: list[int] | None = None, lengths_source: str | None = None) -> Plan:
    """Price ``p``. ``lengths`` (e.g. a run's lengths.jsonl) feed the tail-batching what-if."""
    b = B.step_bytes(p)
    hourly = B.per_hour(p, b)
    times = B.sync_times(p, b)
    link = p.network.sync_link
    # Placement does not depend on the sync; the sync mode depends on the step it must fit in.
    ph0 = estimate(p, b, 0.0)
    dec = decide(p, b, ph0)
    sync_s = 0.0 if dec.placement == "colocated" else times[dec.sync_mode][link]
    ph = estimate(p, b, sync_s)
    sims = {pl: run_sim(p, ph, pl, times[dec.sync_mode][link]) for pl in PLACEMENTS}

    # Budget what-if: shares of the serialized step unless the plan gives its own.
    seconds = ph.seconds()
    total = sum(seconds.values())
    shares = p.budget.shares or ({r: s / total for r, s in seconds.items()} if total else {})
    budget = budget_whatif(shares, p.budget.step_s or total, p.budget.optimizations, p.budget.factors)

    t = p.tail
    src = lengths_source or ("tail.lengths" if t.lengths else
                             f"lognormal, mean {p.rollout.avg_tokens:g} tokens, sigma {t.sigma:g}")
    tail = tail_whatif(prompts=p.rollout.prompts, samples=p.rollout.samples, overprovision=t.overprovision,
                       steps=t.steps, seed=t.seed, cap=t.max_tokens, rollout_s=ph.rollout,
                       lengths=lengths or t.lengths or None, mean=p.rollout.avg_tokens, sigma=t.sigma, source=src)
    return Plan(p, b, hourly, times, ph, dec, B.edges(p, b, dec.placement, dec.sync_mode), sims,
                rate_match(p, ph), budget, tail)


def run_sim(p: PlanInputs, ph: Phases, placement: str, sync_s: float) -> SimResult:
    """Simulate ``placement`` with the plan's phases; ``sync_s`` is one sync's seconds."""
    s = ph.seconds()
    return simulate(placement, s["rollout"], s["train"], 0.0 if placement == "colocated" else sync_s,
                    reward=s["reward"], reference=s["reference"] + s["algorithm"], steps=p.sim.steps,
                    staleness_bound=p.sync.staleness_bound, sync_every=p.sync.every_steps)
