"""Warm start: supervised training on task demonstrations until the policy sometimes succeeds.

No pretrained model exists on this machine, and RL from a random policy gets no reward signal.
``warm_start`` trains on demos until held-out greedy accuracy reaches a target (or a step cap)
and caches the result keyed by everything that determines it, so the next run loads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import deque
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from rollyard import signals
from rollyard.config import ConfigError, RunConfig
from rollyard.env import setup as env_setup
from rollyard.env import template as env_template
from rollyard.evaluate import greedy_accuracy
from rollyard.model import cpu
from rollyard.model.gguf import sweep_stale
from rollyard.model.loading import export, load_policy
from rollyard.reward.dispatcher import RewardDispatcher
from rollyard.tasks.base import Prompt
from rollyard.trainer.trainer import Trainer

# data.* settings that decide the warm start: its demonstrations and the held-out set its stop test uses
DATA_KEYS = ("task", "task_options", "path", "fields", "train_size", "seed", "chat_template", "eval_size", "eval_path")


def cache_key(cfg: RunConfig) -> str:
    """A hash of what decides the warm start, and nothing else: the preset and its init (model.*, not
    the LoRA adapter, which is attached after it), the demonstrations and held-out prompts (DATA_KEYS,
    and the size and time of a dataset file), the sft.* settings, and the trainer's micro-batching.
    Not the RL settings (steps, seed, rollout.max_new_tokens, reward.*, ...): SFT's stop test
    generates as many tokens as the longest demonstration (see ``train_sft``)."""
    d = cfg.data
    files = {k: _stamp(getattr(d, k)) for k in ("path", "eval_path") if getattr(d, k)}
    blob = json.dumps({"model": cfg.model.model_dump(exclude={"lora"}), "data": d.model_dump(include=set(DATA_KEYS)),
                       "files": files, "sft": cfg.sft.model_dump(exclude={"cache_dir", "auto"}),
                       "trainer": cfg.trainer.model_dump(include={"micro_batch_tokens", "logprob_chunk"}), "v": 2,
                       # the CPU class decides kernels and rounding (ROLLYARD_CPU_ISA narrows it): another class's
                       # warm start is another model
                       "cpu": cpu.cpu_class(),
                       # tools: demos' tool turns are masked out of the loss (a warm start cached before that differs)
                       **({"tool_mask": 1} if env_setup.enabled(cfg) else {})},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _stamp(path: str) -> list[int] | None:
    """(size, mtime in ns) of a dataset file, so an edited file is a new warm start; None when missing."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


class ToolDemos(NamedTuple):
    """What demonstrations of a run with tools need: the schemas its chat prompts are rendered with (as the
    rollouts render them, ``env/loop.py``), and the template's text around a tool's output (``tool_turn_bounds``)."""

    schemas: list[dict]
    head: str
    tail: str


def demos(prompts: list[Prompt], tokenizer, tools: ToolDemos | None = None
          ) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, completion ids + EOS, loss mask) per prompt with a ``demo``, or else a string ``meta["answer"]``.

    With ``tools``, a chat prompt is rendered with the tools' schemas in it, and each tool turn of a demo is
    tokenized on its own and masked out of the loss (0), as the multi-turn rollout builds it and the GRPO loss
    masks it (env/loop.py): the model learns its calls and answers, never the tool's output."""
    out = []
    for p in prompts:
        demo = p.demo if p.demo is not None else (p.meta or {}).get("answer")
        if not isinstance(demo, str) or not demo:
            continue
        if tools and p.messages:
            ids = env_template.prompt_with_tools(tokenizer, p.messages, tools.schemas)
        else:
            ids = tokenizer(p.text, add_special_tokens=p.messages is None)["input_ids"]  # as to_requests
        comp: list[int] = []
        mask: list[int] = []
        for text, model in env_template.demo_turns(demo, tools.head, tools.tail) if tools else [(demo, True)]:
            part = tokenizer(text, add_special_tokens=False)["input_ids"]
            comp += part
            mask += [int(model)] * len(part)
        out.append((ids, comp + [tokenizer.eos_token_id], mask + [1]))
    return out


def tool_demos(cfg: RunConfig, tokenizer) -> ToolDemos | None:
    """The run's :class:`ToolDemos` when it has tools, else None."""
    if not env_setup.enabled(cfg):
        return None
    eos = tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False)  # what ends a model turn
    return ToolDemos([t.schema for t in env_setup.specs(cfg)[0]], *env_template.tool_turn_bounds(tokenizer, eos))


