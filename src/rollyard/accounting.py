"""Prompt accounting: every handed-out prompt id is in exactly one state.

```
 stream ──► queued ──hand_out──► in_flight ──finished──► deferred ──trained──► trained
              ▲                      │                       │
              └──────requeue─────────┴───────────────────────┘     (any live state) ──► dead
```

- ``queued``: taken from the stream (or requeued), waiting to be handed to a rollout worker;
- ``in_flight``: on a worker (its inbox or its engine);
- ``deferred``: sampled, waiting in the trainer's buffer for a later step (or, with tail batching,
  cut from a short round and waiting for a long round: ``defer``);
- ``trained``: in an optimizer step (final);
- ``dead``: dead-lettered with a reason (final).

Every transition names the states it may leave; anything else (a prompt trained twice, a requeue
of a trained prompt) raises, so a bookkeeping bug stops the run instead of skewing the data. The
ledger keeps each live prompt's ``Request``: a requeue re-issues exactly the same request, and a
checkpoint carries the live ones (``state_dict``) so a resumed run requeues them: none lost, none
trained twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict

from rollyard.types import Request

STATES = ("queued", "in_flight", "deferred", "trained", "dead")
LIVE = ("queued", "in_flight", "deferred")


class PromptLedger:
    def __init__(self) -> None:
        self.state: dict[str, str] = {}
        self.worker: dict[str, str] = {}  # in_flight id -> worker
        self.requests: dict[str, Request] = {}  # live id -> its request (insertion order = queue order)
        self.requeues = 0

    def _move(self, ids: Iterable[str], to: str, allowed: tuple[str, ...]) -> None:
        for i in ids:
            now = self.state.get(i)
            if now not in allowed:
                raise RuntimeError(f"prompt accounting: {i!r} cannot go {now} -> {to} (allowed from "
                                   f"{', '.join(map(str, allowed))}); this is a bug in the placement driver")
            self.state[i] = to
            if to != "in_flight":
                self.worker.pop(i, None)
            if to in ("trained", "dead"):
                self.requests.pop(i, None)

    def add(self, requests: list[Request]) -> None:
        """New prompts from the stream: queued."""
        for r in requests:
            self._move([r.id], "queued", (None,))
            self.requests[r.id] = r

    def hand_out(self, ids: list[str], worker: str) -> None:
        self._move(ids, "in_flight", ("queued",))
        self.worker.update(dict.fromkeys(ids, worker))

    def finished(self, ids: list[str]) -> None:
        self._move(ids, "deferred", ("in_flight",))

    def defer(self, ids: list[str]) -> None:
        """Tail batching: cut from a short round (or read back from a checkpoint) and held for a long round."""
        self._move(ids, "deferred", ("queued", "in_flight"))

    def trained(self, ids: list[str]) -> None:
        self._move(ids, "trained", ("in_flight", "deferred"))

    def dead(self, ids: list[str]) -> None:
        self._move(ids, "dead", LIVE)

    def requeue(self, ids: list[str]) -> list[Request]:
        """Back to queued, at the end of the queue; returns their requests (to hand out again)."""
        self._move(ids, "queued", ("in_flight", "deferred"))
        self.requeues += len(ids)
        for i in ids:  # move to the end: the queue is the dict's insertion order
            self.requests[i] = self.requests.pop(i)
        return [self.requests[i] for i in ids]

    def queued(self, k: int | None = None) -> list[Request]:
        """The first ``k`` queued requests, oldest first."""
        out = [r for i, r in self.requests.items() if self.state[i] == "queued"]
        return out if k is None else out[:k]

    def on_worker(self, worker: str) -> list[str]:
        return [i for i, w in self.worker.items() if w == worker]

    def ids(self, state: str) -> list[str]:
        return [i for i, s in self.state.items() if s == state]

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        for s in self.state.values():
            out[s] += 1
        return out

    # -- checkpoints: live prompts are carried as requests and requeued on resume ----------------

    def state_dict(self) -> dict:
        return {"trained": self.ids("trained"), "dead": self.ids("dead"), "requeues": self.requeues,
                "live": [asdict(r) for r in self.requests.values()]}

    def load_state_dict(self, d: dict) -> None:
        self.__init__()
        self.state.update(dict.fromkeys(d.get("trained", []), "trained"))
        self.state.update(dict.fromkeys(d.get("dead", []), "dead"))
        self.requeues = int(d.get("requeues", 0))
        for r in d.get("live", []):
            req = Request(**r)
            self.state[req.id] = "queued"
            self.requests[req.id] = req
