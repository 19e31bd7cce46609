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

This file is the policy only (which kind of round comes next, its size, its samples per prompt);
the round book (``rollout/rounds.py``) keeps the queue, the rounds and the checkpoint state, the
same for the in-process engine and the Ray pool.
"""

from __future__ import annotations

import math


def is_long_round(queued: int, prompts: int, round_index: int, long_every: int) -> bool:
    """Run a long round now: the queue holds a full round, or the periodic one is due (queue not empty)."""
    if queued >= prompts:
        return True
    return long_every > 0 and queued > 0 and round_index % long_every == long_every - 1


class TailPolicy:
    """RollPacker's short and long rounds (see the module docstring); the answers ``PlainPolicy`` gives."""

    name = "tail"
    streamed = True  # in-process, the trainer steps inside the round (RollPacker's stream-based training)

    def __init__(self, prompts: int, n: int, overprovision: float = 1.25, extra_samples: int = 2,
                 long_every: int = 0):
        if overprovision < 1 or extra_samples < 0 or n < 2:
            raise ValueError(f"tail scheduling needs overprovision >= 1, extra_samples >= 0 and n >= 2, got "
                             f"{overprovision}, {extra_samples}, {n}")
        self.P, self.n = prompts, n
        self.overprovision, self.extra_samples, self.long_every = overprovision, extra_samples, long_every

    def kind(self, queued: int, rounds: int) -> str:
        return "long" if is_long_round(queued, self.P, rounds, self.long_every) else "short"

    def size(self, kind: str) -> int:
        return math.ceil(self.P * self.overprovision) if kind == "short" else self.P

    def samples(self, kind: str) -> int:
        return self.n + self.extra_samples if kind == "short" else self.n

    def closes_early(self, kind: str) -> bool:
        return kind == "short"
