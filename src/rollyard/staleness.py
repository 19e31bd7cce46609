"""The staleness bound: pure functions used where work is admitted and where samples are consumed.

Versions count optimizer steps: the trainer's version after ``k`` steps is ``k``; a sample's
version is the oldest weight version any of its tokens was sampled under. A sample trained at
trainer version ``t`` lags by ``t - version``; the bound ``K`` allows lags ``0..K``.

- Admission (rollout side): a batch that the trainer will consume at step ``k`` may start only on
  weights of version ``>= min_fresh_version(k, K)``. The target step ``k`` is never below the
  trainer's version, so this is at least as strict as "trainer version - worker version <= K",
  and with ``K = 0`` nothing is ever sampled that would be dropped.
- Consumption (trainer side): a sample older than ``min_fresh_version(trainer version, K)`` is not
  trained on; its prompt is requeued and the drop is counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


def min_fresh_version(trainer_version: int, bound: int) -> int:
    """Oldest weight version a sample may carry to be trained at ``trainer_version``."""
    return max(0, trainer_version - bound)


def is_fresh(sample_version: int, trainer_version: int, bound: int) -> bool:
    return sample_version >= min_fresh_version(trainer_version, bound)


def lags(trainer_version: int, sample_versions: Iterable[int]) -> list[int]:
    """Per-sample lag ``trainer_version - version`` (0 = on-policy)."""
    return [trainer_version - v for v in sample_versions]


def histogram(lag_values: Iterable[int]) -> list[int]:
    """Counts per lag: ``out[d]`` = how many samples lagged by ``d`` versions."""
    counts = Counter(lag_values)
    return [counts.get(d, 0) for d in range(max(counts, default=-1) + 1)]


def bound_of(placement: str, max_staleness: int, sync_every: int, per_step: int = 1) -> int:
    """The bound a placement runs under (the one formula; ``roles.settings`` resolves it once per run), in versions
    (optimizer steps; a step makes ``per_step`` of them: trainer.epochs x trainer.mini_batches). Weights are
    published at the first step end at or past each multiple of ``sync_every`` versions, so a copy lags by up to
    ``published_lag`` versions; colocated samples from that copy, disaggregated is one step (``per_step``
    versions) further off, async runs under ``max_staleness``."""
    if placement == "colocated":
        return published_lag(sync_every, per_step)
    if placement == "disaggregated":
        return published_lag(sync_every, per_step) + per_step
    return max_staleness


def published_lag(sync_every: int, per_step: int = 1) -> int:
    """Versions the published weights lag the trainer's at a step's start: ``(ceil(sync_every / per_step) - 1) x
    per_step`` (``sync_every - 1`` with one optimizer step a step)."""
    return (-(-sync_every // per_step) - 1) * per_step
