"""The Ray rollout side (disaggregated, async): hand out work, take groups, publish, restart. It never
trains: ``step.py`` scores and trains what ``take`` returns, then asks it to ``publish``.

Rounds come from the run's round book (``rollout/rounds.py``, the one the in-process side drives):
which prompts, how many samples, when a round closes (tail: its P-th complete prompt, counted across
the pool) and what it defers; the pool carries out its answers. Round ``b`` is meant for optimizer
step ``b`` and travels with that target, which the worker's admission checks against the bound.
Finished groups arrive through one bounded Ray queue; each is checked where it is consumed
(``take``): a group older than the bound is dropped, its prompt requeued (re-rolled whole) and the
drop counted. Every prompt is in the ledger: ``in_flight`` on a worker, ``deferred`` once its group
arrived (or cut for a long round), ``trained`` after the step. A worker that dies has the groups it
already queued taken first, then its in-flight prompts requeued; it is restarted with the latest
published weights (``SyncSession``'s snapshot, checksum-verified), and the run goes on.
"""

from __future__ import annotations

import sys
import time
from collections import Counter

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.queue import Empty, Queue
from rich.markup import escape

from rollyard import staleness, waits
from rollyard.config import RunConfig
from rollyard.placement.rollout_actor import ROUND_TRIP_S, RolloutWorker, actor_class, handshake, held_checksums
from rollyard.placement.rules import RestartWindow
from rollyard.placement.run import SIDE_WORK, Roles, RunRecord
from rollyard.placement.side import RolloutSide
from rollyard.placement.step import Taken, no_turn
from rollyard.rollout.rounds import make_book
from rollyard.sync import canary
from rollyard.sync.check import WeightsDiffer
from rollyard.sync.session import SyncSession
from rollyard.sync.transport_dist import SyncBroken
from rollyard.telemetry.side import SideWork
from rollyard.types import Request, Sample

# The driver's wait for finished groups is bounded by the workers' silence: no queue item (a finished group, a
# rejection, a catch-up request) from any worker for this long means their loops are stuck (a dead one is replaced).
SILENT_S = 3600.0  # a group's whole generation on the slowest setting fits: the longest completion on a CPU
SILENT_SAY_S = 120.0  # waiting for rollout is normal; one that lasts this long says so
# Silent that long, the driver looks at each worker's loop (``RolloutWorker.state``) and says what it does, again
# every as long; a loop that made no progress (no iteration, no decode step) for ``STUCK_S`` while its process
# spent under ``STUCK_BUSY`` of a core since the last look is blocked, not computing a long prefill: the run stops
# (unless it is inside a bounded wait of its own, a weight fetch or a full queue: that one ends with its own line).
LOOK_EVERY_S = 120.0
STUCK_S = 300.0
STUCK_BUSY = 0.1
STOP_S = 30.0  # a worker's loop ends within a decode step of ``stop``; one that does not by then is killed


def describe(state: dict) -> str:
    """A worker's loop state (``RolloutWorker.state``) in words."""
    needs = f" (they need v{state['needs']}+)" if state["needs"] is not None else ""
    return (f"at v{state['version']}, {state['active']} sample(s) decoding for {state['running']} request(s), "
            f"{state['held']} request(s) held not admitted yet{needs}, {state['ready']} finished group(s) not shipped, "
            f"{state['puts']} queue put(s) unacknowledged; last progress {state['stalled_s']:.1f} s ago, now in "
            f"{state['where']}" + (" (a bounded wait of its own)" if state["bounded"] else ""))


