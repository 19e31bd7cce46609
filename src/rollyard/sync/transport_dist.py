"""torch.distributed transport: a bucketed broadcast from the trainer rank to the rollout ranks.

The caller sets up the process group (``torch.distributed.init_process_group`` or ``new_group``:
gloo on CPU, NCCL on GPU; plain processes in tests), or passes a ``sync.group.SyncGroup`` (a group
of its own, as the Ray placements do: rebuilt when a rollout actor dies) and builds one
``DistTransport`` per process with the same ``src`` rank. The trainer calls ``send(update)``, every
other rank ``recv()``; both block until the broadcast completes.

On the wire, per sync (``sync/wire.py``): a 16-byte int64 prefix ``[header bytes, payload bytes]``,
the JSON header, then the payload in buckets of ``bucket_bytes`` (one broadcast each; a bucket inside
one tensor is sent from the tensor's memory without a copy; on a GPU one bucket at a time is
staged on the device). ``send`` returns the bytes broadcast: prefix +
header + payload, what each receiving rank gets.

Its two halves for ``sync.session``, with the handshake (``sync/group.py``: a group of its own, the
trainer rank 0 hosting a TCP store, the rollout actors ranks 1..N, rebuilt on every ``connect``):
``DistSender`` (trainer half: ``connect`` asks every receiver to ``join``, ``send`` asks each to
``pull`` and broadcasts) and ``DistReceiver`` (receiver half, inside the rollout actor: ``join``,
``recv``, on a control thread so the actor's decode loop keeps going). A whole update for one
receiver (start-up, restart, catch-up) goes through the Ray object store: a broadcast reaches every
member or none.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rollyard import waits
from rollyard.sync.group import SyncGroup
from rollyard.sync.wire import pack_pieces, unpack
from rollyard.types import WeightUpdate

PREFIX_BYTES = 16
GROUP_TIMEOUT_S = 30.0  # a broadcast blocked on a dead member fails after this long


class SyncBroken(RuntimeError):
    """A broadcast over the sync group failed (a member died mid-sync); the group must be rebuilt."""


class DistTransport:
    name = "dist"

    def __init__(self, bucket_bytes: int, src: int = 0, group=None, device: str = "cpu"):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        if not hasattr(group, "broadcast") and not dist.is_initialized():
            raise RuntimeError("DistTransport needs a torch.distributed process group: call "
                               "torch.distributed.init_process_group(...) in every process first")
        self.bucket_bytes, self.src, self.group, self.device = int(bucket_bytes), src, group, torch.device(device)

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        if hasattr(self.group, "broadcast"):  # a group of its own (sync/group.py), rebuilt when a member dies
            return self.group.broadcast(t, self.src)
        dist.broadcast(t, src=self.src, group=self.group)
        return t

    def _recv_buckets(self, payload: torch.Tensor) -> None:
        """Receive into the CPU byte buffer ``payload``, one bucket at a time (staged on a GPU)."""
        for off in range(0, payload.numel(), self.bucket_bytes):
            piece = payload[off:off + self.bucket_bytes]
            if self.device.type == "cpu":
                self._bcast(piece)
            else:
                piece.copy_(self._bcast(torch.empty_like(piece, device=self.device)))

    def send(self, update: WeightUpdate) -> int:
        header, pieces = pack_pieces(update)
        total = sum(p.numel() for p in pieces)
        sizes = torch.tensor([len(header), total], dtype=torch.int64, device=self.device)
        self._bcast(sizes)
        self._bcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device))
        for bucket in buckets(pieces, self.bucket_bytes):
            self._bcast(bucket.to(self.device))
        update.nbytes = PREFIX_BYTES + len(header) + total
        return update.nbytes

    def recv(self) -> WeightUpdate:
        sizes = self._bcast(torch.zeros(2, dtype=torch.int64, device=self.device)).tolist()
        header = self._bcast(torch.empty(sizes[0], dtype=torch.uint8, device=self.device))
        payload = torch.empty(sizes[1], dtype=torch.uint8)
        self._recv_buckets(payload)
        update = unpack(header.cpu().numpy().tobytes(), payload)
        update.nbytes = PREFIX_BYTES + sizes[0] + sizes[1]
        return update

    def close(self) -> None:
        pass


def buckets(pieces: list[torch.Tensor], limit: int):
    """Cut the concatenation of flat uint8 ``pieces`` into consecutive ``limit``-byte buckets (the last shorter).

    A bucket inside one piece is a view of it (no copy); only a bucket spanning pieces is
    concatenated. Receivers cut the payload at the same offsets (multiples of ``limit``).
    """
    pending, size = [], 0
    for p in pieces:
        off = 0
        while off < p.numel():
            take = min(limit - size, p.numel() - off)
            pending.append(p[off:off + take])
            size, off = size + take, off + take
            if size == limit:
                yield pending[0] if len(pending) == 1 else torch.cat(pending)
                pending, size = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else torch.cat(pending)


def broadcast_flat(nbytes: int, src: int = 0, group=None, device: str = "cpu") -> int:
    """Baseline for benchmarks: one broadcast of a flat ``nbytes`` buffer (the transport's limit)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return nbytes


class DistSender:
    """Trainer half over Ray actors that hold a ``DistReceiver`` behind their ``join`` / ``pull`` calls."""

    name = "dist"

    def __init__(self, bucket_bytes: int, timeout_s: float = GROUP_TIMEOUT_S):
        from rollyard.sync.transport_ray import RaySender

        self.bucket_bytes, self.timeout_s = int(bucket_bytes), timeout_s
        self.store = RaySender()  # whole updates for one receiver
        self.group: SyncGroup | None = None
        self.generation = 0

    def connect(self, receivers: dict) -> None:
        """A new group with every receiver (rank = its order in ``receivers``, from 1); blocks until all joined.
        Called at start-up and after every restart: a group cannot outlive a member."""
        import ray

        self.generation += 1
        world = len(receivers) + 1
        address, make = SyncGroup.host(world, self.timeout_s, prefix=f"g{self.generation}")
        refs = [h.join.remote(address, rank, world, self.generation, self.timeout_s)
                for rank, h in enumerate(receivers.values(), 1)]
        try:  # both bounded: make() by the group's timeout (every store wait is capped), the joins' answers too
            self.group = make()
            waits.get(refs, list(receivers), f"a join of sync group g{self.generation}", self.timeout_s,
                      "see the worker's error above or in the Ray logs")
        except (RuntimeError, ray.exceptions.RayError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise SyncBroken(f"sync group g{self.generation}: not every one of the {world - 1} rollout worker(s) "
                             f"joined within {self.timeout_s:.0f} s ({type(e).__name__}: {first}); a worker that "
                             f"dies is replaced, one that hangs is not: the run stops") from e

    def handle(self, update: WeightUpdate) -> tuple[list, int]:
        return self.store.handle(update)

    def send(self, update: WeightUpdate, receivers: dict) -> tuple[int, list[str]]:
        """Broadcast ``update``; ``(bytes, receivers whose receive failed while alive)``. A broadcast that
        fails (a member died mid-sync) raises ``SyncBroken``; a dead receiver is the caller's to replace."""
        import ray

        refs = {h.pull.remote(self.generation, self.bucket_bytes): name for name, h in receivers.items()}
        try:
            nbytes = DistTransport(self.bucket_bytes, group=self.group).send(update)
        except RuntimeError as e:  # gloo: a peer closed its connection or timed out
            raise SyncBroken(f"weight broadcast v{update.version} failed: {str(e).splitlines()[0]}") from e
        missed = []
        for ref, name in refs.items():
            try:
                waits.get(ref, name, f"a receive of the weight broadcast v{update.version}", self.timeout_s,
                          "it is caught up from the snapshot", stop_grace_s=None)  # part of the step
            except ray.exceptions.RayActorError:
                pass  # dead: replaced from a snapshot by the caller
            except (ray.exceptions.RayError, RuntimeError):
                missed.append(name)
        return nbytes, missed


class DistReceiver:
    """Receiver half, in the rollout actor: joins the trainer's group ``generation`` (a newer one
    replaces it) and receives one broadcast update at a time."""

    def __init__(self):
        self.generation: int | None = None
        self.group: SyncGroup | None = None

    def join(self, address: tuple[str, int], rank: int, world: int, generation: int, timeout_s: float) -> None:
        self.group = SyncGroup.join(address, rank, world, timeout_s, prefix=f"g{generation}")
        self.generation = generation

    def recv(self, generation: int, bucket_bytes: int) -> WeightUpdate:
        if self.group is None or self.generation != generation:
            raise RuntimeError(f"sync group {generation} is not the one joined ({self.generation})")
        return DistTransport(bucket_bytes, group=self.group).recv()
