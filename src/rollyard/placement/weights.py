"""The weight-sync seam of the Ray placements: any mode (full, delta, lora) over either transport.

Trainer side, ``Publisher(plan, model, bucket_mb)`` (``plan``: ``sync.factory.resolve``):

- ``startup(model, version) -> (handle, nbytes)``: a full publish (a LoRA one carries the base)
  through the Ray object store; every actor is built from ``handle``.
- ``connect(workers)``: with ``transport=dist``, a fresh ``sync.group.SyncGroup`` (this process
  rank 0, the actors ranks 1..N in order, a new TCP store each time); called at start-up and after
  every restart (a group cannot outlive a member).
- ``publish(model, version, workers) -> nbytes``: the mode's update (full, a sparse delta, the
  adapter), over the object store (each actor gets the ref) or broadcast over the group in
  ``sync.bucket_mb`` buckets (each actor receives on a control thread and queues it for its loop).
  ``nbytes`` is what the transport reports it moved: the ledger's ``weights`` edge. A broadcast
  that fails (a member died mid-sync) raises ``SyncBroken``.
- ``snapshot_handle() -> (handle, nbytes, checksum)``: a full update at the *last published*
  version, through the object store, and the checksum a rollout copy holding it must have. A
  restarted actor starts from it; an actor that missed an update (a broken broadcast, a rejected
  delta) is sent it.
- ``checksum(model)``: what a rollout copy in sync with ``model`` hashes to (the equality check).

Worker side: ``receive(handle)`` (an object-store handle, or an update passed as itself) then
``engine.load_weights(update, inflight)``, which stages, verifies and swaps between decode steps.
"""

from __future__ import annotations

import ray

from rollyard.sync import lora
from rollyard.sync.check import weights_checksum
from rollyard.sync.factory import SyncPlan, make_publisher
from rollyard.sync.group import SyncGroup
from rollyard.sync.transport_dist import DistTransport
from rollyard.sync.transport_ray import RayTransport
from rollyard.types import WeightUpdate

GROUP_TIMEOUT_S = 30.0  # a broadcast blocked on a dead member fails after this long


class SyncBroken(RuntimeError):
    """A broadcast over the sync group failed (a member died mid-sync); the group must be rebuilt."""


class Publisher:
    def __init__(self, plan: SyncPlan, model, bucket_mb: float = 64.0, timeout_s: float = GROUP_TIMEOUT_S):
        self.plan, self.timeout_s = plan, timeout_s
        self.publisher = make_publisher(plan.mode, plan.dtype)
        self.store = RayTransport()
        self.bucket_bytes = max(1, int(bucket_mb * 1e6))
        # LoRA trains the adapter only: the base is published once, kept here for restarts
        self.base = lora.base_weights(model, plan.dtype) if plan.mode == "lora" else None
        self.last: WeightUpdate | None = None
        self.group: SyncGroup | None = None
        self.missed: list[str] = []  # workers that failed to receive the last broadcast
        self.generation = 0

    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def transport(self) -> str:
        return self.plan.transport

    def startup(self, model, version: int) -> tuple[list, int]:
        update = self.publisher.publish(model, version, full=True)
        self.last = update
        nbytes = self.store.send(update)
        return [self.store.ref], nbytes

    def connect(self, workers: dict) -> None:
        if self.transport != "dist":
            return
        self.generation += 1
        world = len(workers) + 1
        address, make = SyncGroup.host(world, self.timeout_s, prefix=f"g{self.generation}")
        refs = [h.join_dist.remote(address, rank, world, self.generation, self.timeout_s)
                for rank, h in enumerate(workers.values(), 1)]
        self.group = make()  # blocks until every actor joined
        ray.get(refs)

    def publish(self, model, version: int, workers: dict) -> int:
        update = self.publisher.publish(model, version)
        self.last = update
        if self.transport == "ray":
            nbytes = self.store.send(update)
            for h in workers.values():
                h.update.remote([self.store.ref])
            return nbytes
        refs = {h.recv_dist.remote(self.generation, self.bucket_bytes): name for name, h in workers.items()}
        try:
            nbytes = DistTransport(self.bucket_bytes, group=self.group).send(update)
        except RuntimeError as e:  # gloo: a peer closed its connection or timed out
            raise SyncBroken(f"weight broadcast v{version} failed: {str(e).splitlines()[0]}") from e
        self.missed = []  # workers whose receive failed (not dead): the caller sends them the snapshot
        for ref, name in refs.items():
            try:
                ray.get(ref, timeout=self.timeout_s)
            except ray.exceptions.RayActorError:
                pass  # dead: the pool replaces it from the snapshot
            except (ray.exceptions.RayError, RuntimeError):
                self.missed.append(name)
        return nbytes

    def snapshot(self) -> WeightUpdate:
        """A full update at the last published version (the receiver needs no base version)."""
        last = self.last
        if self.mode == "delta":  # the publisher's baseline is the last published weights, bit for bit
            return WeightUpdate(version=last.version, mode="full", tensors=dict(self.publisher.baseline))
        if self.mode == "lora":
            adapter = {n: t for n, t in last.tensors.items() if n.endswith(lora.ADAPTER_SUFFIXES)}
            return WeightUpdate(version=last.version, mode="lora", tensors={**self.base, **adapter})
        return WeightUpdate(version=last.version, mode="full", tensors=dict(last.tensors))

    def snapshot_handle(self) -> tuple[list, int, str]:
        update = self.snapshot()
        nbytes = self.store.send(update)
        return [self.store.ref], nbytes, expected_checksum(update)

    def checksum(self, model) -> str:
        return weights_checksum(self.publisher.expected(model))


def expected_checksum(update: WeightUpdate) -> str:
    """The checksum of a rollout copy that holds the full (or full LoRA) ``update``."""
    return weights_checksum(lora.merged(update.tensors) if update.mode == "lora" else update.tensors)


def receive(handle: list | WeightUpdate) -> WeightUpdate:
    """The update a handle names (an update passed as itself -- in one process, in tests -- is returned)."""
    return handle if isinstance(handle, WeightUpdate) else RayTransport().recv(handle[0])
