"""Ray object-store transport: the packed update is put in the object store; receivers get it by ref.

``send(update)`` packs the update (``sync/wire.py``), ``ray.put``s ``(header, payload)`` and
returns the serialized size Ray stores (the bytes a receiving node pulls); ``self.ref`` is the
object ref. A receiver in another process needs that ref: the driver passes ``transport.ref`` to
the rollout actor (refs pickle across Ray calls), which calls ``RayTransport().recv(ref)``. In one
process ``recv()`` reads the last ref sent. Without a Ray session the constructor starts a local
one (no dashboard; set ``RAY_AUTH_MODE=disabled`` locally).
"""

from __future__ import annotations

import ray
import torch

from rollyard.sync.wire import pack, unpack
from rollyard.types import WeightUpdate


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
        header, payload = ray.get(ref)
        update = unpack(header, torch.from_numpy(payload.copy()))
        return update

    def close(self) -> None:
        self.ref = None
