"""The run's tools from its config: every start-up check, then the worker processes.

``toolbox(cfg, tokenizer)`` returns None when ``tools`` is empty (single-turn rollouts, as before), else a
:class:`~rollyard.env.loop.Toolbox` whose executor the caller closes. Bad input (a tool without hints
or docstring, a non-string return annotation, an environment without ``reset``, a chat template
without tool support, a tool module that does not import) is a ConfigError: one line, exit 2, before
any worker starts.
"""

from __future__ import annotations

from rollyard.config import ConfigError, RunConfig
from rollyard.env import template, tools
from rollyard.env.executor import ToolExecutor
from rollyard.env.loop import Toolbox
from rollyard.tasks.base import HookError


def enabled(cfg: RunConfig) -> bool:
    return bool(cfg.tools.functions or cfg.tools.environment)


def check(cfg: RunConfig) -> None:
    """The tools, and the settings they cannot run with: one line each (placement rules call it at start-up)."""
    if not enabled(cfg):
        return
    specs(cfg)  # the tools themselves (hints, docstrings, reset, imports), before any start-up work
    if cfg.rollout.scheduler == "tail":
        raise ConfigError("tools with rollout.scheduler=tail: the tail scheduler defers and resubmits single "
                          "completions, not trajectories; set rollout.scheduler=plain (or drop tools.*)")


def specs(cfg: RunConfig) -> tuple[list[tools.ToolSpec], tuple | None, bool]:
    """``(tool specs, environment target or None, environment has get_reward)``; ConfigError on bad input."""
    t = cfg.tools
    if t.functions and t.environment:
        raise ConfigError(f"tools.functions={t.functions} and tools.environment={t.environment!r} are both set: an "
                          f"environment's methods are its tools; put the functions on the class, or drop one")
    if t.environment:
        target, found, has_reward = tools.environment_specs(t.environment)
    else:
        target, found, has_reward = None, tools.tool_specs(t.functions), False
    tools.check_unique(found)
    return found, target, has_reward


def toolbox(cfg: RunConfig, tokenizer) -> Toolbox | None:
    if not enabled(cfg):
        return None
    found, target, has_reward = specs(cfg)
    schemas = [s.schema for s in found]
    template.check_template(tokenizer, schemas)
    t = cfg.tools
    try:
        executor = ToolExecutor(found, target, num_workers=t.num_workers, timeout_s=t.timeout_s,
                                memory_mb=t.memory_mb, cpu_s=t.cpu_s)
    except HookError as e:
        raise ConfigError(str(e)) from None
    return Toolbox(tokenizer, schemas, executor, t.max_tool_calling_iterations,
                   environment=target[2] if target else None, env_reward=has_reward)
