"""GKD's sequence-level KD (``algo.gkd_seq_kd``, TRL's ``seq_kd``): the off-policy share's completions sampled by the
teacher.

A prompt drawn off-policy (``algo/gkd.on_policy``) trains, with ``gkd_seq_kd``, on completions the teacher samples
instead of the dataset's reference completion: one per sample of its group, as TRL's ``GKDTrainer`` generates one
per row with the teacher. They are sampled by rollyard's own engine (``rollout/engine.RolloutEngine``) over the
teacher's weights, under the rollout's settings (``rollout.temperature``, ``top_p``, ``top_k``, ``precision``, the
completion cap, stopping at an end token: the tokenizer's, the model's generation config's, ``rollout.stop_tokens``),
so they are real teacher samples; the teacher then scores them
(its top-k) like any GKD sample. The engine lives in the trainer's process beside the inline teacher
(``teacher.placement=inline``; the pool's actors only score).

Each call reseeds the engine from ``(run seed, the groups' request ids)``: a resume or a streamed round samples the
same completions for the same groups, with no sampling state to checkpoint.
"""

from __future__ import annotations

import hashlib

from rollyard.config import RunConfig
from rollyard.model import kv_budget
from rollyard.model.loading import eos_ids
from rollyard.rollout.engine import RolloutEngine
from rollyard.trainer.precision import engine_dtype, rollout_precision
from rollyard.types import Request, Sample


class TeacherSampler:
    """``complete(samples, max_new_tokens, context)``: per sample id, a completion the teacher sampled for its
    prompt: ``(token ids, None (every token in the loss), finish_reason)``, the ids ending in an end token when it
    stopped (``"stop"``), at most ``max_new_tokens`` and the context's room."""

    def __init__(self, engine, seed: int):
        self.engine = engine
        self.seed = seed

    def complete(self, samples: list[Sample], max_new_tokens: int, context: int) -> dict[str, tuple[list[int], None, str]]:
        groups: dict[str, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.request_id, []).append(s)
        if not groups:
            return {}
        requests = [Request(id=rid, prompt_ids=list(g[0].prompt_ids), n=len(g),
                            max_new_tokens=max(1, min(max_new_tokens, context - len(g[0].prompt_ids))))
                    for rid, g in groups.items()]
        self.engine.generator.manual_seed(draw_seed(self.seed, list(groups)))
        out, rejected = self.engine.generate(requests)
        if rejected:
            r, why = rejected[0]
            raise RuntimeError(f"the GKD teacher's engine (algo.gkd_seq_kd) rejected prompt {r.id}: {why}")
        got: dict[str, list[Sample]] = {}
        for t in out:
            got.setdefault(t.request_id, []).append(t)
        return {s.id: (list(t.completion_ids), None, t.finish_reason)
                for rid, g in groups.items() for s, t in zip(g, got[rid], strict=True)}


def draw_seed(seed: int, request_ids: list[str]) -> int:
    """A 63-bit sampling seed fixed by the run's seed and the groups sampled together."""
    h = hashlib.blake2b(f"{seed}:seq_kd:{','.join(request_ids)}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") >> 1


def build(cfg: RunConfig, model, tokenizer) -> TeacherSampler:
    """The teacher's sampler for ``cfg``: rollyard's engine over the teacher ``model`` with the rollout's settings."""
    r = cfg.rollout
    device = str(next(model.parameters()).device)
    chosen, _ = rollout_precision(r.precision, model, next(model.parameters()).device)
    engine = RolloutEngine(model, eos_token_id=eos_ids(model, tokenizer, r.stop_tokens),
                           pad_token_id=tokenizer.pad_token_id or 0, temperature=r.temperature, top_p=r.top_p,
                           top_k=r.top_k, max_concurrent=r.max_concurrent,
                           max_cache_tokens=kv_budget.cache_tokens(cfg, model, device), seed=cfg.seed,
                           compute_dtype=engine_dtype(chosen))
    return TeacherSampler(engine, cfg.seed)
