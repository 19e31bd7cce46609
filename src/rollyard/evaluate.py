"""Held-out greedy accuracy: one greedy sample per prompt, scored by the run's verifier."""

from __future__ import annotations

from rollyard.model.loading import eos_ids
from rollyard.reward.dispatcher import RewardDispatcher
from rollyard.rollout.engine import RolloutEngine
from rollyard.rollout.scheduler import to_requests
from rollyard.tasks.base import Prompt


def greedy_accuracy(model, tokenizer, prompts: list[Prompt], rewards: RewardDispatcher,
                    max_new_tokens: int, context: int, max_concurrent: int = 256) -> float | None:
    """Fraction of ``prompts`` whose greedy completion the verifier scores > 0.5; None with no prompts."""
    if not prompts:
        return None
    engine = RolloutEngine(model, eos_token_id=eos_ids(model, tokenizer), pad_token_id=tokenizer.pad_token_id or 0,
                           temperature=0.0, max_concurrent=max_concurrent)
    requests, _dead = to_requests(prompts, tokenizer, n=1, max_new_tokens=max_new_tokens, context=context, suffix="@eval")
    was_training = model.training
    model.eval()
    samples, _rejected = engine.generate(requests)
    model.train(was_training)
    scored = rewards.score(samples)
    return sum(s.reward is not None and s.reward > 0.5 for s in scored) / len(prompts)
