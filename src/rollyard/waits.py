"""A wait on a Ray actor's answer: bounded, said, and ended by a stop signal (every blocking ``ray.get``).

``ray.get`` with no timeout waits forever for an actor that never answers (stuck in a C++ call, a lock, a
swapped-out process): the run hangs with no word. Every wait rollyard makes on an actor goes through
:func:`wait_for` (or :func:`get`, one answer), which polls ``ray.wait``; a wait on a stream of answers
(the driver's wait for finished groups on the sample queue) polls its own source through the same
:class:`Wait`. Each

- after ``say_after_s`` says once, on stderr, whom it waits for, for what, and for how long at most;
- past ``bound_s`` (sized by the caller to the work: an actor's start-up, a step's scoring) raises
  :class:`NoAnswer`, one line: which actors, what they did not answer, the bound, and the fix;
- at a stop signal (``signals.stop_requested()``) that has gone unanswered for ``STOP_GRACE_S`` raises
  :class:`signals.Stopped` naming the wait: a wait outside any step (an actor's start-up, a group's
  rendezvous). The grace lets a slow answer come, so the run reaches its own stop point, which says more.
  A wait that is part of a step (``stop_grace_s=None``: the step's groups, its reference scoring, its
  weight check) keeps the first signal's promise instead: the step finishes, is checkpointed, and the run
  stops; the second signal stops it at once (its handler raises out of the poll, which returns to Python
  every ``POLL_S``), as anywhere in a step.

An answer that is an error (the actor died) is raised by the caller's ``ray.get`` as before: only silence
is this module's. In a Ray actor ``stop_requested()`` is always False; the bound and the word still hold.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from rollyard import signals

SAY_AFTER_S = 10.0  # a wait this long says what it waits for (an actor's answer usually takes well under a second)
STOP_GRACE_S = 10.0  # a stop signal ends a wait outside a step that lasts this long after it (see the docstring)
POLL_S = 0.5


class NoAnswer(RuntimeError):
    """Ray actors did not answer within the wait's bound (one line: who, what, the bound, the fix)."""


class Wait:
    """One bounded, said, stoppable wait (see the module docstring), polled by its caller: :meth:`tick` once per
    poll while it lasts, naming whom it still waits for; :meth:`heard` when progress came (the bound then counts
    from there: a wait for a stream of answers, such as finished groups, is bounded by its silence)."""

    def __init__(self, what: str, bound_s: float, fix: str, say_after_s: float = SAY_AFTER_S,
                 stop_grace_s: float | None = STOP_GRACE_S):
        self.what, self.bound_s, self.fix, self.say_after_s = what, bound_s, fix, say_after_s
        self.stop_grace_s = stop_grace_s
        self.t0 = self.last = time.monotonic()
        self.said, self.stop_at = False, None
        self.looked = 0.0  # the silence at the last ``every``

    def heard(self) -> None:
        self.last = time.monotonic()
        self.looked = 0.0

    def every(self, period_s: float) -> bool:
        """True once per ``period_s`` of silence (counted from the last ``heard``): time to look closer at whom it
        waits for."""
        silent = time.monotonic() - self.last
        if silent < self.looked + period_s:
            return False
        self.looked = silent
        return True

    def left(self) -> float:
        return self.bound_s - (time.monotonic() - self.last)

    def tick(self, who: str) -> None:
        """Raise :class:`NoAnswer` past the bound, :class:`signals.Stopped` ``stop_grace_s`` after a stop signal
        (None: never, the wait is part of a step); say once what it waits for after ``say_after_s``."""
        now = time.monotonic()
        if now - self.last >= self.bound_s:
            raise NoAnswer(f"{who} did not answer {self.what} within {self.bound_s:.0f} s (an answer was expected "
                           f"within {self.bound_s:.0f} s, none came in {now - self.last:.0f} s); {self.fix}")
        if self.stop_grace_s is not None and signals.stop_requested():
            self.stop_at = now if self.stop_at is None else self.stop_at
            if now - self.stop_at > self.stop_grace_s:
                raise signals.Stopped(signals.requested(), None, waiting=f"{who} to answer {self.what}")
        if not self.said and now - self.t0 > self.say_after_s:
            self.said = True
            print(f"rollyard: waiting for {who} to answer {self.what} ({now - self.t0:.0f} s so far, at most "
                  f"{self.bound_s:.0f} s without an answer)", file=sys.stderr, flush=True)


def wait_for(refs: dict, what: str, bound_s: float, fix: str, *, say_after_s: float = SAY_AFTER_S,
             stop_grace_s: float | None = STOP_GRACE_S, idle: Callable[[], None] | None = None,
             poll_s: float = POLL_S) -> None:
    """Return once every ``ObjectRef`` of ``refs`` (ref -> the name of the actor that answers it) is ready
    (a value or an error); ``what``: what they answer, as in "waiting for rollout-0 to answer <what>";
    ``idle()`` runs between polls (e.g. the driver drains its queue meanwhile). Raises :class:`NoAnswer` past
    ``bound_s`` and :class:`signals.Stopped` on a stop signal (``stop_grace_s``: see the module docstring)."""
    import ray

    pending, wait = list(refs), Wait(what, bound_s, fix, say_after_s, stop_grace_s)
    while pending:
        wait.tick(", ".join(dict.fromkeys(refs[r] for r in pending)))
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, min(poll_s, wait.left())))
        if pending and idle is not None:
            idle()


def get(ref, who: str | list[str], what: str, bound_s: float, fix: str, *, say_after_s: float = SAY_AFTER_S,
        stop_grace_s: float | None = STOP_GRACE_S):
    """``ray.get(ref)`` through :func:`wait_for`: the actor ``who`` answers ``ref``; a list of refs is answered by
    the list of actors ``who`` (in the same order), or all by one."""
    import ray

    refs = ref if isinstance(ref, list) else [ref]
    names = who if isinstance(who, list) else [who] * len(refs)
    wait_for(dict(zip(refs, names)), what, bound_s, fix, say_after_s=say_after_s, stop_grace_s=stop_grace_s)
    return ray.get(ref, timeout=POLL_S + bound_s)  # ready: returns at once (the bound only keeps it one)
