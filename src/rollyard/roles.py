"""Build each role from the typed config: small functions a placement driver calls at start-up.

Everything that can be wrong with the inputs fails here, before the first step: the model
directory, the dataset lines, the reward hook, a sync checksum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollyard import staleness
from rollyard.config import ConfigError, RunConfig
from rollyard.env import setup as env_setup
from rollyard.env.loop import MultiTurn
from rollyard.evaluate import accuracy_signal, greedy_accuracy
from rollyard.model import kv_budget, loading
from rollyard.model.loading import attach_lora, eos_ids
from rollyard.reward.dispatcher import RewardDispatcher
from rollyard.reward.hooks import ACCEPTED
from rollyard.reward.timeout import AnchorTimeout
from rollyard.rollout.engine import RolloutEngine
from rollyard.sync.factory import SyncPlan, resolve
from rollyard.tasks import builtin_verifier, chat, framing, load_task, render_task
from rollyard.tasks.base import DataError, HookError, Prompt
from rollyard.tasks.dataset import load_prompts

__all__ = ["Settings", "settings", "trainer_kwargs"]  # built where it lives (trainer/); named here for the drivers
from rollyard.trainer.precision import engine_dtype, rollout_precision
from rollyard.trainer.settings import trainer_kwargs
from rollyard.trainer.trainer import Trainer


def policy(cfg: RunConfig, device: str):
    """(model, tokenizer, context) for the run (``model/loading.py``); with ``rollout.backend=vllm`` the model
    is checked against vLLM here, at start-up (``rollout/vllm.py: check``)."""
    model, tokenizer, context = loading.policy(cfg, device)
    env_setup.chat_template(cfg, tokenizer)  # a built-in task's tools (calculator) bring the template of their turns
    kv_budget.check_fits(cfg, model, device)  # a KV budget or micro-batch that cannot fit: refused here, not OOM
    if cfg.rollout.backend == "vllm":
        from rollyard.rollout.vllm import check
        check(cfg, model)
    return model, tokenizer, context


@dataclass(frozen=True)
class Settings:
    """What start-up resolves from the config once, by one formula each (:func:`settings`), and hands to every
    process that needs it, the Ray rollout actors included: an actor never resolves them again. (An actor holds
    no GPU: resolving the trainer's device there would pick another dtype than the trainer's, or fail.)"""

    device: str  # the trainer's device: trainer.device with auto resolved (cpu, cuda, cuda:N)
    plan: SyncPlan  # the weight sync: mode x transport and the rollout copy's dtype (sync/factory.resolve)
    bound: int  # the staleness bound the placement runs under (staleness.bound_of)


def settings(cfg: RunConfig) -> Settings:
    """The run's :class:`Settings`; a device, sync or rollout-side (``tools.*``: ``env.setup.check``) setting that
    cannot work fails here (ConfigError, one line), before the run directory is touched."""
    env_setup.check(cfg)  # the engine's side: the tools, and the settings they cannot run with
    device = device_of(cfg)
    return Settings(device, resolve(cfg, device), staleness.bound_of(cfg.placement, cfg.max_staleness, cfg.sync.every,
                                                                     cfg.trainer.epochs * cfg.trainer.mini_batches))


def device_of(cfg: RunConfig) -> str:
    """The trainer's device; fails at start-up when it cannot hold ``trainer.dp`` ranks."""
    dev = cfg.trainer.device
    if dev == "auto":
        return _with_ranks(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(dev).type
    except (RuntimeError, ValueError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"trainer.device={dev!r} is not a device rollyard trains on: expected auto, cpu, cuda "
                          f"or cuda:N; set trainer.device=auto")
    if kind == "cuda":
        index = torch.device(dev).index or 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(f"trainer.device={dev} but {torch.cuda.device_count()} CUDA devices are visible; "
                              f"set trainer.device=cpu or auto")
    return _with_ranks(cfg, dev)


def _with_ranks(cfg: RunConfig, device: str) -> str:
    if cfg.trainer.dp > 1:
        from rollyard.trainer.dp import check_backend, check_ranks
        check_backend(cfg)
        check_ranks(cfg.trainer.dp, device)
    return device


def prompts(cfg: RunConfig, deadletter: list[dict], tokenizer) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval) prompts from the built-in task or the dataset files; chat prompts rendered by
    ``tokenizer``'s chat template (or ``data.chat_template``)."""
    d = cfg.data
    if d.path:
        train = load_prompts(d.path, fields=d.fields or None, on_error=d.on_error, deadletter=deadletter)
        if not train:
            first = deadletter[0].get("reason", "?") if deadletter else "the file holds no prompts"
            raise DataError(f"{d.path}: no usable prompt ({len(deadletter)} lines dead-lettered; first: {first}); "
                            f"fix the file or data.fields")
        held = (load_prompts(d.eval_path, fields=d.fields or None, on_error=d.on_error, deadletter=deadletter,
                             key="data.eval_path") if d.eval_path else [])
        if d.few_shot:
            raise DataError(f"data.few_shot={d.few_shot} takes its solved examples from a reasoning_gym:<task>, and "
                            f"this run reads prompts from data.path; put the examples in the file's messages, or "
                            f"set data.few_shot=0")
        system = framing.system_text(d.system_prompt)
        framing.frame(train + held, system)
        if not held and d.task:
            held = _task_prompts(cfg, "eval", d.eval_size)
            framing.frame(held, system)
            render_task(d.task, held, tokenizer, d.chat_template)
        chat.render(train + held, tokenizer, d.chat_template)
        return train, held
    held = _task_prompts(cfg, "eval", d.eval_size)
    train = _task_prompts(cfg, "train", d.train_size, held)  # a reasoning-gym train split skips held-out questions
    framing.frame(train + held, framing.system_text(d.system_prompt), _shots(cfg, held))
    render_task(d.task, train + held, tokenizer, d.chat_template)  # reasoning_gym: chat or plain by the template
    return train, held


