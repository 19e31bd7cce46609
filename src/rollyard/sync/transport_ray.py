"""Ray object-store transport: the packed update is put in the object store; receivers get it by ref.

``send(update)`` packs the update (``sync/wire.py``), ``ray.put``s ``(header, payload)`` and
returns the serialized size Ray stores (the bytes a receiving node pulls); ``self.ref`` is the
object ref. A receiver in another process needs that ref: the driver passes ``transport.ref`` to
the rollout actor (refs pickle across Ray calls), which calls ``RayTransport().recv(ref)``. In one
process ``recv()`` reads the last ref sent. Without a Ray session the constructor starts a local
one (no dashboard; set ``RAY_AUTH_MODE=disabled`` locally).

Its two halves for ``sync.session``: ``RaySender`` (trainer half: one ``put``, every receiver gets
the ref; no handshake) and ``open_handle`` (receiver half: the update a handle names).
"""

from __future__ import annotations

import ray
import torch

from rollyard import waits
from rollyard.sync.wire import pack, unpack
from rollyard.types import WeightUpdate

RECV_S = 600.0  # a fetch of a whole update from the object store (the largest models: GBs over the node's network)


def serialized_size(value) -> int:
    """Bytes Ray's serializer produces for ``value`` (metadata + in-band pickle + out-of-band buffers)."""
    ctx = ray._private.worker.global_worker.get_serialization_context()
    return int(ctx.serialize(value).total_bytes)


class RayTransport:
    name = "ray"

    def __init__(self):
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        self.ref = None

    def send(self, update: WeightUpdate) -> int:
        header, payload = pack(update)
        value = (header, payload.numpy())
        self.ref = ray.put(value)
        update.nbytes = serialized_size(value)
        return update.nbytes

    def recv(self, ref=None) -> WeightUpdate:
        ref = ref if ref is not None else self.ref
        if ref is None:
            raise RuntimeError("RayTransport.recv: no object ref; pass the ref the sender's send() stored")
        header, payload = waits.get(ref, "the weights' owner (the driver)", "a weight update's fetch from the object "
                                    "store", RECV_S, "the driver's node is unreachable or overloaded: see its output")
        update = unpack(header, torch.from_numpy(payload.copy()))
        return update

    def close(self) -> None:
        self.ref = None


class RaySender:
    """Trainer half: the update is put in the object store once and every receiver's ``update`` gets
    ``[ref]`` (a Ray actor: a call that does not wait; an object in this process: applied at once, and
    a rejection, returned as False, is reported as missed). A dead actor is the pool's to replace."""

    name = "ray"

    def __init__(self):
        self.store = RayTransport()

    def connect(self, receivers: dict) -> None:
        """No handshake: a ref reaches any process of the Ray session."""

    def handle(self, update: WeightUpdate) -> tuple[list, int]:
        """``([ref], bytes Ray stores)``: what one receiver needs to load ``update`` whole."""
        nbytes = self.store.send(update)
        return [self.store.ref], nbytes

    def send(self, update: WeightUpdate, receivers: dict) -> tuple[int, list[str]]:
        handle, nbytes = self.handle(update)
        missed = []
        for name, r in receivers.items():
            call = r.update
            if hasattr(call, "remote"):
                call.remote(handle)
            elif call(handle) is False:
                missed.append(name)
        return nbytes, missed


def open_handle(handle: list | WeightUpdate) -> WeightUpdate:
    """Receiver half: the update ``[ref]`` names (an update passed as itself, e.g. received by a
    broadcast or handed over in one process, is returned as is)."""
    return handle if isinstance(handle, WeightUpdate) else RayTransport().recv(handle[0])
