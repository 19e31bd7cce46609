"""Arithmetic: ``"23+45="`` -> ``"68"``.

Addition and subtraction of integers in ``[0, max_operand]``; subtraction keeps ``a >= b`` so
every answer is a non-negative integer. The completion is the answer followed by EOS; the
verifier (:func:`rollyard.reward.verifiers.arithmetic`) compares the stripped completion with the
answer string. The whole problem space is enumerated, a fixed hash of each problem's text puts
~10% of it in the eval split, and a seeded shuffle picks ``n`` problems from the split. The train
split cycles (a fresh shuffle per pass) when ``n`` exceeds it; the eval split never repeats a
problem, so asking for more than it holds returns all of it (138 problems at the default
``max_operand``; the train split holds 1319).

Default ``max_operand=30``: prompts of at most 6 characters, answers of 1-2 digits; a warm-started
~0.5M-parameter character model lands in the 20-40% range, leaving RL room to improve.
"""

from __future__ import annotations

import random

from rollyard.tasks.base import Prompt, draw_problems

NAME = "arithmetic"
VERIFIER = "rollyard.reward.verifiers:arithmetic"
EVAL_BUCKETS = 10  # one bucket in ten is held out
DEFAULT_MAX_OPERAND = 30


def problems(max_operand: int = DEFAULT_MAX_OPERAND, ops: str = "+-") -> list[tuple[str, str]]:
    """Every ``(prompt, answer)`` pair of the task, in a fixed order."""
    if max_operand < 1:
        raise ValueError(f"arithmetic: max_operand must be >= 1, got {max_operand}")
    bad = set(ops) - set("+-")
    if not ops or bad:
        raise ValueError(f"arithmetic: ops must be a non-empty subset of '+-', got {ops!r}")
    out = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            if "+" in ops:
                out.append((f"{a}+{b}=", str(a + b)))
            if "-" in ops and a >= b:
                out.append((f"{a}-{b}=", str(a - b)))
    return out


def generate(split: str, n: int, seed: int, max_operand: int = DEFAULT_MAX_OPERAND, ops: str = "+-") -> list[Prompt]:
    rng = random.Random(f"{NAME}/{split}/{seed}/{max_operand}/{ops}")
    drawn = draw_problems(problems(max_operand, ops), split, n, EVAL_BUCKETS, rng,
                          f"arithmetic: max_operand={max_operand} leaves the {split} split empty; raise max_operand")
    return [Prompt(id=f"{NAME}/{split}/{i}", text=text, meta={"task": NAME, "answer": answer}, demo=answer)
            for i, (text, answer) in enumerate(drawn)]
