"""Reward dispatcher: verifiers run in long-lived worker processes, each call under a timeout.

A verifier is one or more weighted hooks in any of the forms ``hooks.py`` accepts, each named by a
``"module:function"`` or ``"path/to/file.py:function"`` path. The dispatcher validates the hooks in
the parent when it is built (a hook that does not import is a :class:`HookError` before the first
step, not an hour in), decodes completions in the parent, and ships only strings and ``meta`` to
the workers; each worker imports the hooks itself by the same paths and calls every hook on a
sample. The sample's reward is the weighted sum (``hooks.combine``); its per-hook values are in
``sample.reward_parts``; ``reward is None`` when no hook scored it (TRL's ``None``).

Nothing a verifier does stops the run:
  - it raises: reward 0, ``reward_flag = "error: <ExcType>: <msg>"``;
  - it runs past ``timeout_s``: reward 0, ``reward_flag = "timeout"``; its worker (and anything the
    worker started) is killed and replaced, so the pool keeps its size;
  - its worker dies (segfault, ``os._exit``): reward 0, ``reward_flag = "error: worker died (...)"``,
    and a replacement starts;
  - it returns something that is not a finite number (in float32, the dtype advantages are computed
    in: 1e39 is not): reward 0, an ``error: TypeError/ValueError`` flag;
  - it times out on the first ``max(num_workers, 2)`` calls of a batch (at least two different
    prompts) without answering any: the batch's remaining queued samples are flagged ``timeout`` without
    running, so a hook that hangs on everything costs about one timeout per step, not one per
    sample (``score`` interleaves the prompts' samples so the first calls in flight are of different
    prompts); a hook that answers some calls (hangs on some inputs only) never trips this. The next
    batch tries again.
``stats`` counts them (``scored``, ``timeouts``, ``errors``, ``worker_restarts``).

Isolation (see :func:`rollyard.reward.worker.isolate`): each worker runs in its own session, in a
temporary working directory (removed by ``close``), with an address-space limit of ``memory_mb`` and
a CPU-time limit of ``cpu_s`` per call (past the memory limit the call fails with MemoryError; past
the CPU limit the worker is killed and the call flagged ``error: worker died (killed by SIGXCPU)``). Not isolated: the filesystem outside the working directory, the network,
processes the hook starts (they are killed with the worker's process group, but their CPU time is
not limited), and the parent's import of the hook at start-up (it validates the path).

Workers are started as ``python rollyard/reward/worker.py``: a fresh interpreter that imports the
standard library and the hook's module only (not torch, not the parent's ``__main__``), so start
cost is the interpreter start plus the hook's own imports. A background thread feeds them, so
``submit`` returns at once and verification overlaps whatever the caller does next.
"""

from __future__ import annotations

import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rollyard.reward import hooks
from rollyard.reward import worker as _worker
from rollyard.tasks.base import HookError

if TYPE_CHECKING:
    from rollyard.types import Sample

WORKER_SCRIPT = os.path.abspath(_worker.__file__)
_HEADER = struct.Struct(">I")
MAX_START_FAILURES = 3  # consecutive failed worker starts before the pool gives up (and flags every call)



def load_hook(path: str) -> Callable:
    """Resolve ``"module:function"`` or ``"path/to/file.py:function"`` to the callable; :class:`HookError` otherwise."""
    return hooks.load(path)[0]


UNSCORED = "no reward hook scored it (every hook returned None)"


def _groups(samples: list["Sample"]) -> list[list["Sample"]]:
    """``samples`` split by ``request_id`` (one GRPO group per batch), in first-seen order."""
    groups: dict[str, list] = {}
    for s in samples:
        groups.setdefault(s.request_id, []).append(s)
    return list(groups.values())


def split_unscored(samples: list["Sample"]) -> tuple[list["Sample"], list["Sample"]]:
    """``(scored, unscored)``: a sample no hook scored (``reward is None``) is left out of the loss."""
    return [s for s in samples if s.reward is not None], [s for s in samples if s.reward is None]


