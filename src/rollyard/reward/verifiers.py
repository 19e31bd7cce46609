"""Built-in verifiers: ``fn(completion: str, prompt: str, meta: dict) -> float``.

They run inside the reward worker processes, so this module must stay light to import (standard
library only: no torch, no rollyard.types). ``completion`` is the decoded response with EOS and
special tokens already removed; ``meta`` is the prompt's meta dict (the task's ``answer``).
"""

from __future__ import annotations

from typing import Any


def _answer(meta: dict[str, Any]) -> str:
    if "answer" not in meta:
        raise KeyError(f"meta has no 'answer' (keys: {sorted(meta)}); map the dataset's answer column with "
                       f"data.fields={{answer: <column>}}")
    return str(meta["answer"]).strip()


def exact_match(completion: str, prompt: str, meta: dict[str, Any]) -> float:
    """1.0 when the stripped completion equals ``meta["answer"]`` (stripped), else 0.0."""
    return 1.0 if completion.strip() == _answer(meta) else 0.0


def arithmetic(completion: str, prompt: str, meta: dict[str, Any]) -> float:
    """The ``arithmetic`` task: the completion must be exactly the answer's digits."""
    return exact_match(completion, prompt, meta)


def repeat(completion: str, prompt: str, meta: dict[str, Any]) -> float:
    """The ``repeat`` task: the completion must be exactly the repeated unit."""
    return exact_match(completion, prompt, meta)


def countdown(completion: str, prompt: str, meta: dict[str, Any]) -> float:
    """The ``countdown`` task: the whole trace must be right (whitespace between numbers normalized)."""
    return 1.0 if completion.split() == _answer(meta).split() else 0.0


def calculator(completion: str, prompt: str, meta: dict[str, Any]) -> float:
    """The ``calculator`` task: the answer after the last tool response (``</tool_response>``, as the task's chat
    template renders a tool turn) must be exactly the product's digits; without a tool turn, the whole completion.
    The tool's own output (inside the tags) never counts: only the model's answer after it."""
    return exact_match(completion.rsplit("</tool_response>", 1)[-1], prompt, meta)
