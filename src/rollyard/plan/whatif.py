"""Two what-ifs: seed 002's budget allocator and seed 003's tail batching.

Budget allocator: role shares of step time plus chosen optimizations -> new step time and win.
Each optimization divides one role's time by a speed-up factor (or takes the role off the
critical path); several on one role compound. The default factor is the low end of the range
seed 002's tables give, so the what-if is conservative; a plan can override any factor.

Tail batching (RollPacker): a synchronous round waits for its longest response. Plain rounds take
``prompts`` prompts and end when every one is done; tail batching issues ``prompts * (1 +
overprovision)`` prompts, ends the short round as soon as ``prompts`` of them are complete and
defers the rest to a queue that is run as a long round once it holds ``prompts`` prompts. Round
time is modelled as (longest response in the round) x seconds per decode step, i.e. decode is
memory-bound and a decode step costs about the same however many sequences are in flight.
Samples of a prompt are drawn independently from the length distribution.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import asdict, dataclass

from rollyard.plan.inputs import PlanError
from rollyard.telemetry import rundir


@dataclass(frozen=True)
class Optimization:
    name: str
    role: str
    factor: float  # role time is divided by this (inf: off the critical path)
    seed_says: str


INF = math.inf
CATALOG: dict[str, Optimization] = {o.name: o for o in (
    Optimization("prefix_caching", "rollout", 3.0, "3-10x on K-rollout RL (share the prompt's KV across samples)"),
    Optimization("continuous_batching", "rollout", 2.0, "2-20x over padded static batching"),
    Optimization("paged_kv", "rollout", 2.0, "2-4x max batch over a contiguous KV cache"),
    Optimization("chunked_prefill", "rollout", 1.1, "10-20% on long-prompt workloads"),
    Optimization("speculative_decoding", "rollout", 1.5, "1.5-3x at greedy/low temperature, ~1x as temperature rises"),
    Optimization("kv_quantization", "rollout", 1.5, "1.5-2x decode (int8/fp8 KV); needs a log-prob match audit"),
    Optimization("packed_varlen", "train", 1 / 0.7, "30-60% fewer FLOPs than padded batches"),
    Optimization("activation_checkpointing", "train", 1 / (1 + 0.33 * 2 / 6), "a memory win: ~33% extra forward FLOPs (~11% slower step)"),
    Optimization("reference_pool", "reference", INF, "reference on a separate pool, overlapped with rollout: off the critical path"),
    Optimization("sync_less_often", "sync", 4.0, "sync every N steps drops cost linearly (factor = N; default 4)"),
    Optimization("sync_overlap", "sync", INF, "overlap sync with the next rollout's prefill: hidden entirely"),
    Optimization("ipc_handoff", "sync", INF, "colocated: the sync is a pointer swap, ~zero copy"),
    Optimization("verifier_dispatcher", "reward", INF, "verifiers run async in a CPU pool; the GPU never blocks on them"),
)}


@dataclass
class BudgetWhatIf:
    step_s: float
    shares: dict[str, float]
    applied: list[dict]  # name, role, factor, seed_says
    before: dict[str, float]  # role -> seconds
    after: dict[str, float]
    new_step_s: float
    win: float | None  # None: nothing left on the critical path
    # The same optimizations on the chosen placement's critical path (planner.critical_path):
    placement: str = ""
    placement_step_s: float | None = None
    placement_new_step_s: float | None = None
    placement_win: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def budget_whatif(shares: dict[str, float], step_s: float, optimizations: list[str],
                  factors: dict[str, float] | None = None) -> BudgetWhatIf:
    """Apply ``optimizations`` to ``shares`` (role -> fraction, summing to 1) of a ``step_s`` step."""
    factors = factors or {}
    unknown = [n for n in list(optimizations) + list(factors) if n not in CATALOG]
    if unknown:
        import difflib
        n = unknown[0]
        close = difflib.get_close_matches(n, list(CATALOG), n=1, cutoff=0.0)
        raise PlanError(f"unknown optimization {n!r}: did you mean {close[0]!r}? "
                        f"Known (seed 002's tables): {', '.join(CATALOG)}")
    before = {r: shares.get(r, 0.0) * step_s for r in rundir.ROLES}
    after = dict(before)
    applied = []
    for name in dict.fromkeys(optimizations):  # each once, in order
        opt = CATALOG[name]
        f = factors.get(name, opt.factor)
        if f <= 0:
            raise PlanError(f"budget.factors.{name} must be > 0, got {f}")
        after[opt.role] = 0.0 if math.isinf(f) else after[opt.role] / f
        # factor None: the role leaves the critical path (kept JSON-safe: no Infinity)
        applied.append({"name": name, "role": opt.role, "factor": None if math.isinf(f) else f,
                        "seed_says": opt.seed_says})
    new = sum(after.values())
    return BudgetWhatIf(step_s, {r: shares.get(r, 0.0) for r in rundir.ROLES}, applied, before, after, new,
                        step_s / new if new > 0 else None)


# ---- tail batching ----

@dataclass
class TailWhatIf:
    source: str  # where the lengths came from
    mean_length: float
    p50_length: float
    p99_length: float
    max_length: float
    plain_round_tokens: float  # mean decode steps per trained step
    tail_round_tokens: float
    plain_bubble: float  # share of sample-slot time idle, waiting for the round's longest response
    tail_bubble: float
    short_rounds: int
    long_rounds: int
    decode_step_s: float
    plain_rollout_s: float
    tail_rollout_s: float
    speedup: float
    floor_rollout_s: float | None = None  # the bubble-free floor: no schedule beats it
    bounded: bool = False  # the tail-batching figure was raised to the floor
    step_speedup: float | None = None  # the chosen placement's steady-state step, plain / tail rollout
    draws: int = 0  # random draws the what-if made (bounded: see MAX_UNITS, EXACT_DRAWS)

    def as_dict(self) -> dict:
        return asdict(self)


def bound_by_floor(t: TailWhatIf, floor_s: float) -> TailWhatIf:
    """Tail batching only removes bubble: its rollout time cannot go below a synchronous round of
    mean-length responses (``mechanisms.balanced_round_s``), the floor without working ahead."""
    from dataclasses import replace

    if t.tail_rollout_s >= floor_s:
        return replace(t, floor_rollout_s=floor_s)
    return replace(t, floor_rollout_s=floor_s, tail_rollout_s=floor_s, bounded=True,
                   speedup=t.plain_rollout_s / floor_s if floor_s > 0 else t.speedup)


# The what-if's cost is bounded whatever prompts x samples is: a round simulates at most MAX_UNITS
# units (a unit is one prompt, or k = ceil(prompts / MAX_UNITS) prompts deferred together), and a unit
# of more than EXACT_DRAWS responses is drawn by order statistics (its longest response from the
# distribution of the maximum, the rest at the mean of a draw below it) instead of one draw each.
MAX_UNITS = 1024
EXACT_DRAWS = 16


class LengthSampler:
    """Draws response lengths: from a given list (with replacement) or a clipped lognormal."""

    def __init__(self, rng: random.Random, cap: int, lengths: list[int] | None = None,
                 mean: float | None = None, sigma: float = 0.6):
        self.rng, self.cap, self.lengths, self.sigma = rng, cap, list(lengths or []), sigma
        self.draws = 0  # random numbers drawn (the bounded-cost check counts these)
        if not self.lengths:
            if not mean or mean <= 0:
                raise PlanError("tail what-if needs response lengths or a positive mean length")
            self.mu = math.log(mean) - sigma * sigma / 2  # lognormal with this mean
        else:
            self.sorted = sorted(self.lengths)
            self.prefix = [0]
            for x in self.sorted:
                self.prefix.append(self.prefix[-1] + x)

    def _clip(self, x: float) -> int:
        return int(min(max(round(x), 1), self.cap))

    def draw(self) -> int:
        self.draws += 1
        if self.lengths:
            x = self.rng.choice(self.lengths)
        else:
            x = math.exp(self.rng.gauss(self.mu, self.sigma))
        return self._clip(x)

    def draw_many(self, n: int) -> tuple[int, int]:
        """(longest, total) of ``n`` responses: exact draws up to EXACT_DRAWS, else order statistics.

        The maximum of n i.i.d. draws has CDF F^n, so it is F^-1(U^(1/n)); the other n - 1 are i.i.d.
        draws conditioned to lie below it, counted at their conditional mean E[X | X <= max]
        (lognormal: closed form; given lengths: a prefix sum over the sorted list)."""
        if n <= EXACT_DRAWS:  # draw() n times, inlined (the what-if's hot loop): the same draws, the same order
            self.draws += n
            if self.lengths:
                d = [self._clip(self.rng.choice(self.lengths)) for _ in range(n)]
            else:
                gauss, mu, sigma, cap, exp = self.rng.gauss, self.mu, self.sigma, self.cap, math.exp
                d = [min(max(round(exp(gauss(mu, sigma))), 1), cap) for _ in range(n)]
            return max(d), sum(d)
        self.draws += 1
        u = self.rng.random() ** (1.0 / n)
        if self.lengths:
            i = min(len(self.sorted) - 1, int(u * len(self.sorted)))
            top, below = self.sorted[i], self.prefix[i + 1] / (i + 1)
        else:
            from statistics import NormalDist

            z = NormalDist().inv_cdf(min(max(u, 1e-300), 1 - 1e-16))
            top = math.exp(self.mu + self.sigma * z)
            nd = NormalDist()
            lo = nd.cdf(z)
            below = (math.exp(self.mu + self.sigma ** 2 / 2) * nd.cdf(z - self.sigma) / lo) if lo > 0 else top
        longest = self._clip(top)
        return longest, longest + round((n - 1) * min(below, longest))


def _prompt_lengths(sampler: LengthSampler, n_units: int, per_unit: int) -> list[tuple[int, int]]:
    """(longest response, total response tokens) per unit of ``per_unit`` responses; a unit is done
    when all its responses are."""
    return [sampler.draw_many(per_unit) for _ in range(n_units)]


def _round(prompts: list[tuple[int, int]], samples: int) -> tuple[int, float]:
    """Round length (decode steps) and its idle share of sample slots."""
    length = max(p[0] for p in prompts)
    used = sum(p[1] for p in prompts)
    return length, 1 - used / (length * samples * len(prompts))


@functools.lru_cache(maxsize=32)
def _simulate(prompts: int, samples: int, overprovision: float, steps: int, seed: int, cap: int,
              lengths: tuple[int, ...] | None, mean: float | None, sigma: float):
    """The what-if's seeded simulation: (plain rounds, tail rounds, short, long, sorted length sample, draws).
    Cached on its arguments (a pure function of them), so a process pricing many plans with one tail
    setting (a sweep, the calibration rows) simulates it once."""
    group = math.ceil(prompts / MAX_UNITS)  # prompts per simulated unit
    issue = math.ceil((prompts + max(1, math.ceil(prompts * overprovision))) / group)
    prompts = math.ceil(prompts / group)
    samples *= group  # responses per unit
    plain_s = LengthSampler(random.Random(seed), cap, list(lengths) if lengths else None, mean, sigma)
    plain = [_round(_prompt_lengths(plain_s, prompts, samples), samples) for _ in range(steps)]

    tail_s = LengthSampler(random.Random(seed), cap, list(lengths) if lengths else None, mean, sigma)
    issue = max(issue, prompts + 1)
    queue: list[tuple[int, int]] = []
    tail: list[tuple[int, float]] = []
    short = long = 0
    while len(tail) < steps:
        if len(queue) >= prompts:  # a long round: the deferred long-tail prompts, together
            batch, queue = queue[:prompts], queue[prompts:]
            tail.append(_round(batch, samples))
            long += 1
        else:  # a short round: stop once `prompts` prompts are complete, defer the rest
            drawn = sorted(_prompt_lengths(tail_s, issue, samples))
            done, deferred = drawn[:prompts], drawn[prompts:]
            length = done[-1][0]
            used = sum(p[1] for p in done)
            tail.append((length, 1 - used / (length * samples * prompts)))
            queue += deferred
            short += 1

    sample_pool = sorted(plain_s.draw() for _ in range(4000)) if not lengths else sorted(lengths)
    return tuple(plain), tuple(tail), short, long, tuple(sample_pool), plain_s.draws + tail_s.draws


def tail_whatif(*, prompts: int, samples: int, overprovision: float, steps: int, seed: int, cap: int,
                rollout_s: float, lengths: list[int] | None = None, mean: float | None = None,
                sigma: float = 0.6, source: str = "") -> TailWhatIf:
    """Predicted rollout time per step: plain synchronous rounds vs tail batching (bounded cost:
    MAX_UNITS units per round, order statistics above EXACT_DRAWS responses per unit)."""
    plain, tail, short, long, sample_pool, draws = _simulate(
        prompts, samples, overprovision, steps, seed, cap, tuple(lengths) if lengths else None, mean, sigma)

    def pct(q: float) -> float:
        return float(sample_pool[min(len(sample_pool) - 1, int(q * len(sample_pool)))])

    plain_len = sum(r[0] for r in plain) / steps
    tail_len = sum(r[0] for r in tail) / steps
    step_s = rollout_s / plain_len if plain_len else 0.0
    return TailWhatIf(
        source=source, mean_length=sum(sample_pool) / len(sample_pool), p50_length=pct(0.5), p99_length=pct(0.99),
        max_length=float(sample_pool[-1]), plain_round_tokens=plain_len, tail_round_tokens=tail_len,
        plain_bubble=sum(r[1] for r in plain) / steps, tail_bubble=sum(r[1] for r in tail) / steps,
        short_rounds=short, long_rounds=long, decode_step_s=step_s,
        plain_rollout_s=plain_len * step_s, tail_rollout_s=tail_len * step_s,
        speedup=plain_len / tail_len,  # lengths are >= 1, so rounds are never empty
        draws=draws,
    )