# --------------------------------------------------------------------------------------- dispatcher
@dataclass
class _Job:
    """One call to a worker: the samples it scores (one, or a GRPO group when a hook is batched)."""

    seqs: list[int]
    samples: list[Any]
    items: list[hooks.Item]  # (completion, prompt, meta, completion_ids) per sample: what the worker gets

    @property
    def seq(self) -> int:
        return self.seqs[0]


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen
    spawned_at: float
    start_deadline: float
    state: str = "starting"  # starting | idle | busy
    job: _Job | None = None
    sent_at: float = 0.0
    deadline: float = 0.0
    buf: bytearray = field(default_factory=bytearray)

    @property
    def fd(self) -> int:
        return self.proc.stdout.fileno()


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the worker's whole process group (it runs in its own session), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
        pass
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass


def _kill_all(procs: set) -> None:
    for p in list(procs):
        _kill(p)
    procs.clear()


def _finite_f32(x: float) -> bool:
    """Finite and within float32 range (advantages are computed in float32)."""
    return isinstance(x, (int, float)) and abs(float(x)) <= 3.4028234663852886e38


def _within_f32(outcome: tuple) -> tuple:
    """A scored ``(reward, flag, parts)`` whose reward is not finite in float32 becomes an error (reward 0)."""
    reward, flag, parts = outcome
    if flag is None and reward is not None and not _finite_f32(reward):
        return 0.0, (f"error: ValueError: reward {reward!r} is not finite in float32 (|reward| must be "
                     f"< 3.4e38)"), parts
    return outcome


def _interleave(samples: list) -> list:
    """Round-robin over request ids: the first samples sent are of different prompts."""
    groups: dict[Any, list] = {}
    for s in samples:
        groups.setdefault(getattr(s, "request_id", None), []).append(s)
    out, lists = [], list(groups.values())
    for i in range(max((len(g) for g in lists), default=0)):
        out += [g[i] for g in lists if i < len(g)]
    return out


