"""Placements: where the roles run. ``train(cfg, run_dir, resume)`` picks the driver.

- ``colocated``: one process, one copy of the weights, no Ray (the embedded default);
- ``disaggregated``: Ray rollout actors sample step k+1 while the trainer trains step k;
- ``async``: rollout actors run their own loops; a staleness bound holds at admission and consumption.

Every driver runs the one GRPO step (``step.py``) over its rollout side. This file is the package's
face only: the rules live in ``rules.py``; no module of the package imports this one.
"""

from __future__ import annotations

from pathlib import Path

from rollyard.config import RunConfig
from rollyard.placement.rules import PLACEMENTS, RolloutCrashLoop, check

__all__ = ["PLACEMENTS", "RolloutCrashLoop", "check", "train"]


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False) -> dict:
    """Run ``cfg`` in its placement; returns the summary."""
    if cfg.placement == "colocated":
        check(cfg)
        from rollyard.placement import colocated
        return colocated.train(cfg, run_dir, resume)
    from rollyard.placement import cluster
    check(cfg, cluster.cpus())
    cluster.connect()
    if cfg.placement == "disaggregated":
        from rollyard.placement import disaggregated
        return disaggregated.train(cfg, run_dir, resume)
    from rollyard.placement import async_
    return async_.train(cfg, run_dir, resume)
