"""Reward hooks: naming, loading and calling user reward functions, in the three accepted forms.

A hook is named ``"module:function"`` or ``"path/to/file.py:function"``. Its form is read from its
signature (parameter names), so a function written for TRL or verl works unchanged:

  - ``sample``: ``fn(completion, prompt, meta) -> float`` (rollyard's own; any parameter names,
    three positional arguments);
  - ``trl``: ``fn(prompts, completions, **columns) -> list[float | None]`` (TRL's batched reward
    function; recognised by a parameter named ``completions``). It gets the dataset's other columns
    as keyword lists; chat prompts come as message lists and completions as
    ``[{"role": "assistant", "content": ...}]``, as TRL passes them, ``completion_ids`` and
    ``trainer_state`` (``global_step``, ``max_steps``). It is called once per step with the whole
    batch, as TRL calls it (the streaming tail scheduler: once per sample). ``None`` means "not scored";
  - ``verl``: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` (recognised
    by a parameter named ``solution_str``); the ground truth is ``meta["ground_truth"]`` (map it with
    ``data.fields``) or a verl dataset's ``reward_model.ground_truth``. A dict result's ``"score"`` is
    the reward; its other numeric keys are kept (logged as ``rewards/<fn>/<key>``).

A call whose arguments do not fit the function's signature raises :class:`SignatureError`, and a
dataset without a ground truth for ``compute_score`` :class:`MissingGroundTruth`: the start-up dry
call (``RewardDispatcher.dry_run``) turns either into one line before training.

Several hooks combine by weight: the reward is the weighted sum of the hooks that scored the sample;
a sample no hook scored is left out of the loss (``combine`` returns ``None``).

This module is imported by the reward worker processes too (by file path, see ``worker.py``), so at
module level it uses the standard library only; :func:`load` (parent side) imports rollyard lazily.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable
from typing import Any

FORMS = {
    "sample": "fn(completion, prompt, meta) -> float (per sample)",
    "trl": "fn(prompts, completions, **columns) -> list[float | None] (TRL, batched)",
    "verl": "compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float (verl)",
}
ACCEPTED = "the three accepted reward forms are " + "; ".join(FORMS.values())
RULE = "a reward hook is 'module:function' (an importable module) or 'path/to/file.py:function'"
PROMPT_KEY, MESSAGES_KEY = "prompt", "prompt_messages"  # meta keys the scheduler sets (not dataset columns)


class SignatureError(TypeError):
    """The reward function cannot be called with the arguments its form passes (every sample would fail)."""


class MissingGroundTruth(KeyError):
    """``compute_score`` needs a ground truth the dataset does not provide (every sample would fail)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TrainerState:
    """What TRL's ``trainer_state`` offers a reward function here: ``global_step`` and ``max_steps``."""

    def __init__(self, global_step: int = 0, max_steps: int = 0):
        self.global_step, self.max_steps = global_step, max_steps

    def __repr__(self) -> str:
        return f"TrainerState(global_step={self.global_step}, max_steps={self.max_steps})"


# ------------------------------------------------------------------------------- names and imports
def parse_hook(path: str) -> tuple[str, str, str]:
    """``"module:function"`` or ``"path/to/file.py:function"`` -> ``(kind, target, attr)``; ValueError if malformed.

    ``kind`` is ``"file"`` (target an absolute path) or ``"module"``.
    """
    if not isinstance(path, str) or ":" not in path:
        raise ValueError("expected 'module:function' or 'path/to/file.py:function'")
    target, attr = path.rsplit(":", 1)
    if not target or not attr:
        raise ValueError("expected 'module:function' or 'path/to/file.py:function'")
    if target.endswith(".py") or "/" in target or os.sep in target:
        return "file", os.path.abspath(target), attr
    return "module", target, attr


def import_target(kind: str, target: str):
    """Import the hook's module (by name, or from a file path: its folder is appended to ``sys.path``)."""
    if kind == "module":
        return importlib.import_module(target)
    if not os.path.isfile(target):
        raise FileNotFoundError(f"no such file: {target}")
    name = "rollyard_hook_" + "".join(c if c.isalnum() else "_" for c in target)
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(target)
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def get_attr(module, attr: str):
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def path_of(fn: Callable) -> str:
    """The hook path of a module-level function (what the workers import); ValueError for anything else."""
    qual, mod = getattr(fn, "__qualname__", ""), getattr(fn, "__module__", None)
    if not callable(fn) or not qual or "<" in qual or mod is None:
        raise ValueError(f"{fn!r} is not a module-level function; reward workers import hooks by name, so define "
                         f"it at the top level of a module (a lambda or a nested function cannot be imported)")
    if mod == "__main__":
        main = sys.modules["__main__"]
        if not getattr(main, "__file__", None):
            raise ValueError(f"{qual} is defined in an interactive session; define it in a .py file")
        return f"{os.path.abspath(main.__file__)}:{qual}"
    return f"{mod}:{qual}"


