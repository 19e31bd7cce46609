"""Plain scheduling: a round takes the next P prompts and runs every sample to the end.

The synchronous baseline: the round lasts as long as its longest response (the bubble tail
batching removes). Streaming rewards and the streaming trainer work the same as in tail rounds.
"""

from __future__ import annotations

from collections.abc import Callable

from rollyard.rollout.rounds import Round, stream_round
from rollyard.rollout.scheduler import PromptStream, to_requests
from rollyard.types import Sample


class PlainScheduler:
    """``next_round`` = P fresh prompts, n samples each, all run to completion."""

    def __init__(self, stream: PromptStream, tokenizer, *, prompts: int, n: int, max_new_tokens: int, context: int):
        self.stream, self.tokenizer = stream, tokenizer
        self.prompts, self.n, self.max_new_tokens, self.context = prompts, n, max_new_tokens, context

    def next_round(self, engine, rewards, step: int, on_group: Callable[[list[Sample]], None]) -> Round:
        requests, dead = to_requests(self.stream.take(self.prompts), self.tokenizer, self.n, self.max_new_tokens,
                                     self.context, suffix=f"@{step}")
        out, rejected = stream_round(engine, rewards, requests, self.n, len(requests), on_group)
        dead += [{"source": q.id, "reason": why} for q, why in rejected]
        return Round("plain", [q for q in requests if q.id not in {r.id for r, _ in rejected}],
                     [s for g in out.groups for s in g], [], dead, out.bubble, out.wasted_tokens, out.decode_steps)

    def state(self) -> dict:
        return {}

    def restore(self, state: dict | None) -> None:
        pass
