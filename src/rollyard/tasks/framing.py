"""What comes before each question: ``data.system_prompt`` and ``data.few_shot``.

:func:`frame` puts a system turn and ``k`` solved examples (user / assistant turns) before every chat prompt,
in place, before the chat template renders it; a prompt that already opens with a system (or developer) turn
keeps its own and gets no second one. A plain prompt (``messages`` is None) gets the system text as its first
paragraph. Rendering is the chat template's (``tasks/chat.py``) or, for a base model, reasoning-gym's plain
``question\\nAnswer: answer`` paragraphs (``tasks/reasoning_gym.plain_of``).
"""

from __future__ import annotations

from rollyard.tasks.base import DataError, Prompt

GYM = "reasoning_gym:"
SYSTEM_ROLES = ("system", "developer")


def system_text(value: str | None) -> str | None:
    """``data.system_prompt`` as text: ``reasoning_gym:<name>`` is reasoning-gym's ``SYSTEM_PROMPTS[name]``."""
    if not value or not value.startswith(GYM):
        return value or None
    try:
        from reasoning_gym.utils import SYSTEM_PROMPTS
    except ImportError:
        raise DataError(f"data.system_prompt={value} needs the reasoning_gym package, which is not installed; "
                        f"pip install 'rollyard[reasoning-gym]', or give the system text itself") from None
    name = value[len(GYM):]
    if name not in SYSTEM_PROMPTS:
        raise DataError(f"data.system_prompt={value}: reasoning-gym has no system prompt {name!r}; its names are "
                        f"{', '.join(sorted(SYSTEM_PROMPTS))} (or give the system text itself)")
    return SYSTEM_PROMPTS[name]


def shot_turns(shots: list[Prompt]) -> list[dict]:
    """Solved examples as chat turns: each example's question (its own user message) and its answer."""
    turns = []
    for s in shots:
        if s.messages is None or s.demo is None:
            raise DataError(f"few-shot example {s.id} has no question message or no answer; data.few_shot needs a "
                            f"task whose prompts carry both (reasoning_gym:<task>)")
        turns += [*s.messages, {"role": "assistant", "content": s.demo}]
    return turns


def frame(prompts: list[Prompt], system: str | None, shots: list[Prompt] = ()) -> None:
    """Put ``system`` and the ``shots`` before every prompt of ``prompts`` (in place); see the module docstring."""
    examples = shot_turns(list(shots))
    for p in prompts:
        if p.messages is None:
            if examples:
                raise DataError(f"prompt {p.id} is plain text, and data.few_shot puts examples before chat turns; "
                                f"set data.few_shot=0, or use a reasoning_gym:<task>")
            if system:
                p.text = f"{system}\n\n{p.text}"
            continue
        head = [m for m in p.messages[:1] if isinstance(m, dict) and m.get("role") in SYSTEM_ROLES]
        if not head and system:
            head = [{"role": "system", "content": system}]
        rest = p.messages[1:] if head and p.messages[:1] == head else p.messages
        p.messages = [*head, *examples, *rest]