def _shots(cfg: RunConfig, held: list[Prompt]) -> list[Prompt]:
    """``data.few_shot`` solved examples of a reasoning_gym task, from seeds neither split uses, none of them a
    held-out question (its answer would be in every prompt)."""
    d = cfg.data
    if not d.few_shot:
        return []
    if not (d.task or "").startswith("reasoning_gym:"):
        raise DataError(f"data.few_shot={d.few_shot} needs a reasoning_gym:<task> (its solved examples come from "
                        f"seeds neither split uses); data.task is {d.task!r}: set data.few_shot=0")
    from rollyard.tasks import reasoning_gym
    return reasoning_gym.generate(d.task, "shots", d.few_shot, d.seed, exclude=reasoning_gym.questions(held),
                                  **d.task_options)


# data.task_options names rollyard passes to a task itself, and the settings that set them
_RESERVED_OPTIONS = {"seed": "data.seed", "n": "data.train_size and data.eval_size",
                     "split": "rollyard (train and eval splits)", "held_out": "rollyard (the eval split)",
                     "exclude": "rollyard (the eval split)"}


def _task_prompts(cfg: RunConfig, split: str, n: int, held: list[Prompt] = ()) -> list[Prompt]:
    d = cfg.data
    for key in d.task_options:
        if key in _RESERVED_OPTIONS:
            value = d.task_options[key]
            fix = f"set data.seed={value} instead" if key == "seed" else "remove it"
            raise DataError(f"data.task_options.{key}={value!r}: a task's {key} is set by {_RESERVED_OPTIONS[key]}, "
                            f"not by a task option; remove it from data.task_options and {fix}".replace(
                                " and remove it", ""))
    try:
        return load_task(d.task, split, n, d.seed, held_out=held, **d.task_options)
    except DataError:
        raise
    except (TypeError, ValueError) as e:  # a knob of the right name with a value the task cannot use
        raise DataError(f"data.task_options={d.task_options} are not valid for task {d.task!r}: {e}; "
                        f"see the task's options in its module docstring") from None


def reward_hooks(cfg: RunConfig) -> list[str]:
    """The run's reward functions: ``reward.hooks``, else ``reward.hook``, else the built-in task's verifier."""
    if cfg.reward.hooks or cfg.reward.hook:
        return cfg.reward.hooks or [cfg.reward.hook]
    if cfg.data.path and not cfg.data.task:
        raise HookError(
            f"data.path={cfg.data.path!r} has no built-in verifier: set reward.hook=module:function "
            f"(or reward.hooks=[...]) naming a function in one of {ACCEPTED}"
        )
    return [builtin_verifier(cfg.data.task)]


def rewards(cfg: RunConfig, tokenizer, model=None) -> RewardDispatcher:
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    t = cfg.tail  # streaming rewards (scheduler=tail) get the adaptive per-call timeout; T_max = reward.timeout_s
    policy = (AnchorTimeout(t.reward_t_min, t.reward_lambda, cfg.reward.timeout_s, t.reward_window)
              if cfg.rollout.scheduler == "tail" else None)
    return RewardDispatcher(reward_hooks(cfg), weights=cfg.reward.weights or None, num_workers=cfg.reward.num_workers,
                            timeout_s=cfg.reward.timeout_s, decode=decode, eos_token_id=eos_ids(model, tokenizer, cfg.rollout.stop_tokens),
                            memory_mb=cfg.reward.memory_mb, cpu_s=cfg.reward.cpu_s,
                            timeout_policy=policy, columns=cfg.data.fields)