def _percentile(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return 0.0
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


class RewardDispatcher:
    """Score samples with ``hook`` in ``num_workers`` worker processes, ``timeout_s`` per call.

    ``decode(ids) -> str`` turns ``completion_ids`` (trailing ``eos_token_id`` removed when given)
    into the completion text, in the parent; the prompt text is ``meta["prompt"]`` when present,
    else ``decode(prompt_ids)``. ``submit`` queues a sample, ``results`` yields finished samples as
    they complete, ``score`` does both for a list and returns it in input order. Samples are
    updated in place (``reward``, ``reward_flag``). Use as a context manager or call ``close``.
    """

    def __init__(self, hook: str | list[str], *, num_workers: int = 2, timeout_s: float = 5.0,
                 decode: Callable[[list[int]], str], eos_token_id: int | list[int] | None = None,
                 start_timeout_s: float = 60.0, weights: list[float] | None = None, memory_mb: int = 0,
                 cpu_s: float = 0.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        paths = [hook] if isinstance(hook, str) else list(hook)
        self.weights = [1.0] * len(paths) if weights is None else [float(w) for w in weights]
        if not paths or len(self.weights) != len(paths):
            raise ValueError(f"{len(paths)} reward hooks and {len(self.weights)} weights: give one weight per hook")
        self.hook = hook if isinstance(hook, str) else ", ".join(paths)
        self.names = hooks.names_of(paths)
        loaded = [hooks.load(p) for p in paths]  # HookError here, in the parent, before any worker starts
        self.forms = [form for _, _, form in loaded]
        self._spec = [(spec, form) for _, spec, form in loaded]
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self._workdir = tempfile.mkdtemp(prefix="rollyard-reward-")  # each worker gets a subdirectory
        self._limits = {"memory_mb": int(memory_mb), "cpu_s": float(cpu_s)}
        self._hung: list | None = []  # request ids of this batch's timeouts while no call answered; None: one did
        self._decode = decode
        self._eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        self.stats: dict[str, float] = {
            "scored": 0, "timeouts": 0, "errors": 0, "worker_restarts": 0,
            "worker_start_s": 0.0, "latency_p50_s": 0.0, "latency_p99_s": 0.0, "verify_p50_s": 0.0,
        }
        self._cond = threading.Condition()
        self._pending: deque[_Job] = deque()
        self._done: OrderedDict[int, Any] = OrderedDict()
        self._outstanding = 0
        self._seq = 0
        self._latencies: list[float] = []
        self._verify: list[float] = []
        self._stop = False
        self._closed = False
        self._crash: BaseException | None = None
        self._broken: str | None = None
        self._start_failures = 0
        self._start_times: list[float] = []
        self._procs: set[subprocess.Popen] = set()
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)
        weakref.finalize(self, shutil.rmtree, self._workdir, True)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._workers: list[_Worker] = []
        try:
            self._workers = [self._spawn() for _ in range(num_workers)]
            self._wait_ready()
        except BaseException:
            self._shutdown_workers()
            self._close_wake()
            raise
        self._thread = threading.Thread(target=self._loop, name="rollyard-reward-dispatcher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ public API
    def submit(self, sample: "Sample") -> None:
        """Queue ``sample`` for scoring; returns at once."""
        self._submit([sample])

    def results(self) -> Iterator["Sample"]:
        """Yield submitted samples as they finish (any order) until none is outstanding."""
        while True:
            with self._cond:
                while not self._done and self._outstanding > 0:
                    self._wait()
                if not self._done:
                    self._batch_stats()
                    return
                _, sample = self._done.popitem(last=False)
                self._outstanding -= 1
            yield sample

    def score(self, samples: list["Sample"]) -> list["Sample"]:
        """Score ``samples`` and return them (the same objects, rewards set) in input order.

        With a TRL-form (batched) hook, each GRPO group (same ``request_id``) is one call, as TRL
        calls its reward functions; otherwise each sample is its own call (its own timeout), the
        prompts' samples interleaved so that the first calls in flight are of different prompts.
        """
        batches = _groups(samples) if "trl" in self.forms else [[s] for s in _interleave(samples)]
        seqs = [seq for batch in batches for seq in self._submit(batch)]
        with self._cond:
            for seq in seqs:
                while seq not in self._done:
                    self._wait()
            for seq in seqs:
                del self._done[seq]
            self._outstanding -= len(seqs)
            self._batch_stats()
        return samples

    def close(self) -> None:
        """Stop the feeder thread and the workers (idempotent). Unfinished submissions are flagged."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._stop = True
        self._wake()
        if getattr(self, "_thread", None) is not None:
            self._thread.join(timeout=10)
        with self._cond:
            leftovers = list(self._pending) + [w.job for w in self._workers if w.job is not None]
            self._pending.clear()
        for job in leftovers:
            self._finish(job, 0.0, "error: dispatcher closed before this sample was scored", "error")
        for w in self._workers:
            w.job = None
        self._shutdown_workers()
        self._close_wake()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "RewardDispatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------- submission
    def _submit(self, samples: list) -> list[int]:
        """Queue ``samples`` as one call; a sample that cannot be decoded is flagged at once instead."""
        if self._closed:
            raise RuntimeError("RewardDispatcher is closed")
        with self._cond:
            self._raise_if_crashed()
            if self._outstanding == 0:
                self._hung = []  # a new batch: a hook that hung on the last one gets tried again
            seqs = list(range(self._seq, self._seq + len(samples)))
            self._seq += len(samples)
            self._outstanding += len(samples)
        job = _Job([], [], [])
        for seq, sample in zip(seqs, samples):
            try:
                item = self._item(sample)
            except Exception as e:  # noqa: BLE001 - a sample that cannot be decoded is flagged, not fatal
                self._finish(_Job([seq], [sample], []), 0.0, f"error: decode: {type(e).__name__}: {e}", "error")
                continue
            job.seqs.append(seq)
            job.samples.append(sample)
            job.items.append(item)
        if not job.seqs:
            return seqs
        with self._cond:
            broken = self._broken
            if not broken:
                self._pending.append(job)
        if broken:
            self._finish(job, 0.0, f"error: {broken}", "error")
        else:
            self._wake()
        return seqs

    def _item(self, sample) -> hooks.Item:
        """``(completion, prompt, meta, completion_ids)``: the completion without its trailing EOS ids."""
        ids = list(sample.completion_ids)
        while ids and ids[-1] in self._eos:
            ids.pop()
        completion = self._decode(ids)
        prompt = sample.meta.get("prompt") if isinstance(sample.meta, dict) else None
        if not isinstance(prompt, str):
            prompt = self._decode(list(sample.prompt_ids))
        return completion, prompt, dict(sample.meta or {}), ids

    def _wait(self) -> None:
        """Wait on the condition (caller holds it), surfacing a crashed feeder thread instead of hanging."""
        self._raise_if_crashed()
        if self._closed:
            raise RuntimeError("RewardDispatcher was closed while samples were outstanding")
        self._cond.wait(timeout=1.0)
        self._raise_if_crashed()

    def _raise_if_crashed(self) -> None:
        if self._crash is not None:
            raise RuntimeError(f"reward dispatcher thread crashed: {type(self._crash).__name__}: {self._crash}") \
                from self._crash

    def _batch_stats(self) -> None:
        """Latency percentiles of the calls finished since the last batch (caller holds the lock)."""
        if self._latencies:
            lat, ver = sorted(self._latencies), sorted(self._verify)
            self.stats["latency_p50_s"] = _percentile(lat, 0.5)
            self.stats["latency_p99_s"] = _percentile(lat, 0.99)
            self.stats["verify_p50_s"] = _percentile(ver, 0.5)
            self._latencies.clear()
            self._verify.clear()

    def _finish(self, job: _Job, reward: float | None, flag: str | None, kind: str | None,
                latency: float | None = None, verify_s: float | None = None,
                outcomes: list[tuple[float | None, str | None, list]] | None = None) -> None:
        """Settle every sample of ``job``: each with its own ``(reward, flag, parts)`` from ``outcomes``
        (a worker's reply), or all with ``reward`` and ``flag`` (a timeout, a dead worker, ...)."""
        outcomes = outcomes or [(reward, flag, [])] * len(job.samples)
        outcomes = [_within_f32(o) for o in outcomes]
        with self._cond:
            for seq, sample, (r, f, parts) in zip(job.seqs, job.samples, outcomes):
                sample.reward, sample.reward_flag, sample.reward_parts = None if r is None else float(r), f, parts
                self.stats["scored"] += 1
                k = kind or ("error" if f else None)
                if k == "timeout":
                    self.stats["timeouts"] += 1
                elif k == "error":
                    self.stats["errors"] += 1
                self._done[seq] = sample
            if latency is not None:
                self._latencies.append(latency)
            if verify_s is not None:
                self._verify.append(verify_s)
            self._cond.notify_all()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _close_wake(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # ------------------------------------------------------------------------------- workers
    def _spawn(self) -> _Worker:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, WORKER_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                start_new_session=True, close_fds=True, bufsize=0)
        self._procs.add(proc)
        w = _Worker(proc, spawned_at=t0, start_deadline=t0 + self.start_timeout_s)
        init = {"hooks": self._spec, "sys_path": [p or os.getcwd() for p in sys.path], "workdir": self._workdir,
                **self._limits}
        if not self._send(w, init):
            w.start_deadline = t0  # died at once: the loop notices it on EOF
        return w

    def _send(self, w: _Worker, obj) -> bool:
        body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        data = _HEADER.pack(len(body)) + body
        try:
            fd = w.proc.stdin.fileno()
            while data:
                data = data[os.write(fd, data):]
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def _read(self, w: _Worker) -> list | None:
        """Frames now readable from ``w``, or None at EOF (the worker is gone)."""
        try:
            data = os.read(w.fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            return None
        w.buf += data
        frames = []
        while len(w.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(w.buf)
            if len(w.buf) < _HEADER.size + n:
                break
            frames.append(pickle.loads(bytes(w.buf[_HEADER.size:_HEADER.size + n])))
            del w.buf[:_HEADER.size + n]
        return frames

    def _wait_ready(self) -> None:
        """Block until every initial worker has imported the hook; HookError if one cannot."""
        deadline = time.monotonic() + self.start_timeout_s
        while any(w.state == "starting" for w in self._workers):
            left = deadline - time.monotonic()
            if left <= 0:
                raise HookError(f"reward hook {self.hook!r}: worker processes did not finish importing it within "
                                f"{self.start_timeout_s:.0f}s; make the module faster to import")
            starting = [w for w in self._workers if w.state == "starting"]
            ready, _, _ = select.select([w.fd for w in starting], [], [], left)
            for w in starting:
                if w.fd not in ready:
                    continue
                frames = self._read(w)
                if frames is None:
                    rc = w.proc.wait()
                    raise HookError(f"reward hook {self.hook!r}: a worker process exited while importing it "
                                    f"({_describe_exit(rc)}); check that the module imports in a fresh "
                                    f"interpreter: {sys.executable} -c 'import ...'")
                for fr in frames:
                    self._on_start_frame(w, fr, initial=True)
        self.stats["worker_start_s"] = max(self._start_times) if self._start_times else 0.0

    def _on_start_frame(self, w: _Worker, fr, initial: bool) -> None:
        if fr[0] == "ready":
            w.state = "idle"
            self._start_failures = 0
            elapsed = time.monotonic() - w.spawned_at
            if initial:
                self._start_times.append(elapsed)
            else:
                self.stats["worker_start_s"] = elapsed
        elif fr[0] == "init_error":
            if initial:
                raise HookError(f"reward hook {self.hook!r} imports in this process but not in a worker "
                                f"process: {fr[1]}; make the module importable from a fresh interpreter")
            self._start_failed(w, fr[1])

    def _start_failed(self, w: _Worker, why: str) -> None:
        self._start_failures += 1
        if self._start_failures >= MAX_START_FAILURES:
            self._broken = f"reward workers cannot start ({why})"
            print(f"rollyard: {self._broken}; every further reward call scores 0 with an error flag",
                  file=sys.stderr)
        self._replace(w)

    def _replace(self, w: _Worker) -> None:
        """Kill ``w`` and start a fresh worker in its place (unless shutting down or broken)."""
        _kill(w.proc)
        self._procs.discard(w.proc)
        idx = self._workers.index(w)
        if self._stop or self._broken:
            self._workers.pop(idx)
            if self._broken:
                with self._cond:
                    jobs = list(self._pending)
                    self._pending.clear()
                for job in jobs:
                    self._finish(job, 0.0, f"error: {self._broken}", "error")
            return
        self._workers[idx] = self._spawn()
        with self._cond:
            self.stats["worker_restarts"] += 1

    def _shutdown_workers(self) -> None:
        """Close every worker's stdin (it exits on EOF), give them a moment, then kill what is left."""
        for w in self._workers:
            try:
                w.proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + 1.0
        for w in self._workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill(w.proc)
            self._procs.discard(w.proc)
        self._workers = []

    # ---------------------------------------------------------------------------- feeder loop
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stop:
                        return
                self._assign()
                now = time.monotonic()
                deadlines = [w.deadline for w in self._workers if w.job is not None]
                deadlines += [w.start_deadline for w in self._workers if w.state == "starting"]
                timeout = max(0.0, min(deadlines) - now) if deadlines else None
                fds = [self._wake_r] + [w.fd for w in self._workers]
                ready, _, _ = select.select(fds, [], [], timeout)
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                for w in list(self._workers):
                    if w in self._workers and w.fd in ready:
                        self._on_readable(w)
                now = time.monotonic()
                for w in list(self._workers):
                    if w.job is not None and now >= w.deadline:
                        job, w.job = w.job, None
                        self._replace(w)  # first, so stats and pool are settled when the caller sees the flag
                        self._finish(job, 0.0, "timeout", "timeout", latency=now - w.sent_at)
                        if self._hung is not None:
                            self._hung.append(getattr(job.samples[0], "request_id", job.seqs[0]) if job.samples else None)
                        if self._hung and len(self._hung) >= max(self.num_workers, 2) and len(set(self._hung)) >= 2:
                            self._give_up_batch()
                    elif w.state == "starting" and now >= w.start_deadline:
                        self._start_failed(w, f"no worker finished importing the hook within {self.start_timeout_s:.0f}s")
        except BaseException as e:  # noqa: BLE001 - surfaced to every waiter instead of a silent hang
            with self._cond:
                self._crash = e
                self._cond.notify_all()

    def _give_up_batch(self) -> None:
        """Every worker timed out in a row: flag this batch's queued samples ``timeout`` without running them."""
        with self._cond:
            jobs = list(self._pending)
            self._pending.clear()
        if jobs:
            print(f"rollyard: reward hook {self.hook!r} timed out on {len(self._hung)} calls in a row (every worker); "
                  f"the {len(jobs)} samples still queued in this batch are flagged timeout without running",
                  file=sys.stderr, flush=True)
        for job in jobs:
            self._finish(job, 0.0, "timeout", "timeout")

    def _assign(self) -> None:
        while True:
            idle = [w for w in self._workers if w.state == "idle"]
            if not idle:
                return
            with self._cond:
                if not self._pending:
                    return
                job = self._pending.popleft()
            w = idle[0]
            try:
                frame = (job.seq, job.items)
                pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # noqa: BLE001
                self._finish(job, 0.0, f"error: meta is not picklable: {type(e).__name__}: {e}", "error")
                continue
            w.sent_at = time.monotonic()
            if self._send(w, frame):
                w.job, w.state, w.deadline = job, "busy", w.sent_at + self.timeout_s
            else:  # the worker died while idle: not this job's fault, requeue it
                with self._cond:
                    self._pending.appendleft(job)
                self._replace(w)

    def _on_readable(self, w: _Worker) -> None:
        frames = self._read(w)
        if frames is None:
            rc = w.proc.wait()
            job, w.job = w.job, None
            if w.state == "starting":
                self._start_failed(w, f"worker exited while importing the hook ({_describe_exit(rc)})")
            else:
                self._replace(w)
            if job is not None:
                self._finish(job, 0.0, f"error: worker died ({_describe_exit(rc)})", "error",
                             latency=time.monotonic() - w.sent_at)
            return
        now = time.monotonic()
        for fr in frames:
            if w.state == "starting":
                self._on_start_frame(w, fr, initial=False)
                if w not in self._workers:
                    return
                continue
            seq, status, value, verify_s = fr
            job = w.job
            if job is None or seq != job.seq:
                continue  # a stale reply (cannot happen with one job in flight per worker)
            w.job, w.state, self._hung = None, "idle", None
            if status == "ok":  # value: per sample, one part per hook
                self._finish(job, 0.0, None, None, latency=now - w.sent_at, verify_s=verify_s,
                             outcomes=[hooks.combine(parts, self.weights) for parts in value])
            else:
                self._finish(job, 0.0, f"error: {value}"[:500], "error", latency=now - w.sent_at, verify_s=verify_s)
