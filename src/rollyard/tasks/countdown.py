"""Countdown: ``"47-5:"`` -> ``"42 37 32 27 22 17 12 7 2"`` -- a program trace of variable length.

The prompt names a start ``n`` and a step ``d``; the answer is the trace of ``while x >= d: x -= d;
print(x)``: every intermediate value written out, ``k = n // d`` of them. ``k`` is drawn in
``1..max_steps`` with probability proportional to ``k**-alpha`` (default ``alpha=1.2``), so most
traces are a few numbers long and a few run to ``max_steps`` numbers (about 3 tokens each): the
response length is long-tailed *by prompt*, which is what tail batching exploits. Each step is a
subtraction of one digit from the previous number, so a small model learns the rule from demos
but its mistakes compound along the chain: accuracy falls with length, as on real reasoning tasks.

Verifier: :func:`rollyard.reward.verifiers.countdown` (the whole trace must be right: the steps are
the answer). A fixed hash of the prompt text puts ~20% of the problem space (~150 problems) in the eval split.
Set ``rollout.max_new_tokens`` to at least ``3 * max_steps + 1`` or the longest traces are cut off.
"""

from __future__ import annotations

import random

from rollyard.tasks.base import Prompt, draw_split

NAME = "countdown"
VERIFIER = "rollyard.reward.verifiers:countdown"
EVAL_BUCKETS = 5  # one problem in five is held out (the problem space is ~750, so eval holds ~150)


def trace(n: int, d: int) -> str:
    """The answer: ``n - d, n - 2d, ...`` down to the last value ``>= 0``, space-separated."""
    out, x = [], n
    while x >= d:
        x -= d
        out.append(str(x))
    return " ".join(out)


def generate(split: str, n: int, seed: int, max_steps: int = 24, max_start: int = 99, alpha_x10: int = 12) -> list[Prompt]:
    """``n`` prompts; ``alpha_x10`` is the tail exponent times 10 (task options are integers)."""
    if not 2 <= max_steps <= 49:
        raise ValueError(f"countdown: max_steps must be in 2..49, got {max_steps}")
    if not 2 * (max_steps + 1) <= max_start <= 999:
        raise ValueError(f"countdown: max_start must be in {2 * (max_steps + 1)}..999 (room for max_steps "
                         f"steps of at least 2), got {max_start}")
    rng = random.Random(f"{NAME}/{split}/{seed}/{max_steps}/{max_start}/{alpha_x10}")
    ks = list(range(1, max_steps + 1))
    weights = [k ** (-alpha_x10 / 10) for k in ks]

    def draw() -> tuple[str, str, dict]:
        k = rng.choices(ks, weights)[0]
        d = rng.randint(2, max(2, min(9, (max_start + 1) // (k + 1))))  # n = k*d + r <= max_start
        start = k * d + rng.randint(0, d - 1)
        return f"{start}-{d}:", trace(start, d), {"steps": k}

    return draw_split(NAME, split, n, EVAL_BUCKETS, draw)
