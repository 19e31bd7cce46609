"""reasoning-gym's procedural tasks as data: ``data.task=reasoning_gym:<name>``.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ (``pip install 'rollyard[reasoning-gym]'``,
offline, 100+ generators such as ``chain_sum``, ``basic_arithmetic``, ``gsm_symbolic``) is the task library
verl, prime-rl and TRL users train on. ``data.task_options`` are passed to its ``create_dataset(name, ...)``
(``{min_terms: 2, max_terms: 3}`` for ``chain_sum``); ``seed`` and ``size`` are rollyard's to set.

- **Splits.** The train split is the dataset built with ``seed = B``, the held-out split with ``seed = 2**31 + B``
  (``B = (data.seed % 2147) * 10**6``): reasoning-gym draws item ``i`` from ``seed + i``, so for up to 10**6
  prompts a split the two never share a seed. A problem space smaller than the splits repeats questions (a
  2-term 1-digit ``chain_sum`` has 200), so the train split skips every question the held-out split holds:
  held-out accuracy is on questions the run never trains on.
- **Prompts.** Each question is a user message, rendered with the model's chat template (or
  ``data.chat_template``) by :func:`render`; a model without one (a base model) gets the plain text
  ``"<question>\\nAnswer:"``.
- **Scoring.** :func:`score`, the run's verifier, runs in the verifier pool (its timeouts and limits): the
  completion's answer (the last ``<answer>...</answer>`` when there is one, else its first non-empty line)
  through the task's own ``score_answer(answer, entry)``, a number in [0, 1], is the reward. ``reward/accuracy``
  and the held-out eval count a score above 0.5 as correct, as for every rollyard verifier: a task's partial
  credit above 0.5 counts (``chain_sum`` gives ``"129"`` for ``"12"`` len(oracle) / len(answer) = 0.67).

This module imports reasoning-gym at its top (the verifier workers import it once, before their first call, not
inside a call's timeout); ``rollyard.tasks`` imports it only for a ``reasoning_gym:`` task.
"""

from __future__ import annotations

import difflib
import functools
import json
from typing import Any

from rollyard.tasks import chat
from rollyard.tasks.base import DataError, Prompt

try:
    import reasoning_gym
    from reasoning_gym.factory import DATASETS
except ImportError:
    reasoning_gym = None
    DATASETS = {}

PREFIX = "reasoning_gym:"
VERIFIER = "rollyard.tasks.reasoning_gym:score"
SPAN = 10**6  # prompts a split may hold: the splits' seed ranges are this wide
EVAL_OFFSET = 2**31
RESERVED = ("seed", "size")  # set from data.seed and data.train_size / data.eval_size


def is_task(name: str | None) -> bool:
    """``name`` names a reasoning-gym task (``reasoning_gym:<name>``)."""
    return isinstance(name, str) and name.startswith(PREFIX)


def _gym_name(name: str) -> str:
    """The reasoning-gym dataset ``name`` names; DataError for a missing package or an unknown task."""
    if reasoning_gym is None:
        raise DataError(f"data.task={name} needs the reasoning_gym package, which is not installed; "
                        f"pip install 'rollyard[reasoning-gym]'")
    gym = name[len(PREFIX):]
    if gym not in DATASETS:
        close = difflib.get_close_matches(gym, list(DATASETS), n=1)
        hint = f"did you mean {PREFIX}{close[0]}? " if close else ""
        raise DataError(f"data.task={name}: reasoning-gym {_version()} has no task "
                        f"{gym!r}; {hint}its tasks include {', '.join(sorted(DATASETS)[:8])}, ... "
                        f"(reasoning_gym.factory.DATASETS lists all {len(DATASETS)})")
    return gym


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("reasoning-gym")
    except PackageNotFoundError:
        return "(version unknown)"


def split_seed(split: str, seed: int) -> int:
    """The reasoning-gym seed of ``split`` (train, eval, or shots: ``data.few_shot``'s solved examples) for
    ``data.seed``: the three seed ranges never meet."""
    base = (seed % 2147) * SPAN
    return base + {"train": 0, "eval": EVAL_OFFSET, "shots": 2 * EVAL_OFFSET}[split]


