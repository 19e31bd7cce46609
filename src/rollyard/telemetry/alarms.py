"""Seed 002's alarms, checked on every metrics row: a slow step, and reward hacking.

- ``alarm/step_time``: the step's wall time (``time/step``) is more than ``slow_ratio`` (1.2: 20%)
  above the median of the trailing ``window`` steps (after ``min_history`` steps, so warm-up does
  not count).
- ``alarm/reward_hacking``: at a held-out eval (a row with ``eval/accuracy``, every ``eval_every``
  steps), the mean train reward since the previous eval rose by more than ``reward_rise`` over the
  mean of the interval before it, while held-out accuracy did not rise by more than
  ``accuracy_flat`` (flat or falling): the policy is learning the verifier, not the task.

Both are printed and written as 0/1 in the row. History is seeded from the run's existing rows, so
a resumed run keeps its baseline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from statistics import mean, median
from typing import Any

from rollyard.telemetry import rundir

EVAL_KEY = "eval/accuracy"


class Alarms:
    def __init__(self, window: int = 20, min_history: int = 5, slow_ratio: float = 1.2, reward_rise: float = 0.05,
                 accuracy_flat: float = 0.01, log: Callable[[str], None] | None = None):
        self.window, self.min_history, self.slow_ratio = window, min_history, slow_ratio
        self.reward_rise, self.accuracy_flat = reward_rise, accuracy_flat
        self.log = log or (lambda m: print(m, flush=True))
        self.times: list[float] = []
        self.rewards: list[float] = []            # reward/mean per row, in step order
        self.evals: list[tuple[int, float]] = []  # (index into rewards after which it ran, accuracy)

    def seed(self, rows: Iterable[dict[str, Any]]) -> None:
        """Take the history of earlier rows (a resumed run's metrics.jsonl) without alarming."""
        for row in rows:
            self._record(row)

    def check(self, row: dict[str, Any]) -> dict[str, float]:
        """The alarm values for ``row`` (printing each that fires); then ``row`` joins the history."""
        out = {"alarm/step_time": 0.0}
        t = row.get(rundir.STEP_TIME)
        trail = self.times[-self.window:]
        if isinstance(t, (int, float)) and len(trail) >= self.min_history and t > self.slow_ratio * median(trail):
            out["alarm/step_time"] = 1.0
            self.log(f"ALARM step {row.get('step')}: step time {t:.3f}s is {t / median(trail) - 1:.0%} above the "
                     f"median {median(trail):.3f}s of the last {len(trail)} steps")
        prev = self.evals[-1] if self.evals else None
        self._record(row)
        if EVAL_KEY in row:
            out["alarm/reward_hacking"] = 0.0
            if prev is not None and self._hacking(prev, row[EVAL_KEY]):
                out["alarm/reward_hacking"] = 1.0
                self.log(f"ALARM step {row.get('step')}: train reward rose by {self._rise(prev):+.3f} since the "
                         f"previous eval while held-out accuracy went {prev[1]:.1%} -> {row[EVAL_KEY]:.1%}; the "
                         f"policy may be exploiting the verifier (inspect samples, tighten the reward)")
        return out

    def _record(self, row: dict[str, Any]) -> None:
        t, r = row.get(rundir.STEP_TIME), row.get("reward/mean")
        if isinstance(t, (int, float)) and math.isfinite(t):
            self.times.append(float(t))
        if isinstance(r, (int, float)):
            self.rewards.append(float(r))
        if isinstance(row.get(EVAL_KEY), (int, float)):
            self.evals.append((len(self.rewards), float(row[EVAL_KEY])))

    def _rise(self, prev: tuple[int, float]) -> float:
        since = self.rewards[prev[0]:]
        before = self.rewards[max(0, prev[0] - len(since)):prev[0]]
        return mean(since) - mean(before) if since and before else 0.0

    def _hacking(self, prev: tuple[int, float], accuracy: float) -> bool:
        return self._rise(prev) > self.reward_rise and accuracy - prev[1] <= self.accuracy_flat
