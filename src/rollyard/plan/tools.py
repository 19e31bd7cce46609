"""Tool latency in the plan: calls per sample and a latency distribution -> the rollout round's tail.

A multi-turn sample alternates model turns and tool calls (``rollyard.env``). While a tool runs the engine decodes
the other samples, so a tool call costs the engine nothing; it costs the *sample* its latency. A sample's tool time
is the sum of its calls' latencies (one call per turn, turns in sequence).

- **Synchronous round** (colocated, disaggregated): the step waits for the round's slowest sample, so the rollout
  phase grows by the expected *largest* tool time among the round's ``prompts x samples`` samples: the tail of the
  distribution, which grows with the round's size and the latency spread.
- **Async**: the pool starts the next batch while a slow tool runs (no round barrier), so a batch pays the *mean*
  tool time per sample, not the slowest's: what async buys when tools are slow is the difference. (A stated
  model: with free KV slots the waits could hide entirely; with every slot held by a waiting sample, they cannot.)

Per-sample tool times are drawn (deterministic in ``tail.seed``): each sample makes ``floor(calls_per_sample)`` calls,
one more with the fractional part's probability; a call's latency is drawn from ``tools.latencies`` (measured
seconds, e.g. a run's ``tools/latency_*``) or a lognormal with median ``tools.latency_s`` and shape
``tools.latency_sigma``. The expected maximum of ``n`` draws is read at the ``n / (n + 1)`` quantile of
``DRAWS`` draws (for rounds larger than that, the largest draw: a lower bound, said so in the note).
Bytes: ``tools.bytes_per_call`` per call (arguments out and output back) is the ``tools`` edge.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import asdict, dataclass

from rollyard.plan.inputs import PlanInputs, ToolsSection

DRAWS = 20_000  # per-sample tool times drawn for the quantiles


@dataclass(frozen=True)
class ToolTime:
    """What tools add to a step's rollout phase, per placement."""

    calls_per_sample: float
    samples: int  # samples per synchronous round (prompts x samples)
    mean_s: float  # mean tool seconds per sample (what an async batch pays)
    round_tail_s: float  # expected tool seconds of the round's slowest sample (what a synchronous round pays)
    lower_bound: bool  # the round is larger than DRAWS: round_tail_s is the largest draw, a lower bound
    source: str

    def rollout_extra(self, placement: str) -> float:
        """Seconds the rollout phase of ``placement`` grows by."""
        return self.mean_s if placement == "async" else self.round_tail_s

    def as_dict(self) -> dict:
        return asdict(self)


def per_sample_times(p: PlanInputs, n: int = DRAWS) -> list[float]:
    """``n`` draws of one sample's total tool seconds, sorted (the same inputs: the same draws)."""
    return list(_draws(p.tools.model_dump_json(), p.tail.seed, n))


@functools.lru_cache(maxsize=16)  # make_plan prices every placement from the same inputs
def _draws(tools_json: str, seed: int, n: int) -> tuple[float, ...]:
    t = ToolsSection.model_validate_json(tools_json)
    rng = random.Random(f"tools/{seed}")
    whole, frac = int(t.calls_per_sample), t.calls_per_sample - int(t.calls_per_sample)

    def latency() -> float:
        if t.latencies:
            return rng.choice(t.latencies)
        return t.latency_s * (math.exp(rng.gauss(0.0, t.latency_sigma)) if t.latency_sigma else 1.0)

    out = []
    for _ in range(n):
        calls = whole + (1 if frac and rng.random() < frac else 0)
        out.append(sum(latency() for _ in range(calls)))
    return tuple(sorted(out))


def price(p: PlanInputs) -> ToolTime:
    """The plan's tool time (zeros when ``tools.calls_per_sample`` is 0)."""
    t = p.tools
    n = p.rollout.prompts * p.rollout.samples
    src = (f"{len(t.latencies)} measured latencies" if t.latencies else
           f"lognormal, median {t.latency_s:g} s, sigma {t.latency_sigma:g}")
    if t.calls_per_sample == 0:
        return ToolTime(0.0, n, 0.0, 0.0, False, "no tools")
    draws = per_sample_times(p)
    q = n / (n + 1)  # E[max of n iid draws] ~ the n/(n+1) quantile
    idx = min(len(draws) - 1, int(q * len(draws)))
    return ToolTime(t.calls_per_sample, n, sum(draws) / len(draws), draws[idx], n >= len(draws), src)


def edge_bytes(p: PlanInputs) -> tuple[float, str]:
    """The ``tools`` edge per step: calls x bytes per call."""
    t = p.tools
    calls = p.rollout.prompts * p.rollout.samples * t.calls_per_sample
    if not calls:
        return 0.0, "no tool calls (tools.calls_per_sample = 0)"
    return calls * t.bytes_per_call, f"{calls:g} calls x {t.bytes_per_call:g} B (arguments out + output back)"


def note(tt: ToolTime, period: dict[str, float], chosen: str) -> str:
    """The decision record's line: what tools add to each placement's step and what async hides."""
    if not tt.calls_per_sample:
        return ""
    bound = " (at least: the round is larger than the draws)" if tt.lower_bound else ""
    hides = tt.round_tail_s - tt.mean_s
    steps = ", ".join(f"{k} {v:.1f} s" for k, v in period.items())
    return (f"Tools: {tt.calls_per_sample:g} calls per sample ({tt.source}): a synchronous round waits "
            f"{tt.round_tail_s:.2f} s for its slowest of {tt.samples} samples' tools{bound}, an async batch "
            f"{tt.mean_s:.2f} s (the mean), so async hides {hides:.2f} s of tool wait per step; steps with tools: "
            f"{steps} ({chosen} chosen).")
