"""Seed 002's alarms, checked on every metrics row: a slow step, reward hacking, a held-out regression.

- ``alarm/step_time``: the step's wall time (``time/step``) is more than ``slow_ratio`` (1.2: 20%)
  above the median of the trailing ``window`` baseline steps (after ``min_history`` of them, so
  warm-up does not count).
- ``alarm/reward_hacking``: at a held-out eval (a row with ``eval/accuracy``, every ``eval_every``
  steps), the mean train reward since the previous eval rose by more than ``reward_rise`` over the
  mean of the interval before it, while held-out accuracy did not rise by more than
  ``accuracy_flat`` (flat or falling): the policy is learning the verifier, not the task. Held-out
  accuracy exists only for a correctness signal (``evaluate.accuracy_signal``), so a reward that is
  not one (a length bonus) is held against real correctness, never against itself.
- ``alarm/held_out_regression``: at a held-out eval, accuracy fell below the best earlier eval of
  the run by more than ``regression_z`` standard errors of the difference of two binomial
  proportions over the ``eval/prompts`` held-out prompts, ``sqrt(p_best (1 - p_best) / n + p (1 - p) / n)``
  (at least ``1/n``: two evals at 0% or 100% are not noise-free). Not checked on rows without
  ``eval/prompts`` (runs written before it).
- ``alarm/logprob_canary``: after a sync, the rollout copy's score of the fixed probe differs from the
  trainer's at the same version (``canary/logprob_gap``, ``sync/canary.py``) by more than
  ``canary_ratio`` x the run's first canary (the copy's dtype rounding, measured on the first sync's
  weights, which the equality check verifies by default) + ``canary_abs``: a copy that stopped
  taking weights or loaded them wrong. The staleness lag (``canary/lag``) is not part of it. The first
  canary is held to ``canary_first_max`` (the copy's dtype's rounding with room: 1e-3 nats for an fp32
  copy, 0.5 for bf16 (a real model's rarer tokens round more), ``first_canary_max``): past it the copy never matched (a sampling support, a
  dtype or a weight mapping that differs from the first sync on), and the floor is that ceiling.

Both have hysteresis: an alarm is printed once when it fires, the row value stays 1 while the
condition holds, and it re-arms only after a recovery: a step back under ``recover_ratio`` x the
median, an eval that is not hacking or is back within noise of the best (one "cleared" line; for a slow
episode only when it lasted more than one step). A load spike is one alarm, not one per
step. Steps whose wall time includes a held-out eval or a checkpoint write (rows with
``eval/seconds``, ``checkpoint/seconds``, or ``restart/seconds``: a rollout worker replaced) are neither alarmed on nor part of the baseline, nor
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
EVAL_N_KEY = "eval/prompts"  # held-out prompts behind EVAL_KEY (its noise)
CANARY_KEY = "canary/logprob_gap"


def first_canary_max(copy_dtype) -> float:
    """The largest first-sync canary gap a rollout copy computing in ``copy_dtype`` (its dtype, or the native
    engine's rollout.precision) reads from rounding alone, with room:
    measured at most 3.3e-6 (fp32) and 2.1e-2 (bf16) nats (docs/weight-sync.md, ``bench/canary.py --part gaps``);
    int8 weights (rollout.precision=int8, a scale per 64 inputs) 0.27-0.30 (SmolLM2-135M, the real-model example's
    first 6 syncs, 3 seeds; 0.44-0.48 with a scale per row)."""
    if str(copy_dtype) in ("int8", "w8a8"):
        return 2.0
    return 1e-3 if str(copy_dtype) in ("torch.float32", "fp32", "float32") else 0.5
# Row values: seconds of this step's wall time spent outside the step's own work (see RunRecord)
OVERHEAD_KEYS = ("eval/seconds", "checkpoint/seconds", "restart/seconds")


class Alarms:
    def __init__(self, window: int = 20, min_history: int = 5, slow_ratio: float = 1.2, recover_ratio: float = 1.1,
                 reward_rise: float = 0.05, accuracy_flat: float = 0.01, regression_z: float = 2.0,
                 canary_ratio: float = 10.0, canary_abs: float = 1e-4, canary_first_max: float = 0.1,
                 log: Callable[[str], None] | None = None):
        self.window, self.min_history = window, min_history
        self.slow_ratio, self.recover_ratio = slow_ratio, min(recover_ratio, slow_ratio)
        self.reward_rise, self.accuracy_flat, self.regression_z = reward_rise, accuracy_flat, regression_z
        self.canary_ratio, self.canary_abs, self.canary_first_max = canary_ratio, canary_abs, canary_first_max
        self.canary_floor: float | None = None   # the run's first canary gap
        self.canary_off = False                  # a canary alarm is active
        self.log = log or (lambda m: print(m, flush=True))
        self.times: list[float] = []              # the step-time baseline
        self.rewards: list[float] = []            # the reward per row, in step order
        self.evals: list[tuple[int, float]] = []  # (index into rewards after which it ran, accuracy)
        self.slow = False                         # a step-time alarm is active
        self._slow_since = 0                      # the step it fired at
        self.hacking = False                      # a reward-hacking alarm is active
        self.regressed = False                    # a held-out regression alarm is active

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
        if isinstance(row.get(CANARY_KEY), (int, float)):
            out["alarm/logprob_canary"] = self._canary(row)
        if EVAL_KEY in row:
            out["alarm/reward_hacking"] = self._reward_hacking(row, prev)
            if isinstance(row.get(EVAL_N_KEY), int) and row[EVAL_N_KEY] > 0:
                out["alarm/held_out_regression"] = self._regression(row)
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

    def _canary(self, row: dict[str, Any]) -> float:
        gap = float(row[CANARY_KEY])
        if self.canary_floor is None:
            self.canary_floor = min(gap, self.canary_first_max)
            if gap <= self.canary_first_max:
                return 0.0
            limit = self.canary_first_max
            if not self.canary_off:
                self.log(f"ALARM step {row.get('step')}: logprob canary: at the first sync the rollout copy's logprobs "
                         f"of the fixed probe already differ from the trainer's by {gap:.2e}, past the copy dtype's "
                         f"rounding ({limit:g}): the two sides never matched. Check that rollout.top_p / top_k / "
                         f"temperature reach both sides, rollout.dtype / rollout.precision, and the weight names the copy loads "
                         f"(sync.check_every=1 names a differing tensor)")
            self.canary_off = True
            return 1.0
        limit = self.canary_ratio * self.canary_floor + self.canary_abs
        off = gap > limit
        if off and not self.canary_off:
            self.log(f"ALARM step {row.get('step')}: logprob canary: the rollout copy's logprobs of the fixed probe "
                     f"differ from the trainer's at the same version by {gap:.2e} (limit {limit:.2e}: the first "
                     f"sync's {self.canary_floor:.2e} x {self.canary_ratio:g} + {self.canary_abs:g}); it is not "
                     f"sampling from the trainer's weights: run with sync.check_every=1 to name the tensor, "
                     f"stop and resume from the latest checkpoint")
        elif self.canary_off and not off:
            self.log(f"alarm cleared at step {row.get('step')}: logprob canary {gap:.2e} back under {limit:.2e}")
        self.canary_off = off
        return float(off)

    def _regression(self, row: dict[str, Any]) -> float:
        acc, n = float(row[EVAL_KEY]), row[EVAL_N_KEY]
        earlier = [a for _, a in self.evals[:-1]]  # _record already appended this eval
        best = max(earlier, default=acc)
        noise = max(math.sqrt(best * (1 - best) / n + acc * (1 - acc) / n), 1 / n)
        regressed = best - acc > self.regression_z * noise
        if regressed and not self.regressed:
            self.log(f"ALARM step {row.get('step')}: held-out accuracy fell to {acc:.1%} from the run's best "
                     f"{best:.1%}, {(best - acc) / noise:.1f} standard errors over {n} prompts (alarm past "
                     f"{self.regression_z:g}); the policy is getting worse at the task: compare the checkpoints "
                     f"around the best eval (eval.jsonl), lower trainer.lr or resume from an earlier checkpoint")
        elif self.regressed and not regressed:
            self.log(f"alarm cleared at step {row.get('step')}: held-out accuracy {acc:.1%} is back within "
                     f"noise of the best {best:.1%}")
        self.regressed = regressed
        return float(regressed)

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
