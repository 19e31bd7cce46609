"""Full sync: every parameter by name, cast to the rollout dtype.

Publish side: ``FullPublisher(dtype).publish(model, version) -> WeightUpdate``.
Apply side: ``stage(live, update) -> {name: new tensor}`` builds the new tensors beside the live
ones (nothing is written into ``live``); ``apply.Receiver`` swaps them in after the checks.
"""

from __future__ import annotations

import torch

from rollyard.sync.wire import SyncRejected
from rollyard.types import WeightUpdate


def rollout_weights(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What the rollout copy must hold: every (deduplicated) parameter, cast to ``dtype``, detached copies."""
    return {n: p.detach().to(dtype=dtype, copy=True) for n, p in model.named_parameters()}


class FullPublisher:
    """Publishes every parameter; ``full`` is accepted for a uniform surface (every sync is full)."""

    mode = "full"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    @torch.no_grad()
    def publish(self, model, version: int, full: bool = False) -> WeightUpdate:
        return WeightUpdate(version=version, mode="full", tensors=rollout_weights(model, self.dtype))

    def expected(self, model) -> dict[str, torch.Tensor]:
        """The weights a rollout copy in sync with ``model`` holds (for the equality check)."""
        return rollout_weights(model, self.dtype)


def stage(live: dict[str, torch.Tensor], update: WeightUpdate) -> dict[str, torch.Tensor]:
    """New value per named parameter, shape- and dtype-checked against ``live``."""
    out = {}
    for name, value in update.tensors.items():
        if name not in live:
            raise SyncRejected(f"full update v{update.version} names parameter {name!r}, which the rollout model "
                               f"lacks; trainer and rollout must load the same architecture")
        p = live[name]
        if tuple(value.shape) != tuple(p.shape):
            raise SyncRejected(f"full update v{update.version}: {name!r} has shape {tuple(p.shape)} in the rollout "
                               f"model, the update sends {tuple(value.shape)}")
        out[name] = value.to(device=p.device, dtype=p.dtype)
    carried = {live[n].data_ptr() for n in out}  # a tied alias (lm_head = embed) counts as carried
    missing = [n for n in live if n not in out and live[n].data_ptr() not in carried]
    if missing:
        raise SyncRejected(f"full update v{update.version} lacks {len(missing)} parameters (first: {missing[0]!r}); "
                           f"a full sync must carry every parameter")
    return out

