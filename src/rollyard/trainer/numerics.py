"""Non-finite loss or gradient: skip the update loudly, and stop after too many in a row.

A skipped step leaves the weights and the optimizer's moments untouched (the gradients are
dropped), is printed, and is counted (``train/skipped`` this step, ``train/skipped_steps`` in
total); the driver does not advance the weight version. ``max_consecutive`` skips in a row mean
the run is diverging, not hitting a rare bad batch: :class:`NumericalError` stops it.
"""

from __future__ import annotations

import math
import sys


class NumericalError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient norm."""


class SkipGuard:
    """``check(loss, grad_norm) -> skip?``; counts skips and raises after ``max_consecutive`` in a row."""

    def __init__(self, max_consecutive: int = 3):
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.total = 0
        self.consecutive = 0

    def check(self, loss: float, grad_norm: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive = 0
            return False
        self.total += 1
        self.consecutive += 1
        print(f"rollyard: optimizer step skipped: loss {loss}, gradient norm {grad_norm} (not finite); weights "
              f"unchanged ({self.consecutive} in a row, limit trainer.max_skipped_steps={self.max_consecutive})",
              file=sys.stderr, flush=True)
        if self.consecutive >= self.max_consecutive:
            raise NumericalError(
                f"{self.consecutive} consecutive optimizer steps had a non-finite loss or gradient (last: loss "
                f"{loss}, gradient norm {grad_norm}); the run is diverging. Lower trainer.lr, check the rewards "
                f"for huge values, or raise trainer.max_skipped_steps (now {self.max_consecutive})")
        return True
