"""A rollout worker: one process with its own model copy and engine, running its own loop.

The placement wraps this class as a Ray actor (threaded: control calls run beside ``run``).
Control methods only enqueue, under a lock; the loop thread alone touches the engine (it is not
thread-safe: the weight checksum too is computed by the loop, between two decode steps). ``state`` reads
plain counters and the loop thread's stack, for a driver that has heard nothing for long. One loop iteration:

1. apply queued weight updates between two decode steps, under ``inflight``:
   ``finish`` (in-flight sequences complete on the old weights first), ``abort`` (they stop; their
   groups are restarted whole under the new weights) or ``continue`` (they go on; each token
   carries the version it was sampled under);
2. admit held work whose target step allows it: a request that the trainer will consume at step
   ``target`` starts only on weights of version ``>= min_fresh_version(target - lag, bound)``, where
   ``lag`` (``retarget``) is how many versions the trainer is behind its step count (skipped
   optimizer steps make no version; without it a round could wait for a version never published);
3. one ``engine.step()``; the groups it finished (all ``n`` samples of a request) go to the bounded
   output queue as one item (a full queue blocks the loop: backpressure), with the spans since.

A request is complete at ``rollout.samples_per_prompt`` finished samples: the engine keeps that many
(``submit(keep=...)``) and aborts the rest of a request that carries more (tail batching's short rounds
over-provision); ``cut`` aborts the prompts of a round the driver has closed (the round book's answer,
``rollout/rounds.py``). The tokens both drop are counted as ``cut_tokens``.

This class is a receiver of the driver's ``sync.session.SyncSession``: weights arrive as handles
(``update``: opened by ``session.receive``) or, for a transport with a handshake, through its
receiver half (``factory.make_receiver``: ``join`` the group, ``pull`` one broadcast on a control
thread) and are queued the same way; an update at or below the held version is skipped, a rejected
one (``SyncRejected``: nothing applied) is reported to the driver, which sends the last full version.

Spans are wall-clock ``time.time()`` records tagged with this worker's name and pid; the driver
shifts them by the clock offset it measured (``info``) and writes them to the run's spans.jsonl.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections import deque

import torch

from rollyard import roles, staleness, waits
from rollyard.config import RunConfig
from rollyard.sync import canary
from rollyard.sync.check import weights_checksum
from rollyard.sync.factory import make_receiver
from rollyard.sync.session import receive
from rollyard.sync.wire import SyncRejected
from rollyard.telemetry.memory import peak_rss_bytes
from rollyard.types import Request, Sample, WeightUpdate

SPAN_MAX_S = 0.5  # a busy period is cut into spans of at most this long (timeline resolution)
PUTS_IN_FLIGHT = 4  # queue puts the loop does not wait for; past that it waits (a full queue: backpressure)
SHIP_HOLD_S = 0.02  # a finished group waits up to this long for the rest of its round while the engine decodes
IDLE_WAIT_S = 0.05  # with nothing to decode the loop sleeps until a control call wakes it, at most this long
# The bounds of the waits on a worker's answers (rollyard/waits.py), sized to their work:
START_S = 1200.0  # start-up: scheduled on a free CPU, model copy built (a large model loads, vLLM builds, in minutes)
ROUND_TRIP_S = 60.0  # an answer that does no work (the clock round trip)
CHECKSUM_S = 600.0  # the weight check: the worker applies the update first, after in-flight sequences finish
CHECKSUM_SAY_S = 30.0  # finishing in-flight sequences takes seconds: said only when it takes longer than that
SHIP_S = 3600.0  # a put into a full sample queue: the driver takes once its step trains
SHIP_SAY_S = 600.0  # a full queue is backpressure, not news, unless the driver's step takes this long


class RolloutWorker:
    def __init__(self, cfg: dict, name: str, seed: int, handle, out, bound: int, inflight: str, settings: roles.Settings):
        """``settings``: the driver's, resolved once at start-up (``roles.settings``): this process holds no GPU
        and never resolves the trainer's device or the sync plan itself."""
        torch.set_num_threads(1)
        self.cfg = RunConfig.model_validate(cfg)
        self.name, self.out, self.bound, self.inflight = name, out, bound, inflight
        self.lag = 0  # per_step x trainer steps minus trainer versions (skipped optimizer steps), set by ``retarget``
        self.per_step = self.cfg.trainer.epochs * self.cfg.trainer.mini_batches  # versions one trainer step makes
        self.keep = self.cfg.rollout.samples_per_prompt  # a request is complete at this many finished samples
        model, tokenizer, _ = roles.policy(self.cfg, "cpu")
        plan = settings.plan
        model = model.to(plan.dtype)  # the dtype the trainer publishes in
        self.link = make_receiver(plan.transport)  # the transport's receiver half (None: handles only)
        update = receive(handle)  # the trainer's weights: start-up or a restart
        self.engine = roles.engine(self.cfg, model, tokenizer, version=update.version - 1, seed=seed)
        self.engine.load_weights(update)
        self._lock = threading.Lock()
        self._inbox: list[tuple[Request, int]] = []
        self._updates: deque[list] = deque()  # weight handles, applied by the loop thread
        self._cuts: list[tuple[str, int]] = []  # (request id, target) the driver cut (tail), applied by the loop
        self._stop = False
        self._wake = threading.Event()  # set by every control call: the idle loop wakes at once
        self._puts: deque = deque()  # Ray queue puts not yet acknowledged, oldest first
        self.held: list[tuple[Request, int]] = []  # handed to this worker, not yet admitted
        self.requests: dict[str, tuple[Request, int]] = {}  # admitted, unfinished: id -> (request, target)
        self.groups: dict[str, list[Sample]] = {}
        self.spans: list[dict] = []
        self.stats = _fresh_stats()
        self._busy: dict | None = None  # the open rollout span
        self._idle_since: float | None = None  # holding work the bound does not admit yet
        self._ready: list[tuple[str, list[Sample]]] = []  # finished groups not yet shipped
        self._ready_since = 0.0  # when the oldest of them finished
        self._needs_full = False  # an update was rejected: the driver sends the last full version
        self._canary_wanted: dict[int, Sample] = {}  # canary probes asked for, by version (``canary``)
        self._canary_out: list[tuple] = []  # canary answers not yet shipped
        self._checks: list[tuple[int, float, dict]] = []  # checksums asked for: (version, deadline, answer box)
        self._loop: int | None = None  # the loop thread's ident while ``run`` runs (None: the engine is free)
        self._loop_at = time.monotonic()  # when the loop last made progress (an iteration, a decode step)
        self.runtime = runtime(self.engine)  # replaced by the loop thread's own view when ``run`` starts
        self.ref_actors: list = []  # reference.placement=pool: its actors (``reference``)
        self._ref_n = 0  # groups sent to them (round-robin)
        self.teacher_actors: list = []  # teacher.placement=pool: the distillation teacher's actors (``teacher``)
        self._teacher_n = 0

    # -- control (any thread) --------------------------------------------------------------------

    def submit(self, items: list[tuple[Request, int]]) -> None:
        with self._lock:
            self._inbox.extend(items)
        self._wake.set()

    def update(self, handle: list) -> None:
        with self._lock:
            self._updates.append(handle)
        self._wake.set()

    def cut(self, pairs: list[tuple[str, int]]) -> None:
        """Abort these ``(request id, target)`` (a closed round's unfinished prompts: tail batching's short rounds);
        the target tells a cut request from the same prompt handed out again for its long round."""
        with self._lock:
            self._cuts.extend(pairs)
        self._wake.set()

    def retarget(self, lag: int) -> None:
        """The trainer's version is ``lag`` behind ``per_step`` x its step count: a round for step t needs version
        t x per_step - lag - bound."""
        self.lag = lag
        self._wake.set()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()

    def reference(self, actors: list) -> None:
        """reference.placement=pool: send each finished group to these reference actors as it ships
        (``placement/reference_pool.py``); the result's ObjectRef travels with the group."""
        self.ref_actors = actors

    def teacher(self, actors: list) -> None:
        """teacher.placement=pool: send each finished group to these teacher actors as it ships, as ``reference``
        does (the teacher is a reference pool with other weights, ``placement/teacher.py``)."""
        self.teacher_actors = actors

    def join(self, *args) -> None:
        """The transport's handshake, receiver side (``dist``: join the trainer's group ``generation``)."""
        self.link.join(*args)

    def pull(self, *args) -> int:
        """Receive one update through the transport (on a control thread, so the loop keeps decoding) and queue it."""
        update = self.link.recv(*args)
        self.update(update)
        return update.nbytes

    def checksum(self, version: int, timeout_s: float = 120.0) -> tuple[int, str]:
        """``(version, checksum)`` of the weights once the loop applied ``version`` (the equality check), or of what it
        holds after ``timeout_s``. The loop thread computes it between two decode steps: reading the weights is the
        engine's work (vLLM's are read through its engine, which is not thread-safe). Before the loop starts, here."""
        box: dict = {"done": threading.Event()}
        with self._lock:  # the loop starts (or ends) under it: no engine work can begin while this one runs
            if self._loop is None:
                return self.engine.version, weights_checksum(self.engine.model)
            self._checks.append((version, time.monotonic() + timeout_s, box))
        self._wake.set()
        box["done"].wait()  # the driver bounds its own wait (CHECKSUM_S); a stuck loop is reported there
        return box["answer"]

    def state(self) -> dict:
        """What the loop is doing, for a driver that has heard nothing for long (``pool.RolloutPool``): seconds
        since it last made progress, where its thread is (the innermost frames), the process's CPU seconds (a
        blocked loop spends none, a long prefill all of a core), whether it is inside a bounded wait of its own
        (``waits.wait_for``: a weight fetch, a full queue; it ends with its own line) and its counters. Read here, on
        a control thread, from plain attributes: it never waits for the loop."""
        frame = sys._current_frames().get(self._loop) if self._loop is not None else None
        return {"pid": os.getpid(), "stalled_s": time.monotonic() - self._loop_at, "where": where(frame),
                "bounded": in_bounded_wait(frame),
                "time": time.monotonic(), "cpu_s": time.process_time(),
                "version": self.engine.version, "active": self.engine.num_active, "held": len(self.held),
                "running": len(self.requests), "ready": len(self._ready), "puts": len(self._puts),
                "needs": min((self._needs(t) for _, t in self.held), default=None), "looping": self._loop is not None}

    def canary(self, version: int, probe) -> None:
        """Score the canary probe (``sync/canary.py``) once the loop holds ``version``; the answer ships with
        the next queue item as ``canary``: ``[(version asked, version held, logprobs or None)]``."""
        with self._lock:
            self._canary_wanted[version] = probe
        self._wake.set()

    def info(self) -> dict:
        import rollyard
        return {"pid": os.getpid(), "node": _node_id(), "time": time.time(), "version": self.engine.version,
                "checksum": weights_checksum(self.engine.model),
                "active": self.engine.num_active, "held": len(self.held), "rollyard": rollyard.__file__,
                "runtime": self.runtime}

    # -- the loop (one thread) -------------------------------------------------------------------

    def run(self) -> list[dict]:
        """Loop until ``stop``; returns the spans not yet shipped."""
        self.runtime = runtime(self.engine)  # threads are per OS thread: the loop's own
        with self._lock:
            self._loop = threading.get_ident()
        try:
            while not self._stop:
                self.poll()
        finally:
            with self._lock:
                self._loop = None
            self._answer_checks(final=True)
        self._close_span()
        if self._puts:  # what was shipped reaches the queue before the driver collects the rest
            import ray

            ray.wait(list(self._puts), num_returns=len(self._puts), timeout=10)
        return self.spans

    def poll(self) -> None:
        """One loop iteration: apply queued updates, admit what the bound allows, one engine step
        (or, with nothing admitted, a wait for the next control call)."""
        self._loop_at = time.monotonic()
        self._wake.clear()  # before the inbox is read: a call that lands after it wakes the wait below
        with self._lock:
            updates, self._updates = list(self._updates), deque()
            self.held += self._inbox
            self._inbox = []
            cuts, self._cuts = set(self._cuts), []
        if cuts:
            self._cut(cuts)
        for handle in updates:
            self._apply(receive(handle))
        self._answer_checks()
        self._answer_canaries()
        self._admit()
        if not self.engine.busy:
            self._close_span()
            if self.held and self._idle_since is None:
                self._idle_since = time.time()
            self._wake.wait(IDLE_WAIT_S)
            return
        if self._idle_since is not None:
            self.stats["held_s"] += time.time() - self._idle_since
            self._idle_since = None
        self._open_span()
        self._step()
        self._ship()

    def _answer_checks(self, final: bool = False) -> None:
        """Answer each checksum asked for a version this copy now holds, or past its deadline (``final``: every one,
        the loop is ending)."""
        if not self._checks:  # the common case, every iteration: no lock taken
            return
        now = time.monotonic()
        due, wait = [], []
        with self._lock:
            for c in self._checks:
                (due if final or c[0] <= self.engine.version or now >= c[1] else wait).append(c)
            self._checks = wait
        for _, _, box in due:
            box["answer"] = (self.engine.version, weights_checksum(self.engine.model))
            box["done"].set()

    def _answer_canaries(self) -> None:
        """Score each canary probe asked for a version this copy now holds, and ship the answers at once."""
        with self._lock:
            probes = [(v, self._canary_wanted.pop(v)) for v in sorted(self._canary_wanted) if v <= self.engine.version]
        if not probes:
            return
        for v, probe in probes:  # through what the engine samples with (vLLM: its own forward)
            self._canary_out.append((v, self.engine.version, canary.answer(self.engine, probe)))
        self._ship()

    def _step(self) -> None:
        """One ``engine.step()``, timed: ``engine_s`` wall clock, ``engine_cpu_s`` this thread's CPU
        time (their difference: waiting for a core, or for the GIL)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        done = self.engine.step()
        self._loop_at = time.monotonic()
        self.stats["engine_s"] += time.perf_counter() - t0
        self.stats["engine_cpu_s"] += time.thread_time() - c0
        for s in done:
            self._collect(s)
        self.stats["cut_tokens"] += sum(len(x.completion_ids) for x in self.engine.surplus())  # the keep rule's

    def _ship(self, rejected: list | None = None) -> None:
        """One queue item with every group finished since the last one: sent once the engine has
        nothing left in flight, or the oldest group has waited ``SHIP_HOLD_S`` (the groups of a
        round finish within a few decode steps of each other: one item per round instead of one per
        decode step, each a serialization and a round trip), at once with a rejection or a request
        for full weights."""
        if not (self._ready or rejected or self._needs_full or self._canary_out):
            return
        if (not rejected and not self._needs_full and not self._canary_out and self.engine.num_active
                and time.perf_counter() - self._ready_since < SHIP_HOLD_S):
            return
        # work the engine drives beside decoding, as the engine names it: its intervals as spans here, the rest
        # shipped as it is (the driver sums the workers' counters and takes percentiles over all their calls)
        step = self._busy["step"] if self._busy else self._target_now()
        if (side := self.engine.drain()) is not None:
            self.spans += [{**span, "pid": os.getpid()} for span in side.spans(step, self.name)]
            side = side._replace(intervals=[])
        spans, self.spans = self.spans, []
        stats, self.stats = self.stats, _fresh_stats()
        t0 = time.perf_counter()
        refs = {}
        if self.ref_actors and self._ready:  # reference.placement=pool: scored while the rest decodes
            from rollyard.placement.reference_pool import score_group
            ref = score_group(self.ref_actors, [s for _, g in self._ready for s in g], self._target_now(), self._ref_n)
            refs = {rid: ref for rid, _ in self._ready}  # one call per item: one packed pass over its groups
            self._ref_n += 1
        teacher = {}
        if self.teacher_actors and self._ready:  # teacher.placement=pool: the same, on the teacher's actors
            from rollyard.placement.reference_pool import score_group
            ref = score_group(self.teacher_actors, [s for _, g in self._ready for s in g], self._target_now(),
                              self._teacher_n)
            teacher = {rid: ref for rid, _ in self._ready}
            self._teacher_n += 1
        self._put({"worker": self.name, "pid": os.getpid(), "groups": self._ready, "rejected": rejected or [],
                   "spans": spans, "stats": stats, "needs_full": self._needs_full, "version": self.engine.version,
                   "reference": refs, "teacher": teacher, "canary": self._canary_out, "memory_peak": peak_rss_bytes(),
                   "side": side})  # None: nothing beside decoding
        self._canary_out = []
        self.stats["ship_s"] += time.perf_counter() - t0
        self._needs_full = False
        self._ready = []

    def _put(self, item: dict) -> None:
        """Put ``item`` on the output queue without waiting for it, up to ``PUTS_IN_FLIGHT``.

        A Ray queue's ``put`` is a round trip to the queue's actor: 2-5 ms on an idle machine, tens
        of ms when the trainer and this loop fill the cores, and the loop decoded nothing meanwhile
        (measured: 0.03-0.06 s of a demo step's ~0.1 s rollout). So the put is sent and the loop
        goes on; the oldest acknowledgement is collected once more are outstanding (a full queue
        holds them: backpressure as before) and each one as it comes (an error, such as the queue
        gone, is raised here). Puts from this caller start in order, and the queue's actor appends
        in that order. Anything else with a ``put`` (a list in a test, the bench) is called as is."""
        actor = getattr(self.out, "actor", None)
        if actor is None:
            self.out.put(item)
            return
        import ray

        self._puts.append(actor.put.remote(item, None))
        while self._puts and (len(self._puts) > PUTS_IN_FLIGHT or ray.wait([self._puts[0]], timeout=0)[0]):
            waits.get(self._puts.popleft(), "the run's sample queue", "a put of finished groups (the queue is full "
                      "until the driver takes)", SHIP_S, "the driver took nothing for that long: see the driver's "
                      "output for why it stopped taking samples", say_after_s=SHIP_SAY_S)

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

    def _cut(self, cuts: set[tuple[str, int]]) -> None:
        self.held = [(q, t) for q, t in self.held if (q.id, t) not in cuts]
        ids = [rid for rid, (_, t) in self.requests.items() if (rid, t) in cuts]
        for rid in ids:
            del self.requests[rid]
            self.groups.pop(rid, None)
        self.stats["cut_tokens"] += sum(len(s.completion_ids) for s in self.engine.abort(ids)) if ids else 0

    def _admit(self) -> None:
        v = self.engine.version

        def due(q: Request, t: int) -> bool:  # a prompt still running here (a cut not applied yet) waits
            return v >= self._needs(t) and q.id not in self.requests

        ok = [(q, t) for q, t in self.held if due(q, t)]
        if not ok:
            return
        self.held = [(q, t) for q, t in self.held if not due(q, t)]
        rejected = self.engine.submit([q for q, _ in ok], keep=self.keep)  # one call: admitted together, as colocated does
        bad = {q.id for q, _ in rejected}
        for q, t in ok:
            if q.id not in bad:
                self.requests[q.id] = (q, t)
        if rejected:
            self._ship([(q.id, why) for q, why in rejected])

    def _needs(self, t: int) -> int:
        """The oldest weight version a request for step ``t`` may start on (the trainer's version then, less the bound)."""
        return staleness.min_fresh_version(t * self.per_step - self.lag, self.bound)

    def _collect(self, s: Sample) -> None:
        if s.request_id not in self.requests:  # a leftover of a group that was aborted and restarted
            return
        req, _ = self.requests[s.request_id]
        self.stats["tokens"] += len(s.completion_ids)
        group = self.groups.setdefault(s.request_id, [])
        group.append(s)
        if len(group) == min(req.n, self.keep):  # complete (the engine stopped its other samples)
            del self.requests[s.request_id], self.groups[s.request_id]
            group.sort(key=lambda x: int(x.id.rsplit("#", 1)[1]))
            if not self._ready:
                self._ready_since = time.perf_counter()
            self._ready.append((s.request_id, group))

    def _apply(self, u: WeightUpdate) -> None:
        if u.version <= self.engine.version:  # a catch-up snapshot this copy already holds
            return
        if self.inflight == "finish":  # in-flight sequences complete on the weights they started with
            while self.engine.num_active:
                self._open_span()
                self._step()
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


ROLLOUT_RESOURCE = "rollyard_rollout"  # nodes started with this custom resource host the rollout workers


def actor_class(cls: type):
    """``cls`` as a Ray actor class: one CPU, control calls (submit, update, the transport's join/pull, checksum)
    running beside its loop; on a cluster that names its rollout nodes (``ROLLOUT_RESOURCE``), placed there."""
    import ray

    opts = {"num_cpus": 1, "max_concurrency": 8}
    if ray.cluster_resources().get(ROLLOUT_RESOURCE):
        opts["resources"] = {ROLLOUT_RESOURCE: 0.001}
    return ray.remote(**opts)(cls)


def handshake(h, name: str, checksum: str, bound_s: float = START_S) -> tuple[dict, float]:
    """``(info, clock offset)`` of a started actor ``h``: waits for its model copy (at most ``bound_s``), then a
    round trip measures the offset. Its weights must hash to ``checksum`` (``WeightsDiffer``), and it must import
    this rollyard. An actor that does not answer is one line (``waits.NoAnswer``), a stop signal ends the wait."""
    import rollyard
    from rollyard.config import ConfigError
    from rollyard.sync.check import WeightsDiffer

    waits.get(h.info.remote(), f"rollout worker {name}", "its start-up (scheduling, model copy, engine)", bound_s,
              f"see its error above or in the Ray logs; a worker is started once a CPU is free (ray status: the free "
              f"CPUs, and the {ROLLOUT_RESOURCE!r} resource on a cluster that names its rollout nodes), then start "
              f"the run again")
    t0 = time.time()
    info = waits.get(h.info.remote(), f"rollout worker {name}", "a clock round trip", ROUND_TRIP_S,
                     "its process is alive but not answering: see the Ray logs, then start the run again")
    offset = info["time"] - (t0 + time.time()) / 2
    if info["checksum"] != checksum:
        raise WeightsDiffer(f"rollout worker {name} starts with weights that differ from the trainer's at "
                            f"version {info['version']} (checksum {info['checksum'][:12]} vs {checksum[:12]})")
    if info["rollyard"] != rollyard.__file__:
        raise ConfigError(f"Ray workers import rollyard from {info['rollyard']}, this driver from "
                          f"{rollyard.__file__}; install the same rollyard on every node (or set PYTHONPATH)")
    return info, offset


def held_checksums(workers: dict, version: int, wait, bound_s: float = CHECKSUM_S) -> dict[str, tuple[int, str] | None]:
    """Each actor's ``(version, checksum)`` once it holds ``version`` (None: it died meanwhile); ``wait()`` runs
    while they have not all answered (the driver drains its queue: a worker may be asking for a catch-up). One
    that does not answer within ``bound_s`` is one line (``waits.NoAnswer``)."""
    import ray
    from ray.exceptions import RayActorError

    pending = {h.checksum.remote(version): f"rollout worker {n}" for n, h in workers.items()}
    waits.wait_for(pending, f"the weight check at version {version} (its checksum once it holds that version)",
                   bound_s, "a worker that never applies an update is stuck in its loop: see the Ray logs; "
                   "the run stops rather than sample from unchecked weights", idle=wait, poll_s=0.05,
                   say_after_s=CHECKSUM_SAY_S, stop_grace_s=None)  # part of the step: a first signal lets it finish
    out: dict[str, tuple[int, str] | None] = {}
    for ref, name in zip(pending, workers):
        try:
            out[name] = tuple(ray.get(ref, timeout=waits.POLL_S))  # ready: returns at once
        except RayActorError:
            out[name] = None
    return out


def runtime(engine) -> dict:
    """What sets the engine's speed in the calling thread: torch's intra- and inter-op threads,
    the CPUs it may run on, the thread settings in the environment, the compiled-kernel and oneDNN
    choices (``model/choices.py``) and the weights' dtype. A Ray actor and the driver compare
    equal on these when the actor runs the engine as the driver would (``bench/placements.py
    --actor-speed`` prints both)."""
    from rollyard.model.choices import choices

    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(("OMP_", "MKL_", "KMP_", "GOMP_", "ROLLYARD_")) or k in ("LD_PRELOAD", "MALLOC_CONF")}
    return {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "affinity": affinity, "env": env, "kernels": choices(),
            "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch.")}


