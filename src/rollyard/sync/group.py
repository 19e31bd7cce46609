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
``TCPStore`` itself binds the wildcard address whatever host it is given). Any process that reaches
the port can still talk to a ``TCPStore`` (list, read, write, delete keys): it has no access control.
So every group's keys go through :class:`SecretStore`, keyed by a per-group secret (128 bits, handed
to the joining ranks inside ``address`` over Ray's authenticated calls, or to spawned dp ranks over
spawn's pipe): a key is stored under HMAC-SHA256(secret, name) and its value carries
HMAC-SHA256(secret, name, value). A process without the secret lists opaque hex names (neither the
secret nor what the keys are), and a value it writes or swaps fails authentication at the reader,
one line (:class:`StoreTampered`), never reaching gloo. What it can still do is deny service (delete
or overwrite keys, bump counters): the run then stops with that line or at the rendezvous bound.
A joining rank checks the secret first (:func:`admit`), so a rank given the wrong store is one line
instead of a hang. Gloo's own sockets bind to the same address.

Every wait on a store is bounded by the store's rendezvous timeout (:data:`RENDEZVOUS_S` unless the
caller sizes it), whatever longer timeout gloo asks for on connect: a peer that never arrives is an
error within that bound, not a 10- or 30-minute hang.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
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
RENDEZVOUS_S = 120.0  # the longest any rank waits on a store for a peer (spawn + import + model load fit well inside)
_TAG = 32  # HMAC-SHA256 bytes in front of every value


class StoreTampered(RuntimeError):
    """A value in a group's store failed authentication: written by a process without the group's secret."""


def new_secret() -> str:
    return secrets.token_hex(16)


class SecretStore(dist.Store):
    """``inner`` (a TCPStore) seen through a group's ``secret``: key names HMAC-ed, values authenticated.

    Key ``k`` lives at ``hex(HMAC(secret, "k" + k))``; its value is ``HMAC(secret, "v" + k + 0 + value) + value``,
    checked on every ``get`` (:class:`StoreTampered`, one line, on a mismatch). Counters (``add``) are integers the
    server increments: their names are HMAC-ed, their values cannot carry a tag (tampering with one can only
    disturb a barrier, i.e. deny service). Waits are capped at ``bound_s`` (see the module docstring)."""

    def __init__(self, inner: dist.Store, secret: str, where: str, bound_s: float = RENDEZVOUS_S):
        super().__init__()
        self.inner, self.where, self.bound_s = inner, where, bound_s
        self._k = hashlib.sha256(b"rollyard-store\0" + secret.encode()).digest()

    def name(self, key: str) -> str:
        """The name ``key`` is stored under: reveals neither ``key`` nor the secret."""
        return hmac.new(self._k, b"k" + key.encode(), hashlib.sha256).hexdigest()

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._k, b"v" + key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value) -> None:
        v = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(self.name(key), self._tag(key, v) + v)

    def get(self, key: str) -> bytes:
        raw = bytes(self.inner.get(self.name(key)))
        tag, v = raw[:_TAG], raw[_TAG:]
        if len(raw) < _TAG or not hmac.compare_digest(tag, self._tag(key, v)):
            raise StoreTampered(f"a value in the rendezvous store at {self.where} fails its authentication: a process "
                                f"without this run's secret wrote it; the group cannot be trusted, so the run stops "
                                f"(find the local process that connects to {self.where}, then start or resume again)")
        return v

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self.name(key), amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        exp = expected.encode() if isinstance(expected, str) else bytes(expected)
        des = desired.encode() if isinstance(desired, str) else bytes(desired)
        got = bytes(self.inner.compare_set(self.name(key), self._tag(key, exp) + exp if exp else b"",
                                           self._tag(key, des) + des))
        return got[_TAG:] if len(got) >= _TAG else got

    def check(self, keys: list[str]) -> bool:
        return self.inner.check([self.name(k) for k in keys])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        bound = datetime.timedelta(seconds=self.bound_s)
        self.inner.wait([self.name(k) for k in keys], bound if timeout is None else min(timeout, bound))

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self.name(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(min(timeout, datetime.timedelta(seconds=self.bound_s)))

    @property
    def timeout(self) -> datetime.timedelta:
        return self.inner.timeout


def open_to(store: dist.Store, secret: str, where: str = "", bound_s: float = RENDEZVOUS_S) -> SecretStore:
    """The host's side: the group's keys under ``secret``; joiners check for ``SECRET_KEY`` there."""
    scoped = SecretStore(store, secret, where or f"port {getattr(store, 'port', '?')}", bound_s)
    scoped.set(SECRET_KEY, b"1")
    return scoped


def admit(store: dist.Store, secret: str, where: str, bound_s: float = RENDEZVOUS_S) -> SecretStore:
    """The joiner's side: ``store`` seen through ``secret``; ValueError (one line) when the host did not set it,
    StoreTampered when what is there was not written with it."""
    scoped = SecretStore(store, secret, where, bound_s)
    if not scoped.check([SECRET_KEY]):
        raise ValueError(f"the rendezvous store at {where} does not hold this group's secret: it belongs to "
                         f"another run or group; join with the address the trainer handed out")
    scoped.get(SECRET_KEY)
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
