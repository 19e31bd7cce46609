"""A torch.distributed group of its own, for weight sync between a trainer and rollout processes.

``torch.distributed``'s default group is one per process and cannot be rebuilt while a member is
gone; a rollout actor that dies must be replaced without ending the run. So the sync group is
built the way verl and OpenRLHF build their weight-update groups: its own ``TCPStore`` (the
trainer, rank 0, hosts it on a free port and hands ``(host, port)`` to the rollout ranks
``1..N``) and a process group object (gloo on CPU, NCCL on GPU) made from it directly. When a
member dies, every survivor and the replacement join a *new* group on a new store; the old one is
dropped (an operation still blocked on it fails after ``timeout_s``).

``SyncGroup.host(world, ...)`` on the trainer, ``SyncGroup.join(address, rank, world, ...)`` on
each rollout rank; both block until every rank has joined. ``broadcast(tensor, src)`` is what
``transport_dist.DistTransport(group=...)`` calls.

A store listens where the run is: on this node's address (127.0.0.1 for a local Ray session, the
node's cluster address when the run spans nodes), never on every interface (:func:`listening_store`;
``TCPStore`` itself binds the wildcard address whatever host it is given). It carries a per-group
secret (128 bits, handed to the joining ranks inside ``address`` over Ray's authenticated calls):
every key the group uses lives under it, and a joining rank checks it first (:func:`admit`), so a
process that finds the port cannot read or write the group's rendezvous, and a rank given the wrong
store is one line instead of a hang. Gloo's own sockets bind to the same address.
"""

from __future__ import annotations

import datetime
import secrets
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


def listening_store(ip: str, world: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore server listening on ``ip`` only, on a port the OS picks: the socket is bound here and
    handed to the store (``master_listen_fd``), which then owns it."""
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((ip, 0))
    sock.listen(max(world, 16))
    port = sock.getsockname()[1]
    return dist.TCPStore(ip, port, world, True, timeout=timeout, wait_for_workers=False, master_listen_fd=sock.detach())


SECRET_KEY = "rollyard/admitted"


def new_secret() -> str:
    return secrets.token_hex(16)


def open_to(store: dist.Store, secret: str) -> dist.PrefixStore:
    """The host's side: the group's keys under ``secret``; joiners check for ``SECRET_KEY`` there."""
    scoped = dist.PrefixStore(secret, store)
    scoped.set(SECRET_KEY, b"1")
    return scoped


def admit(store: dist.Store, secret: str, where: str) -> dist.PrefixStore:
    """The joiner's side: ``store`` scoped to ``secret``; ValueError (one line) when the host did not set it."""
    scoped = dist.PrefixStore(secret, store)
    if not scoped.check([SECRET_KEY]):
        raise ValueError(f"the rendezvous store at {where} does not hold this group's secret: it belongs to "
                         f"another run or group; join with the address the trainer handed out")
    return scoped


def gloo_options(ip: str, timeout: datetime.timedelta):
    """Gloo options whose device binds ``ip`` (the default device binds the address the host name resolves to)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ip)]
    return opts


class SyncGroup:
    def __init__(self, store, rank: int, world: int, timeout_s: float, backend: str, ip: str):
        self.rank, self.world, self.store = rank, world, store
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(store, rank, world)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world, gloo_options(ip, timeout))

    @classmethod
    def host(cls, world: int, timeout_s: float = 60.0, backend: str = "gloo", prefix: str = "sync"):
        """The trainer's side (rank 0): a store on a free port of this node's address; ``address`` (ip, port,
        secret) is what the others join. Returns ``(address, make)``: call ``make()`` once the joins are
        under way (it blocks until all joined)."""
        ip, secret = node_ip(), new_secret()
        store = listening_store(ip, world, datetime.timedelta(seconds=timeout_s))
        scoped = open_to(store, secret)
        address = (ip, store.port, secret)
        return address, lambda: cls(dist.PrefixStore(prefix, scoped), 0, world, timeout_s, backend, ip)

    @classmethod
    def join(cls, address: tuple[str, int, str], rank: int, world: int, timeout_s: float = 60.0, backend: str = "gloo",
             prefix: str = "sync"):
        host, port, secret = address
        store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=timeout_s))
        scoped = admit(store, secret, f"{host}:{port}")
        return cls(dist.PrefixStore(prefix, scoped), rank, world, timeout_s, backend, node_ip())

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([t], opts).wait()
        return t
