"""The Ray rollout side (disaggregated, async): hand out work, take groups, publish, restart. It never
trains: ``step.py`` scores and trains what ``take`` returns, then asks it to ``publish``.

Work is handed out in rounds of ``prompts_per_step`` prompts; round ``b`` is meant for optimizer
step ``b`` and travels with that target, which the worker's admission checks against the bound.
Finished groups arrive through one bounded Ray queue; each is checked where it is consumed
(``take``): a group older than the bound is dropped, its prompt requeued and the drop counted.

Every prompt is in the ledger: ``in_flight`` on a worker, ``deferred`` once its group arrived,
``trained`` after the step. A worker that dies (its ``run`` call fails with an actor error) has
the groups it already queued taken first, then its remaining in-flight prompts requeued; it is
restarted with the latest published weights, and the run goes on.

Weights go through one ``sync.session.SyncSession``: its start-up handle builds every worker, its
transport reaches all of them (``connect`` again after a restart), its snapshot builds a restarted
worker and catches up one that missed an update.

With ``rollout.scheduler=tail`` the rounds are RollPacker's short and long rounds across the pool
(``pool_tail.py``): a short round is cut once ``prompts_per_step`` of its prompts are complete, its
unfinished prompts are aborted on their workers and queued (ledger ``deferred``) for a long round;
the queue and each live prompt's round are carried in the checkpoint (``TrainState.extra``).
"""

from __future__ import annotations

import time
from collections import Counter, deque

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.queue import Empty, Queue
from rich.markup import escape

import rollyard
from rollyard import roles, staleness
from rollyard.config import ConfigError, RunConfig
from rollyard.env import setup as env_setup
from rollyard.env.loop import TOOL_SECONDS
from rollyard.placement.pool_tail import STATE_KEY, PoolTail
from rollyard.placement.rollout_actor import RolloutWorker
from rollyard.placement.rules import RolloutCrashLoop
from rollyard.placement.run import Roles, RunRecord
from rollyard.placement.step import Taken, no_turn
from rollyard.sync import canary
from rollyard.sync.check import WeightsDiffer
from rollyard.sync.factory import resolve
from rollyard.sync.session import SyncSession
from rollyard.sync.transport_dist import SyncBroken
from rollyard.telemetry import rundir
from rollyard.types import Request, Sample

MAX_RESTARTS = 3  # restarts within RESTART_WINDOW_S; workers that keep dying are a bug to surface, not to hide
RESTART_WINDOW_S = 600.0
ROLLOUT_RESOURCE = "rollyard_rollout"  # nodes started with this custom resource host the rollout workers
MAX_TOP_UPS = 10  # draws to refill a round whose prompts were dead-lettered