def _dataset(gym: str, name: str, options: dict[str, Any], seed: int, size: int):
    """``reasoning_gym.create_dataset(gym, seed=seed, size=size, **options)``, bad options as one DataError."""
    fields = list(getattr(DATASETS[gym][1], "__dataclass_fields__", {}))
    own = sorted(set(options) & set(RESERVED))
    if own:
        raise DataError(f"data.task_options.{own[0]} is set by rollyard for {name} (seed: from data.seed, size: from "
                        f"data.train_size / data.eval_size); remove it from data.task_options")
    unknown = sorted(set(options) - set(fields))
    if unknown:
        known = [f for f in fields if f not in RESERVED]
        raise DataError(f"data.task_options.{unknown[0]}: {name} has no such option; its options are "
                        f"{', '.join(known)}")
    try:
        return reasoning_gym.create_dataset(gym, seed=seed, size=max(size, 1), **options)
    except (AssertionError, TypeError, ValueError) as e:
        raise DataError(f"data.task_options={options} are not valid for {name}: {type(e).__name__}: "
                        f"{e or 'its config check failed'}; see the task's config class in reasoning-gym") from None


def generate(name: str, split: str, n: int, seed: int, exclude: frozenset[str] | set[str] = frozenset(),
             **options: Any) -> list[Prompt]:
    """``n`` prompts of reasoning-gym task ``name`` (``reasoning_gym:<task>``), split ``train``, ``eval`` or
    ``shots``, skipping the items whose question is in ``exclude`` (the held-out questions, for the train split)."""
    gym = _gym_name(name)
    if n > SPAN:
        raise DataError(f"data.{'eval' if split == 'eval' else 'train'}_size={n}: a reasoning-gym split holds at "
                        f"most {SPAN} prompts (its seed range); lower it")
    ds = _dataset(gym, name, options, split_seed(split, seed), n)
    out: list[Prompt] = []
    index = 0
    while len(out) < n:
        if index >= SPAN or (index >= 64 + 20 * n and len(out) < index / 20):
            raise DataError(f"data.task={name} with data.task_options={options}: {len(out)} of the first {index} "
                            f"{split} questions are not held-out questions; the task's problem space is too small "
                            f"for a held-out split of data.eval_size: lower data.eval_size or widen data.task_options")
        entry = ds[index]
        index += 1
        question = entry["question"]
        if question in exclude:
            continue
        meta = {"task": name, "answer": str(entry["answer"]), "options": dict(options), "entry": entry}
        out.append(Prompt(id=f"{name}/{split}/{len(out)}", text=plain_text(question), meta=meta,
                          demo=str(entry["answer"]), messages=[{"role": "user", "content": question}]))
    return out


def questions(prompts: list[Prompt]) -> frozenset[str]:
    """The questions of ``prompts`` (a split's, to keep out of another)."""
    return frozenset(p.meta["entry"]["question"] for p in prompts)


def plain_text(question: str) -> str:
    """A question as a plain prompt, for a model without a chat template."""
    return f"{question}\nAnswer:"


def plain_of(messages: list[dict]) -> str:
    """A chat prompt as plain text for a base model: a system turn as the first paragraph, each question as
    :func:`plain_text` and each answer after it (``data.few_shot``'s examples), the last question open."""
    parts = []
    for m in messages:
        role, content = m.get("role"), str(m.get("content", ""))
        if role == "assistant":
            parts[-1] += f" {content}\n\n"
        elif role == "user":
            parts.append(plain_text(content))
        else:
            parts.append(f"{content.strip()}\n\n")
    return "".join(parts)


def render(prompts: list[Prompt], tokenizer, override: str | None = None) -> None:
    """Chat prompts by the model's chat template (or ``override``, ``data.chat_template``) when it has one;
    else plain text (:func:`plain_of`), with ``messages`` cleared (in place)."""
    if chat.template_of(override, tokenizer):
        chat.render(prompts, tokenizer, override)
        return
    for p in prompts:
        if p.messages is not None:
            p.text = plain_of(p.messages)
            p.messages = None


def extract(completion: str) -> str:
    """The answer in a completion: the last ``<answer>...</answer>``, else the first non-empty line (stripped)."""
    tagged = reasoning_gym.utils.extract_answer(completion) if reasoning_gym is not None else None
    if tagged is not None:
        return tagged
    return next((line.strip() for line in completion.splitlines() if line.strip()), "")


@functools.lru_cache(maxsize=16)
def _scorer(gym: str, options_json: str):
    """The dataset whose ``score_answer`` scores ``gym`` under these options (built once per worker)."""
    return reasoning_gym.create_dataset(gym, seed=0, size=1, **json.loads(options_json))


def score(completion: str, prompt: str, meta: dict[str, Any]) -> float:
    """The verifier of a ``reasoning_gym:`` task: the task's own ``score_answer`` on the extracted answer."""
    gym = _gym_name(meta["task"])
    ds = _scorer(gym, json.dumps(meta.get("options") or {}, sort_keys=True))
    return float(ds.score_answer(extract(completion), meta["entry"]))
