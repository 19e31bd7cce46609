"""Held-out greedy accuracy: one greedy sample per prompt, scored by a correctness signal.

Accuracy means "share correct" only when the score says correct / not. The signal is, in order:
``eval.reward`` (a verifier the user names for the eval, separate from the training reward), the
built-in task's verifier (no ``reward.hook``), or the training reward when the user declares it a
correctness signal (``reward.correctness=true``). A custom training reward alone is no correctness
signal: there is then no held-out eval (a random model would otherwise read as 100% accurate under
a reward that is high for anything), and the start-up line says how to get one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollyard.env.loop import MultiTurn
from rollyard.model.loading import eos_ids
from rollyard.reward.dispatcher import RewardDispatcher
from rollyard.rollout.engine import RolloutEngine
from rollyard.rollout.scheduler import to_requests
from rollyard.tasks.base import Prompt

if TYPE_CHECKING:
    from rollyard.config import RunConfig


def train_reward_is_correctness(cfg: RunConfig) -> bool:
    """The training reward says correct / not: a built-in task's verifier, or ``reward.correctness``
    (then ``reward/accuracy`` is the share of rewards > 0.5)."""
    rw = cfg.reward
    return rw.correctness or not (rw.hook or rw.hooks)


def accuracy_signal(cfg: RunConfig) -> str | None:
    """What scores the held-out eval, in words for the console and run.json; None: no correctness signal."""
    rw = cfg.reward
    if cfg.eval.reward:
        return f"eval.reward={cfg.eval.reward}"
    if not (rw.hook or rw.hooks):
        return f"the {cfg.data.task} task's verifier" if cfg.data.task else None
    if rw.correctness:
        return f"the training reward {rw.hook or rw.hooks} (reward.correctness=true)"
    return None


def no_signal_reason(cfg: RunConfig) -> str:
    """Why a run has no held-out accuracy, and the fix (one line)."""
    rw = cfg.reward
    named = f"reward.hook={rw.hook}" if rw.hook else f"reward.hooks={rw.hooks}"
    return (f"no held-out accuracy: {named} is not declared a correctness signal (a reward that is high for any "
            f"text would read as accuracy); name a verifier with eval.reward=module:function (1 correct, 0 not), "
            f"or set reward.correctness=true if the training reward is one")


def cadence_note(cfg: RunConfig) -> str | None:
    """A start-up note when held-out accuracy is measured only before and after RL: the reward-hacking and
    held-out regression alarms compare evals made during the run, so with ``eval_every=0`` they never fire."""
    if cfg.eval_every:
        return None
    return (f"held-out eval only before and after RL (eval_every=0): the reward-hacking and held-out regression "
            f"alarms compare evals made during the run; set eval_every=N (e.g. {max(1, cfg.steps // 20)}, every 5% "
            f"of the {cfg.steps} steps) to arm them")


def greedy_accuracy(model, tokenizer, prompts: list[Prompt], rewards: RewardDispatcher | None,
                    max_new_tokens: int, context: int, max_concurrent: int = 256, tools=None,
                    stop: list[str] | tuple[str, ...] = ()) -> float | None:
    """Fraction of ``prompts`` whose greedy completion ``rewards`` scores > 0.5; None with no prompts or
    no correctness signal (``rewards`` None). ``tools`` (an ``env.loop.Toolbox``, e.g. ``env.setup.for_eval``'s):
    the completion is multi-turn with those tools, as the run's rollouts are. ``stop``: ``rollout.stop_tokens``."""
    if not prompts or rewards is None:
        return None
    requests, _dead = to_requests(prompts, tokenizer, n=1, max_new_tokens=max_new_tokens, context=context, suffix="@eval")
    # KV budget: these requests at once, not the engine's default 65536 tokens (3 GB for a 135M real model)
    width = max((len(q.prompt_ids) + max_new_tokens for q in requests), default=64)
    engine = RolloutEngine(model, eos_token_id=eos_ids(model, tokenizer, stop), pad_token_id=tokenizer.pad_token_id or 0,
                           temperature=0.0, max_concurrent=max_concurrent,
                           max_cache_tokens=max(64, min(len(requests), max_concurrent) * width))
    was_training = model.training
    model.eval()
    samples, _rejected = (MultiTurn(engine, tools) if tools is not None else engine).generate(requests)
    model.train(was_training)
    scored = rewards.score(samples)
    return sum(s.reward is not None and s.reward > 0.5 for s in scored) / len(prompts)
