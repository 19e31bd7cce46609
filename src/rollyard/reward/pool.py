"""Reward worker processes: spawning, framed pipes, start / replace / shut down, the select over their pipes.

:class:`WorkerPool` owns ``size`` long-lived ``python rollyard/reward/worker.py`` processes (see
``worker.py`` for the protocol and the isolation each applies to itself). It knows nothing about
samples or scoring: the dispatcher (``dispatcher.py``) hands a job to an idle :class:`Worker` with
:meth:`WorkerPool.send`, reads its replies from :meth:`WorkerPool.wait`, and asks for a
:meth:`WorkerPool.replace` when a call ran past its timeout or the worker died.

What the pool does on its own: a worker is ``starting`` until its ``("ready", pid)`` frame; one that
exits, reports ``init_error`` or is still importing after ``start_timeout_s`` is replaced, and after
``MAX_START_FAILURES`` failed starts in a row the pool is ``broken`` (one line on stderr; the
dispatcher then flags every further call). A replaced worker's whole process group is SIGKILLed
(workers run in their own session), so anything a hook started goes with it. Processes still up
when the pool is garbage-collected are killed by a finalizer.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from rollyard.reward import worker as _worker
from rollyard.tasks.base import HookError

WORKER_SCRIPT = os.path.abspath(_worker.__file__)
_HEADER = struct.Struct(">I")
MAX_START_FAILURES = 3  # consecutive failed worker starts before the pool gives up (and flags every call)
EOF_GRACE_S = 5.0  # a worker whose pipe closed has this long to exit before it is killed (see reap)


@dataclass(eq=False)
class Worker:
    """One worker process; ``job``/``sent_at``/``deadline`` are the dispatcher's bookkeeping of its call."""

    proc: subprocess.Popen
    spawned_at: float
    start_deadline: float
    state: str = "starting"  # starting | idle | busy
    job: Any = None
    sent_at: float = 0.0
    deadline: float = 0.0
    buf: bytearray = field(default_factory=bytearray)

    @property
    def fd(self) -> int:
        return self.proc.stdout.fileno()


