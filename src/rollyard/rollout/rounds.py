"""Rounds: the one round book every rollout side drives, and one synchronous round run in-process.

``RoundBook`` decides, over the prompt ledger, which prompts a round hands out and with how many samples
each, which round a prompt belongs to, when a round closes (``arrived``: the one close rule), what it cuts
and defers, what the trainer took, the ``tail/*`` metrics (``metrics``) and what a checkpoint keeps (one
``TrainState.extra`` key, written by ``save``). A policy answers the few questions that differ
(``rollout/plain.py``, ``rollout/tail.py``: RollPacker's short and long rounds); the book is built once
from the config (``make_book``) and driven by both rollout sides (``placement/side.py``): the in-process
engine (``run_round``, ``placement/colocated.py``) and the Ray pool (``placement/pool.py``). A rollout
side never branches on the scheduler.

``run_round`` issues a round and runs it on an engine in this process. The engine completes the groups
(``submit(keep=n)``: a group's first ``n`` finished samples, the others aborted at once); every finished
sample goes to the reward pool while decoding goes on (or, without one, the step scores the round
after), and every *complete, scored* group to ``on_group`` (the streaming trainer accumulates its
gradient there). Each complete group is reported to the book (``arrived``); when that closes the round
(tail: its P-th complete prompt), the prompts it cuts are aborted and wait, deferred, for a long round.
Under the plain policy nothing is cut: everything runs to the end.

Aborted samples are dropped, partial tokens included (see rollout/tail.py for why); their tokens
are counted in ``wasted_tokens``.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import count

from rollyard.config import RunConfig
from rollyard.rollout.plain import PlainPolicy
from rollyard.rollout.scheduler import PromptFeed, to_requests
from rollyard.rollout.tail import TailPolicy
from rollyard.tasks.base import Prompt
from rollyard.types import Request, Sample

STATE_KEY = "rounds"  # TrainState.extra: the book's state (a policy that keeps none beyond the ledger writes none)
LEGACY_KEYS = ("tail_pool", "tail")  # written before the book (the Ray pool's tail, colocated's): still resumed
MEASURED = ("bubble", "decode_steps", "train_in_round_s")  # tail/* measured by the in-process round only
MAX_TOP_UPS = 10  # draws to refill a round whose prompts were dead-lettered
Send = Callable[[list[Request], list[dict]], None]  # a round's requests (to hand out) and dead-letter records


@dataclass
class Round:
    """What ``run_round`` returns: one optimizer step's worth of samples."""

    kind: str  # "plain" | "short" | "long"
    requests: list[Request]  # submitted (accepted) this round
    complete: list[Request]  # of those, the ones whose group is in ``samples`` (the rest are ``deferred``)
    samples: list[Sample]  # n per complete prompt (rewards set when the round scored them), in hand-out order
    deferred: list[Request] = field(default_factory=list)  # cut this round, queued for a long round
    dead: list[dict] = field(default_factory=list)  # dead-letter records (with reasons)
    bubble: float = 0.0  # share of rollout slot-time idle (see ``bubble``)
    wasted_tokens: int = 0  # tokens of aborted or surplus samples (decoded, never trained on)
    decode_steps: int = 0  # the round's length in decode steps (what a memory-bound GPU round costs)


def decode_steps(lengths: list[int], slots: int) -> int:
    """Decode steps a round of these sample lengths takes at least: its longest sample, or full slots."""
    total = sum(lengths)
    return max(max(lengths), math.ceil(total / slots)) if total and slots >= 1 else 0


def bubble(lengths: list[int], slots: int) -> float:
    """Share of slot-steps idle while a round decodes ``lengths`` (one entry per sample, aborted ones too).

    A round of ``sum(lengths)`` token-steps over ``slots`` slots lasts at least ``max(lengths)`` decode
    steps (its longest sample) and at least ``sum / slots`` (full slots). Idle share =
    ``1 - sum / (slots * steps)``. Exact when every sample holds a slot from the first step
    (slots >= samples); otherwise a lower bound on the idle share.
    """
    total = sum(lengths)
    if total == 0 or slots < 1:
        return 0.0
    return 1.0 - total / (slots * decode_steps(lengths, slots))


