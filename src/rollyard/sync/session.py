"""The one weight-sync path, for a rollout side in this process or in Ray actors.

Trainer side, ``SyncSession(plan, model, every, check_every, bucket_mb)`` (``plan``: ``factory.resolve``):

- ``startup(model, version) -> (handle, nbytes)``: a full update (a LoRA one carries the base) as a
  handle every receiver is built from (or loads: ``LocalReceiver``), and the bytes it moved.
- ``connect(receivers)``: the transport's handshake (``dist``: a new group of every receiver;
  called at start-up and after every restart), nothing for the others.
- ``due(version)``: the one publish rule, for every placement: publish when the trainer holds a
  version newer than the last published one and ``version % sync.every == 0``. A skipped optimizer
  step makes no version, so it publishes nothing, in every placement alike.
- ``publish(model, version, receivers) -> nbytes``: the mode's update (full, a sparse delta, the
  adapter) sent by the transport to every receiver; ``missed``: receivers that did not load it
  (a rejected update, a failed receive), to be sent ``catch_up``.
- ``snapshot_handle() -> (handle, nbytes, checksum)``: a full update at the *last published* version
  and the checksum a copy holding it has; a restarted or lagging receiver starts from it.
- ``catch_up(receiver) -> nbytes``: that snapshot sent to one receiver.
- ``expected(model)`` / ``checksum(model)``: what a receiver in sync with ``model`` holds / hashes to.

``receivers`` maps a name to an object with ``update(handle)`` (and for ``dist``: ``join`` and
``pull``, the receiver half of ``transport_dist``): a ``LocalReceiver`` over an engine in this
process, or a Ray actor handle (``placement.rollout_actor.RolloutWorker``).

Receiver side: ``receive(handle) -> WeightUpdate`` opens any handle a transport produced, then
``engine.load_weights(update, inflight)`` stages, verifies and swaps (``apply.Receiver``).

A transport is one file holding both halves (``transport_inprocess``, ``transport_ray``,
``transport_dist``) registered in ``factory.make_sender`` / ``make_receiver``.
"""

from __future__ import annotations

import copy

import torch

from rollyard.sync import lora
from rollyard.sync.check import weights_checksum
from rollyard.sync.factory import SyncPlan, make_publisher, make_sender
from rollyard.sync.transport_dist import GROUP_TIMEOUT_S
from rollyard.sync.wire import SyncRejected
from rollyard.types import WeightUpdate


