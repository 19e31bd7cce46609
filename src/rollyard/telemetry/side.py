"""Work a rollout engine drives beside decoding (a multi-turn engine's tool calls), as one record the engine
names: what ``EngineBase.drain()`` returns (``rollout/engine.py``). The placements forward it without reading it;
the run record (``placement/run.py``) turns it into the step's metrics, a traffic edge, the summary and spans."""

from __future__ import annotations

import math
from typing import NamedTuple


class SideWork(NamedTuple):
    """What an engine did beside decoding since its last ``drain()`` (a multi-turn engine: its tool calls), named
    by the engine. A placement forwards it as it is (a Ray worker ships it, the pool sums the workers'); the run
    record turns it into the step's metrics, a traffic edge, the run summary and timeline spans."""

    role: str  # the timeline role of ``intervals``; the run summary's entry ``{role}_latency_s``
    name: str  # the prefix of its metrics (``{name}/...``, ``{name}/latency_p50_s``) and its traffic edge
    counts: dict[str, float]  # counters under names the engine gives; ``{name}/bytes`` and ``{name}/calls``, the edge's
    seconds: list[float]  # each call's wall seconds (percentiles are taken over every worker's calls)
    intervals: list[tuple[float, float]]  # wall-clock (``time.time()``) intervals during which some call ran

    def spans(self, step: int, worker: str) -> list[dict]:
        """``intervals`` as timeline spans of ``role`` for ``step``, run by ``worker``."""
        return [{"role": self.role, "step": step, "worker": worker, "start": a, "end": b} for a, b in self.intervals]

    def plus(self, other: SideWork) -> SideWork:
        """Both records' work: counters summed (a mean, ``*_mean``, is per worker: dropped), calls joined."""
        counts = dict(self.counts)
        for k, v in other.counts.items():
            counts[k] = counts.get(k, 0.0) + v
        return self._replace(counts={k: v for k, v in counts.items() if not k.endswith("_mean")},
                             seconds=self.seconds + other.seconds, intervals=self.intervals + other.intervals)

    def emptied(self) -> SideWork:
        """The same kind of work with nothing done (a step without calls still reports zero latencies)."""
        return self._replace(counts={}, seconds=[], intervals=[])


def latency_metrics(seconds: list[float], prefix: str) -> dict[str, float]:
    """Call-latency percentiles (nearest rank) and maximum, in seconds: ``{prefix}p50_s``, ``_p90_s``, ``_p99_s``,
    ``_max_s``; all 0.0 without calls."""
    lat = sorted(seconds)
    at = lambda q: lat[min(len(lat) - 1, math.ceil(q * len(lat)) - 1)] if lat else 0.0  # noqa: E731
    return {f"{prefix}p50_s": at(0.5), f"{prefix}p90_s": at(0.9), f"{prefix}p99_s": at(0.99),
            f"{prefix}max_s": lat[-1] if lat else 0.0}
