"""The trainer inside an in-process round (rollout.scheduler = tail): streaming scoring and gradients.

The colocated rollout side runs its round (``rounds.run_round``) with ``InRound.add`` as the round's
``on_group`` when the book's policy trains in the round (``policy.streamed``); ``step.py`` then skips its
own scoring and training for that step. Scoring is the step's own (``step.score_rewarded``: settle,
reference, GRPO advantages, with their spans), applied per complete group, and its edges (``step.edges``)
once per step (``finish``).
Why this path trains inside the round: RollPacker's stream-based training overlaps the trainer's
forward/backward of finished groups with the decoding of the rest (the long tail), so each
complete group's gradient is accumulated while the engine keeps decoding; only the optimizer step
waits for the round to end. Moved after the round, the overlap -- the point of tail batching --
would be gone.
"""

from __future__ import annotations

import time

from rollyard.placement.step import edges, score_rewarded
from rollyard.trainer.streaming import StreamingStep
from rollyard.types import Sample


class InRound:
    """One step's trainer inside its round. ``run``: the run record; ``roles``: the driver's role handles."""

    def __init__(self, run, roles, step: int):
        self.run, self.roles, self.step = run, roles, step
        self.stream = StreamingStep(roles.trainer)
        self.scored: list[Sample] = []  # every scored sample, failed verifier calls included: the step's metrics count them
        self.trained: list[Sample] = []
        self.train_s = 0.0  # seconds scoring and accumulating gradients inside the round (tail/train_in_round_s)

    def add(self, group: list[Sample]) -> None:
        """A complete, rewarded group: the step's scoring and spans (failed verifier calls: the step row shows
        the last), then its gradient, while the rest of the round decodes."""
        t0 = time.perf_counter()
        group, kept = score_rewarded(self.run, self.roles, self.step, group)
        self.scored.extend(group)
        self.trained.extend(kept)
        if not kept:
            return
        self.stream.add(kept)
        self.train_s += time.perf_counter() - t0

    def finish(self) -> dict[str, float]:
        """The step's edges and its one optimizer step; returns the trainer's metrics."""
        edges(self.run, self.roles, self.step, self.scored, self.trained)
        with self.run.telemetry.span("train", self.step):
            return self.stream.finish()
