"""One synchronous rollout round, streamed: what plain and tail scheduling share.

``stream_round`` submits a round's requests and, while the engine is still decoding, sends every
finished sample to the reward pool and hands each *complete, scored* group to ``on_group`` (the
streaming trainer accumulates its gradient there). A request is complete when ``n`` of its samples
have finished (finish reason ``stop`` or ``length``); its other samples are aborted at once. The
round ends when ``need`` requests are complete: every request still running is aborted and comes
back in ``incomplete`` (tail batching defers those prompts). With ``need = len(requests)`` and
``n`` = the request's ``n`` this is the plain round: everything runs to the end.

Aborted samples are dropped, partial tokens included (see rollout/tail.py for why); their tokens
are counted in ``wasted_tokens``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from rollyard.tasks.base import Prompt
from rollyard.types import Request, Sample


@dataclass
class Round:
    """What a scheduler's ``next_round`` returns: one optimizer step's worth of scored samples."""

    kind: str  # "plain" | "short" | "long"
    requests: list[Request]  # submitted (accepted) this round
    samples: list[Sample]  # trained on: n per complete prompt, rewards set
    deferred: list[Prompt] = field(default_factory=list)  # aborted this round, queued for a long round
    dead: list[dict] = field(default_factory=list)  # dead-letter records (with reasons)
    bubble: float = 0.0  # share of rollout slot-time idle (see ``bubble``)
    wasted_tokens: int = 0  # tokens of aborted or surplus samples (decoded, never trained on)
    decode_steps: int = 0  # the round's length in decode steps (what a memory-bound GPU round costs)


@dataclass
class Streamed:
    groups: list[list[Sample]]  # complete groups, in completion order, each sorted by sample index
    incomplete: list[str]  # request ids aborted before n of their samples finished
    bubble: float
    wasted_tokens: int
    decode_steps: int


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


def stream_round(engine, rewards, requests: list[Request], n: int, need: int,
                 on_group: Callable[[list[Sample]], None]) -> tuple[Streamed, list[tuple[Request, str]]]:
    """Run one round (see the module docstring); returns the outcome and the engine's rejections."""
    rejected = engine.submit(requests)
    bad = {q.id for q, _ in rejected}
    live = {q.id: q for q in requests if q.id not in bad}
    need = min(need, len(live))
    finished: dict[str, list[Sample]] = defaultdict(list)  # first n finished samples per request
    scored: dict[str, list[Sample]] = defaultdict(list)
    complete: set[str] = set()
    closed: set[str] = set()  # complete or aborted: later samples of these are surplus
    groups: list[list[Sample]] = []
    lengths: list[int] = []
    wasted = 0

    def emit(rid: str) -> None:
        if rid in complete and len(scored.get(rid, ())) == n:  # complete and every sample scored
            groups.append(sorted(scored.pop(rid), key=lambda x: int(x.id.rsplit("#", 1)[1])))
            on_group(groups[-1])

    def collect(samples: list[Sample]) -> None:
        for s in samples:
            if s.request_id in closed and s.request_id not in complete:
                continue  # a sample of a prompt deferred after it was submitted for scoring
            scored[s.request_id].append(s)
            emit(s.request_id)

    for s in engine.results():
        lengths.append(len(s.completion_ids))
        rid = s.request_id
        if rid in closed:  # finished in the same decode step as its group's n-th sample, or after the cut
            wasted += len(s.completion_ids)
            continue
        finished[rid].append(s)
        rewards.submit(s)  # streaming rewards: scored while decoding goes on
        if len(finished[rid]) == n:
            complete.add(rid)
            closed.add(rid)
            emit(rid)
            done = {x.id for x in finished[rid]}
            surplus = engine.abort([f"{rid}#{k}" for k in range(live[rid].n) if f"{rid}#{k}" not in done])
            lengths += [len(x.completion_ids) for x in surplus]
            wasted += sum(len(x.completion_ids) for x in surplus)
            if len(complete) == need:
                rest = [r for r in live if r not in closed]
                cut = engine.abort(rest)
                lengths += [len(x.completion_ids) for x in cut]
                wasted += sum(len(x.completion_ids) for x in cut)
                closed.update(rest)
        collect(rewards.poll())
    collect(list(rewards.results()))  # the last groups' rewards (and the deferred prompts' strays)
    incomplete = [r for r in live if r not in complete]
    wasted += sum(len(x.completion_ids) for r in incomplete for x in finished.get(r, []))
    slots = min(engine.max_concurrent, sum(q.n for q in live.values()))
    return Streamed(groups, incomplete, bubble(lengths, slots), wasted, decode_steps(lengths, slots)), rejected
