"""Plain scheduling: a round takes the next P prompts and runs every sample to the end.

The synchronous baseline: the round lasts as long as its longest response (the bubble tail
batching removes). The policy only answers the round book's questions (``rollout/rounds.py``);
the book does the bookkeeping, the same for every policy.
"""

from __future__ import annotations


class PlainPolicy:
    """Every round ``plain``: ``P`` fresh prompts, ``n`` samples each, complete when all ``n`` finish."""

    name = "plain"
    streamed = False  # the trainer steps after the round (``step.py`` scores and trains what the side takes)

    def __init__(self, prompts: int, n: int):
        self.P, self.n = prompts, n

    def kind(self, queued: int, rounds: int) -> str:
        """The next round's kind, given ``queued`` deferred prompts and ``rounds`` rounds issued so far."""
        return "plain"

    def size(self, kind: str) -> int:
        """Prompts a round of ``kind`` hands out."""
        return self.P

    def samples(self, kind: str) -> int:
        """Samples per prompt a round of ``kind`` asks for (a prompt is complete at ``n`` of them)."""
        return self.n

    def closes_early(self, kind: str) -> bool:
        """A round of ``kind`` closes once ``P`` of its prompts are complete (the rest are cut and deferred)."""
        return False
