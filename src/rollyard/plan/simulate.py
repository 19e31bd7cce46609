"""A small discrete-event simulator of a few steps in each placement (lesson 19's model).

Resources: the rollout pool, the trainer pool, the reward (verifier) workers and the sync link.
Work items per step k: ``gen k`` (rollout, R s) -> ``reward k`` (W s) -> ``ref k`` + ``train k``
(trainer, F + T s) -> weight version k + 1 -> ``sync`` (S s, every ``sync_every`` steps).

- colocated: one GPU pool time-shares everything; the sync is an in-process handle (S = 0 is
  what the caller passes). Step = R + W + F + T.
- disaggregated: two pools in lockstep, one step off policy. A sync occupies both pools (the
  trainer broadcasts, the rollout pool loads between batches). Step = max(R, T) + S.
- async: both pools run continuously; a sync is a background transfer on the link that the
  rollout pool picks up at its next batch boundary. Step = max(R, T), unless the staleness bound
  forces a stall.

Admission enforces staleness: batch k is trained at trainer version k, so ``gen k`` may start
only once the rollout pool holds a version >= k - bound (disaggregated: bound min(1, plan bound);
async: the plan's bound). Deterministic and pure: same inputs, same events. ``steady_state``
doubles the simulated horizon until the period stops changing and reports the horizon.
"""

from __future__ import annotations

from dataclasses import dataclass

LANES = ("rollout", "reward", "trainer", "sync")


@dataclass(frozen=True)
class Event:
    lane: str  # one of LANES
    kind: str  # gen | reward | ref | train | sync
    step: int
    start: float
    end: float


@dataclass
class SimResult:
    placement: str
    events: list[Event]
    period_s: float  # steady-state seconds per step
    steps_per_hour: float
    max_staleness: int
    horizon_steps: int = 0  # steps simulated to reach the steady-state period (0: the events' own run)

    def as_dict(self) -> dict:
        return {"placement": self.placement, "period_s": self.period_s, "steps_per_hour": self.steps_per_hour,
                "max_staleness": self.max_staleness, "horizon_steps": self.horizon_steps,
                "events": [{"lane": e.lane, "kind": e.kind, "step": e.step, "start": e.start, "end": e.end}
                           for e in self.events]}