class RolloutPool:
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
        # control calls (submit, update, the transport's join/pull, checksum) run beside the loop
        opts = {"num_cpus": 1, "max_concurrency": 8}
        if ray.cluster_resources().get(ROLLOUT_RESOURCE):  # a cluster that names its rollout nodes
            opts["resources"] = {ROLLOUT_RESOURCE: 0.001}
        self.actor = ray.remote(**opts)(worker or RolloutWorker)
        s = cfg.sync
        self.session = SyncSession(resolve(cfg, roles.device_of(cfg)), r.model, s.every, s.check_every, s.bucket_mb)
        self.ref, nbytes = self.session.startup(r.model, run.state.version)
        self.checksum = self.session.checksum(r.model)  # every worker must start equal to the trainer
        run.totals["sync/startup_bytes"] = nbytes
        run.telemetry.traffic(run.state.step, "weights", nbytes)  # the opening full sync (review expects it)
        self.meta: dict[str, tuple[int, int]] = {}  # request id -> (round, hand-out order)
        self.next_round = r.feed.last_round + 1
        self.buffer: dict[str, tuple[str, list[Sample]]] = {}  # finished groups in arrival order
        self.workers: dict[str, object] = {}
        self.runs: dict[str, object] = {}
        self.offsets: dict[str, float] = {}
        self.pids: dict[str, int] = {}  # each worker's current process: items from a replaced one are late
        self.restarts: Counter = Counter()
        self.restart_times: deque[float] = deque()  # when workers were replaced (the crash-loop window)
        self.stats: Counter = Counter()
        self.tool_seconds: list[float] = []  # this step's tool calls' latencies, from every worker (metrics())
        self.canaries: dict[int, tuple] = {}  # version -> (trainer's probe logprobs, {worker: answer}) not complete
        self.canary_done: dict = {}  # the latest complete canary's metrics, for the next row
        self.lag = run.state.step - run.state.version  # steps that made no version (skipped), see retarget
        self.target: dict[str, int] = {}  # tail: request id -> the target step it was last handed out with
        t = cfg.tail
        self.tail = PoolTail(self.P, cfg.rollout.samples_per_prompt, t.overprovision, t.extra_samples,
                             t.long_every) if cfg.rollout.scheduler == "tail" else None
        for i in range(cfg.rollout.workers):
            self._start(f"rollout-{i}", self.ref, self.checksum)
        self.session.connect(self.workers)
        live = self.ledger.queued()  # a resumed run's live prompts: requeued, meant for the next step
        round_of = {}
        if self.tail is not None:  # tail: the long-round queue stays queued; the rest keep their rounds
            round_of = self.tail.restore(run.state.extra.get(STATE_KEY))
            waiting = set(self.tail.long)
            self.ledger.defer([q.id for q in live if q.id in waiting])
            self.tail.long = deque(i for i in self.tail.long if self.ledger.state.get(i) == "deferred")
            live = [q for q in live if q.id not in waiting]
            self.next_round = max(self.next_round, self.tail.next_round)
        for q in live:
            self.meta[q.id] = (round_of.get(q.id, run.state.step), len(self.meta))
        self._hand_out([(q, run.state.step) for q in live])

    # -- workers -----------------------------------------------------------------------------------

    def _start(self, name: str, handle, checksum: str) -> None:
        """Start actor ``name`` from the weights ``handle`` names; it must hash to ``checksum``."""
        i, n = int(name.rsplit("-", 1)[1]), self.restarts[name]
        h = self.actor.remote(self.cfg.model_dump(mode="json"), name, self.cfg.seed + i + 1000 * n, handle,
                              self.queue, self.admission_bound, self.cfg.rollout.inflight)
        ray.get(h.info.remote())  # waits for the model copy to be built
        t0 = time.time()
        info = ray.get(h.info.remote())  # then a round trip measures the clock offset
        self.offsets[name] = info["time"] - (t0 + time.time()) / 2
        if info["checksum"] != checksum:
            raise WeightsDiffer(f"rollout worker {name} starts with weights that differ from the trainer's at "
                                f"version {info['version']} (checksum {info['checksum'][:12]} vs {checksum[:12]})")
        if info["rollyard"] != rollyard.__file__:
            raise ConfigError(f"Ray workers import rollyard from {info['rollyard']}, this driver from "
                              f"{rollyard.__file__}; install the same rollyard on every node (or set PYTHONPATH)")
        h.retarget.remote(self.lag)
        if self.r.reference is not None and self.cfg.reference.placement == "pool":  # groups go to its actors
            h.reference.remote(self.r.reference.actors)
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
                ray.get(self.runs[name])
                raise RuntimeError(f"rollout worker {name} left its loop without being stopped")
            except RayActorError as e:
                self._replace(name, e)
        if dead:
            self.session.connect(self.workers)  # a sync group cannot outlive a member: a new one, all ranks

    def _replace(self, name: str, err: Exception) -> None:
        now = time.time()
        self.restart_times.append(now)
        while self.restart_times and now - self.restart_times[0] > RESTART_WINDOW_S:
            self.restart_times.popleft()
        if len(self.restart_times) > MAX_RESTARTS:
            raise RolloutCrashLoop(f"rollout workers died {len(self.restart_times)} times within "
                                   f"{RESTART_WINDOW_S:.0f} s (limit {MAX_RESTARTS}), last {name} "
                                   f"({type(err).__name__}); stopping rather than restarting in a loop; see the "
                                   f"worker's log above, the latest checkpoint is intact (--resume)") from err
        self.restarts[name] += 1
        self._drain()  # the groups it queued before dying are taken, not requeued
        requeued = self.ledger.requeue(self.ledger.on_worker(name))
        del self.workers[name], self.runs[name]
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
        self._hand_out([(q, max(self.run.state.version, self.meta[q.id][0])) for q in requeued])

    def _catch_up(self, name: str) -> None:
        """Send worker ``name`` the last published version in full (it missed or rejected an update)."""
        nbytes = self.session.catch_up(self.workers[name])
        self.run.telemetry.traffic(self.run.state.step, "weights", nbytes)
        self.stats["catch_ups"] += 1

    # -- the step's side (step.py) -------------------------------------------------------------------

    def take(self, step: int, version: int) -> Taken:
        """Hand out rounds up to ``ahead`` steps on, then the step's groups (round ``step`` exactly, or
        the first ``prompts_per_step`` fresh ones) for the trainer at ``version``."""
        if step - version != self.lag:  # a skipped optimizer step: rounds' target versions move back by one
            self.lag = step - version
            for h in self.workers.values():
                h.retarget.remote(self.lag)
        self.fill(horizon=step + self.ahead, step=step)
        requests, samples = self.groups(self.P, version, round_=step if self.by_round else None)
        return Taken(requests, samples)

    trainer_turn = staticmethod(no_turn)  # the workers hold their own copies: nothing to give the trainer

    def rng_state(self) -> None:
        return None  # each worker's sampling RNG is seeded per start (seed, worker, restarts)

    # -- hand out ------------------------------------------------------------------------------------

    def fill(self, horizon: int, step: int) -> None:
        """Hand out every round up to ``horizon`` (each round meant for the step of its number)."""
        while self.next_round <= horizon:
            if self.tail is None:
                self._issue(self.next_round, self.P, step)
            else:
                self._issue_tail(self.next_round, step)
            self.next_round += 1

    def _issue_tail(self, round_: int, step: int) -> None:
        """rollout.scheduler=tail: a short round of fresh prompts, or a long round of queued ones."""
        kind = self.tail.next_kind()
        self.tail.issued(round_, kind)
        if kind == "short":
            self._issue(round_, self.tail.short_size(), step)
            return
        requests = [self._reform(q, self.tail.long_form) for q in self.ledger.requeue(self.tail.take_long())]
        for q in requests:
            self.meta[q.id] = (round_, len(self.meta))
        self.run.telemetry.traffic(step, "prompts", 4 * sum(len(q.prompt_ids) for q in requests))
        self._hand_out([(q, round_) for q in requests])

    def _reform(self, q: Request, form) -> Request:
        """``q`` as ``form`` makes it (tail: its sample count), recorded in the ledger (a requeue re-issues it)."""
        self.ledger.requests[q.id] = form(q)
        return self.ledger.requests[q.id]

    def _cut(self, round_: int) -> None:
        """Tail: a short round has its P complete prompts; abort the rest on their workers, queue them for a long round."""
        ids = [i for i, (b, _) in self.meta.items() if b == round_ and self.ledger.state.get(i) in ("queued", "in_flight")]
        per: dict[str, list] = {}
        for i in ids:
            per.setdefault(self.ledger.worker.get(i), []).append((i, self.target[i]))
            del self.meta[i]
        self.ledger.defer(ids)
        self.tail.defer(ids)
        for name, pairs in per.items():
            if name in self.workers:
                self.workers[name].cut.remote(pairs)

    def _issue(self, round_: int, k: int, step: int) -> None:
        """Hand out ``k`` prompts for ``round_``; dead-lettered ones are replaced, so a round stays
        full (an async trainer waits for ``prompts_per_step`` groups)."""
        for _ in range(MAX_TOP_UPS):
            requests, dead = self.r.feed.take(k, round_)
            if self.tail is not None:  # a short round's prompts: n + extra samples, complete at n
                requests = [self._reform(q, self.tail.short_form) for q in requests]
            self.run.dead_letter(dead, step)
            for q in requests:
                self.meta.setdefault(q.id, (round_, len(self.meta)))
            self.run.telemetry.traffic(step, "prompts", 4 * sum(len(q.prompt_ids) for q in requests))
            self._hand_out([(q, round_) for q in requests])
            k -= len(requests)
            if k <= 0:
                return
        raise RuntimeError(f"round {round_}: {MAX_TOP_UPS} draws from the prompt set left {k} prompts short, every "
                           f"one dead-lettered; see {rundir.DEADLETTER} for why")

    def _hand_out(self, items: list[tuple[Request, int]]) -> None:
        load = Counter(dict.fromkeys(self.workers, 0) | Counter(self.ledger.worker.values()))
        per: dict[str, list] = {}
        for q, target in items:
            w = min(self.workers, key=lambda n: (load[n], n))
            load[w] += 1
            per.setdefault(w, []).append((q, target))
            self.ledger.hand_out([q.id], w)
            if self.tail is not None:  # what a cut names
                self.target[q.id] = target
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
            tel.record(span, self.offsets.get(name, 0.0))
        self.stats.update(item["stats"])
        tel.memory.observe("rollout_actor", item.get("memory_peak"))  # the actor process's peak RSS so far
        self.tool_seconds += item.get("tool_seconds", [])
        if item.get("needs_full") and name in self.workers:
            self._catch_up(name)
        for rid, why in item["rejected"]:
            cut = self.tail is not None and rid in self.tail.long  # rejected, and cut before the news came
            if cut:
                self.tail.long.remove(rid)
            self.ledger.dead([rid])
            self.run.dead_letter([{"source": rid, "reason": why}], step)
            if not cut and (self.tail is None or self.meta[rid][0] in self.tail.done):  # tail: open short rounds only
                self._issue(self.meta[rid][0], 1, step)
        late = item.get("pid", self.pids.get(name)) != self.pids.get(name)  # sent by a worker since replaced
        for rid, samples in item["groups"]:
            if late or self.ledger.state.get(rid) != "in_flight" or self.ledger.worker.get(rid) != name:
                if self.tail is not None and rid in self.tail.long:  # finished as its round was cut: deferred all the same
                    self.stats["cut_tokens"] += sum(len(s.completion_ids) for s in samples)
                else:
                    self.stats["duplicates"] += 1  # requeued meanwhile: the other copy counts
                continue
            self.ledger.finished([rid])
            if self.tail is not None and self.tail.complete(self.meta[rid][0]):
                self._cut(self.meta[rid][0])
            self.buffer[rid] = (name, samples)  # its bytes count on the samples edge when consumed (take, drop)
            if rid in item.get("reference", {}):  # reference.placement=pool: its reference logprobs, under way
                self.r.reference.adopt({rid: item["reference"][rid]})
        for version, held, logprobs in item.get("canary", ()):
            self._canary_answer(name, version, held, logprobs)

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
                if self.tail is not None:  # re-rolled whole; an open short round counts it once, when it comes back
                    self.tail.undo(self.meta[rid][0])
                self._hand_out([(q, version) for q in self.ledger.requeue([rid])])

    def groups(self, k: int, version: int, round_: int | None = None) -> tuple[list[Request], list[Sample]]:
        """Groups to train on at trainer ``version``: the first ``k`` fresh ones to arrive, or (with
        ``round_``) exactly that round's. Blocks until they are there; returns them in hand-out order."""
        t0 = time.time()
        while True:
            self._drop_stale(version)
            if round_ is None:
                chosen = list(self.buffer)[:k] if len(self.buffer) >= k else None
            else:
                ids = [i for i, (b, _) in self.meta.items() if b == round_ and self.ledger.state.get(i) != "dead"]
                chosen = ids if all(i in self.buffer for i in ids) else None
            if chosen is not None:
                break
            try:
                self._receive(self.queue.get(timeout=0.05))
                self._drain()
            except Empty:
                pass
            self._check_workers()
        self.stats["wait_s"] += time.time() - t0
        chosen.sort(key=lambda i: self.meta[i][1])
        if self.tail is not None:
            self.tail.took([self.meta[i][0] for i in chosen])
            for i in chosen:
                self.target.pop(i, None)
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
            pending = {h.checksum.remote(version): n for n, h in self.workers.items()}
            checked, dead = 0, False
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.05)
                if not ready:
                    self._drain()
                    continue
                name = pending.pop(ready[0])
                try:
                    held, checksum = ray.get(ready[0])
                except RayActorError:
                    dead = True
                    continue
                if (held, checksum) != (version, expected):
                    raise WeightsDiffer(f"weight sync equality check failed at version {version}: rollout worker "
                                        f"{name} holds v{held} with checksum {checksum[:12]}, the trainer's is "
                                        f"{expected[:12]}; stopping rather than sampling from the wrong weights")
                checked += 1
        if dead:  # after the span: a replacement's start-up is not the check's time
            self._check_workers(wait_s=self.session.timeout_s)
        self.stats["checked"] += 1  # run-wide count (rollout/checked); the step's row says sync/checked
        self.run.log(f"sync check v{version}: {checked} worker(s) equal the trainer ({expected[:12]})")

    def canary(self, version: int, probe, trainer_lp: list[float]) -> dict:
        """Ask every worker to score the canary probe once it holds ``version``: its loop answers through
        the queue, so the step is not held up. Returns the metrics of the latest canary every live worker
        has answered since the last call (``canary/version`` says which sync; {} when none)."""
        self.canaries[version] = (trainer_lp, {})
        for h in self.workers.values():
            h.canary.remote(version, probe)
        out, self.canary_done = self.canary_done, {}
        return out

    def _canary_answer(self, name: str, version: int, held: int, logprobs) -> None:
        if version not in self.canaries:
            return
        trainer_lp, answers = self.canaries[version]
        answers[name] = (held, logprobs)
        if set(answers) >= set(self.workers):
            scored = {n: a for n, a in answers.items() if a[1] is not None}
            self.canary_done = {**canary.compare(version, trainer_lp, scored), "canary/version": version}
            for v in [v for v in self.canaries if v <= version]:  # older ones a replaced worker never answered
                del self.canaries[v]

    def metrics(self) -> dict:
        """This step's pool counters (reset), for the step's metrics row."""
        s, self.stats = self.stats, Counter()
        seconds, self.tool_seconds = self.tool_seconds, []
        for key in ("restarts", "dropped", "duplicates", "checked"):
            self.run.count(f"rollout/{key}", s[key])
        counts = self.ledger.counts()
        tail = {}
        if self.tail is not None:  # its counters, and its queue into the checkpoint this step may write
            tail = self.tail.metrics(s["cut_tokens"])
            waiting = set(self.tail.long)
            live = [i for i in self.ledger.requests if i not in waiting]
            self.run.state.extra[STATE_KEY] = self.tail.state({i: self.meta[i][0] for i in live if i in self.meta},
                                                              Counter(self.meta[i][0] for i in self.buffer))
        return {**tail, "staleness/dropped": s["dropped"], "sync/catch_ups": s["catch_ups"], "rollout/aborted": s["aborted"], "rollout/restarts": s["restarts"],
                "rollout/held_s": s["held_s"], "rollout/engine_s": s["engine_s"], "rollout/engine_cpu_s": s["engine_cpu_s"],
                "rollout/ship_s": s["ship_s"],
                "rollout/tokens": s["tokens"], "wait/samples_s": s["wait_s"], "rollout/buffered": len(self.buffer),
                **{f"prompts/{k}": v for k, v in counts.items()},
                **{k: v for k, v in s.items() if k.startswith("tools/")},  # tools.*: the workers' tool counters
                **({TOOL_SECONDS: seconds} if env_setup.enabled(self.cfg) else {}),  # their calls' latencies
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
            try:
                for span in ray.get(ref, timeout=30):
                    self.run.telemetry.record(span, self.offsets[name])
            except RayError as e:  # a worker that died at the end has nothing to give
                self.run.log(f"rollout worker {name} did not stop cleanly: {type(e).__name__}")
        for h in self.workers.values():
            ray.kill(h)
        ray.kill(self.queue.actor)
