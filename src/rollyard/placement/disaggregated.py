"""Disaggregated placement (one step off): rollout workers (Ray actors) sample step k+1 while the
trainer trains step k.

Round k+1 is handed out before step k trains; the weights published after step k reach the
workers before they start round k+2 (a round meant for step b starts only on weights of version
``>= b - sync.every``). The trainer takes exactly round k at step k, so every sample lags by at
most ``sync.every`` versions (1 by default), checked where it is consumed. With
``rollout.scheduler=tail`` round k is a short round (its first P complete prompts; the rest deferred)
or a long round of deferred prompts (the round book, ``rollout/rounds.py``).
"""

from __future__ import annotations

from pathlib import Path

from rollyard.config import RunConfig
from rollyard.placement import step
from rollyard.placement.pool import RolloutPool
from rollyard.placement.run import start


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False, worker: type | None = None) -> dict:
    """``worker`` (a test hook): the rollout actor class (tests/faults.py)."""
    run, r, _ = start(cfg, run_dir, resume)
    return step.train(run, r, RolloutPool(cfg, run, r, bound=run.settings.bound, ahead=1, by_round=True, worker=worker))
