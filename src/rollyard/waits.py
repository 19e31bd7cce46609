"""A wait on a Ray actor's answer: bounded, said, and ended by a stop signal (every blocking ``ray.get``).

``ray.get`` with no timeout waits forever for an actor that never answers (stuck in a C++ call, a lock, a
swapped-out process): the run hangs with no word. Every wait rollyard makes on an actor goes through
:func:`wait_for` (or :func:`get`, one answer), which polls ``ray.wait`` and

- after ``say_after_s`` says once, on stderr, whom it waits for, for what, and for how long at most;
- past ``bound_s`` (sized by the caller to the work: an actor's start-up, a step's scoring) raises
  :class:`NoAnswer`, one line: which actors, what they did not answer, the bound, and the fix;
- at a stop signal (``signals.stop_requested()``) that has gone unanswered for ``STOP_GRACE_S`` raises
  :class:`signals.Stopped` naming the wait. The grace lets a wait inside a step end by itself, so the step
  finishes and writes its checkpoint (the first signal's promise) when the answer was only slow.

An answer that is an error (the actor died) is raised by the caller's ``ray.get`` as before: only silence
is this module's. In a Ray actor ``stop_requested()`` is always False; the bound and the word still hold.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from rollyard import signals

SAY_AFTER_S = 10.0  # a wait this long says what it waits for (an actor's answer usually takes well under a second)
STOP_GRACE_S = 10.0  # a stop signal ends a wait that lasts this long after it (a slow answer lets the step finish)
POLL_S = 0.5


class NoAnswer(RuntimeError):
    """Ray actors did not answer within the wait's bound (one line: who, what, the bound, the fix)."""


def wait_for(refs: dict, what: str, bound_s: float, fix: str, *, say_after_s: float = SAY_AFTER_S,
             idle: Callable[[], None] | None = None, poll_s: float = POLL_S) -> None:
    """Return once every ``ObjectRef`` of ``refs`` (ref -> the name of the actor that answers it) is ready
    (a value or an error); ``what``: what they answer, as in "waiting for rollout-0 to answer <what>";
    ``idle()`` runs between polls (e.g. the driver drains its queue meanwhile). Raises :class:`NoAnswer` past
    ``bound_s`` and :class:`signals.Stopped` on a stop signal (see the module docstring)."""
    import ray

    pending = list(refs)
    t0, said, stop_at = time.monotonic(), False, None
    while pending:
        waited = time.monotonic() - t0
        left = bound_s - waited
        if left <= 0:
            who = ", ".join(dict.fromkeys(refs[r] for r in pending))
            raise NoAnswer(f"{who} did not answer {what} within {bound_s:.0f} s (Ray actor: an answer was expected "
                           f"within {bound_s:.0f} s, none came in {waited:.0f} s); {fix}")
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(poll_s, left))
        if not pending:
            return
        if signals.stop_requested():
            stop_at = time.monotonic() if stop_at is None else stop_at
            if time.monotonic() - stop_at > STOP_GRACE_S:
                who = ", ".join(dict.fromkeys(refs[r] for r in pending))
                raise signals.Stopped(signals.requested(), None, waiting=f"{who} to answer {what}")
        if not said and time.monotonic() - t0 > say_after_s:
            said = True
            who = ", ".join(dict.fromkeys(refs[r] for r in pending))
            print(f"rollyard: waiting for {who} to answer {what} ({time.monotonic() - t0:.0f} s so far, at most "
                  f"{bound_s:.0f} s)", file=sys.stderr, flush=True)
        if idle is not None:
            idle()


def get(ref, who: str | list[str], what: str, bound_s: float, fix: str, *, say_after_s: float = SAY_AFTER_S):
    """``ray.get(ref)`` through :func:`wait_for`: the actor ``who`` answers ``ref``; a list of refs is answered by
    the list of actors ``who`` (in the same order), or all by one."""
    import ray

    refs = ref if isinstance(ref, list) else [ref]
    names = who if isinstance(who, list) else [who] * len(refs)
    wait_for(dict(zip(refs, names)), what, bound_s, fix, say_after_s=say_after_s)
    return ray.get(ref, timeout=POLL_S + bound_s)  # ready: returns at once (the bound only keeps it one)
