"""Tool calls in isolated worker processes, with a per-call timeout: a hang or a crash is that call's failure.

:class:`ToolExecutor` owns a :class:`rollyard.reward.pool.WorkerPool` of ``env/worker.py`` processes
(the verifier pool's processes, pipes, start-up and replacement, reused; only the script differs) and
is driven by the multi-turn loop without threads: :meth:`submit` queues a job, :meth:`poll` hands
queued jobs to idle workers, waits up to ``timeout`` for replies and returns the finished ones.

A job that runs past ``timeout_s`` has its worker killed (with its process group) and replaced; one
whose worker dies (a crash, the memory or CPU limit) likewise: either way the job finishes with
status ``"error"`` and a one-line reason, and the run goes on. With an environment class every
sample's instance lives in one worker (the one its ``reset`` ran on); when that worker is replaced
the instance is gone, and the sample's later jobs fail with ``"environment lost"``.

``stats`` counts tool ``calls`` and ``errors`` (every failed call: the tool raised, was called
wrongly, timed out or crashed), ``timeouts`` and ``crashes`` (worker deaths), ``cut`` (outputs cut
to ``max_output_bytes`` in the worker or ``max_output_tokens`` here: the cut is said at the end of
the output the model reads) and ``printed_bytes`` (what calls printed: captured per call into
``Job.printed``, never the run's console); ``seconds`` holds the wall time of each finished call
(the tool latency distribution).
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import time
import weakref
from collections import deque
from dataclasses import dataclass

from rollyard.env.tools import ToolSpec
from rollyard.reward.pool import Worker, WorkerPool, describe_exit

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def cap_tokens(value, tokenizer, limit: int) -> tuple[object, bool]:
    """``(value, cut?)``: a str output of more than ``limit`` tokens keeps its first ``limit`` and says so at
    its end. The worker cut it to ``max_output_bytes`` first, so what is tokenized here is bounded."""
    if limit <= 0 or tokenizer is None or not isinstance(value, str):
        return value, False
    ids = tokenizer(value, add_special_tokens=False)["input_ids"]
    if len(ids) <= limit:
        return value, False
    return tokenizer.decode(ids[:limit]) + f"\n[tool output cut: {len(ids)} tokens, the first {limit} kept]", True


class _ToolPool(WorkerPool):
    """The reward pool running ``env/worker.py`` instead of the reward worker (same protocol frames)."""

    script = WORKER_SCRIPT


@dataclass(eq=False)
class Job:
    """One call: ``op`` (call | reset | reward | drop), the sample ``sid``, tool ``name`` and ``args``.
    ``key`` is the caller's handle; ``status``/``value``/``seconds`` are filled when it finishes."""

    key: object
    op: str
    sid: str
    name: str = ""
    args: dict | None = None
    status: str = ""
    value: object = None
    seconds: float = 0.0
    started: float = 0.0  # time.time() when a worker got it (0: it never ran)
    printed: str = ""  # the first bytes of what the call printed (env/worker.py PRINT_KEEP)