class RoundBook:
    """The rounds of a run over its prompt feed and ledger, under one policy (module docstring).

    ``issue`` a round (its requests go to the caller's ``send``, which hands them out); ``arrived``: a prompt's
    group is complete, returning what its round cuts when that closes it (deferred: ledger ``deferred``,
    queued oldest first for a long round; the caller aborts them); ``took``: the trainer took these groups;
    ``measure`` and ``metrics`` for the step's row, ``save`` and ``restore`` for the checkpoint. The ledger
    holds every request; the book holds ids and round numbers.
    """

    def __init__(self, feed: PromptFeed, policy: PlainPolicy | TailPolicy, refill: bool = False):
        self.feed, self.ledger, self.policy = feed, feed.ledger, policy
        self.refill = refill  # top a round up when prompts are dead-lettered (the Ray pool: async waits for P groups)
        self.meta: dict[str, tuple[int, int]] = {}  # live request id -> (round, hand-out order)
        self.long: deque[str] = deque()  # deferred request ids, oldest first
        self.kind: dict[int, str] = {}  # round -> its kind
        self.done: dict[int, int] = {}  # open round that closes early -> prompts complete so far (it closes at P)
        self.rounds = 0  # rounds issued (the policy's long_every counts these)
        self.next_round = feed.last_round + 1  # the number the next round gets (carried across a resume)
        self.trained = {"short": 0, "long": 0}  # groups trained, by the kind of their round
        self.step: Counter = Counter()  # this step's counters (``metrics`` resets them)
        self._order = count()

    # -- rounds ----------------------------------------------------------------------------------------

    def issue(self, round_: int, send: Send) -> str:
        """Issue round ``round_`` (a long round takes the queue's first P); returns its kind. Its requests go to
        ``send(requests, dead-letter records)``, which hands them out (they leave ``queued``)."""
        kind = self.policy.kind(len(self.long), self.rounds)
        self.kind[round_] = kind
        if self.policy.closes_early(kind):
            self.done[round_] = 0
        self.rounds += 1
        self.next_round = max(self.next_round, round_ + 1)
        if kind != "long":
            self.draw(round_, self.policy.size(kind), send)
            return kind
        ids = [self.long.popleft() for _ in range(min(self.policy.P, len(self.long)))]
        requests = [self._form(q, kind) for q in self.ledger.requeue(ids)]
        self._place(requests, round_)
        send(requests, [])
        return kind

    def draw(self, round_: int, k: int, send: Send) -> None:
        """``k`` prompts for ``round_`` from the feed (requeued ones first) in the round's form, to ``send`` with
        the records of those dead-lettered; with ``refill`` these are replaced (each draw sent before the next:
        a prompt drawn stays ``queued`` until it is handed out), so the round stays full."""
        kind = self.kind.get(round_, "plain")
        for _ in range(MAX_TOP_UPS if self.refill else 1):
            got, lost = self.feed.take(k, round_)
            got = [self._form(q, kind) for q in got]
            self._place(got, round_)
            send(got, lost)
            k -= len(got)
            if k <= 0 or not self.refill:
                return
        raise RuntimeError(f"round {round_}: {MAX_TOP_UPS} draws from the prompt set left {k} prompts short, every "
                           f"one dead-lettered; see the run's dead letters for why")

    def _form(self, q: Request, kind: str) -> Request:
        """``q`` with the samples a round of ``kind`` asks for, recorded in the ledger (a requeue re-issues it)."""
        n = self.policy.samples(kind)
        if q.n != n:
            self.ledger.requests[q.id] = replace(q, n=n)
        return self.ledger.requests.get(q.id, q)

    def _place(self, requests: list[Request], round_: int) -> None:
        for q in requests:
            self.meta.setdefault(q.id, (round_, next(self._order)))

    def round_of(self, rid: str) -> int:
        return self.meta[rid][0]

    def round_ids(self, round_: int) -> list[str]:
        """The live prompts of ``round_`` (not cut, not dead-lettered)."""
        return [i for i, (b, _) in self.meta.items() if b == round_ and self.ledger.state.get(i) != "dead"]

    def order(self, rid: str) -> int:
        return self.meta[rid][1]

    # -- arrivals, cuts, drops ---------------------------------------------------------------------------

    def arrived(self, rid: str) -> list[str]:
        """``rid``'s group is complete (ledger ``deferred``: it waits for the trainer). The one close rule: returns
        the prompts its round cuts if that closed it (a round that closes early, at its P-th complete prompt): its
        unfinished ones, still ``queued`` or ``in_flight``, deferred now (``defer``); the caller aborts them. Else []."""
        self.ledger.finished([rid])
        round_ = self.meta[rid][0]
        if round_ not in self.done:
            return []
        self.done[round_] += 1
        if self.done[round_] < self.policy.P:
            return []
        del self.done[round_]
        cut = [i for i, (b, _) in self.meta.items() if b == round_ and self.ledger.state.get(i) in ("queued", "in_flight")]
        self.defer(cut)
        return cut

    def defer(self, ids: list[str]) -> None:
        """Cut from their round: ledger ``deferred``, queued oldest first for a long round."""
        self.ledger.defer(ids)
        self.long.extend(ids)
        for i in ids:
            self.meta.pop(i, None)
        self.step["deferred"] += len(ids)

    def close(self, round_: int) -> None:
        """A round run whole in one go (in-process) that never reached its P-th arrival (refused prompts): it counts
        no more arrivals."""
        self.done.pop(round_, None)

    def was_cut(self, rid: str) -> bool:
        """``rid`` waits for a long round (a group of it that arrives now was decoded and dropped)."""
        return rid in self.long

    def rejected(self, rid: str) -> int | None:
        """The engine refused ``rid``: dead (the caller dead-letters it). Returns the round to top up with one
        fresh prompt (a round still filling: plain, or short and open), else None."""
        self.ledger.dead([rid])
        if rid in self.long:  # cut before the news came
            self.long.remove(rid)
            return None
        round_ = self.meta.pop(rid)[0]
        return round_ if self.kind.get(round_, "plain") == "plain" or round_ in self.done else None

    def dropped(self, rid: str) -> None:
        """``rid``'s group was dropped as stale and its prompt re-rolled: an open round counts it again when it
        comes back; a long round's (a deferred prompt's) drop is counted as ``tail/rerolled``."""
        round_ = self.meta[rid][0]
        if round_ in self.done:
            self.done[round_] -= 1
        if self.kind.get(round_) == "long":
            self.step["rerolled"] += 1

    def took(self, ids: list[str]) -> None:
        """The trainer took these prompts' groups."""
        for i in ids:
            kind = self.kind.get(self.meta.pop(i)[0], "plain")
            if kind in self.trained:
                self.trained[kind] += 1
                self.step[f"{kind}_groups"] += 1

    # -- the step's row, the checkpoint ----------------------------------------------------------------

    def measure(self, **values: float) -> None:
        """Add a rollout side's measures of this step's rounds to its row (``metrics``: ``tail/<key>``):
        ``wasted_tokens`` (decoded, never trained on) from every side; ``bubble``, ``decode_steps`` and
        ``train_in_round_s`` from the in-process round (``run_round``, the streaming trainer)."""
        self.step.update(values)

    def metrics(self) -> dict[str, float]:
        """This step's ``tail/*`` counters (reset); none under the plain policy. ``tail/long_round``: the share of
        the step's groups that come from long rounds (in-process, one round a step: 1 for a long round, else 0)."""
        s, self.step = self.step, Counter()
        if self.policy.name == "plain":
            return {}
        groups = s["short_groups"] + s["long_groups"]
        return {"tail/long_round": s["long_groups"] / max(groups, 1), "tail/deferred": float(s["deferred"]),
                "tail/queue": float(len(self.long)), "tail/wasted_tokens": float(s["wasted_tokens"]),
                "tail/rerolled": float(s["rerolled"]), "tail/long_share": self.long_share(),
                **{f"tail/{k}": float(s[k]) for k in MEASURED if k in s}}

    def long_share(self) -> float:
        return self.trained["long"] / max(self.trained["short"] + self.trained["long"], 1)

    def save(self, extra: dict, buffered: list[str] = ()) -> None:
        """Write the book's state into a checkpoint's ``extra`` (``STATE_KEY``; nothing under the plain policy): the
        one writer, called by a rollout side's ``checkpoint`` when a checkpoint is written (``placement/side.py``)."""
        if (state := self.state(buffered)) is not None:
            extra[STATE_KEY] = state

    def state(self, buffered: list[str] = ()) -> dict | None:
        """JSON-able, for ``TrainState.extra[STATE_KEY]``; None where the ledger says it all (plain). Carries
        the deferred queue, each other live prompt's round (a resumed run hands it out again in that round) and
        each open round's complete count less its groups in ``buffered`` (received, not trained: a resumed run
        samples them again)."""
        if self.policy.name == "plain":
            return None
        waiting = set(self.long)
        round_of = {i: self.meta[i][0] for i in self.ledger.requests if i not in waiting and i in self.meta}
        held = Counter(self.meta[i][0] for i in buffered if i in self.meta)
        live = set(round_of.values()) | set(self.done)
        return {"long": list(self.long), "kind": {str(r): k for r, k in self.kind.items() if r in live},
                "done": {str(r): c - held[r] for r, c in self.done.items()}, "rounds": self.rounds,
                "next_round": self.next_round, "trained": dict(self.trained), "round_of": round_of}

    def restore(self, extra: dict, step: int) -> None:
        """Load the state a checkpoint's ``extra`` carries (``STATE_KEY``, or a key written before the book:
        ``LEGACY_KEYS``, dropped from ``extra``). The ledger's live prompts that wait for a long round become
        ``deferred`` again; the other live ones (``queued``: the caller hands them out again) keep their round,
        or without one belong to round ``step``."""
        state = extra.get(STATE_KEY) or extra.pop("tail_pool", None)
        old = extra.pop("tail", None)
        state = state or (self._from_colocated(old) if old else None)
        round_of = self._load(state) if state else {}
        for q in self.ledger.queued():
            self.meta.setdefault(q.id, (round_of.get(q.id, step), next(self._order)))

    def _load(self, state: dict) -> dict[str, int]:
        self.long = deque(state["long"])
        self.kind = {int(r): k for r, k in state["kind"].items()}
        self.done = {int(r): int(c) for r, c in state["done"].items()}
        self.rounds = int(state["rounds"])
        self.next_round = max(self.next_round, int(state["next_round"]))
        self.trained = {k: int(v) for k, v in state["trained"].items()}
        live = {q.id for q in self.ledger.queued()}
        self.ledger.defer([i for i in self.long if i in live])
        self.long = deque(i for i in self.long if self.ledger.state.get(i) == "deferred")
        return {i: int(r) for i, r in state["round_of"].items()}

    def _from_colocated(self, old: dict) -> dict:
        """The in-process tail scheduler's state (before the book): its queue held prompts outside the ledger;
        they enter it now (queued; ``restore`` defers them), each under an id of its own; it counted trained
        samples (``n`` per complete group), the book counts groups."""
        f, queue = self.feed, [Prompt(**p) for p in old["queue"]]
        ids = []
        for i, p in enumerate(queue):
            requests, _ = to_requests([p], f.tokenizer, f.n, f.max_new_tokens, f.context, suffix=f"@q{old['rounds']}.{i}",
                                      max_prompt=f.max_prompt)
            self.ledger.add(requests)  # a prompt that no longer fits the context is left out
            ids += [q.id for q in requests]
        return {"long": ids, "kind": {}, "done": {}, "rounds": old["rounds"], "next_round": 0,  # it counted samples:
                "trained": {k: int(v) // f.n for k, v in old["trained"].items()}, "round_of": {}}  # n per group


def make_book(cfg: RunConfig, feed: PromptFeed, refill: bool = False) -> RoundBook:
    """The run's round book: ``rollout.scheduler``'s policy (``tail.*`` for tail) over ``feed``."""
    r, t = cfg.rollout, cfg.tail
    policy = (TailPolicy(r.prompts_per_step, r.samples_per_prompt, t.overprovision, t.extra_samples, t.long_every)
              if r.scheduler == "tail" else PlainPolicy(r.prompts_per_step, r.samples_per_prompt))
    return RoundBook(feed, policy, refill)


def _issue(book: RoundBook, engine, round_: int, worker: str) -> tuple[str, list[Request], list[dict]]:
    """Issue round ``round_`` (handed out to ``worker`` in the ledger) and submit it to ``engine``, which completes
    each group at its first n samples. Returns ``(kind, live, dead)``: the round's kind, the requests the engine
    accepted, and the dead letters (the book's and the engine's rejections)."""
    requests: list[Request] = []
    dead: list[dict] = []

    def send(got: list[Request], lost: list[dict]) -> None:
        book.ledger.hand_out([q.id for q in got], worker)
        requests.extend(got)
        dead.extend(lost)

    kind = book.issue(round_, send)
    rejected = engine.submit(requests, keep=book.policy.n)
    for q, why in rejected:
        book.rejected(q.id)
        dead.append({"source": q.id, "reason": why})
    gone = {r.id for r, _ in rejected}
    return kind, [q for q in requests if q.id not in gone], dead


def _measure(book: RoundBook, engine, live: list[Request], groups: dict[str, list[Sample]], lengths: list[int]
             ) -> tuple[float, int, int]:
    """The round's waste: the decoded tokens no kept group holds, the batch's idle slots (the bubble) and its decode
    steps, over every sample's decoded length; recorded in the book. Returns ``(bubble, wasted, decode_steps)``."""
    wasted = sum(lengths) - sum(len(s.completion_ids) for g in groups.values() for s in g)
    slots = min(engine.max_concurrent, sum(q.n for q in live))
    idle, steps = bubble(lengths, slots), decode_steps(lengths, slots)
    book.measure(wasted_tokens=wasted, bubble=idle, decode_steps=steps)
    return idle, wasted, steps


def run_round(book: RoundBook, engine, rewards, round_: int, on_group: Callable[[list[Sample]], None] | None = None,
              worker: str = "local") -> Round:
    """Issue round ``round_`` from ``book`` and run it on ``engine`` in this process (the module docstring).
    ``rewards``: the reward pool's streaming surface (``submit`` / ``poll`` / ``results``), each complete group
    handed to ``on_group`` once scored; or None: the samples come back unscored (the step scores them after).
    ``Round.requests`` are the accepted ones; the complete ones are taken (``book.took``) and wait in the ledger
    (``deferred``) until trained. The round's measures go to the book (``book.measure``)."""
    kind, live, dead = _issue(book, engine, round_, worker)
    n = book.policy.n
    finished: dict[str, list[Sample]] = defaultdict(list)  # finished samples per request (the engine keeps n)
    scored: dict[str, list[Sample]] = defaultdict(list)
    groups: dict[str, list[Sample]] = {}  # complete (and, with rewards, scored) groups, in completion order
    cut: list[str] = []  # the prompts the book cut when the round closed
    lengths: list[int] = []  # every sample's decoded length, aborted and surplus ones too (the bubble)

    def collect(samples: list[Sample]) -> None:  # scored samples; a group once all n are scored
        for s in samples:
            rid = s.request_id
            scored[rid].append(s)
            if rid not in cut and len(scored[rid]) == n and len(finished[rid]) == n:
                groups[rid] = sorted(scored.pop(rid), key=lambda x: int(x.id.rsplit("#", 1)[1]))
                if on_group is not None:
                    on_group(groups[rid])

    while not engine.idle:  # the engine's own loop, as a rollout actor drives it (submit checked the weights)
        for s in engine.step():
            lengths.append(len(s.completion_ids))
            rid = s.request_id
            if rid in cut:  # finished in the decode step that closed its round
                continue
            finished[rid].append(s)
            if len(finished[rid]) == n:
                closes = book.arrived(rid)  # the one close rule (tail: the round's P-th complete prompt)
                lengths += [len(x.completion_ids) for x in engine.abort(closes)] if closes else []
                cut += closes
                if rewards is None:
                    groups[rid] = sorted(finished[rid], key=lambda x: int(x.id.rsplit("#", 1)[1]))
            if rewards is not None:
                rewards.submit(s)  # streaming rewards: scored while decoding goes on
        if rewards is not None:
            collect(rewards.poll())
    if rewards is not None:
        collect(list(rewards.results()))  # the last groups' rewards (and the cut prompts' strays)
    lengths += [len(x.completion_ids) for x in engine.surplus()]  # the keep rule's: decoded, dropped
    book.close(round_)
    book.took(list(groups))
    idle, wasted, steps = _measure(book, engine, live, groups, lengths)
    complete = [q for q in live if q.id in groups]  # hand-out order
    return Round(kind, live, complete, [s for q in complete for s in groups[q.id]],
                 [book.ledger.requests[i] for i in cut], dead, idle, wasted, steps)
