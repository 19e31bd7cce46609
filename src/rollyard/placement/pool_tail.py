"""Tail batching (RollPacker) on the Ray rollout pool: the driver's short and long rounds.

The rule is ``rollout/tail.py``'s, applied across the pool rather than per worker. A short round
hands out ``ceil(P x overprovision)`` fresh prompts with ``n + extra_samples`` samples each; a
worker completes a prompt at ``n`` finished samples and aborts the rest of its group; once ``P``
prompts of the round are complete (counted by the driver, whichever workers finished them) the
round's unfinished prompts are cut: the driver asks their workers to abort them and queues them,
oldest first, for a long round. A long round (the queue holds ``P`` prompts, or every
``long_every`` rounds when it is not empty) hands out the first ``P`` queued prompts with ``n``
samples each and runs them to the end.

Why across the pool: a round's prompts are spread over the workers by load, so no worker sees a
round whole; a per-worker cut would stop at "P / workers" prompts on each and defer a worker's
short prompts because another worker was slow. The driver already receives every group in arrival
order (the point where "P complete" is known), and the ledger already knows which worker holds
each prompt (where the cut must go).

Partial samples of a cut prompt are dropped and the prompt restarts whole in its long round, as
colocated: its samples then come from weights admitted for the long round's step, so the
staleness bound (admission and consumption, ``pool.py``) applies to a deferred prompt as to any
other, and a long-round group that arrives older than the bound is dropped and re-rolled whole
(``tail/rerolled``). The decoded-then-dropped tokens are counted as ``tail/wasted_tokens``.

``PoolTail`` is the bookkeeping only (no Ray): which kind of round comes next, which prompts it
takes, when a short round closes, what a checkpoint carries. Ledger states: a queued long-round
prompt is ``deferred``; handed out again it is ``in_flight``.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import replace

from rollyard.rollout.tail import is_long_round
from rollyard.types import Request

STATE_KEY = "tail_pool"  # TrainState.extra key (colocated's scheduler writes "tail")


class PoolTail:
    def __init__(self, prompts: int, n: int, overprovision: float = 1.25, extra_samples: int = 2,
                 long_every: int = 0):
        self.P, self.n = prompts, n
        self.overprovision, self.extra_samples, self.long_every = overprovision, extra_samples, long_every
        self.long: deque[str] = deque()  # deferred prompt ids, oldest first
        self.kind: dict[int, str] = {}  # round -> "short" | "long"
        self.done: dict[int, int] = {}  # open short round -> prompts complete so far (it closes at P)
        self.rounds = 0  # rounds issued (long_every counts these)
        self.next_round = 0  # the number the next round gets (carried across a resume)
        self.trained = {"short": 0, "long": 0}  # groups trained, by the kind of their round
        self.step = Counter()  # this step's counters (``metrics`` resets them)

    # -- rounds --------------------------------------------------------------------------------------

    def next_kind(self) -> str:
        return "long" if is_long_round(len(self.long), self.P, self.rounds, self.long_every) else "short"

    def short_size(self) -> int:
        return math.ceil(self.P * self.overprovision)

    def take_long(self) -> list[str]:
        """The queued prompts a long round takes (the first P)."""
        return [self.long.popleft() for _ in range(min(self.P, len(self.long)))]

    def short_form(self, q: Request) -> Request:
        return replace(q, n=self.n + self.extra_samples)

    def long_form(self, q: Request) -> Request:
        return replace(q, n=self.n)

    def issued(self, round_: int, kind: str) -> None:
        self.kind[round_] = kind
        if kind == "short":
            self.done[round_] = 0
        self.rounds += 1
        self.next_round = max(self.next_round, round_ + 1)

    def complete(self, round_: int) -> bool:
        """A prompt of ``round_`` completed; True when that closes a short round (cut the rest now)."""
        if round_ not in self.done:
            return False
        self.done[round_] += 1
        if self.done[round_] < self.P:
            return False
        del self.done[round_]
        return True

    def undo(self, round_: int) -> None:
        """A group of ``round_`` was dropped as stale and its prompt re-rolled: an open round counts it again
        when it comes back; a long round's (a deferred prompt's) drop is counted as ``tail/rerolled``."""
        if round_ in self.done:
            self.done[round_] -= 1
        if self.kind.get(round_) == "long":
            self.step["rerolled"] += 1

    def defer(self, ids: list[str]) -> None:
        self.long.extend(ids)
        self.step["deferred"] += len(ids)

    def took(self, rounds: list[int]) -> None:
        """The trainer took one group from each of these rounds."""
        kinds = Counter(self.kind.get(r, "short") for r in rounds)
        self.trained["short"] += kinds["short"]
        self.trained["long"] += kinds["long"]
        self.step["long_groups"] += kinds["long"]
        self.step["groups"] += len(rounds)

    def metrics(self, wasted_tokens: int) -> dict[str, float]:
        s, self.step = self.step, Counter()
        return {"tail/long_round": s["long_groups"] / max(s["groups"], 1), "tail/deferred": float(s["deferred"]),
                "tail/queue": float(len(self.long)), "tail/wasted_tokens": float(wasted_tokens),
                "tail/rerolled": float(s["rerolled"]),
                "tail/long_share": self.trained["long"] / max(self.trained["short"] + self.trained["long"], 1)}

    # -- checkpoint ----------------------------------------------------------------------------------

    def state(self, round_of: dict[str, int], buffered: Counter) -> dict:
        """JSON-able. ``round_of``: each live prompt outside the queue -> its round (a resumed run hands it out
        again in that round); ``buffered``: per round, groups received but not trained (they are sampled
        again after a resume, so an open round's count leaves them out)."""
        live = set(round_of.values()) | set(self.done)  # the rounds a resumed run still hands out or counts
        return {"long": list(self.long), "kind": {str(r): k for r, k in self.kind.items() if r in live},
                "done": {str(r): c - buffered[r] for r, c in self.done.items()}, "rounds": self.rounds,
                "next_round": self.next_round, "trained": dict(self.trained),
                "round_of": dict(round_of)}

    def restore(self, state: dict | None) -> dict[str, int]:
        """Load ``state``; returns its ``round_of``."""
        if not state:
            return {}
        self.long = deque(state["long"])
        self.kind = {int(r): k for r, k in state["kind"].items()}
        self.done = {int(r): int(c) for r, c in state["done"].items()}
        self.rounds, self.next_round = int(state["rounds"]), int(state["next_round"])
        self.trained = {k: int(v) for k, v in state["trained"].items()}
        return {i: int(r) for i, r in state["round_of"].items()}
