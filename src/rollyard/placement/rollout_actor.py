"""A rollout worker: one process with its own model copy and engine, running its own loop.

The placement wraps this class as a Ray actor (threaded: control calls run beside ``run``).
Control methods only enqueue, under a lock; the loop thread alone touches the engine (it is not
thread-safe). One loop iteration:

1. apply queued weight updates between two decode steps, under ``inflight``:
   ``finish`` (in-flight sequences complete on the old weights first), ``abort`` (they stop; their
   groups are restarted whole under the new weights) or ``continue`` (they go on; each token
   carries the version it was sampled under);
2. admit held work whose target step allows it: a request that the trainer will consume at step
   ``target`` starts only on weights of version ``>= min_fresh_version(target, bound)``;
3. one ``engine.step()``; the groups it finished (all ``n`` samples of a request) go to the bounded
   output queue as one item (a full queue blocks the loop: backpressure), with the spans since.

Weights arrive as object-store handles (``update``) or, with ``sync.transport=dist``, by a
broadcast received on a control thread (``join_dist``, ``recv_dist``) and queued the same way;
an update at or below the held version is skipped, a rejected one (``SyncRejected``: nothing
applied) is reported to the driver, which sends the last full version.

Spans are wall-clock ``time.time()`` records tagged with this worker's name and pid; the driver
shifts them by the clock offset it measured (``info``) and writes them to the run's spans.jsonl.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

import torch

from rollyard import roles, staleness
from rollyard.config import RunConfig
from rollyard.placement import weights
from rollyard.sync.check import weights_checksum
from rollyard.sync.factory import resolve
from rollyard.sync.group import SyncGroup
from rollyard.sync.transport_dist import DistTransport
from rollyard.sync.wire import SyncRejected
from rollyard.types import Request, Sample, WeightUpdate

SPAN_MAX_S = 0.5  # a busy period is cut into spans of at most this long (timeline resolution)


class RolloutWorker:
    def __init__(self, cfg: dict, name: str, seed: int, handle: list, out, bound: int, inflight: str):
        torch.set_num_threads(1)
        self.cfg = RunConfig.model_validate(cfg)
        self.name, self.out, self.bound, self.inflight = name, out, bound, inflight
        model, tokenizer, _ = roles.policy(self.cfg, "cpu")
        model = model.to(resolve(self.cfg, roles.device_of(self.cfg)).dtype)  # the dtype the trainer publishes in
        update = weights.receive(handle)  # the trainer's weights: start-up or a restart
        self.engine = roles.engine(self.cfg, model, tokenizer, version=update.version - 1, seed=seed)
        self.engine.load_weights(update)
        self._lock = threading.Lock()
        self._inbox: list[tuple[Request, int]] = []
        self._updates: deque[list] = deque()  # weight handles, applied by the loop thread
        self._stop = False
        self.held: list[tuple[Request, int]] = []  # handed to this worker, not yet admitted
        self.requests: dict[str, tuple[Request, int]] = {}  # admitted, unfinished: id -> (request, target)
        self.groups: dict[str, list[Sample]] = {}
        self.spans: list[dict] = []
        self.stats = {"aborted": 0, "held_s": 0.0}
        self._busy: dict | None = None  # the open rollout span
        self._idle_since: float | None = None  # holding work the bound does not admit yet
        self._ready: list[tuple[str, list[Sample]]] = []  # finished groups not yet shipped
        self._group: tuple[int, SyncGroup] | None = None  # sync.transport=dist: (generation, group)
        self._needs_full = False  # an update was rejected: the driver sends the last full version

    # -- control (any thread) --------------------------------------------------------------------

    def submit(self, items: list[tuple[Request, int]]) -> None:
        with self._lock:
            self._inbox.extend(items)

    def update(self, handle: list) -> None:
        with self._lock:
            self._updates.append(handle)

    def stop(self) -> None:
        self._stop = True

    def join_dist(self, address: tuple[str, int], rank: int, world: int, generation: int, timeout_s: float) -> None:
        """Join the trainer's sync group ``generation`` (a newer one replaces it; see sync/group.py)."""
        self._group = (generation, SyncGroup.join(address, rank, world, timeout_s, prefix=f"g{generation}"))

    def recv_dist(self, generation: int, bucket_bytes: int) -> int:
        """Receive one broadcast update (on a control thread, so the loop keeps decoding) and queue it."""
        if self._group is None or self._group[0] != generation:
            raise RuntimeError(f"{self.name}: sync group {generation} is not the one joined "
                               f"({self._group[0] if self._group else None})")
        update = DistTransport(bucket_bytes, group=self._group[1]).recv()
        self.update(update)
        return update.nbytes

    def checksum(self, version: int, timeout_s: float = 120.0) -> tuple[int, str]:
        """``(version, checksum)`` of the weights once the loop applied ``version`` (the equality check)."""
        deadline = time.time() + timeout_s
        while self.engine.version < version and time.time() < deadline:
            time.sleep(0.005)
        return self.engine.version, weights_checksum(self.engine.model)

    def info(self) -> dict:
        import rollyard
        return {"pid": os.getpid(), "node": _node_id(), "time": time.time(), "version": self.engine.version,
                "checksum": weights_checksum(self.engine.model),
                "active": self.engine.num_active, "held": len(self.held), "rollyard": rollyard.__file__}

    # -- the loop (one thread) -------------------------------------------------------------------

    def run(self) -> list[dict]:
        """Loop until ``stop``; returns the spans not yet shipped."""
        while not self._stop:
            self.poll()
        self._close_span()
        return self.spans

    def poll(self) -> None:
        """One loop iteration: apply queued updates, admit what the bound allows, one engine step
        (or, with nothing admitted, a short wait)."""
        with self._lock:
            updates, self._updates = list(self._updates), deque()
            self.held += self._inbox
            self._inbox = []
        for handle in updates:
            self._apply(weights.receive(handle))
        self._admit()
        if not self.engine.num_active and not self.engine.num_queued:
            self._close_span()
            if self.held and self._idle_since is None:
                self._idle_since = time.time()
            time.sleep(0.002)
            return
        if self._idle_since is not None:
            self.stats["held_s"] += time.time() - self._idle_since
            self._idle_since = None
        self._open_span()
        for s in self.engine.step():
            self._collect(s)
        self._ship()

    def _ship(self, rejected: list | None = None) -> None:
        """One queue item per loop iteration with every group finished in it (a round's short
        answers finish together: one round trip instead of one per group)."""
        if not (self._ready or rejected or self._needs_full):
            return
        spans, self.spans = self.spans, []
        stats, self.stats = self.stats, {"aborted": 0, "held_s": 0.0}
        self.out.put({"worker": self.name, "groups": self._ready, "rejected": rejected or [], "spans": spans,
                      "stats": stats, "needs_full": self._needs_full, "version": self.engine.version})
        self._needs_full = False
        self._ready = []

    def _target_now(self) -> int:
        return min((t for _, t in self.requests.values()), default=0)

    def _open_span(self) -> None:
        now = time.time()
        if self._busy is not None and now - self._busy["start"] > SPAN_MAX_S:
            self._close_span()
        if self._busy is None:
            self._busy = {"role": "rollout", "step": self._target_now(), "worker": self.name, "pid": os.getpid(),
                          "start": now, "version": self.engine.version}

    def _close_span(self) -> None:
        if self._busy is not None:
            self.spans.append({**self._busy, "end": time.time()})
            self._busy = None

    def _admit(self) -> None:
        v = self.engine.version
        ok = [(q, t) for q, t in self.held if v >= staleness.min_fresh_version(t, self.bound)]
        if not ok:
            return
        self.held = [(q, t) for q, t in self.held if v < staleness.min_fresh_version(t, self.bound)]
        rejected = self.engine.submit([q for q, _ in ok])  # one call: admitted together, as colocated does
        bad = {q.id for q, _ in rejected}
        for q, t in ok:
            if q.id not in bad:
                self.requests[q.id] = (q, t)
        if rejected:
            self._ship([(q.id, why) for q, why in rejected])

    def _collect(self, s: Sample) -> None:
        if s.request_id not in self.requests:  # a leftover of a group that was aborted and restarted
            return
        req, _ = self.requests[s.request_id]
        group = self.groups.setdefault(s.request_id, [])
        group.append(s)
        if len(group) == req.n:
            del self.requests[s.request_id], self.groups[s.request_id]
            group.sort(key=lambda x: int(x.id.rsplit("#", 1)[1]))
            self._ready.append((s.request_id, group))

    def _apply(self, u: WeightUpdate) -> None:
        if u.version <= self.engine.version:  # a catch-up snapshot this copy already holds
            return
        if self.inflight == "finish":  # in-flight sequences complete on the weights they started with
            while self.engine.num_active:
                self._open_span()
                for s in self.engine.step():
                    self._collect(s)
            self._ship()
        self._close_span()
        start = time.time()
        try:
            aborted = self.engine.load_weights(u, self.inflight)
        except SyncRejected:  # nothing applied; ask the driver for the last full version
            self._needs_full = True
            self._ship()
            return
        if aborted:  # restart the aborted groups whole, under the new weights
            ids = {s.request_id for s in aborted}
            self.engine.abort(list(ids))
            self.stats["aborted"] += len(aborted)
            for rid in ids:
                self.groups.pop(rid, None)
                self.held.insert(0, self.requests.pop(rid))
        self.spans.append({"role": "sync", "step": u.version - 1, "worker": self.name, "pid": os.getpid(),
                           "start": start, "end": time.time(), "version": u.version, "inflight": self.inflight,
                           "aborted": len(aborted)})


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:
        return None
