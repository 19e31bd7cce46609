"""Seed 002's alarms, checked on every metrics row: a slow step, and reward hacking.

- ``alarm/step_time``: the step's wall time (``time/step``) is more than ``slow_ratio`` (1.2: 20%)
  above the median of the trailing ``window`` baseline steps (after ``min_history`` of them, so
  warm-up does not count).
- ``alarm/reward_hacking``: at a held-out eval (a row with ``eval/accuracy``, every ``eval_every``
  steps), the mean train reward since the previous eval rose by more than ``reward_rise`` over the
  mean of the interval before it, while held-out accuracy did not rise by more than
  ``accuracy_flat`` (flat or falling): the policy is learning the verifier, not the task.

Both have hysteresis: an alarm is printed once when it fires, the row value stays 1 while the
condition holds, and it re-arms only after a recovery: a step back under ``recover_ratio`` x the
median, an eval that is not hacking (one "cleared" line, for a slow episode only when it lasted
more than one step). A load spike is one alarm, not one per
step. Steps whose wall time includes a held-out eval or a checkpoint write (rows with
``eval/seconds`` or ``checkpoint/seconds``) are neither alarmed on nor part of the baseline, nor
are the steps of an active step-time alarm. History is seeded from the run's existing rows, so a
resumed run keeps its baseline and its alarms' state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from statistics import mean, median
from typing import Any

from rollyard.telemetry import rundir

EVAL_KEY = "eval/accuracy"
# Row values: seconds of this step's wall time spent outside the step's own work (see RunRecord)
OVERHEAD_KEYS = ("eval/seconds", "checkpoint/seconds")


class Alarms:
    def __init__(self, window: int = 20, min_history: int = 5, slow_ratio: float = 1.2, recover_ratio: float = 1.1,
                 reward_rise: float = 0.05, accuracy_flat: float = 0.01, log: Callable[[str], None] | None = None):
        self.window, self.min_history = window, min_history
        self.slow_ratio, self.recover_ratio = slow_ratio, min(recover_ratio, slow_ratio)
        self.reward_rise, self.accuracy_flat = reward_rise, accuracy_flat
        self.log = log or (lambda m: print(m, flush=True))
        self.times: list[float] = []              # the step-time baseline
        self.rewards: list[float] = []            # the reward per row, in step order
        self.evals: list[tuple[int, float]] = []  # (index into rewards after which it ran, accuracy)
        self.slow = False                         # a step-time alarm is active
        self._slow_since = 0                      # the step it fired at
        self.hacking = False                      # a reward-hacking alarm is active

    def seed(self, rows: Iterable[dict[str, Any]]) -> None:
        """Take the history of earlier rows (a resumed run's metrics.jsonl) without printing."""
        log, self.log = self.log, lambda m: None
        try:
            for row in rows:
                self.check(row)
        finally:
            self.log = log

    def check(self, row: dict[str, Any]) -> dict[str, float]:
        """The alarm values for ``row`` (printing each that fires or clears); then ``row`` joins the history."""
        out = {"alarm/step_time": self._step_time(row)}
        prev = self.evals[-1] if self.evals else None
        self._record(row)
        if EVAL_KEY in row:
            out["alarm/reward_hacking"] = self._reward_hacking(row, prev)
        return out

    def _step_time(self, row: dict[str, Any]) -> float:
        t = row.get(rundir.STEP_TIME)
        if not isinstance(t, (int, float)) or not math.isfinite(t) or any(row.get(k) for k in OVERHEAD_KEYS):
            return float(self.slow)  # no verdict on a step that did an eval or a checkpoint
        trail = self.times[-self.window:]
        if len(trail) < self.min_history:
            self.times.append(float(t))
            return 0.0
        base = median(trail)
        if not self.slow and t > self.slow_ratio * base:
            self.slow, self._slow_since = True, row.get("step", 0)
            self.log(f"ALARM step {row.get('step')}: step time {t:.3f}s is {t / base - 1:.0%} above the median "
                     f"{base:.3f}s of the last {len(trail)} steps (printed once; cleared when a step is back "
                     f"under {self.recover_ratio:.2f}x the median)")
        elif self.slow and t <= self.recover_ratio * base:
            self.slow = False
            if row.get("step", 0) - self._slow_since > 1:  # an episode, not a one-step blip: say it ended
                self.log(f"alarm cleared at step {row.get('step')}: step time {t:.3f}s, median {base:.3f}s")
        if not self.slow:
            self.times.append(float(t))  # a slow episode does not move the baseline
        return float(self.slow)

    def _reward_hacking(self, row: dict[str, Any], prev: tuple[int, float] | None) -> float:
        hacking = prev is not None and self._hacking(prev, row[EVAL_KEY])
        if hacking and not self.hacking:
            self.log(f"ALARM step {row.get('step')}: train reward rose by {self._rise(prev):+.3f} since the "
                     f"previous eval while held-out accuracy went {prev[1]:.1%} -> {row[EVAL_KEY]:.1%}; the "
                     f"policy may be exploiting the verifier (inspect samples, tighten the reward)")
        elif self.hacking and not hacking:
            self.log(f"alarm cleared at step {row.get('step')}: held-out accuracy {row[EVAL_KEY]:.1%} keeps up "
                     f"with the train reward again")
        self.hacking = hacking
        return float(hacking)

    def _record(self, row: dict[str, Any]) -> None:
        r = row.get("reward")
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