def describe_exit(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def kill(proc: subprocess.Popen) -> None:
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


def reap(proc: subprocess.Popen) -> str:
    """How a worker whose pipe reached end of file ended (:func:`describe_exit`). Such a worker is exiting, so it
    is waited for ``EOF_GRACE_S`` at most: one still running then (its code closed the pipe and went on) is
    killed and said so, never waited for without a bound."""
    try:
        return describe_exit(proc.wait(timeout=EOF_GRACE_S))
    except subprocess.TimeoutExpired:
        kill(proc)
        return f"closed its pipe to rollyard and was still running {EOF_GRACE_S:.0f} s later: killed"


def kill_all(procs: set) -> None:
    for p in list(procs):
        kill(p)
    procs.clear()


def encode(obj) -> bytes:
    """One frame: a 4-byte big-endian length and the pickle."""
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def decode_frames(buf: bytearray) -> list:
    """The complete frames at the start of ``buf`` (removed from it); a partial frame stays."""
    frames = []
    while len(buf) >= _HEADER.size:
        (n,) = _HEADER.unpack_from(buf)
        if len(buf) < _HEADER.size + n:
            break
        frames.append(pickle.loads(bytes(buf[_HEADER.size:_HEADER.size + n])))
        del buf[:_HEADER.size + n]
    return frames


class WorkerPool:
    """``size`` worker processes started with the ``init`` frame; blocks until all are ready.

    ``label`` names what the workers import in error messages (``"reward hook 'm:f'"``). Raises
    :class:`HookError` when an initial worker cannot import it. ``restarts`` counts replacements;
    ``start_s`` is the start time of the slowest initial worker, then of the latest replacement.
    ``script`` is the worker program (a subclass runs another one that speaks the same frames).
    """

    script = WORKER_SCRIPT

    def __init__(self, init: dict, size: int, *, start_timeout_s: float, label: str):
        self.init = init
        self.start_timeout_s = float(start_timeout_s)
        self.label = label
        self.workers: list[Worker] = []
        self.procs: set[subprocess.Popen] = set()
        self.broken: str | None = None  # why no worker can start; set after MAX_START_FAILURES in a row
        self.stopping = False  # set by the owner when closing: a replaced worker is not restarted
        self.restarts = 0
        self.start_s = 0.0
        self._start_failures = 0
        self._finalizer = weakref.finalize(self, kill_all, self.procs)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        try:
            self.workers = [self._spawn() for _ in range(size)]
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------ the owner's API
    def idle(self) -> list[Worker]:
        return [w for w in self.workers if w.state == "idle"]

    def send(self, w: Worker, obj) -> bool:
        """Write one frame to ``w``; False when its pipe is gone (the worker died)."""
        data = encode(obj)
        try:
            fd = w.proc.stdin.fileno()
            while data:
                data = data[os.write(fd, data):]
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def wake(self) -> None:
        """Make a :meth:`wait` in another thread return now (new work to hand out, or closing)."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def wait(self, deadline: float | None) -> list[tuple[Worker, list | None]]:
        """Block until a worker is readable, :meth:`wake` is called or ``deadline`` (monotonic) passes.

        Returns ``(worker, frames)`` for every ready worker that is past its start (``frames`` None: it
        exited; its ``proc.returncode`` is set). Starting workers are handled here: ready, or replaced
        when they fail or pass their start deadline.
        """
        deadlines = [w.start_deadline for w in self.workers if w.state == "starting"]
        if deadline is not None:
            deadlines.append(deadline)
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        ready, _, _ = select.select([self._wake_r] + [w.fd for w in self.workers], [], [], timeout)
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        events = []
        for w in list(self.workers):
            if w not in self.workers or w.fd not in ready:
                continue
            frames = self._read(w)
            if w.state != "starting":
                if frames is None:
                    reap(w.proc)
                events.append((w, frames))
            elif frames is None:
                self._start_failed(w, f"worker ended while importing the hook ({reap(w.proc)})")
            else:
                for fr in frames:
                    self._on_start_frame(w, fr, initial=False)
                    if w not in self.workers:
                        break
        now = time.monotonic()
        for w in list(self.workers):
            if w.state == "starting" and now >= w.start_deadline:
                self._start_failed(w, f"no worker finished importing the hook within {self.start_timeout_s:.0f}s")
        return events

    def replace(self, w: Worker) -> bool:
        """Kill ``w`` and start a fresh worker in its place; False (``w`` just removed) when stopping or broken."""
        kill(w.proc)
        self.procs.discard(w.proc)
        idx = self.workers.index(w)
        if self.stopping or self.broken:
            self.workers.pop(idx)
            return False
        self.workers[idx] = self._spawn()
        self.restarts += 1
        return True

    def close(self) -> None:
        """Close every worker's stdin (it exits on EOF), give them a moment, then kill what is left."""
        for w in self.workers:
            try:
                w.proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + 1.0
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            kill(w.proc)
            self.procs.discard(w.proc)
        self.workers = []
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # ------------------------------------------------------------------------------------ starting
    def _spawn(self) -> Worker:
        t0 = time.monotonic()
        # user code (a verifier, a tool fed the model's arguments) gets no key to the run's Ray session
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
        proc = subprocess.Popen([sys.executable, self.script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                start_new_session=True, close_fds=True, bufsize=0, env=env)
        self.procs.add(proc)
        w = Worker(proc, spawned_at=t0, start_deadline=t0 + self.start_timeout_s)
        if not self.send(w, self.init):
            w.start_deadline = t0  # died at once: the loop notices it on EOF
        return w

    def _read(self, w: Worker) -> list | None:
        """Frames now readable from ``w``, or None at EOF (the worker is gone)."""
        try:
            data = os.read(w.fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            return None
        w.buf += data
        return decode_frames(w.buf)

    def _wait_ready(self) -> None:
        """Block until every initial worker has imported the hook; HookError if one cannot."""
        deadline = time.monotonic() + self.start_timeout_s
        times: list[float] = []
        while any(w.state == "starting" for w in self.workers):
            left = deadline - time.monotonic()
            if left <= 0:
                raise HookError(f"{self.label}: worker processes did not finish importing it within "
                                f"{self.start_timeout_s:.0f}s; make the module faster to import")
            starting = [w for w in self.workers if w.state == "starting"]
            ready, _, _ = select.select([w.fd for w in starting], [], [], left)
            for w in starting:
                if w.fd not in ready:
                    continue
                frames = self._read(w)
                if frames is None:
                    raise HookError(f"{self.label}: a worker process ended while importing it "
                                    f"({reap(w.proc)}); check that the module imports in a fresh "
                                    f"interpreter: {sys.executable} -c 'import ...'")
                for fr in frames:
                    elapsed = self._on_start_frame(w, fr, initial=True)
                    if elapsed is not None:
                        times.append(elapsed)
        self.start_s = max(times) if times else 0.0

    def _on_start_frame(self, w: Worker, fr, initial: bool) -> float | None:
        """A starting worker's frame; returns its start time when it is ``ready``."""
        if fr[0] == "ready":
            w.state = "idle"
            self._start_failures = 0
            elapsed = time.monotonic() - w.spawned_at
            if not initial:
                self.start_s = elapsed
            return elapsed
        if fr[0] == "init_error":
            if initial:
                raise HookError(f"{self.label} imports in this process but not in a worker "
                                f"process: {fr[1]}; make the module importable from a fresh interpreter")
            self._start_failed(w, fr[1])
        return None

    def _start_failed(self, w: Worker, why: str) -> None:
        self._start_failures += 1
        if self._start_failures >= MAX_START_FAILURES:
            self.broken = f"reward workers cannot start ({why})"
            print(f"rollyard: {self.broken}; every further reward call scores 0 with an error flag",
                  file=sys.stderr)
        self.replace(w)