# ------------------------------------------------------------------------------------- the forms
def detect_form(fn: Callable) -> str | None:
    """``"sample"``, ``"trl"`` or ``"verl"`` from ``fn``'s signature; None when it matches none.

    A callable without a readable signature (some builtins) is taken as ``sample``: the call decides.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "sample"
    names = set(sig.parameters)
    if "solution_str" in names:
        return "verl"
    if "completions" in names:
        return "trl"
    try:
        sig.bind("completion", "prompt", {})
    except TypeError:
        return None
    return "sample"


def _accepts(fn: Callable) -> Callable[[str], bool]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return lambda name: True
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return lambda name: True
    names = {p.name for p in params}
    return lambda name: name in names


def _columns(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k not in (PROMPT_KEY, MESSAGES_KEY)}


def _ground_truth(meta: dict):
    if "ground_truth" in meta:
        return meta["ground_truth"]
    rm = meta.get("reward_model")
    if isinstance(rm, dict) and "ground_truth" in rm:
        return rm["ground_truth"]
    raise MissingGroundTruth(f"no ground truth for compute_score: meta has neither 'ground_truth' nor "
                   f"'reward_model.ground_truth' (keys: {sorted(_columns(meta))}); map the column with "
                   f"data.fields={{ground_truth: <column>}}")


Item = tuple[str, str, dict, list[int]]  # (completion, prompt, meta, completion token ids without EOS)


def call_batch(form: str, fn: Callable, items: list[Item], state: dict | None = None) -> list[tuple]:
    """Score ``items`` (``(completion, prompt, meta, completion_ids)`` each) with ``fn`` called in its ``form``.

    Returns one part per item: ``("ok", float)`` (a verl dict result: ``("ok", float, {key: float})``),
    ``("none", None)`` (not scored) or ``("error", "ExcType: message")``. A TRL-form function is
    called once for the whole batch (a raise flags every item), with ``trainer_state`` built from
    ``state``; the other forms once per item.
    """
    if form == "trl":
        try:
            values = _call_trl(fn, items, TrainerState(**(state or {})))
        except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from a hook are its errors too
            return [("error", f"{type(e).__name__}: {e}")] * len(items)
        return [_part(lambda v=v: None if v is None else check_reward(v)) for v in values]
    one = _call_verl if form == "verl" else _call_sample
    return [_part(lambda it=it: one(fn, *it[:3])) for it in items]


def _part(thunk: Callable[[], Any]) -> tuple:
    try:
        value = thunk()
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from a hook are its errors too
        return "error", f"{type(e).__name__}: {e}"
    if isinstance(value, tuple):  # (score, extras) from a verl dict
        return ("ok", *value)
    return ("none", None) if value is None else ("ok", value)


def _bind(fn: Callable, args: tuple, kwargs: dict, how: str) -> None:
    """SignatureError when ``fn`` cannot take ``args`` / ``kwargs`` (checked before the call)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise SignatureError(f"{getattr(fn, '__name__', fn)}{sig} cannot be called as {how}: {e}") from None


def _call_sample(fn: Callable, completion: str, prompt: str, meta: dict) -> float:
    _bind(fn, (completion, prompt, meta), {}, "fn(completion, prompt, meta)")
    return check_reward(fn(completion, prompt, meta))


def _call_verl(fn: Callable, completion: str, prompt: str, meta: dict) -> float | tuple[float, dict]:
    kwargs = {"data_source": meta.get("data_source"), "solution_str": completion,
              "ground_truth": _ground_truth(meta), "extra_info": meta.get("extra_info")}
    _bind(fn, (), kwargs, "compute_score(data_source=, solution_str=, ground_truth=, extra_info=)")
    value = fn(**kwargs)
    if isinstance(value, dict):  # verl's compute_score may return {"score": ..., <extra metrics>}
        if "score" not in value:
            raise KeyError(f"compute_score returned a dict without 'score' (keys: {sorted(value)})")
        extras = {str(k): float(v) for k, v in value.items() if k != "score" and isinstance(v, (int, float))
                  and math.isfinite(float(v))}
        score = check_reward(value["score"])
        return (score, extras) if extras else score
    return check_reward(value)


def _call_trl(fn: Callable, items: list[Item], state: TrainerState | None = None) -> list:
    """TRL's call: ``fn(prompts=[...], completions=[...], completion_ids=[...], trainer_state=...,
    **{column: [...]})``; chat prompts as message lists and completions as ``[{"role": "assistant",
    "content": ...}]``, as TRL passes them. Only the keywords ``fn`` accepts are passed (all of them
    with ``**kwargs``)."""
    ok = _accepts(fn)
    chat = all(it[2].get(MESSAGES_KEY) for it in items)
    names = dict.fromkeys(k for it in items for k in _columns(it[2]))
    kwargs = {k: [_columns(it[2]).get(k) for it in items] for k in names if ok(k)}
    if ok("prompts"):
        kwargs["prompts"] = [it[2][MESSAGES_KEY] if chat else it[1] for it in items]
    if ok("completion_ids"):
        kwargs["completion_ids"] = [list(it[3]) for it in items]
    if ok("trainer_state"):
        kwargs["trainer_state"] = state if state is not None else TrainerState()
    kwargs["completions"] = [[{"role": "assistant", "content": it[0]}] if chat else it[0] for it in items]
    _bind(fn, (), kwargs, f"TRL does, with the keywords {', '.join(sorted(kwargs))} (the dataset's columns "
                          f"and prompts, completions, completion_ids, trainer_state)")
    values = fn(**kwargs)
    if callable(getattr(values, "tolist", None)):  # a numpy array or a tensor, as TRL also accepts
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != len(items):
        raise TypeError(f"a TRL-style reward function must return a list with one value per completion; got "
                        f"{type(values).__name__} {repr(values)[:40]} for {len(items)} completions")
    return list(values)


