"""What a task hands the rest of rollyard: prompts, and the errors bad input raises.

A :class:`Prompt` is the unit every loader produces (built-in task generators and the dataset
loader alike). ``DataError`` and ``HookError`` are the two "your input is wrong" exceptions of this
layer; the CLI maps both to exit code 2 and prints their message, so each message says where
(file:line or the hook path), which rule was broken, and how to fix it.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Prompt:
    """One prompt.

    ``id`` is unique within a prompt set and stable across runs (dataset ``file:line`` or the id
    column; ``task/split/index`` for built-ins). ``text`` is fed to the model as-is (built-ins use
    no chat template). ``meta`` holds the verifier's inputs (``{"task": "arithmetic", "answer":
    "19"}``) and must be JSON-serialisable. ``demo`` is a correct completion (without EOS) for the
    SFT warm start; built-in tasks always set it. ``messages`` is a chat prompt (``[{"role": ...,
    "content": ...}]``); ``text`` is then its rendering by the chat template (``tasks/chat.py``),
    which already holds any special tokens the model expects.
    """

    id: str
    text: str
    meta: dict[str, Any]
    demo: str | None = None
    messages: list[dict[str, Any]] | None = None


class DataError(ValueError):
    """Bad dataset input: the message names ``file:line``, the rule broken, and the fix."""


class HookError(ValueError):
    """A ``module:function`` reward hook that does not import, is not callable, or has the wrong shape."""


def stable_bucket(text: str, buckets: int) -> int:
    """A bucket in ``[0, buckets)`` for ``text`` that never changes between runs or machines.

    Built-in tasks put a problem in the eval split when its bucket is 0, so train and eval are
    disjoint by construction, for every seed and every ``n``.
    """
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") % buckets


def draw_split(name: str, split: str, n: int, buckets: int,
               draw: Callable[[], tuple[str, str, dict[str, Any]]]) -> list[Prompt]:
    """Up to ``n`` prompts of ``split`` from a generator's ``draw() -> (text, answer, extra meta)``.

    A draw whose :func:`stable_bucket` puts it in the other split is skipped; the eval split never
    repeats a problem. Gives up after 10,000 misses in a row (a problem space too small for ``n``).
    """
    want_eval = split == "eval"
    out: list[Prompt] = []
    seen: set[str] = set()
    misses = 0
    while len(out) < n and misses < 10_000:
        text, answer, extra = draw()
        if (stable_bucket(text, buckets) == 0) != want_eval or (want_eval and text in seen):
            misses += 1
            continue
        misses = 0
        seen.add(text)
        out.append(Prompt(id=f"{name}/{split}/{len(out)}", text=text,
                          meta={"task": name, "answer": answer, **extra}, demo=answer))
    return out


def draw_problems(problems: list[tuple[str, str]], split: str, n: int, buckets: int, rng: random.Random,
                  empty: str) -> list[tuple[str, str]]:
    """``n`` ``(text, answer)`` problems of ``split`` from a task's whole problem space (in a fixed order).

    The split's problems are those :func:`stable_bucket` puts in it (bucket 0: eval); each pass over them is
    a fresh ``rng`` shuffle, so the train split cycles when ``n`` exceeds it, and the eval split never repeats
    a problem (asking for more returns all of it). ``ValueError(empty)`` when the split holds none.
    """
    want_eval = split == "eval"
    pool = [p for p in problems if (stable_bucket(p[0], buckets) == 0) == want_eval]
    if not pool:
        raise ValueError(empty)
    if want_eval:
        n = min(n, len(pool))
    out: list[tuple[str, str]] = []
    while len(out) < n:
        order = pool[:]
        rng.shuffle(order)
        out += order[: n - len(out)]
    return out
