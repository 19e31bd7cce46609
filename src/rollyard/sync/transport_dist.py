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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rollyard.sync.wire import pack_pieces, unpack
from rollyard.types import WeightUpdate

PREFIX_BYTES = 16


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
