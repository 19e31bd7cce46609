"""The run's tools from its config: every start-up check, then the worker processes.

``toolbox(cfg, tokenizer)`` returns None when ``tools`` is empty (single-turn rollouts, as before), else a
:class:`~rollyard.env.loop.Toolbox` whose executor the caller closes. Bad input (a tool without hints
or docstring, an environment without ``reset``, a chat template
without tool support, a tool module that does not import) is a ConfigError: one line, exit 2, before
any worker starts. A built-in task with tools (``data.task=calculator``) gives the run its tools when
``tools.*`` names none, and its chat template when the tokenizer has none (``functions``, ``chat_template``).
"""

from __future__ import annotations

import contextlib

from rollyard.config import ConfigError, RunConfig
from rollyard.env import template, tools
from rollyard.env.executor import ToolExecutor
from rollyard.env.loop import Toolbox
from rollyard.tasks import builtin_template, builtin_tools, chat
from rollyard.tasks.base import DataError, HookError


def functions(cfg: RunConfig) -> list[str]:
    """The run's tool functions: ``tools.functions``; with neither it nor ``tools.environment`` set, the built-in
    task's tools (``data.task`` providing the prompts, e.g. ``calculator`` unless ``data.task_options.tools=0``)."""
    t, d = cfg.tools, cfg.data
    if t.functions or t.environment or not d.task or d.path:
        return list(t.functions)
    return builtin_tools(d.task, d.task_options)


def enabled(cfg: RunConfig) -> bool:
    return bool(functions(cfg) or cfg.tools.environment)


def chat_template(cfg: RunConfig, tokenizer) -> None:
    """The chat template a run with tools renders its prompts, tools and tool turns with (``roles.policy`` calls
    this): ``data.chat_template`` when set (a model whose own template has no tool support, e.g. SmolLM2's, gets
    one: ``examples/smollm2_tools.jinja``), else the built-in task's when the tokenizer has none (a preset's
    character tokenizer). A run without tools keeps the tokenizer's (``data.chat_template`` renders its prompts).
    ConfigError (one line) when the template cannot hold a tool conversation."""
    if not enabled(cfg):
        return
    if cfg.data.chat_template:
        try:
            tokenizer.chat_template = chat.template_of(cfg.data.chat_template, tokenizer)
        except DataError as e:
            raise ConfigError(str(e)) from None
    elif cfg.data.task and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = builtin_template(cfg.data.task)
    template.check_template(tokenizer, [s.schema for s in specs(cfg)[0]])  # at start-up: before a warm start uses it


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
        target, found, has_reward = None, tools.tool_specs(functions(cfg)), False
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
                                memory_mb=t.memory_mb, cpu_s=t.cpu_s, max_output_bytes=t.max_output_bytes,
                                max_output_tokens=t.max_output_tokens, tokenizer=tokenizer)
    except HookError as e:
        raise ConfigError(str(e)) from None
    return Toolbox(tokenizer, schemas, executor, t.max_tool_calling_iterations,
                   environment=target[2] if target else None, env_reward=has_reward)


@contextlib.contextmanager
def for_eval(cfg: RunConfig, tokenizer):
    """The held-out eval's toolbox (its own tool workers, closed on exit), or None for a run without tools: the
    eval runs the same multi-turn loop with the same tools as the rollouts (``evaluate.greedy_accuracy``)."""
    box = toolbox(cfg, tokenizer)
    try:
        yield box
    finally:
        if box is not None:
            box.executor.close()