def simulate(placement: str, rollout: float, train: float, sync: float, *, reward: float = 0.0,
             reference: float = 0.0, steps: int = 6, staleness_bound: int = 1, sync_every: int = 1) -> SimResult:
    """Simulate ``steps`` training steps; every time in seconds, ``sync`` is one sync's duration."""
    if placement not in ("colocated", "disaggregated", "async"):
        raise ValueError(f"unknown placement {placement!r}; expected colocated, disaggregated or async")
    if steps < 2:
        raise ValueError(f"simulate at least 2 steps to measure a period, got {steps}")
    if placement == "colocated":
        events, staleness = _colocated(rollout, reward, reference, train, sync, steps, sync_every)
    else:
        # Disaggregated runs one step off policy (sync_every steps when syncs are sparser), within the bound.
        bound = min(staleness_bound, max(1, sync_every)) if placement == "disaggregated" else staleness_bound
        events, staleness = _two_pools(placement, rollout, reward, reference, train, sync, steps, bound, sync_every)
    ends = sorted(e.end for e in events if e.kind == "train")
    # Steady state: the mean step over the second half (the pipeline has filled by then).
    m = max(1, steps // 2)
    period = (ends[-1] - ends[-1 - m]) / m
    return SimResult(placement, events, period, 3600.0 / period if period > 0 else float("inf"), staleness)


def steady_state(placement: str, rollout: float, train: float, sync: float, *, draw_steps: int = 6,
                 max_steps: int = 1024, **kw) -> SimResult:
    """The steady-state period: simulate 8, 16, 32, ... steps until the period stops changing
    (relative 1e-9) or ``max_steps``; the events kept are a ``draw_steps`` run for the timeline."""
    n = 8
    prev = simulate(placement, rollout, train, sync, steps=n, **kw)
    while n < max_steps:
        n *= 2
        cur = simulate(placement, rollout, train, sync, steps=n, **kw)
        done = abs(cur.period_s - prev.period_s) <= 1e-9 * max(cur.period_s, 1e-12)
        prev = cur
        if done:
            break
    drawn = simulate(placement, rollout, train, sync, steps=draw_steps, **kw)
    return SimResult(placement, drawn.events, prev.period_s, prev.steps_per_hour,
                     max(prev.max_staleness, drawn.max_staleness), n)


def _colocated(R, W, F, T, S, steps, every):
    events, t = [], 0.0
    for k in range(steps):
        for lane, kind, dur in (("rollout", "gen", R), ("reward", "reward", W), ("trainer", "ref", F),
                                ("trainer", "train", T)):
            if dur > 0:
                events.append(Event(lane, kind, k, t, t + dur))
                t += dur
        if (k + 1) % every == 0 and S > 0:
            events.append(Event("sync", "sync", k, t, t + S))
            t += S
    # Each batch is sampled with the weights of the previous sync: on-policy when every == 1.
    return events, every - 1


def _two_pools(placement, R, W, F, T, S, steps, bound, every):
    """Event-driven: start whatever may start at time t, then advance to the next completion."""
    lockstep = placement == "disaggregated"
    events: list[Event] = []
    running: list[tuple[float, str, int]] = []  # completions still to come: (time, kind, step)
    t = 0.0
    free = {"rollout": 0.0, "trainer": 0.0, "reward": 0.0, "sync": 0.0}
    next_gen = next_train = 0
    held = 0  # weight version the rollout pool generates with
    arrived = 0  # async: newest version delivered, applied at the rollout's next batch boundary
    batch_version: dict[int, int] = {}
    ready: set[int] = set()  # batches scored, waiting for the trainer
    pending_sync: list[int] = []  # versions published and not yet sent
    staleness = 0

    def run(lane: str, kind: str, k: int, start: float, dur: float, complete: bool = True) -> float:
        if dur > 0:
            events.append(Event(lane, kind, k, start, start + dur))
        if complete:
            running.append((start + dur, kind, k))
        free[lane] = start + dur
        return start + dur

    while next_train < steps:
        progressed = True
        while progressed:
            progressed = False
            if pending_sync and free["sync"] <= t and (not lockstep or (free["rollout"] <= t and free["trainer"] <= t)):
                end = run("sync", "sync", pending_sync.pop(0) - 1, t, S)
                if lockstep:  # the broadcast holds both pools
                    free["rollout"] = free["trainer"] = end
                progressed = True
            blocked = lockstep and bool(pending_sync)  # lockstep: the sync goes before new work
            if not blocked and free["rollout"] <= t and next_gen < steps:
                if not lockstep:
                    held = arrived
                if held >= next_gen - bound:  # admission: the staleness bound
                    batch_version[next_gen] = held
                    run("rollout", "gen", next_gen, t, R)
                    next_gen += 1
                    progressed = True
            if not blocked and free["trainer"] <= t and next_train in ready:
                k = next_train
                ready.discard(k)
                start = run("trainer", "ref", k, t, F, complete=False)
                run("trainer", "train", k, start, T)
                staleness = max(staleness, k - batch_version[k])
                next_train += 1
                progressed = True
        if not running:
            raise RuntimeError("simulator deadlock: nothing running and nothing can start")
        running.sort()
        t = running[0][0]
        while running and running[0][0] <= t:
            _, kind, k = running.pop(0)
            if kind == "gen":
                run("reward", "reward", k, max(t, free["reward"]), W)
            elif kind == "reward":
                ready.add(k)
            elif kind == "train" and (k + 1) % every == 0:
                pending_sync.append(k + 1)
            elif kind == "sync":
                if lockstep:
                    held = k + 1
                else:
                    arrived = k + 1
    return events, staleness


def timeline_text(res: SimResult, width: int = 72) -> list[str]:
    """One line per lane: the step index (mod 10) of whatever occupies each cell, '.' idle."""
    horizon = max((e.end for e in res.events), default=0.0) or 1.0
    cell = horizon / width
    lines = []
    for lane in LANES:
        cells = ["."] * width
        for e in (e for e in res.events if e.lane == lane):
            i0 = min(round(e.start / cell), width - 1)
            i1 = max(round(e.end / cell), i0 + 1)  # a short event still gets one cell
            for i in range(i0, min(i1, width)):
                cells[i] = "r" if e.kind == "ref" else str(e.step % 10)
        if any(e.lane == lane for e in res.events):
            lines.append(f"  {lane:<8} {''.join(cells)}")
    end = f"{horizon:.0f} s"
    lines.append(f"  {'':<8} 0 s{end:>{width - 3}}")
    return lines


def timeline_png(results: list[SimResult], path) -> None:
    """Draw each placement's timeline as horizontal bars (matplotlib, Agg backend)."""
    from rollyard.config import require_package

    matplotlib = require_package("matplotlib", "plots", "the plan's timeline.png (rollyard plan --out)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"gen": "tab:blue", "reward": "tab:orange", "ref": "tab:gray", "train": "tab:green", "sync": "tab:red"}
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 1.6 * len(results) + 0.6), squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        lanes = [lane for lane in LANES if any(e.lane == lane for e in res.events)]
        for y, lane in enumerate(lanes):
            for e in (e for e in res.events if e.lane == lane):
                ax.broken_barh([(e.start, e.end - e.start)], (y - 0.4, 0.8), facecolors=colors[e.kind],
                               edgecolor="white", linewidth=0.5)
                if e.end - e.start > 0:
                    ax.text((e.start + e.end) / 2, y, str(e.step), ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_title(f"{res.placement}: {res.period_s:.1f} s/step, {res.steps_per_hour:.1f} steps/h", fontsize=9)
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
