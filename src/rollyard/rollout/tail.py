"""Tail batching (RollPacker): short rounds that stop at P complete prompts, long rounds for the rest.

Short round: ``ceil(P x overprovision)`` fresh prompts, ``n + extra_samples`` samples each. A prompt
is complete when ``n`` of its samples have finished (the others are aborted); the round ends when
``P`` prompts are complete, and every unfinished prompt is aborted and appended to the long-prompt
queue. Prompts that lead to long responses are the ones still running at the cut, so short
rounds are short and balanced. Long round: when the queue holds ``P`` prompts (or every
``long_every`` rounds, if it is not empty), the first ``P`` queued prompts run to full length with
``n`` samples and no over-provisioning. Every round is synchronous: its samples come from the
current weights and train one optimizer step, as in plain scheduling.

Aborted samples are dropped, partial tokens included, and a deferred prompt restarts from its
prompt in the long round. Keeping partials would make the long round's samples span several
weight versions (off-policy, needing importance correction and a staleness bound), which is what
tail batching exists to avoid; and a partial's KV cache is invalid after the weight update anyway
(it would be re-prefilled). The price is the decoded-then-dropped tokens, reported per step as
``tail/wasted_tokens``.

The queue is part of the checkpoint (``state()`` / ``restore()``): together with the prompt
stream's cursor it says exactly which prompts are still owed a round, so nothing deferred is lost
or trained twice across a resume.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import asdict

from rollyard.rollout.rounds import Round, stream_round
from rollyard.rollout.scheduler import PromptStream, to_requests
from rollyard.tasks.base import Prompt
from rollyard.types import Sample


def is_long_round(queued: int, prompts: int, round_index: int, long_every: int) -> bool:
    """Run a long round now: the queue holds a full round, or the periodic one is due (queue not empty)."""
    if queued >= prompts:
        return True
    return long_every > 0 and queued > 0 and round_index % long_every == long_every - 1


class TailScheduler:
    """RollPacker's short and long rounds over ``stream`` (see the module docstring)."""

    def __init__(self, stream: PromptStream, tokenizer, *, prompts: int, n: int, max_new_tokens: int, context: int,
                 overprovision: float = 1.25, extra_samples: int = 2, long_every: int = 0):
        if overprovision < 1 or extra_samples < 0 or n < 2:
            raise ValueError(f"tail scheduling needs overprovision >= 1, extra_samples >= 0 and n >= 2, got "
                             f"{overprovision}, {extra_samples}, {n}")
        self.stream, self.tokenizer = stream, tokenizer
        self.prompts, self.n, self.max_new_tokens, self.context = prompts, n, max_new_tokens, context
        self.overprovision, self.extra_samples, self.long_every = overprovision, extra_samples, long_every
        self.queue: deque[Prompt] = deque()
        self.rounds = 0
        self.trained = {"short": 0, "long": 0}  # samples trained on, by round kind (the bias metric)

    def next_round(self, engine, rewards, step: int, on_group: Callable[[list[Sample]], None]) -> Round:
        long = is_long_round(len(self.queue), self.prompts, self.rounds, self.long_every)
        if long:
            prompts = [self.queue.popleft() for _ in range(min(self.prompts, len(self.queue)))]
            per_prompt, need = self.n, len(prompts)
        else:
            prompts = self.stream.take(math.ceil(self.prompts * self.overprovision))
            per_prompt, need = self.n + self.extra_samples, self.prompts
        requests, dead = to_requests(prompts, self.tokenizer, per_prompt, self.max_new_tokens, self.context,
                                     suffix=f"@{step}")
        out, rejected = stream_round(engine, rewards, requests, self.n, need, on_group)
        dead += [{"source": q.id, "reason": why} for q, why in rejected]
        by_request = {f"{p.id}@{step}": p for p in prompts}
        deferred = [by_request[r] for r in out.incomplete]
        self.queue.extend(deferred)
        self.rounds += 1
        kind = "long" if long else "short"
        samples = [s for g in out.groups for s in g]
        self.trained[kind] += len(samples)
        rejected_ids = {q.id for q, _ in rejected}
        return Round(kind, [q for q in requests if q.id not in rejected_ids], samples, deferred, dead,
                     out.bubble, out.wasted_tokens, out.decode_steps)

    def state(self) -> dict:
        """JSON-able: the queued prompts (in order), the round counter, the trained-sample counts."""
        return {"queue": [asdict(p) for p in self.queue], "rounds": self.rounds, "trained": dict(self.trained)}

    def restore(self, state: dict | None) -> None:
        if not state:
            return
        self.queue = deque(Prompt(**p) for p in state["queue"])
        self.rounds = int(state["rounds"])
        self.trained = {k: int(v) for k, v in state["trained"].items()}
