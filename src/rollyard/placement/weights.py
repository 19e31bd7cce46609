"""The weight-sync seam of the Ray placements, over the sync layer (``rollyard.sync``).

Trainer side: ``Publisher(dtype).publish(model, version)`` -> ``(handle, nbytes)``: the sync
layer's full publisher (every parameter in the rollout dtype) sent through its Ray object-store
transport (which stamps the payload checksum); ``nbytes`` is the serialized size the transport reports (what the
traffic ledger records) and ``handle`` is what a worker receives it by (the object ref, wrapped so
Ray does not resolve it in the control call). Worker side: ``receive(handle)`` then
``engine.load_weights(update, inflight)``, which stages, verifies and swaps between decode steps.
Only ``full`` for now: a restarted worker gets the latest publish as it is.
"""

from __future__ import annotations

import torch

from rollyard.sync.check import weights_checksum
from rollyard.sync.factory import make_publisher
from rollyard.sync.transport_ray import RayTransport
from rollyard.types import WeightUpdate


class Publisher:
    def __init__(self, dtype: torch.dtype):
        self.publisher, self.transport = make_publisher("full", dtype), RayTransport()

    def publish(self, model, version: int) -> tuple[list, int]:
        nbytes = self.transport.send(self.publisher.publish(model, version, full=True))
        return [self.transport.ref], nbytes

    def checksum(self, model) -> str:
        """What a rollout copy in sync with ``model`` hashes to (the start-up equality check)."""
        return weights_checksum(self.publisher.expected(model))


def receive(handle: list | WeightUpdate) -> WeightUpdate:
    """The update a handle names (an update passed as itself -- in one process, in tests -- is returned)."""
    return handle if isinstance(handle, WeightUpdate) else RayTransport().recv(handle[0])