def eval_rewards(cfg: RunConfig, tokenizer, model, train: RewardDispatcher) -> RewardDispatcher | None:
    """The held-out eval's scorer (``evaluate.accuracy_signal``): ``eval.reward``'s own verifier pool,
    the training reward's pool when it is a correctness signal, else None (no held-out accuracy)."""
    if cfg.eval.reward:
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return RewardDispatcher([cfg.eval.reward], num_workers=min(cfg.reward.num_workers, 2),
                                timeout_s=cfg.reward.timeout_s, decode=decode, eos_token_id=eos_ids(model, tokenizer, cfg.rollout.stop_tokens),
                                memory_mb=cfg.reward.memory_mb, cpu_s=cfg.reward.cpu_s, columns=cfg.data.fields)
    return train if accuracy_signal(cfg) else None


def held_out_accuracy(cfg: RunConfig, model, tokenizer, prompts: list[Prompt], rewards, context: int) -> float | None:
    """Greedy accuracy on ``prompts`` (``evaluate.greedy_accuracy``) with the rollouts' own engine side: a run with
    tools is evaluated multi-turn with them (``env.setup.for_eval``)."""
    with env_setup.for_eval(cfg, tokenizer) as box:
        return greedy_accuracy(model, tokenizer, prompts, rewards, cfg.rollout.max_new_tokens, context, tools=box,
                               stop=cfg.rollout.stop_tokens)


def rollout_facts(cfg: RunConfig) -> dict:
    """What run.json states about the rollouts' engine side: ``tools``, the functions or environment the rollouts
    and the held-out eval run with (None: single-turn)."""
    return {"tools": env_setup.functions(cfg) or cfg.tools.environment}


def with_lora(cfg: RunConfig, model):
    """The policy to train: ``model`` itself, or wrapped in a PEFT LoRA adapter when ``model.lora.r > 0``."""
    lora = cfg.model.lora
    return attach_lora(model, lora.r, lora.alpha, lora.targets) if lora.r > 0 else model


def engine(cfg: RunConfig, model, tokenizer, version: int = 0, seed: int | None = None):
    """The rollout engine of ``rollout.backend`` (rollyard's own, or one vLLM engine: ``rollout/vllm.py``); with
    ``tools.*`` set, wrapped in the multi-turn loop (``env/loop.MultiTurn``: the same contract, trajectories over
    the engine, the tool calls' counters in its ``drain``). Every rollout side builds its engine here."""
    eng = _bare_engine(cfg, model, tokenizer, version, seed)
    box = env_setup.toolbox(cfg, tokenizer)
    return eng if box is None else MultiTurn(eng, box)


def _bare_engine(cfg: RunConfig, model, tokenizer, version: int, seed: int | None) -> RolloutEngine:
    r = cfg.rollout
    budget = kv_budget.cache_tokens(cfg, model, _device(model))  # rollout.kv_memory_gb over the model's KV bytes/token
    if r.backend == "vllm":
        from rollyard.rollout.vllm import VllmEngine
        return VllmEngine(model, eos_token_id=eos_ids(model, tokenizer, cfg.rollout.stop_tokens), pad_token_id=tokenizer.pad_token_id or 0,
                          temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_concurrent=r.max_concurrent,
                          max_cache_tokens=budget, seed=cfg.seed if seed is None else seed,
                          version=version, options=r.vllm)
    chosen, _ = rollout_precision(r.precision, model, torch.device(_device(model)))
    return RolloutEngine(model, eos_token_id=eos_ids(model, tokenizer, cfg.rollout.stop_tokens), pad_token_id=tokenizer.pad_token_id or 0,
                         temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_concurrent=r.max_concurrent,
                         max_cache_tokens=budget, seed=cfg.seed if seed is None else seed,
                         version=version, compute_dtype=engine_dtype(chosen))


def _device(model) -> str:
    return str(next(model.parameters()).device)


def trainer(cfg: RunConfig, model, device: str):
    """A Trainer, or with ``trainer.dp > 1`` a handle over dp ranks with the same methods (trainer/dp.py)."""
    if cfg.trainer.dp > 1:
        from rollyard.trainer.dp import DataParallelTrainer
        return DataParallelTrainer(cfg, model, device)
    return Trainer(model, **trainer_kwargs(cfg), device=device)
