"""Tools and environments as TRL names them, checked at start-up.

A tool is a plain module-level function (sync or async) with type hints and a Google-style docstring
(``Args:`` describing every parameter); its JSON schema is what ``transformers.utils.get_json_schema``
builds from them, the schema TRL puts in the chat template's ``tools``. It may return anything, as in
TRL: the value goes back to the model as ``str(value)``, a list of content blocks as it is
(``env/worker.py``); a call that raises goes back as TRL's ``{'error': ...}`` turn
(:func:`error_content`) and counts as a failed call (``tools/errors``). An environment is a class
(TRL's ``environment_factory``): one instance per sample, ``reset(**row)`` before the first turn,
every other public method a tool, an optional ``get_reward()`` read when the sample ends.

Tools are named by import path (``module:function``, ``path/file.py:function``, as reward hooks are)
because they run in worker processes that import them by name (``env/worker.py``). Every check
here raises :class:`~rollyard.config.ConfigError`: one line naming the tool, the rule and the fix.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

from rollyard.config import ConfigError
from rollyard.reward.hooks import get_attr, import_target, parse_hook, path_of

RESERVED = ("reset", "get_reward")  # environment methods that are not tools


@dataclass(frozen=True)
class ToolSpec:
    """One tool: its name (what the model calls), its JSON schema, and how a worker finds it.

    ``target`` is ``(kind, module-or-file, attr)`` as ``reward.hooks.parse_hook`` returns it; for an
    environment's method ``attr`` is the method name (called on the sample's instance).
    """

    name: str
    schema: dict
    target: tuple[str, str, str]


def path_or_name(obj) -> str:
    """A function or class as the import path the workers use; strings pass through."""
    if isinstance(obj, str):
        return obj
    try:
        return path_of(obj)
    except ValueError as e:
        raise ConfigError(f"tools: {e}") from None


def load(path: str, what: str):
    """Import ``path`` (``module:attr`` or ``file.py:attr``) in this process; ConfigError on failure."""
    try:
        kind, target, attr = parse_hook(path)
    except ValueError:
        raise ConfigError(f"{what} {path!r} is malformed: expected 'module:function' or 'path/to/file.py:function' "
                          f"(e.g. tools.functions=['my_tools:add'])") from None
    try:
        return get_attr(import_target(kind, target), attr), (kind, target, attr)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - user code failing to import is bad input
        raise ConfigError(f"{what} {path!r} cannot be imported ({type(e).__name__}: {e}); make it a module-level "
                          f"name of an importable module or file") from None


def schema_of(fn, what: str) -> dict:
    """The JSON schema TRL would build for ``fn``; ConfigError when its hints or docstring are missing."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - TypeHintParsingException / DocstringParsingException and kin
        raise ConfigError(f"{what}: {e}; a tool needs a type hint on every parameter and a docstring with a "
                          f"description and an 'Args:' line per parameter (as TRL requires)") from None
    return schema  # any return type: the worker sends the value back as TRL does (env/worker.py)


def error_content(message: str) -> str:
    """The tool turn of a call that raised, as TRL writes it: ``str({"error": str(exception)})``. ``message`` is the
    worker's ``"ExcType: text"``; TRL shows the exception's text only."""
    head, sep, text = message.partition(": ")
    return str({"error": text if sep and head.isidentifier() else message})


def tool_specs(functions: list[str]) -> list[ToolSpec]:
    """Specs of the plain tool functions at ``functions`` (import paths)."""
    out = []
    for path in functions:
        fn, target = load(path, "tool")
        if not callable(fn) or inspect.isclass(fn):
            raise ConfigError(f"tool {path!r} is a {type(fn).__name__}, not a function; pass a function (an "
                              f"environment class goes in environment_factory= / tools.environment)")
        schema = schema_of(fn, f"tool {path!r}")
        out.append(ToolSpec(schema["function"]["name"], schema, target))
    return out


def environment_class(factory, what: str) -> type:
    """The class of the environments ``factory`` makes: ``factory`` itself when it is a class, else the type of one
    instance it returns (TRL's ``environment_factory`` is any callable; like TRL, a factory function is called once
    here to see its instance's methods). ConfigError when it is not callable or its call fails."""
    if inspect.isclass(factory):
        return factory
    if not callable(factory):
        raise ConfigError(f"{what} is a {type(factory).__name__}, expected a class or a function returning an "
                          f"environment (reset() and tool methods; TRL's environment_factory)")
    try:
        return type(factory())
    except Exception as e:  # noqa: BLE001 - the user's factory failing is bad input
        raise ConfigError(f"{what}() raised {type(e).__name__}: {e}; expected a class or a function returning an "
                          f"environment, called with no arguments (TRL's environment_factory)") from None


def environment_specs(path: str) -> tuple[tuple[str, str, str], list[ToolSpec], bool]:
    """``(target, tool specs, has get_reward)`` of the environments the class or factory at ``path`` makes
    (the tool workers call ``target()`` once per sample, ``env/worker.py``)."""
    factory, target = load(path, "environment_factory")
    what = f"environment_factory {path!r}"
    cls = environment_class(factory, what)
    if not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"{what}: {cls.__name__} has no reset() method; add reset(self, **kwargs) (called with "
                          f"the dataset row before each sample's first turn, as in TRL)")
    specs = []
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") or name in RESERVED:
            continue
        # The schema of the method as called on an instance: bind it to the class so `self` drops out.
        schema = schema_of(types.MethodType(fn, cls), f"{what} method {name!r}")
        specs.append(ToolSpec(name, schema, (target[0], target[1], f"{target[2]}.{name}")))
    if not specs:
        raise ConfigError(f"{what}: {cls.__name__} has no public method besides reset/get_reward, so the model "
                          f"has no tool to call; add a type-hinted, documented method")
    return target, specs, callable(getattr(cls, "get_reward", None))


def check_unique(specs: list[ToolSpec]) -> None:
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"tools: the name(s) {dup} are given twice (the model calls a tool by name); rename one")
