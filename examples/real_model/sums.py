"""Two-digit sums as a chat dataset, and its reward: the SmolLM2-135M-Instruct example (docs/real-models.md).

    python examples/real_model/sums.py OUT_DIR          # writes OUT_DIR/train.jsonl (2000) and OUT_DIR/eval.jsonl (64)

Each row: ``{"id", "prompt": [{"role": "user", "content": "What is 27+82? Answer with the number only."}],
"answer": "109"}``. The train and held-out prompts are disjoint pairs (a, b), 10 <= a, b <= 99, drawn with a
fixed seed. :func:`last_integer_is_sum` is the reward (``reward.hook=examples/real_model/sums.py:last_integer_is_sum``):
1.0 when the last integer in the completion is the sum, else 0.0; with ``reward.correctness=true`` it also
scores the held-out greedy eval.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

QUESTION = "What is {a}+{b}? Answer with the number only."
INTEGER = re.compile(r"-?\d+")


def rows(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held-out): 2000 and 64 rows over disjoint (a, b) pairs."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)

    def row(i: int, a: int, b: int) -> dict:
        return {"id": f"sum-{a}-{b}", "prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
                "answer": str(a + b)}

    return [row(i, a, b) for i, (a, b) in enumerate(pairs[:2000])], [row(i, a, b) for i, (a, b) in enumerate(pairs[2000:2064])]


def last_integer_is_sum(completion: str, prompt: str, meta: dict) -> float:
    """1.0 when the completion's last integer equals ``meta["answer"]``, else 0.0."""
    found = INTEGER.findall(completion)
    return float(bool(found) and found[-1] == str(meta["answer"]).strip())


def write(out_dir: str | Path, transform=lambda part: part) -> tuple[Path, Path]:
    """train.jsonl and eval.jsonl under ``out_dir`` (each list of rows through ``transform`` first)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, held = rows()
    for name, part in (("train.jsonl", transform(train)), ("eval.jsonl", transform(held))):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return out / "train.jsonl", out / "eval.jsonl"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/real_model/sums.py OUT_DIR")
    for p in write(sys.argv[1]):
        print(p)
