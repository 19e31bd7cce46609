"""Built-in synthetic tasks, generated locally from a seed, each with its verifier.

``load_task(name, split, n, seed)`` returns ``n`` prompts of the ``train`` or ``eval`` split;
the splits are disjoint by construction (a fixed hash of the problem text decides its split) and
the same arguments always give the same prompts. ``builtin_verifier(name)`` is the task's reward
function as a ``module:function`` path, ready for :class:`rollyard.reward.dispatcher.RewardDispatcher`.

Tasks: ``arithmetic`` (``"23+45="`` -> ``"68"``) and ``repeat`` (``"rep 3 ab:"`` -> ``"ababab"``,
long-tailed response lengths) and ``countdown`` (``"47-5:"`` -> ``"42 37 ... 2"``, a program trace
whose length is long-tailed by prompt) and ``calculator`` (``"47*38="`` -> ``"1786"``, multi-turn: the model
may call the task's calculator tool). ``builtin_tools`` / ``builtin_template`` are a task's tools and the chat
template their tool turns need (``env/setup.py`` reads them). ``reasoning_gym:<task>`` names one of
reasoning-gym's tasks (``tasks/reasoning_gym.py``, imported only then); ``render_task`` renders its prompts.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from rollyard.tasks import arithmetic, calculator, countdown, repeat
from rollyard.tasks.base import DataError, Prompt

TASKS = {arithmetic.NAME: arithmetic, repeat.NAME: repeat, countdown.NAME: countdown, calculator.NAME: calculator}
SPLITS = ("train", "eval")


def _task(name: str):
    if name not in TASKS:
        close = difflib.get_close_matches(str(name), list(TASKS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise DataError(f"unknown built-in task {name!r}: {hint}built-in tasks are {', '.join(sorted(TASKS))}; "
                        f"set data.task to one of them or to reasoning_gym:<task>, or data.path to a dataset file")
    return TASKS[name]


def load_task(name: str, split: str, n: int, seed: int, held_out: list[Prompt] = (), **kwargs: Any) -> list[Prompt]:
    """``n`` prompts of built-in task ``name``'s ``split`` ("train" or "eval"), deterministic in ``seed``.

    ``kwargs`` are the task's difficulty knobs (``arithmetic``: ``max_operand``, ``ops``;
    ``repeat``: ``max_times``, ``max_unit``). ``held_out``: the eval split's prompts, which the train split of a
    reasoning-gym task skips (a built-in task's splits are disjoint by construction).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if _is_gym(name):
        from rollyard.tasks import reasoning_gym
        return reasoning_gym.generate(name, split, n, seed, exclude=reasoning_gym.questions(held_out), **kwargs)
    task = _task(name)
    knobs = [k for k in inspect.signature(task.generate).parameters if k not in ("split", "n", "seed")]
    unknown = sorted(set(kwargs) - set(knobs))
    if unknown:
        raise DataError(f"task {name!r} has no option {unknown[0]!r}; its options are {', '.join(knobs)}")
    return task.generate(split, n, seed, **kwargs)


def builtin_verifier(name: str) -> str:
    """The ``module:function`` path of built-in task ``name``'s verifier."""
    return "rollyard.tasks.reasoning_gym:score" if _is_gym(name) else _task(name).VERIFIER


def builtin_tools(name: str, options: dict[str, Any]) -> list[str]:
    """The tools (import paths) built-in task ``name`` gives a run with these ``options``: its ``TOOLS`` unless
    its ``tools`` option is 0; none for a task without tools."""
    if _is_gym(name):
        return []
    task = _task(name)
    default = inspect.signature(task.generate).parameters.get("tools")
    on = options.get("tools", default.default if default is not None else 0)
    return list(getattr(task, "TOOLS", [])) if on else []


def builtin_template(name: str) -> str | None:
    """The chat template built-in task ``name``'s tool turns are rendered with when the tokenizer has none."""
    return None if _is_gym(name) else getattr(_task(name), "TEMPLATE", None)


def render_task(name: str | None, prompts: list[Prompt], tokenizer, override: str | None = None) -> None:
    """Render task ``name``'s prompts for ``tokenizer`` (in place): a reasoning-gym task's questions are chat
    prompts by the model's chat template, plain text without one; built-in tasks' prompts are plain already."""
    if _is_gym(name):
        from rollyard.tasks import reasoning_gym
        reasoning_gym.render(prompts, tokenizer, override)


def _is_gym(name: str | None) -> bool:
    return isinstance(name, str) and name.startswith("reasoning_gym:")


__all__ = ["TASKS", "load_task", "builtin_verifier", "builtin_tools", "builtin_template", "render_task", "Prompt"]
