"""Fully-async placement: rollout workers (Ray actors) run their own loops; the trainer never waits
for a round to finish, only for enough fresh groups.

Rounds are handed out up to ``max_staleness + 1`` steps ahead; a worker starts a round meant for
step ``k`` only on weights of version ``>= k - max_staleness`` (admission), and the trainer drops
and requeues a group older than that when it takes it (consumption). Weights are published every
``sync.every`` steps and applied between decode steps under ``rollout.inflight``. The loss corrects
the gap with truncated importance sampling on the rollout's logprobs (trainer.step). With
``max_staleness = 0`` and one worker it trains on exactly the samples colocated would. With
``rollout.scheduler=tail`` the rounds handed out are short and long rounds (the round book,
``rollout/rounds.py``); a deferred prompt restarts whole in its long round, under the same bound.
"""

from __future__ import annotations

from pathlib import Path

from rollyard.config import RunConfig
from rollyard.placement import step
from rollyard.placement.pool import RolloutPool
from rollyard.placement.run import start


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False, admission_slack: int = 0,
          worker: type | None = None) -> dict:
    """Test hooks: ``admission_slack``: workers admit work that many versions past the bound, so
    the consumption check must catch it; ``worker``: the rollout actor class (tests/faults.py)."""
    run, r, _ = start(cfg, run_dir, resume)
    bound = run.settings.bound
    return step.train(run, r, RolloutPool(cfg, run, r, bound, ahead=bound + 1, by_round=False,
                                          admission_slack=admission_slack, worker=worker))