def train_sft(model, tokenizer, train: list[Prompt], held: list[Prompt], rewards: RewardDispatcher, cfg: RunConfig,
              context: int, device: str, log: Callable[[str], None] = print) -> dict:
    """SFT ``model`` in place until the median of the last ``cfg.sft.target_evals`` held-out evals reaches
    ``cfg.sft.target_accuracy`` (or ``cfg.sft.steps``), and leave it at the weights of that median eval; return a
    summary.

    Between two evals the policy moves by several points (measured on the demo: 25 steps apart, 24.6% then 44.2%),
    so the model at whichever eval first crosses the target is a draw from that swing. The median of the last k evals
    ignores one eval that jumps up (it cannot stop SFT alone) or down (it does not restart the count), and keeping the
    median eval's weights makes the warm start's accuracy that median: the level SFT reached, not its luckiest eval.
    k = 1 is the plain rule: the first eval at the target, its weights."""
    s = cfg.sft
    pairs = demos(train, tokenizer, tool_demos(cfg, tokenizer))
    if not pairs:
        raise ConfigError("sft.auto=true warm-starts a preset on demonstrations, but no prompt has one nor a string "
                          "`answer` (map a column with data.fields={demo: <column>}); set sft.auto=false or "
                          "model.name=<a local model>")
    trainer = Trainer(model, lr=s.lr, max_grad_norm=1.0, micro_batch_tokens=cfg.trainer.micro_batch_tokens,
                      logprob_chunk=cfg.trainer.logprob_chunk, device=device)
    g = torch.Generator().manual_seed(cfg.model.seed)  # part of making the initial policy, like the init
    acc, t0, step, loss, kept = 0.0, time.time(), 0, float("nan"), None
    window: deque[tuple[float, int, dict]] = deque(maxlen=s.target_evals)  # (accuracy, step, weights) per eval
    longest = max(len(c) for _, c, _ in pairs)  # the stop test's budget: the longest demo (EOS included), not RL's

    def evaluate() -> float | None:  # with the run's tools, as the rollouts and the run's held-out eval
        with env_setup.for_eval(cfg, tokenizer) as tools:
            return greedy_accuracy(model, tokenizer, held, rewards, longest, context, tools=tools)

    for step in range(1, s.steps + 1):
        signals.raise_if_stopping_warm_start()  # SIGTERM / SIGINT: stop within a step, not after the warm start
        idx = torch.randint(len(pairs), (s.batch_size,), generator=g).tolist()
        loss = trainer.sft_step([pairs[i] for i in idx])["loss"]
        if held and (step % s.eval_every == 0 or step == s.steps):
            acc = evaluate()
            window.append((acc, step, _weights(model) if s.target_evals > 1 else {}))
            med = median_eval(window)
            need = (f", median of the last {s.target_evals} evals: {med[0]:.1%}" if s.target_evals > 1
                    and len(window) == s.target_evals else "")
            log(f"sft step {step}/{s.steps}: loss {loss:.3f}, held-out greedy accuracy {acc:.1%} "
                f"(target {s.target_accuracy:.0%}{need}, {time.time() - t0:.0f}s)")
            if len(window) == s.target_evals and med[0] >= s.target_accuracy:
                kept = med
                break
    info = {"sft_steps": step, "sft_loss": loss, "sft_accuracy": acc, "sft_seconds": time.time() - t0}
    if kept is not None and kept[1] != step:  # the median eval is an earlier one: back to its weights
        model.load_state_dict(kept[2])
        log(f"warm start: kept the weights of sft step {kept[1]} ({kept[0]:.1%}, the median of the last "
            f"{s.target_evals} evals)")
    if kept is not None:
        info.update(sft_accuracy=kept[0], sft_kept_step=kept[1])
    return info


def median_eval(window) -> tuple:
    """The median entry of ``window`` by accuracy (the lower one of an even count: two evals both at the target; of
    equal accuracies, the latest)."""
    value = sorted(e[0] for e in window)[(len(window) - 1) // 2]
    return [e for e in window if e[0] == value][-1]


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def warm_start(model, tokenizer, train: list[Prompt], held: list[Prompt], rewards: RewardDispatcher, cfg: RunConfig,
               context: int, device: str, log: Callable[[str], None] = print):
    """Return a warm-started ``(model, info)``, from the cache when this exact setup was done before."""
    sweep_stale(Path(cfg.sft.cache_dir))  # copies a killed warm start left (``<key>.tmp<pid>``: a model each)
    if not demos(train, tokenizer):
        log("warm start skipped: the prompts carry no `demo` and no string `answer` to learn from (set sft.auto=false "
            "to silence this, or add a demo column with data.fields.demo=...); RL starts from the untrained preset")
        return model, {"sft_skipped": "no demonstrations"}
    cache = Path(cfg.sft.cache_dir) / cache_key(cfg)
    if (cache / "config.json").exists():
        log(f"warm start: loading cached SFT model from {cache}")
        model, _ = load_policy(str(cache))
        info = json.loads((cache / "sft.json").read_text())
        return model.to(device), {**info, "cached": True}
    log(f"warm start: SFT on task demonstrations (up to {cfg.sft.steps} steps, target {cfg.sft.target_accuracy:.0%})")
    info = train_sft(model, tokenizer, train, held, rewards, cfg, context, device, log)
    # Written aside under a name of this process's own, then renamed into place: two runs warm-starting the same
    # setup at once (the same key: the same model) each write their own copy, the first rename wins and the other
    # copy is dropped; a reader never sees a half-written directory.
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    export(model, tokenizer, tmp)
    (tmp / "sft.json").write_text(json.dumps(info))
    if not (cache / "config.json").exists():
        shutil.rmtree(cache, ignore_errors=True)  # a directory left without its config: an interrupted older write
        try:
            tmp.rename(cache)
        except OSError:  # another run renamed its copy in between
            pass
    shutil.rmtree(tmp, ignore_errors=True)
    return model, {**info, "cached": False}
