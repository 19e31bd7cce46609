"""A torch.distributed group of its own, for weight sync between a trainer and rollout processes.

``torch.distributed``'s default group is one per process and cannot be rebuilt while a member is
gone; a rollout actor that dies must be replaced without ending the run. So the sync group is
built the way verl and OpenRLHF build their weight-update groups: its own ``TCPStore`` (the
trainer, rank 0, hosts it on a free port and hands ``(host, port)`` to the rollout ranks
``1..N``) and a process group object (gloo on CPU, NCCL on GPU) made from it directly. When a
member dies, every survivor and the replacement join a *new* group on a new store; the old one is
dropped (an operation still blocked on it fails after ``timeout_s``).

``SyncGroup.host(world, ...)`` on the trainer, ``SyncGroup.join(host, port, rank, world, ...)`` on
each rollout rank; both block until every rank has joined. ``broadcast(tensor, src)`` is what
``transport_dist.DistTransport(group=...)`` calls.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist


def node_ip() -> str:
    """An address of this machine other processes (other nodes) can reach."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


class SyncGroup:
    def __init__(self, store, rank: int, world: int, timeout_s: float, backend: str):
        self.rank, self.world, self.store = rank, world, store
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(store, rank, world)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world, timeout)

    @classmethod
    def host(cls, world: int, timeout_s: float = 60.0, backend: str = "gloo", prefix: str = "sync"):
        """The trainer's side (rank 0): a store on a free port; ``address`` is what the others join.
        Returns ``(address, make)``: call ``make()`` once the joins are under way (it blocks until all joined)."""
        ip = node_ip()
        store = dist.TCPStore(ip, 0, world, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        address = (ip, store.port)
        return address, lambda: cls(dist.PrefixStore(prefix, store), 0, world, timeout_s, backend)

    @classmethod
    def join(cls, address: tuple[str, int], rank: int, world: int, timeout_s: float = 60.0, backend: str = "gloo",
             prefix: str = "sync"):
        store = dist.TCPStore(address[0], address[1], world, False, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(dist.PrefixStore(prefix, store), rank, world, timeout_s, backend)

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([t], opts).wait()
        return t
