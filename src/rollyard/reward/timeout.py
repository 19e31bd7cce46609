"""Adaptive per-call verifier timeout (RollPacker's dynamic reward scheduling).

A fixed timeout is either too tight for a slow task or lets one hung verifier hold a round's
last group for seconds. Here each call gets ``min(max(T_min, lambda x T_anchor), T_max)`` where
``T_anchor`` is the median latency of the task's recent calls: calls that run ``lambda`` times
longer than usual are cut, but never below ``T_min`` (scheduling jitter) nor above ``T_max``.
Until a task has an observation its calls get ``T_max``. Only calls that finished feed the
anchor (a timed-out call's true latency is unknown).

Standard library only: the dispatcher imports it.
"""

from __future__ import annotations

from collections import deque
from statistics import median


def adaptive_timeout(t_min: float, lam: float, anchor: float | None, t_max: float) -> float:
    """``min(max(t_min, lam * anchor), t_max)``; ``t_max`` while there is no anchor yet."""
    if anchor is None:
        return t_max
    return min(max(t_min, lam * anchor), t_max)


class AnchorTimeout:
    """Per-task ``T_anchor`` tracked online: the median of the last ``window`` finished calls.

    The dispatcher calls ``timeout(meta)`` when it sends a call and ``observe(meta, seconds)``
    when one finishes; the task is ``meta["task"]`` (one anchor for samples without one).
    """

    def __init__(self, t_min: float, lam: float, t_max: float, window: int = 256):
        if not 0 < t_min <= t_max:
            raise ValueError(f"adaptive timeout needs 0 < t_min <= t_max, got t_min={t_min}, t_max={t_max}")
        if lam <= 0 or window < 1:
            raise ValueError(f"adaptive timeout needs lambda > 0 and window >= 1, got {lam}, {window}")
        self.t_min, self.lam, self.t_max, self.window = t_min, lam, t_max, window
        self._seen: dict[str, deque[float]] = {}

    @staticmethod
    def _task(meta: dict) -> str:
        return str(meta.get("task", "")) if isinstance(meta, dict) else ""

    def anchor(self, task: str) -> float | None:
        seen = self._seen.get(task)
        return median(seen) if seen else None

    def timeout(self, meta: dict) -> float:
        return adaptive_timeout(self.t_min, self.lam, self.anchor(self._task(meta)), self.t_max)

    def observe(self, meta: dict, seconds: float) -> None:
        self._seen.setdefault(self._task(meta), deque(maxlen=self.window)).append(float(seconds))
