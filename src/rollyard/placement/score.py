"""The one scoring path every placement shares: reward -> reference -> advantages.

Runs in the driver process on finished samples (for async, on a consumed batch), records the
``reward``, ``reference`` and ``algorithm`` spans and the ``rewards`` / ``ref_logprobs`` edges.
Samples the verifier could not score are dead-lettered and left out.
"""

from __future__ import annotations

from rollyard.algo.advantages import assign_advantages
from rollyard.placement.run import Roles, RunRecord
from rollyard.reward.dispatcher import UNSCORED, split_unscored
from rollyard.types import Sample


def score(run: RunRecord, r: Roles, step: int, samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """Returns ``(scored, trained)``: every scored sample (for the step's metrics) and those to train
    on (failed verifier calls are counted and, by default, left out), with advantages set."""
    tel, cfg = run.telemetry, run.cfg
    with tel.span("reward", step):
        samples, unscored = split_unscored(r.rewards.score(samples))
        trained = run.settle_rewards(step, samples)
    run.dead_letter([{"source": s.id, "reason": UNSCORED} for s in unscored], step)
    tel.traffic(step, "rewards", 4 * len(samples))
    if r.reference is not None:
        with tel.span("reference", step):
            for s, lp in zip(trained, r.trainer.logprobs(trained, model=r.reference)):
                s.ref_logprobs = lp.tolist()
        tel.traffic(step, "ref_logprobs", 4 * sum(len(s.completion_ids) for s in trained))
    with tel.span("algorithm", step):
        assign_advantages(trained, cfg.algo.normalize_std)
    return samples, trained