class SyncSession:
    def __init__(self, plan: SyncPlan, model, every: int = 1, check_every: int = 0, bucket_mb: float = 64.0,
                 canary_every: int = 1):
        self.plan, self.every, self.check_every, self.canary_every = plan, every, check_every, canary_every
        self.publisher = make_publisher(plan.mode, plan.dtype)
        self.sender = make_sender(plan.transport, bucket_mb)
        # LoRA trains the adapter only: the base is published once, kept here for snapshots
        self.base = lora.base_weights(model, plan.dtype) if plan.mode == "lora" else None
        self.last: WeightUpdate | None = None
        self.missed: list[str] = []
        self.syncs = 0
        # mode inprocess: whether the engine reads the trainer's module itself (native) or holds a copy of it
        # anyway (vLLM keeps its weights inside its worker): only a copy can be checked
        self.shared = plan.mode == "inprocess"

    @property
    def mode(self) -> str:
        return self.plan.mode

    @property
    def transport(self) -> str:
        return self.plan.transport

    @property
    def timeout_s(self) -> float:
        """How long a receiver that died may take to be seen dead (a blocked broadcast fails after it)."""
        return getattr(self.sender, "timeout_s", GROUP_TIMEOUT_S)

    def startup(self, model, version: int) -> tuple[object, int]:
        self.last = self.publisher.publish(model, version, full=True)
        return self.sender.handle(self.last)

    def connect(self, receivers: dict) -> None:
        self.sender.connect(receivers)

    def due(self, version: int) -> bool:
        """A version newer than the last published that reached a multiple of ``sync.every`` (a step of several
        optimizer steps may pass one without landing on it)."""
        return version > self.last.version and version // self.every > self.last.version // self.every

    def check_due(self) -> bool:
        """The equality check runs after the first publish, then every ``sync.check_every``-th (0: never).
        Not where the engine reads the trainer's own module (mode ``inprocess``, native): no copy to compare."""
        if not self.check_every or self.shared:
            return False
        return self.syncs == 1 or self.syncs % self.check_every == 0

    def canary_due(self) -> bool:
        """The logprob canary runs after the first publish, then every ``sync.canary_every``-th (0: never)."""
        return bool(self.canary_every) and (self.syncs == 1 or self.syncs % self.canary_every == 0)

    def publish(self, model, version: int, receivers: dict) -> int:
        self.last = self.publisher.publish(model, version)
        self.syncs += 1
        nbytes, self.missed = self.sender.send(self.last, receivers)
        return nbytes

    def snapshot(self) -> WeightUpdate:
        """A full update at the last published version (the receiver needs no base version)."""
        last = self.last
        if self.mode == "inprocess":  # the receiver shares the module: the version is all there is
            return last
        if self.mode == "delta":  # the publisher's baseline is the last published weights, bit for bit
            return WeightUpdate(version=last.version, mode="full", tensors=dict(self.publisher.baseline))
        if self.mode == "lora":
            adapter = {n: t for n, t in last.tensors.items() if n.endswith(lora.ADAPTER_SUFFIXES)}
            return WeightUpdate(version=last.version, mode="lora", tensors={**self.base, **adapter})
        return WeightUpdate(version=last.version, mode="full", tensors=dict(last.tensors))

    def snapshot_handle(self) -> tuple[object, int, str]:
        update = self.snapshot()
        handle, nbytes = self.sender.handle(update)
        return handle, nbytes, expected_checksum(update)

    def catch_up(self, receiver) -> int:
        handle, nbytes, _ = self.snapshot_handle()
        if hasattr(receiver.update, "remote"):  # a Ray actor: the call does not wait
            receiver.update.remote(handle)
        else:
            receiver.update(handle)
        return nbytes

    def expected(self, model) -> dict[str, torch.Tensor]:
        return self.publisher.expected(model)

    def checksum(self, model) -> str:
        return weights_checksum(self.publisher.expected(model))


class LocalReceiver:
    """A receiver in the trainer's process (colocated): loads each update into ``engine`` at once;
    ``update`` returns False when it was rejected (nothing applied: the session sends a catch-up)."""

    def __init__(self, engine):
        self.engine = engine

    def update(self, handle) -> bool:
        try:
            self.engine.load_weights(receive(handle))
        except SyncRejected:
            return False
        return True


def receive(handle) -> WeightUpdate:
    """The update a transport's handle names (an update passed as itself is returned)."""
    if isinstance(handle, WeightUpdate):
        return handle
    from rollyard.sync.transport_ray import open_handle
    return open_handle(handle)


def expected_checksum(update: WeightUpdate) -> str:
    """The checksum of a rollout copy that holds the full (or full LoRA) ``update``."""
    return weights_checksum(lora.merged(update.tensors) if update.mode == "lora" else update.tensors)


def rollout_copy(model, dtype: torch.dtype):
    """A plain, frozen copy of ``model`` in ``dtype`` (a PEFT model is merged first)."""
    m = copy.deepcopy(model)
    if hasattr(m, "merge_and_unload"):
        m = m.merge_and_unload()
    return m.to(dtype).eval().requires_grad_(False)


def push_pull(publisher, transport, model, engine, version: int, full: bool = False) -> int:
    """By hand in one process over a bare wire transport (tests, benches): publish, send, receive,
    load; a rejected update is followed by one full one. Returns the bytes the transport reported."""
    nbytes = transport.send(publisher.publish(model, version, full=full))
    try:
        engine.load_weights(transport.recv())
    except SyncRejected:
        nbytes += transport.send(publisher.publish(model, version, full=True))
        engine.load_weights(transport.recv())
    return nbytes
