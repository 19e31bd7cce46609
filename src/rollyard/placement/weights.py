"""The weight-sync seam of the Ray placements: what the trainer publishes and how a worker applies it.

Until the sync layer (``sync/{full,delta,lora}`` x ``sync/transport_*``) lands, this ships full
weights through the Ray object store: one ``ray.put`` per publish, every worker reads the same
object. ``publish`` returns the object ref and the bytes put (what the traffic ledger records);
``apply`` is the receiving half. Swapping in the sync layer changes these two functions only.
"""

from __future__ import annotations

import torch

from rollyard.sync.apply import apply_update, weights_checksum
from rollyard.types import Sample, WeightUpdate


def publish(model, version: int, dtype: torch.dtype = torch.float32, checksum: bool = False):
    """Put ``model``'s weights at ``version`` into the object store; returns ``(ref, nbytes)``.

    Tied parameters go once (``named_parameters`` de-duplicates them); the receiver's
    ``apply_update`` resolves either name. ``checksum``: the receiver verifies its copy after applying.
    """
    import ray

    tensors = {n: p.detach().to("cpu", dtype).clone() for n, p in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    same = dtype == next(model.parameters()).dtype
    update = WeightUpdate(version=version, mode="full", tensors=tensors, nbytes=nbytes,
                          checksum=weights_checksum(model) if checksum and same else None)
    return ray.put(update), nbytes


def apply(engine, update: WeightUpdate, inflight: str) -> list[Sample]:
    """Apply ``update`` to ``engine`` between two decode steps; returns the samples ``abort`` stopped."""
    return engine.load_weights(update, inflight)


def apply_initial(model, update: WeightUpdate) -> None:
    """A new worker's model takes the trainer's weights (start-up, or a restart after a death)."""
    apply_update(model, update)
