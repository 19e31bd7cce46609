"""What a run does with samples whose verifier failed: count, record, alarm, leave out (or not).

``settle(step, samples)`` is called once per step after scoring. It

- prints the step's failures by kind when there are any (``timeout: 3, error: RuntimeError: 1``);
- keeps the first ``FIRST_TEXTS`` texts of each kind, with their step, in ``RUN_DIR/reward_errors.json``
  (the reason a run scored 0 is on disk, not only in a scrolled-away terminal);
- raises an alarm (printed; ``alarm/reward_failures`` = 1 in metrics.jsonl) when more than
  ``max_failure_frac`` of the step's calls failed;
- returns the samples to train on: without the failed ones (``on_failure="skip"``, the default: a
  verifier that could not judge a sample says nothing about it) or all of them with reward 0
  (``"zero"``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from rollyard.telemetry import rundir
from rollyard.types import Sample

FIRST_TEXTS = 3


def kind_of(flag: str) -> str:
    """``"timeout"`` / ``"error: RuntimeError: boom"`` -> ``"timeout"`` / ``"error: RuntimeError"``."""
    if not flag.startswith("error: "):
        return flag.split(" ", 1)[0]
    head = flag[len("error: "):]
    cut = min((i for i in (head.find(":"), head.find(" (")) if i >= 0), default=len(head))
    return "error: " + head[:cut]


class RewardFailures:
    """Per-run failure accounting; ``resume_step`` drops first texts recorded at or after it (re-run steps)."""

    def __init__(self, run_dir: str | Path, on_failure: str = "skip", max_failure_frac: float = 0.5,
                 log: Callable[[str], None] = print, resume_step: int = 0):
        if on_failure not in ("skip", "zero"):
            raise ValueError(f"on_failure must be 'skip' or 'zero', got {on_failure!r}")
        self.path = Path(run_dir) / rundir.REWARD_ERRORS
        self.on_failure, self.max_failure_frac, self.log = on_failure, max_failure_frac, log
        self.first: dict[str, list[dict]] = {}
        if self.path.exists():
            try:
                saved = json.loads(self.path.read_text())
            except ValueError:
                saved = {}
            for kind, texts in saved.items():
                kept = [t for t in texts if isinstance(t, dict) and t.get("step", 0) < resume_step]
                if kept:
                    self.first[kind] = kept

    def settle(self, step: int, samples: list[Sample]) -> tuple[list[Sample], dict[str, float]]:
        """``(samples to train on, metric values for the step)``; see the module docstring."""
        failed = [s for s in samples if s.reward_flag]
        frac = len(failed) / max(len(samples), 1)
        alarm = frac > self.max_failure_frac
        values = {"reward/failed_frac": frac, "alarm/reward_failures": float(alarm)}
        if not failed:
            return samples, values
        counts = Counter(kind_of(s.reward_flag) for s in failed)
        self._remember(step, failed)
        what = "left out of the loss" if self.on_failure == "skip" else "trained on as reward 0"
        self.log(f"step {step}: {len(failed)}/{len(samples)} reward calls failed "
                 f"({', '.join(f'{k}: {n}' for k, n in counts.most_common())}); {what} "
                 f"(reward.on_failure={self.on_failure}); first texts in {self.path}")
        if alarm:
            self.log(f"ALARM step {step}: {frac:.0%} of reward calls failed, above reward.max_failure_frac="
                     f"{self.max_failure_frac:.0%}; e.g. {failed[0].reward_flag[:200]}")
        if self.on_failure == "zero":
            return samples, values
        return [s for s in samples if not s.reward_flag], values

    def _remember(self, step: int, failed: list[Sample]) -> None:
        changed = False
        for s in failed:
            texts = self.first.setdefault(kind_of(s.reward_flag), [])
            if len(texts) < FIRST_TEXTS:
                texts.append({"step": step, "sample": s.id, "text": s.reward_flag})
                changed = True
        if changed:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.first, indent=1))
            os.replace(tmp, self.path)