def where(frame, depth: int = 3) -> str:
    """The innermost ``depth`` frames of a thread's stack as ``function (file:line)``, innermost first (Ray's
    wrappers left out)."""
    if frame is None:
        return "not in its loop"
    ray_dir = os.sep + "ray" + os.sep
    stack = [f for f in traceback.extract_stack(frame) if ray_dir not in f.filename][-depth:]
    return " <- ".join(f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})" for f in reversed(stack))


def in_bounded_wait(frame) -> bool:
    """The thread whose innermost frame is ``frame`` is inside ``waits.wait_for`` (a wait that ends at its bound)."""
    while frame is not None:
        if frame.f_code is waits.wait_for.__code__:
            return True
        frame = frame.f_back
    return False


def _fresh_stats() -> dict:
    """Counters shipped with each queue item and summed by the driver: groups restarted by an
    abort, seconds holding work the bound did not admit yet, seconds inside ``engine.step()`` (wall
    clock and this thread's CPU time), the tokens it generated, seconds the loop spent handing
    the previous item to the queue, and the tokens tail batching decoded and dropped (``cut_tokens``)."""
    return {"aborted": 0, "held_s": 0.0, "engine_s": 0.0, "engine_cpu_s": 0.0, "tokens": 0, "ship_s": 0.0,
            "cut_tokens": 0}


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:
        return None
