"""Repeat: ``"rep 3 ab:"`` -> ``"ababab"``.

A unit of 1-``max_unit`` lowercase letters repeated ``k`` times, ``k`` in ``1..max_times`` drawn
with probability proportional to ``k**-1.3``: most answers are a few characters, a few run to
``max_unit * max_times`` (32 by default). The response length is long-tailed and varies widely
across prompts, which is what tail-aware batching has to cope with. Set
``rollout.max_new_tokens`` to at least ``max_unit * max_times + 1`` (the answer plus EOS) or the
longest answers are cut off and score 0.

Verifier: :func:`rollyard.reward.verifiers.repeat` (exact match of the stripped completion). A
fixed hash of the prompt text puts ~10% of the problem space in the eval split; the eval split
never repeats a problem (train may).
"""

from __future__ import annotations

import random
import string

from rollyard.tasks.base import Prompt, draw_split

NAME = "repeat"
VERIFIER = "rollyard.reward.verifiers:repeat"
EVAL_BUCKETS = 10
LETTERS = string.ascii_lowercase


def generate(split: str, n: int, seed: int, max_times: int = 8, max_unit: int = 4) -> list[Prompt]:
    if not 1 <= max_times <= 9:
        raise ValueError(f"repeat: max_times must be in 1..9 (one digit in the prompt), got {max_times}")
    if not 1 <= max_unit <= 12:
        raise ValueError(f"repeat: max_unit must be in 1..12 (prompts stay < 24 characters), got {max_unit}")
    rng = random.Random(f"{NAME}/{split}/{seed}/{max_times}/{max_unit}")
    times = list(range(1, max_times + 1))
    weights = [k ** -1.3 for k in times]

    def draw() -> tuple[str, str, dict]:
        k = rng.choices(times, weights)[0]
        unit = "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, max_unit)))
        return f"rep {k} {unit}:", unit * k, {}

    return draw_split(NAME, split, n, EVAL_BUCKETS, draw)
