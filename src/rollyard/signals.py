"""SIGINT / SIGTERM during a run: finish the step in progress, checkpoint it, exit 130 / 143.

``graceful()`` (entered by ``rollyard train``) installs the handlers. The first signal only sets a
flag: the driver finishes the step it is in, writes a checkpoint (``stop_requested()`` makes the
checkpoint condition true) and calls :func:`raise_if_stopping`, which raises :class:`Stopped`; the
CLI prints one line and exits ``128 + signal``. A signal during the run's last step lets the run
finish instead (its checkpoint, the held-out eval after, the ``model/`` export, the summary), so a
stop requested at the end never leaves a finished run without its exported policy. A second signal abandons the step at once (the
previous checkpoint stays the latest). Without ``graceful()`` (library use, tests calling the
driver in-process) nothing changes: ``stop_requested()`` is always False.

A signal is heard from any wait: a wait that is not a step (a rendezvous, a build lock) checks
``stop_requested()`` as it polls and raises ``Stopped(..., waiting=what)`` at the first signal (there
is no step to finish). ``Stopped`` is a ``BaseException``, like ``KeyboardInterrupt``: no ``except
Exception`` fallback (a fast path's "try it, else the slow one") can swallow a stop.

A Python handler runs only when the main thread is back in Python; a process blocked inside C++ (a
gloo collective or store wait, a library's own wait) never gets there. So ``graceful()`` also has
the C-level handler write each signal to a pipe (``signal.set_wakeup_fd``) that a thread of its own
reads: at the second signal, if the process is still there ``HARD_STOP_S`` later, that thread says
so in one line and exits ``128 + signal`` at once. A second signal is never lost.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_requested: list[int] = []  # signals received since graceful() was entered
HARD_STOP_S = 5.0  # after a second signal, the Python handler's stop has this long before the process ends itself


class Stopped(BaseException):
    """The run stopped on a signal; ``step`` is the step the latest checkpoint resumes at (None: unknown).
    ``warm_start``: it stopped before RL began (no checkpoint, nothing to resume). ``waiting``: what the
    process was waiting for when it stopped (a rendezvous, a lock), outside any step."""

    def __init__(self, signum: int, step: int | None, abandoned: bool = False, warm_start: bool = False,
                 waiting: str = ""):
        self.signum, self.step, self.abandoned = signum, step, abandoned
        name = signal.Signals(signum).name
        if waiting:
            where = (f"it was waiting for {waiting}; nothing was lost (a run resumes from its latest checkpoint "
                     f"with --resume, one without a checkpoint starts again)")
        elif warm_start:
            where = "the warm start was abandoned before RL began (nothing cached, no checkpoint); run the command again"
        elif abandoned:
            where = "the step in progress was abandoned; the latest checkpoint is intact; resume with --resume"
        else:
            where = f"checkpoint written at step {step}; resume with --resume"
        super().__init__(f"stopped by {name}: {where}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum, frame) -> None:
    _requested.append(signum)
    if len(_requested) == 1:
        print(f"\nrollyard: {signal.Signals(signum).name} received: finishing this step, then a checkpoint once "
              f"RL has begun (send it again to stop at once)", file=sys.stderr, flush=True)
        return
    raise Stopped(signum, None, abandoned=True)


def _hard_stop(read_fd: int) -> None:
    """Read the signals the C-level handler writes; at the second SIGINT / SIGTERM, give the Python handler
    ``HARD_STOP_S`` to stop the run, then end the process (the main thread is blocked where Python cannot run)."""
    seen: list[int] = []
    noticed = False
    while True:
        try:  # 2 s after a first signal the Python handler has not heard (blocked): say it was received
            ready, _, _ = select.select([read_fd], [], [], 2.0 if seen and not noticed else None)
            if not ready:
                noticed = True
                if not _requested:
                    os.write(2, f"\nrollyard: {signal.Signals(seen[0]).name} received while blocked outside Python: "
                                f"the run stops when that wait ends; send it again to stop at once\n".encode())
                continue
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:  # graceful() closed the pipe
            return
        seen += [b for b in data if b in (signal.SIGINT, signal.SIGTERM)]
        if len(seen) >= 2:
            ready, _, _ = select.select([read_fd], [], [], HARD_STOP_S)
            if ready and not os.read(read_fd, 64):  # graceful() was left: the stop reached Python in time
                return
            name = signal.Signals(seen[1]).name
            with contextlib.suppress(OSError):
                os.write(2, f"\nrollyard: {name} received twice while blocked outside Python: stopping at once (the "
                            f"step in progress is abandoned; the latest checkpoint is intact; resume with "
                            f"--resume)\n".encode())
            os._exit(128 + seen[1])


@contextmanager
def graceful() -> Iterator[None]:
    """Handle SIGINT and SIGTERM as described in the module docstring, for the ``with`` body."""
    previous = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)}
    _requested.clear()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: the Python handlers alone
        old_wakeup = None
    watcher = threading.Thread(target=_hard_stop, args=(read_fd,), daemon=True, name="rollyard-signal-watch")
    watcher.start()
    try:
        yield
    finally:
        if old_wakeup is not None:
            signal.set_wakeup_fd(old_wakeup)
        for s, h in previous.items():
            signal.signal(s, h)
        _requested.clear()
        os.close(write_fd)  # the watcher reads end-of-file and ends
        watcher.join(timeout=5)
        os.close(read_fd)


def stop_requested() -> bool:
    return bool(_requested)


def requested() -> int:
    """The first signal received (SIGTERM when none: a caller asks only after ``stop_requested()``)."""
    return _requested[0] if _requested else signal.SIGTERM


def raise_if_stopping_warm_start() -> None:
    """Called between warm-start (SFT) steps: a signal stops at once, as nothing there can be resumed."""
    if _requested:
        raise Stopped(_requested[0], None, warm_start=True)


def raise_if_stopping(step: int) -> None:
    """Called by a driver after a step's checkpoint: raise Stopped when a signal asked to stop."""
    if _requested:
        raise Stopped(_requested[0], step)
