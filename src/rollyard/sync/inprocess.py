"""In-process mode: the engine shares the trainer's module, so a sync only bumps the version.

The update carries no tensors; the engine refreshes what it derived from the weights (the fast
path's fused copies). Only valid with the in-process transport and a rollout dtype equal to the
trainer's (checked at start-up by ``factory.resolve``).
"""

from __future__ import annotations

from rollyard.types import WeightUpdate


class SharedPublisher:
    mode = "inprocess"

    def publish(self, model, version: int, full: bool = False) -> WeightUpdate:
        return WeightUpdate(version=version, mode="inprocess")

    def expected(self, model) -> dict:
        return {n: p.detach() for n, p in model.named_parameters()}