class RolloutPool(RolloutSide):
    """The Ray rollout side (the module docstring)."""

    def __init__(self, cfg: RunConfig, run: RunRecord, r: Roles, bound: int, ahead: int, by_round: bool,
                 admission_slack: int = 0, worker: type | None = None):
        """``bound``: the staleness bound; rounds are handed out ``ahead`` steps past the current one;
        ``by_round``: step k takes exactly round k (disaggregated), else the first fresh groups (async).
        ``admission_slack`` and ``worker`` (the actor class, default ``RolloutWorker``) are test hooks."""
        self.cfg, self.run, self.r, self.bound, self.ahead, self.by_round = cfg, run, r, bound, ahead, by_round
        self.admission_bound = bound + admission_slack  # test hook: > bound exercises consumption alone
        self.ledger = r.feed.ledger
        self.P = cfg.rollout.prompts_per_step
        self.queue = Queue(maxsize=self.P * (bound + 2), actor_options={"num_cpus": 0})
        self.actor = actor_class(worker or RolloutWorker)
        s = cfg.sync
        self.session = SyncSession(run.settings.plan, r.model, s.every, s.check_every, s.bucket_mb, s.canary_every)
        self.ref, nbytes = self.session.startup(r.model, run.state.version)
        self.checksum = self.session.checksum(r.model)  # every worker must start equal to the trainer
        run.totals["sync/startup_bytes"] = nbytes
        run.telemetry.traffic(run.state.step, "weights", nbytes)  # the opening full sync (review expects it)
        self.book = make_book(cfg, r.feed, refill=True)  # the rounds (rollout/rounds.py): which prompts, when cut
        self.buffer: dict[str, tuple[str, list[Sample]]] = {}  # finished groups in arrival order
        self.workers: dict[str, object] = {}
        self.runs: dict[str, object] = {}
        self.offsets: dict[str, float] = {}
        self.pids: dict[str, int] = {}  # each worker's current process: items from a replaced one are late
        self.restarts: Counter = Counter()
        self.crashes = RestartWindow()  # workers replaced within the window: past its limit the run stops
        self.stats: Counter = Counter()
        self.side: SideWork | None = None  # this step's work beside decoding, every worker's (metrics())
        self.canaries = canary.Answers()  # the workers answer through the queue, the step is not held up
        self.looks: dict[str, dict] = {}  # each worker's state at the last look (``_look``)
        self.stuck: set[str] = set()  # workers ``_look`` found blocked: not waited for at the stop
        self.per_step = cfg.trainer.epochs * cfg.trainer.mini_batches  # versions one step makes
        self.lag = self.per_step * run.state.step - run.state.version  # versions not made (skipped), see retarget
        self.sent: dict[str, tuple[str, int]] = {}  # request id -> (worker, target step) it was last handed out to
        # round -> when the driver first handed its prompts out (this clock), on the round's rollout spans: the review
        # tells a round the driver held back until training ended from one whose worker started it late
        self.handed: dict[int, float] = {}
        for i in range(cfg.rollout.workers):
            self._start(f"rollout-{i}", self.ref, self.checksum)
        self.session.connect(self.workers)
        self.book.restore(run.state.extra, run.state.step)  # deferred prompts wait again; the rest keep their rounds
        self._hand_out([(q, run.state.step) for q in self.ledger.queued()])  # a resumed run's live prompts

    # -- workers -----------------------------------------------------------------------------------

    def _start(self, name: str, handle, checksum: str) -> None:
        """Start actor ``name`` from the weights ``handle`` names; it must hash to ``checksum``."""
        i, n = int(name.rsplit("-", 1)[1]), self.restarts[name]
        h = self.actor.remote(self.cfg.model_dump(mode="json"), name, self.cfg.seed + i + 1000 * n, handle,
                              self.queue, self.admission_bound, self.cfg.rollout.inflight, self.run.settings)
        info, self.offsets[name] = handshake(h, name, checksum)
        h.retarget.remote(self.lag)
        if self.r.reference is not None and self.cfg.reference.placement == "pool":  # groups go to its actors
            h.reference.remote(self.r.reference.actors)
        if self.r.teacher is not None and self.cfg.teacher.placement == "pool":  # and to the teacher's
            h.teacher.remote(self.r.teacher.actors)
        self.workers[name], self.runs[name], self.pids[name] = h, h.run.remote(), info["pid"]
        here = ray.get_runtime_context().get_node_id()
        where = "the driver's node" if info["node"] == here else "another node than the driver"
        self.run.log(f"{name}: pid {info['pid']} on node {info['node'][:12]} ({where})")

    def _check_workers(self, wait_s: float = 0.0) -> None:
        """Replace every worker whose loop ended (``wait_s``: wait that long for one to end)."""
        ready, _ = ray.wait(list(self.runs.values()), num_returns=1, timeout=wait_s) if wait_s else ([], [])
        ready += ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=0)[0]
        dead = [n for n, ref in self.runs.items() if ref in ready]
        for name in dead:
            try:
                ray.get(self.runs[name], timeout=waits.POLL_S)  # ready: returns (or raises) at once
                raise RuntimeError(f"rollout worker {name} left its loop without being stopped")
            except RayActorError as e:
                self._replace(name, e)
            except waits.NoAnswer as e:  # its own wait went unanswered: that line, not Ray's remote traceback
                raise waits.NoAnswer(f"rollout worker {name}: {getattr(e, 'cause', e)}") from None
        if dead:
            self.session.connect(self.workers)  # a sync group cannot outlive a member: a new one, all ranks

    def _replace(self, name: str, err: Exception) -> None:
        self.crashes.record(name, err)
        self.restarts[name] += 1
        self._drain()  # the groups it queued before dying are taken, not requeued
        requeued = self.ledger.requeue(self.ledger.on_worker(name))
        del self.workers[name], self.runs[name]
        self.looks.pop(name, None)  # its replacement is another process
        handle, nbytes, checksum = self.session.snapshot_handle()  # the current weights, not the start-up ones
        self.run.telemetry.traffic(self.run.state.step, "weights", nbytes)
        self.run.count("sync/restart_bytes", nbytes)
        t0 = time.time()
        self._start(name, handle, checksum)  # a new actor and engine: booked as restart/seconds, not as a role
        self.stats["restart_s"] += time.time() - t0
        self.stats["restarts"] += 1
        self.run.log(f"[yellow]rollout worker {name} died ({type(err).__name__}); restarted at weights "
                     f"v{self.session.last.version} (checksum verified), {len(requeued)} in-flight prompts "
                     f"requeued[/yellow]")
        self._hand_out([(q, max(self.run.state.version, self.book.round_of(q.id))) for q in requeued])

    def _catch_up(self, name: str) -> None:
        """Send worker ``name`` the last published version in full (it missed or rejected an update)."""
        nbytes = self.session.catch_up(self.workers[name])
        self.run.telemetry.traffic(self.run.state.step, "weights", nbytes)
        self.stats["catch_ups"] += 1

    # -- the step's side (step.py) -------------------------------------------------------------------

    def take(self, step: int, version: int) -> Taken:
        """Hand out rounds up to ``ahead`` steps on, then the step's groups (round ``step`` exactly, or
        the first ``prompts_per_step`` fresh ones) for the trainer at ``version``."""
        if self.per_step * step - version != self.lag:  # a skipped optimizer step: rounds' targets move back one
            self.lag = self.per_step * step - version
            for h in self.workers.values():
                h.retarget.remote(self.lag)
        self.fill(horizon=step + self.ahead, step=step)
        requests, samples = self.groups(self.P, version, round_=step if self.by_round else None)
        return Taken(requests, samples)

    trainer_turn = staticmethod(no_turn)  # the workers hold their own copies: nothing to give the trainer

    def checkpoint(self) -> None:
        """The book's state, its open rounds' counts less the groups buffered (received, not trained: a resumed run
        samples them again). No RNG: each worker's sampling RNG is seeded per start (seed, worker, restarts)."""
        self.book.save(self.run.state.extra, list(self.buffer))

    # -- hand out ------------------------------------------------------------------------------------

    def fill(self, horizon: int, step: int) -> None:
        """Hand out every round up to ``horizon`` (each round meant for the step of its number)."""
        while self.book.next_round <= horizon:
            self.book.issue(self.book.next_round, self._sender(self.book.next_round, step))

    def _sender(self, round_: int, step: int):
        def send(requests: list[Request], dead: list[dict]) -> None:  # the book's draws, handed out as they come
            self.run.dead_letter(dead, step)
            self.run.telemetry.traffic(step, "prompts", 4 * sum(len(q.prompt_ids) for q in requests))
            self._hand_out([(q, round_) for q in requests])
        return send

    def _cut(self, ids: list[str]) -> None:
        """A round closed (the book's answer, its cut prompts deferred): abort them on their workers."""
        per: dict[str, list] = {}
        for i in ids:
            name, target = self.sent[i]
            per.setdefault(name, []).append((i, target))
        for name, pairs in per.items():
            if name in self.workers:
                self.workers[name].cut.remote(pairs)

    def _hand_out(self, items: list[tuple[Request, int]]) -> None:
        now = time.time()
        for _, target in items:
            self.handed.setdefault(target, now)
        load = Counter(dict.fromkeys(self.workers, 0) | Counter(self.ledger.worker.values()))
        per: dict[str, list] = {}
        for q, target in items:
            w = min(self.workers, key=lambda n: (load[n], n))
            load[w] += 1
            per.setdefault(w, []).append((q, target))
            self.ledger.hand_out([q.id], w)
            self.sent[q.id] = (w, target)
        for w, batch in per.items():
            self.workers[w].submit.remote(batch)

    # -- take ----------------------------------------------------------------------------------------

    def _drain(self) -> None:
        n = self.queue.qsize()
        if n:
            for item in self.queue.get_nowait_batch(n):
                self._receive(item)

    def _receive(self, item: dict) -> None:
        name, tel, step = item["worker"], self.run.telemetry, self.run.state.step
        for span in item["spans"]:
            self._record(span, name)
        self.stats.update(item["stats"])
        tel.memory.observe("rollout_actor", item.get("memory_peak"))  # the actor process's peak RSS so far
        if (side := item.get("side")) is not None:  # from then on every row reports it (zeros in a step without)
            self.side = (self.side or side.emptied()).plus(side)
        if item.get("needs_full") and name in self.workers:
            self._catch_up(name)
        for rid, why in item["rejected"]:
            self.run.dead_letter([{"source": rid, "reason": why}], step)
            if (round_ := self.book.rejected(rid)) is not None:  # a round still filling gets a fresh prompt
                self.book.draw(round_, 1, self._sender(round_, step))
        late = item.get("pid", self.pids.get(name)) != self.pids.get(name)  # sent by a worker since replaced
        for rid, samples in item["groups"]:
            if late or self.ledger.state.get(rid) != "in_flight" or self.ledger.worker.get(rid) != name:
                if self.book.was_cut(rid):  # finished as its round was cut: deferred all the same
                    self.stats["cut_tokens"] += sum(len(s.completion_ids) for s in samples)
                else:
                    self.stats["duplicates"] += 1  # requeued meanwhile: the other copy counts
                continue
            if cut := self.book.arrived(rid):  # it closed its round (tail: the P-th complete prompt)
                self._cut(cut)
            self.buffer[rid] = (name, samples)  # its bytes count on the samples edge when consumed (take, drop)
            if rid in item.get("reference", {}):  # reference.placement=pool: its reference logprobs, under way
                self.r.reference.adopt({rid: item["reference"][rid]})
            if rid in item.get("teacher", {}):  # teacher.placement=pool: its teacher logprobs, under way
                self.r.teacher.adopt({rid: item["teacher"][rid]})
        for version, held, logprobs in item.get("canary", ()):
            self.canaries.answer(name, version, held, logprobs, self.workers)

    def _record(self, span: dict, name: str) -> None:
        """A worker's span on the run's timeline (its clock aligned); a rollout span carries its round's hand-out."""
        if span.get("role") == "rollout" and span.get("step") in self.handed:
            span = {**span, "handed_out": self.handed[span["step"]]}
        self.run.telemetry.record(span, self.offsets.get(name, 0.0))

    def _watching(self):
        """The idle callback of a wait on every worker: drain the queue (a worker may be asking for a catch-up) and
        look at their loops every ``LOOK_EVERY_S`` (``_look``), on a ``waits.Wait``'s clock as the wait for groups."""
        clock = waits.Wait("the weight check", float("inf"), "")  # only its ``every``: the caller bounds the wait

        def idle() -> None:
            self._drain()
            if clock.every(LOOK_EVERY_S):
                self._look()
        return idle

    def _look(self) -> None:
        """Ask each worker what its loop does and say it (one line each, on stderr); raise ``waits.NoAnswer`` (one
        line naming where it is) for one whose loop is blocked: no progress for ``STUCK_S``, its process nearly
        idle since the last look. A dead one is left to ``_check_workers`` (replaced)."""
        names = list(self.workers)
        try:
            states = waits.get([self.workers[n].state.remote() for n in names], names, "a look at its loop",
                               ROUND_TRIP_S, "its process is alive but answers no call: see the Ray logs")
        except RayError:
            return
        for name, st in zip(names, states):
            before, self.looks[name] = self.looks.get(name), st
            busy = (st["cpu_s"] - before["cpu_s"]) / max(1e-9, st["time"] - before["time"]) if before else 1.0
            print(f"rollyard: rollout worker {name}: {describe(st)}; its process used {busy:.0%} of a core since "
                  f"the last look", file=sys.stderr, flush=True)
            if st["looping"] and not st["bounded"] and st["stalled_s"] >= STUCK_S and busy < STUCK_BUSY:
                self.stuck.add(name)
                raise waits.NoAnswer(
                    f"rollout worker {name}: its loop made no progress for {st['stalled_s']:.0f} s (a decode step or a "
                    f"weight load takes seconds; at most {STUCK_S:.0f} s is allowed) and its process is idle "
                    f"({busy:.0%} of a core): it is blocked in {st['where']}; a blocked worker is alive and is not "
                    f"replaced: the run stops (resume with --resume; report that place if it happens again)")

    def _drop_stale(self, version: int) -> None:
        """Consumption: a buffered group older than the bound is not trained on; its prompt is
        requeued (handed out again) and the drop counted, with the reason printed."""
        floor = staleness.min_fresh_version(version, self.bound)
        for rid, (_, samples) in list(self.buffer.items()):
            oldest = min(s.version for s in samples)
            if not staleness.is_fresh(oldest, version, self.bound):
                del self.buffer[rid]
                self.run.telemetry.traffic(self.run.state.step, "samples", sum(s.payload_bytes() for s in samples))
                self.stats["dropped"] += 1
                self.run.log(f"[yellow]dropped stale group {rid}: sampled at v{oldest}, trainer at v{version} "
                             f"accepts v{floor}+ (max staleness {self.bound}); prompt requeued[/yellow]")
                self.book.dropped(rid)  # re-rolled whole; an open round counts it once, when it comes back
                self._hand_out([(q, version) for q in self.ledger.requeue([rid])])

    def groups(self, k: int, version: int, round_: int | None = None) -> tuple[list[Request], list[Sample]]:
        """Groups to train on at trainer ``version``: the first ``k`` fresh ones to arrive, or (with
        ``round_``) exactly that round's. Blocks until they are there; returns them in hand-out order. The wait is
        bounded by the workers' silence (``SILENT_S`` with no item from any: ``waits.NoAnswer``, one line), said
        after ``SILENT_SAY_S``; a second stop signal ends it at once, as anywhere in a step (``waits.Wait``)."""
        t0 = time.time()
        wait = waits.Wait(f"the step's request for {k} finished group(s) (trainer at version {version})", SILENT_S,
                          "a worker whose loop is stuck ships nothing and is not replaced (it is alive): see the "
                          "Ray logs; the run stops (resume with --resume)", say_after_s=SILENT_SAY_S,
                          stop_grace_s=None)  # part of the step: a first signal lets it finish
        while True:
            self._drop_stale(version)
            if round_ is None:
                chosen = list(self.buffer)[:k] if len(self.buffer) >= k else None
            else:
                ids = self.book.round_ids(round_)
                chosen = ids if all(i in self.buffer for i in ids) else None
            if chosen is not None:
                break
            try:
                self._receive(self.queue.get(timeout=0.05))
                self._drain()
                wait.heard()
            except Empty:
                wait.tick(f"rollout workers {', '.join(self.workers)}")
                if wait.every(LOOK_EVERY_S):
                    self._look()
            self._check_workers()
        self.stats["wait_s"] += time.time() - t0
        chosen.sort(key=self.book.order)
        self.book.took(chosen)
        for i in chosen:
            self.sent.pop(i, None)
        groups = [self.buffer.pop(i)[1] for i in chosen]
        # The samples edge counts a group's bytes in the step that consumes it, so the per-step ledger
        # matches the tokens trained; groups that arrive ahead of the last step are reported at stop.
        self.run.telemetry.traffic(self.run.state.step, "samples", sum(s.payload_bytes() for g in groups for s in g))
        return [self.ledger.requests[i] for i in chosen], [s for g in groups for s in g]

    # -- weights -------------------------------------------------------------------------------------

    def publish(self, step: int, version: int) -> int:
        """Send the trainer's weights at ``version`` to every worker; returns the bytes the transport moved.
        A worker that missed it is caught up; a broken broadcast (a member died mid-sync) replaces the
        dead, rebuilds the group and catches every worker up from the snapshot."""
        try:
            nbytes = self.session.publish(self.r.model, version, self.workers)
            for name in self.session.missed:
                self._catch_up(name)
        except SyncBroken as e:
            self.run.log(f"[yellow]{escape(str(e))}; rebuilding the sync group[/yellow]")
            nbytes = 0
            self._check_workers(wait_s=self.session.timeout_s)
            for name in self.workers:
                self._catch_up(name)  # each skips it if it already holds this version
        return nbytes

    def check(self, step: int, version: int) -> None:
        """The equality check: every worker's weights, once at ``version``, hash to the trainer's.
        A worker that dies meanwhile is replaced (its replacement was checked against this version
        when it started); the queue is drained while waiting (a worker may be asking for a catch-up)."""
        expected = self.session.checksum(self.r.model)
        with self.run.telemetry.span("sync_check", step, version=version, checksum=expected):
            held = held_checksums(self.workers, version, wait=self._watching())
        for name, got in held.items():
            if got is not None and got != (version, expected):
                raise WeightsDiffer(f"weight sync equality check failed at version {version}: rollout worker "
                                    f"{name} holds v{got[0]} with checksum {got[1][:12]}, the trainer's is "
                                    f"{expected[:12]}; stopping rather than sampling from the wrong weights")
        checked = sum(got is not None for got in held.values())
        if checked < len(held):  # after the span: a replacement's start-up is not the check's time
            self._check_workers(wait_s=self.session.timeout_s)
        self.stats["checked"] += 1  # run-wide count (rollout/checked); the step's row says sync/checked
        self.run.log(f"sync check v{version}: {checked} worker(s) equal the trainer ({expected[:12]})")

    def canary(self, version: int, probe, trainer_lp: list[float]) -> dict:
        """Ask every worker to score the canary probe once it holds ``version``; returns the metrics of the latest
        canary every live worker has answered since the last call (``canary/version`` says which sync)."""
        self.canaries.ask(version, trainer_lp)
        for h in self.workers.values():
            h.canary.remote(version, probe)
        return self.canaries.latest()

    def metrics(self) -> dict:
        """This step's pool counters (reset), for the step's metrics row."""
        s, self.stats = self.stats, Counter()
        side, self.side = self.side, (self.side and self.side.emptied())
        for key in ("restarts", "dropped", "duplicates", "checked"):
            self.run.count(f"rollout/{key}", s[key])
        self.book.measure(wasted_tokens=s["cut_tokens"])  # the workers' cut and surplus tokens, and late groups'
        worker = {f"rollout/{k}": s[k] for k in ("aborted", "restarts", "held_s", "engine_s", "engine_cpu_s", "ship_s", "tokens")}
        return {**self.book.metrics(), "staleness/dropped": s["dropped"], "sync/catch_ups": s["catch_ups"],
                **worker, "wait/samples_s": s["wait_s"], "rollout/buffered": len(self.buffer),
                **{f"prompts/{k}": v for k, v in self.ledger.counts().items()},
                **({SIDE_WORK: side} if side is not None else {}),  # the engines' work beside decoding (run.py)
                **({"restart/seconds": s["restart_s"]} if s["restart_s"] else {})}  # the step-time alarm skips it

    def stop(self) -> None:
        if self.buffer:  # generated ahead of the last trained step (the pipeline's lead): crossed, never trained
            left = [s for _, g in self.buffer.values() for s in g]
            self.run.log(f"{len(self.buffer)} group(s) ({sum(len(s.completion_ids) for s in left)} tokens, "
                         f"{sum(s.payload_bytes() for s in left)} B) arrived ahead of the last trained step and "
                         "were not trained (not on the samples edge: it counts what steps consumed)")
        for h in self.workers.values():
            h.stop.remote()
        self._drain()  # unblock a worker waiting on a full queue
        for name, ref in self.runs.items():
            if name in self.stuck:  # its loop never comes back to see the stop: killed below
                continue
            try:
                for span in waits.get(ref, f"rollout worker {name}", "its stop (the spans it has not shipped)", STOP_S,
                                      "it is killed", stop_grace_s=None):  # the run's own stop: a signal waits
                    self._record(span, name)
            except (RayError, waits.NoAnswer) as e:  # a worker that died (or hangs) at the end has nothing to give
                self.run.log(f"rollout worker {name} did not stop cleanly: "
                             f"{escape(str(e)) if isinstance(e, waits.NoAnswer) else type(e).__name__}")
        for h in self.workers.values():
            ray.kill(h)
        ray.kill(self.queue.actor)