def check_reward(value) -> float:
    """The hook's return value as a finite float, or TypeError/ValueError saying what it was."""
    if not isinstance(value, (int, float)):
        item = getattr(value, "item", None)  # numpy / torch scalars
        if callable(item):
            try:
                value = item()
            except Exception:  # noqa: BLE001
                pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"reward hook returned {type(value).__name__} {repr(value)[:40]}, expected a float")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward hook returned {value}, expected a finite float")
    return value


# ---------------------------------------------------------------------------------- combination
def combine(parts: list[tuple[str, Any]], weights: list[float]) -> tuple[float | None, str | None, list]:
    """Per-hook results -> ``(reward, flag, values)``.

    ``parts[i]`` is ``("ok", float)``, ``("none", None)`` or ``("error", "ExcType: msg")``. An error
    scores 0 for its hook and flags the sample; ``reward`` is the weighted sum of the hooks that
    scored, or None when none did (the sample is left out of the loss). ``values`` holds each hook's
    value (None where it did not score).
    """
    values, errors = [], []
    for i, (status, value, *_extras) in enumerate(parts):
        if status == "error":
            errors.append(f"hook {i}: {value}" if len(parts) > 1 else str(value))
            values.append(0.0)
        else:
            values.append(value if status == "ok" else None)
    scored = [(v, w) for v, w in zip(values, weights) if v is not None]
    reward = sum(v * w for v, w in scored) if scored else None
    flag = ("error: " + "; ".join(errors))[:500] if errors else None
    return reward, flag, values


# -------------------------------------------------------------------------------- parent side
def names_of(paths: list[str]) -> list[str]:
    """Each hook's short name for its metrics (``rewards/<name>/mean``): the function name, with its
    position appended where two hooks share one (``score_0``, ``score_1``)."""
    names = [p.rsplit(":", 1)[-1].rsplit(".", 1)[-1] for p in paths]
    return [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def load(path: str) -> tuple[Callable, tuple[str, str, str], str]:
    """``(callable, (kind, target, attr), form)`` of the hook at ``path``; HookError with the fix otherwise."""
    from rollyard.tasks.base import HookError  # lazy: workers load this module with the standard library only

    try:
        kind, target, attr = parse_hook(path)
    except ValueError:
        raise HookError(f"reward hook {path!r} is malformed: {RULE}; e.g. reward.hook=my_rewards:score "
                        f"or reward.hook=hooks/reward.py:score") from None
    if kind == "file" and not os.path.isfile(target):
        raise HookError(f"reward hook {path!r}: file {target} does not exist; {RULE} (relative paths are "
                        f"from the working directory {os.getcwd()})")
    try:
        module = _import(kind, target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise HookError(f"reward hook {path!r}: no module named {e.name!r} on the Python path; install it, "
                            f"run from the folder that holds it, or name the file: "
                            f"reward.hook=path/to/{target.replace('.', '/')}.py:{attr}") from None
        raise HookError(f"reward hook {path!r}: importing {target} failed: {type(e).__name__}: {e}; "
                        f"install the missing package or fix the module's imports") from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - any import-time failure of user code (sys.exit too) is bad input
        raise HookError(f"reward hook {path!r}: importing {target} raised {type(e).__name__}: {e}; "
                        f"fix the module so it imports cleanly") from None
    try:
        fn = get_attr(module, attr)
    except AttributeError:
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise HookError(f"reward hook {path!r}: {target} has no function {attr!r}; {hint}"
                        f"its functions: {', '.join(names[:12]) or '(none)'}") from None
    if not callable(fn):
        raise HookError(f"reward hook {path!r}: {attr} is a {type(fn).__name__}, not a function; "
                        f"{RULE}, naming a function in one of {ACCEPTED}")
    form = detect_form(fn)
    if form is None:
        raise HookError(f"reward hook {path!r}: {attr}{inspect.signature(fn)} matches none of the three accepted "
                        f"reward forms: {'; '.join(FORMS.values())}; rename its parameters to match one")
    return fn, (kind, target, attr), form


def _import(kind: str, target: str):
    try:
        return import_target(kind, target)
    except ModuleNotFoundError as e:
        # A console script does not put the working directory on sys.path; a hook module sitting in
        # it should still import (the workers get the same sys.path).
        cwd = os.getcwd()
        if kind == "module" and e.name == target.split(".")[0] and cwd not in sys.path and "" not in sys.path:
            sys.path.append(cwd)
            return import_target(kind, target)
        raise