class ToolExecutor:
    """Worker processes that run ``specs`` (plain tools) or ``env``'s methods; see the module docstring."""

    def __init__(self, specs: list[ToolSpec], env: tuple[str, str, str] | None = None, *, num_workers: int = 2,
                 timeout_s: float = 10.0, memory_mb: int = 0, cpu_s: float = 0.0, start_timeout_s: float = 60.0,
                 max_output_bytes: int = 0, max_output_tokens: int = 0, tokenizer=None):
        self.timeout_s = float(timeout_s)
        self.max_output_tokens, self.tokenizer = int(max_output_tokens), tokenizer
        self.env = env
        self._workdir = tempfile.mkdtemp(prefix="rollyard-tools-")
        weakref.finalize(self, shutil.rmtree, self._workdir, True)
        init = {"tools": [s.target for s in specs], "env": env, "sys_path": [os.path.abspath(p or os.getcwd()) for p in sys.path],
                "workdir": self._workdir, "memory_mb": int(memory_mb), "cpu_s": float(cpu_s),
                "max_output_bytes": int(max_output_bytes)}
        label = f"environment {env[2]!r}" if env else f"tools {', '.join(s.name for s in specs)!r}"
        self._pool = _ToolPool(init, num_workers, start_timeout_s=start_timeout_s, label=label)
        self._queue: deque[Job] = deque()
        self._home: dict[str, Worker] = {}  # sid -> the worker holding its environment
        self._seq = 0
        self.stats = {"calls": 0, "errors": 0, "timeouts": 0, "crashes": 0, "cut": 0, "printed_bytes": 0}
        self.seconds: list[float] = []

    # --------------------------------------------------------------------------------- public API
    @property
    def busy(self) -> bool:
        return bool(self._queue) or any(w.job is not None for w in self._pool.workers)

    def submit(self, job: Job) -> None:
        self._queue.append(job)

    def poll(self, timeout: float) -> list[Job]:
        """Hand queued jobs to workers, wait up to ``timeout`` s for replies; the jobs that finished."""
        done: list[Job] = []
        self._assign(done)
        if not any(w.job is not None for w in self._pool.workers):
            if self._queue and not done:  # every worker still starting: wait for one
                self._pool.wait(time.monotonic() + min(timeout, 0.05))
                self._assign(done)
            return done
        deadlines = [w.deadline for w in self._pool.workers if w.job is not None]
        until = min([time.monotonic() + timeout, *deadlines])
        for w, frames in self._pool.wait(until):
            self._on_frames(w, frames, done)
        now = time.monotonic()
        for w in list(self._pool.workers):
            if w.job is not None and now >= w.deadline:
                job, w.job = w.job, None
                self.stats["timeouts"] += 1
                self._replace(w)
                self._finish(job[1], "error", f"TimeoutError: no answer within {self.timeout_s:g}s (the worker was "
                                           f"killed)", now - w.sent_at, done)
        self._assign(done)
        return done

    def run(self, jobs: list[Job]) -> list[Job]:
        """Submit ``jobs`` and block until every one finished (tests, start-up probes)."""
        for j in jobs:
            self.submit(j)
        left = set(map(id, jobs))
        while left:
            for j in self.poll(1.0):
                left.discard(id(j))
        return jobs

    def close(self) -> None:
        self._pool.stopping = True
        self._pool.close()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- internals
    def _assign(self, done: list[Job]) -> None:
        waiting: deque[Job] = deque()
        while self._queue:
            job = self._queue.popleft()
            w = self._worker_for(job, done)
            if w is None:
                if job.status:  # finished already (environment lost)
                    continue
                waiting.append(job)
                continue
            self._seq += 1
            frame = (self._seq, job.op, job.sid, job.name, job.args or {})
            try:
                pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # noqa: BLE001 - arguments the model cannot have produced, but say so
                self._finish(job, "error", f"TypeError: arguments are not picklable: {e}", 0.0, done)
                continue
            w.sent_at, job.started = time.monotonic(), time.time()
            if self._pool.send(w, frame):
                w.job, w.state, w.deadline = (self._seq, job), "busy", w.sent_at + self.timeout_s
                if job.op == "reset":
                    self._home[job.sid] = w
            else:  # died while idle: replace it; the job waits for the next worker
                self.stats["crashes"] += 1
                self._replace(w)
                waiting.append(job)
        self._queue = waiting

    def _worker_for(self, job: Job, done: list[Job]) -> Worker | None:
        if self.env is None or job.op == "reset":
            idle = self._pool.idle()
            if not idle:
                return None
            # a reset goes to the worker holding the fewest environments (they stay there)
            return min(idle, key=lambda w: sum(1 for h in self._home.values() if h is w))
        home = self._home.get(job.sid)
        if home is None or home not in self._pool.workers:
            self._home.pop(job.sid, None)
            if job.op == "drop":
                self._finish(job, "ok", None, 0.0, done)
            else:
                self._finish(job, "error", "LookupError: environment lost (its worker was replaced after a timeout "
                                           "or crash)", 0.0, done)
            return None
        return home if home.state == "idle" else None

    def _on_frames(self, w: Worker, frames: list | None, done: list[Job]) -> None:
        if frames is None:
            pending, w.job = w.job, None
            self.stats["crashes"] += 1
            self._replace(w)
            if pending is not None:
                self._finish(pending[1], "error", f"RuntimeError: the tool's worker died "
                                                  f"({describe_exit(w.proc.returncode)})",
                             time.monotonic() - w.sent_at, done)
            return
        for seq, status, value, _seconds, info in frames:
            if w.job is None or seq != w.job[0]:
                continue
            job, w.job, w.state = w.job[1], None, "idle"
            if job.op in ("reward", "drop"):
                self._home.pop(job.sid, None)
            job.printed = info.get("printed", "")
            self.stats["printed_bytes"] += int(info.get("printed_bytes", 0))
            if status == "ok" and job.op == "call":
                value, cut = cap_tokens(value, self.tokenizer, self.max_output_tokens)
                self.stats["cut"] += int(cut or bool(info.get("cut")))
            self._finish(job, status, value, time.monotonic() - w.sent_at, done)

    def _finish(self, job: Job, status: str, value, seconds: float, done: list[Job]) -> None:
        job.status, job.value, job.seconds = status, value, seconds
        if job.op == "call":
            self.stats["calls"] += 1
            self.seconds.append(seconds)
            if status != "ok":
                self.stats["errors"] += 1
        done.append(job)

    def _replace(self, w: Worker) -> None:
        for sid in [s for s, h in self._home.items() if h is w]:
            del self._home[sid]
        self._pool.replace(w)
