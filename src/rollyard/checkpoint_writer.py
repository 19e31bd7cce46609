"""A checkpoint written in the background, off the step's critical path (``checkpoint_async``, the default).

The step pays for :func:`checkpoint.snapshot` with ``copy=True`` only: the model and optimizer state copied to
CPU memory, the RNG states, the prompt cursor and ledger in state.json's text. :class:`Writer` then runs
:func:`checkpoint.write` on it in one thread of its own, as torch.distributed.checkpoint's ``async_save`` does:
the files, the manifest, their fsync, the atomic rename that publishes the checkpoint, then the pruning to
``keep_checkpoints``. The protocol is the synchronous one, so a crash during the write leaves ``step_N.tmp``
(never read) and the previous checkpoint the latest valid one.

At most one write is in flight. The next checkpoint, a stop signal's checkpoint and the run's end (normal,
stopped or failed) wait for it; every wait is bounded and said (``waits.Wait``: after ``SAY_AFTER_S`` one line
says what it waits for, past ``BOUND_S`` :class:`waits.NoAnswer`, one line). A failed write is never silent:
the wait that collects it raises its :class:`checkpoint.CheckpointWriteError` (the CLI's one line, exit 2).

The thread is a daemon so that a process that must end at once (a second signal, a write hung past its bound)
is not held by it; every ordinary end of a run joins it first (``RunRecord.finish_checkpoint``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollyard import checkpoint, waits

BOUND_S = 1800.0  # a write of a few GB takes seconds on a local disk; past this the disk is hung
SAY_AFTER_S = 5.0


@dataclass
class Done:
    """A finished background write: the checkpoint published (``path``) or the error that stopped it."""

    step: int
    seconds: float  # the write's own wall time, in its thread (files, manifest, fsync, rename, pruning)
    path: Path | None = None
    error: checkpoint.CheckpointWriteError | None = None


class Writer:
    """One checkpoint write at a time in a thread of its own. ``write``: what writes a snapshot (the test hook;
    ``checkpoint.write`` by default). Not thread-safe itself: the driver's thread calls it."""

    def __init__(self, write: Callable[..., Path] = checkpoint.write, bound_s: float = BOUND_S,
                 say_after_s: float = SAY_AFTER_S):
        self._write, self.bound_s, self.say_after_s = write, bound_s, say_after_s
        self._thread: threading.Thread | None = None
        self._done: Done | None = None
        self._run_dir: Path | None = None

    @property
    def in_flight(self) -> bool:
        """A write was submitted and not yet collected (it may have finished meanwhile)."""
        return self._thread is not None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """The write in flight has finished, and failed (not yet collected)."""
        return self.in_flight and not self.running and self._done.error is not None

    def submit(self, run_dir: str | Path, snap: checkpoint.Snapshot, keep: int) -> None:
        """Start writing ``snap`` under ``run_dir``; the previous write must have been collected."""
        if self._thread is not None:
            raise RuntimeError("a checkpoint write is still in flight: wait() for it before submitting the next")
        self._run_dir, self._done = Path(run_dir), Done(snap.step, 0.0)
        self._thread = threading.Thread(target=self._run, args=(self._done, self._run_dir, snap, keep),
                                        name=f"rollyard-checkpoint-{snap.step}", daemon=True)
        self._thread.start()

    def _run(self, done: Done, run_dir: Path, snap: checkpoint.Snapshot, keep: int) -> None:
        t0 = time.monotonic()
        try:
            done.path = self._write(run_dir, snap, keep)
        except checkpoint.CheckpointWriteError as e:
            done.error = e
        except Exception as e:  # noqa: BLE001 - not a disk error (a bug, a library's own): one line, never lost
            done.error = checkpoint.write_failed(run_dir, snap.step, e)
        finally:
            done.seconds = time.monotonic() - t0
            if done.path is None and done.error is None:  # the thread was ended by something else
                done.error = checkpoint.write_failed(run_dir, snap.step, RuntimeError("the write did not finish"))

    def poll(self) -> Done | None:
        """The write in flight if it has finished (collected: the writer is free again), else None; never waits."""
        if self._thread is None or self._thread.is_alive():
            return None
        return self._collect()

    def wait(self) -> Done | None:
        """Wait for the write in flight (None: there is none) and collect it. Bounded and said (module docstring);
        a second stop signal ends it at once (its handler raises out of the join, which polls). A wait that ends
        so abandons the write: its ``step_N.tmp`` is never read, the previous checkpoint stays the latest."""
        if self._thread is None:
            return None
        step = self._done.step
        wait = waits.Wait(f"checkpoint step {step} (its files written, fsynced and renamed in place)", self.bound_s,
                          f"the disk under {self._run_dir} is hung or far too slow: check it (df, dmesg), then resume "
                          f"from the previous checkpoint with --resume {self._run_dir}", self.say_after_s,
                          stop_grace_s=None)  # part of a step: a first signal's checkpoint is what it waits for
        try:
            while self._thread.is_alive():
                wait.tick("the checkpoint writer thread")
                self._thread.join(timeout=max(0.0, min(waits.POLL_S, wait.left())))
        except BaseException:  # past the bound, or a second signal: the run ends without this write (abandoned:
            self._thread = self._done = None  # no later wait is held by it, nor the process: it is a daemon)
            raise
        return self._collect()

    def _collect(self) -> Done:
        self._thread.join()  # finished: returns at once
        done, self._thread, self._done = self._done, None, None
        return done
