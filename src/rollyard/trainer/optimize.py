"""The optimisation loop over one generation batch: ``epochs`` passes, each ``mini_batches`` optimizer steps.

TRL's ``num_iterations`` and ``steps_per_generation``, verl's ``ppo_epochs`` and ``ppo_mini_batch_size``: the step's
samples are cut into ``mini_batches`` parts of whole groups (a group's advantages were computed together, and its
prompt is shared in the forward), and every pass steps the optimizer once per part. pi_old is the policy that
generated the batch's ratio baseline: with one update it is the current policy, read from the training forward
itself (no extra pass); with more it is computed once, before the first update (one no-grad pass), so the ratio and
clip act from the second update on. With ``top_entropy_quantile < 1`` each update first scores its part once
without gradients for the entropies the top-entropy mask is taken from (the mask of TRL's forward, which has the
same weights).

``trainer`` is anything with ``step(samples, old_logprobs, entropy_masks=...)`` and ``logprobs(samples)``: the
in-process Trainer or the data-parallel handle.
"""

from __future__ import annotations

import time

import torch

from rollyard.algo.policy_loss import entropy_mask
from rollyard.types import Sample

# per-update metrics that add up over the updates of a step (work done); the rest are averaged
SUMMED = ("optimizer_s", "lm_head_s", "micro_batches", "packed_tokens", "computed_positions", "recomputed_positions", "positions")


def split_groups(samples: list[Sample], parts: int) -> list[list[int]]:
    """Indices of ``samples`` in ``parts`` runs of whole groups (same ``request_id``), in order, as even in samples as
    whole groups allow; fewer parts when there are fewer groups."""
    groups: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.request_id, []).append(i)
    ordered = list(groups.values())
    parts = max(1, min(parts, len(ordered)))
    out: list[list[int]] = [[] for _ in range(parts)]
    total, done = len(samples), 0
    k = 0
    for g in ordered:
        # move to the next part once this one holds its share of the samples so far
        while k < parts - 1 and done >= total * (k + 1) / parts:
            k += 1
        out[k] += g
        done += len(g)
    return [p for p in out if p]


def optimize(trainer, samples: list[Sample], epochs: int = 1, mini_batches: int = 1,
             top_entropy_quantile: float = 1.0, loss_mask=None) -> dict[str, float]:
    """``epochs x mini_batches`` optimizer steps on ``samples``; the step's metrics (means over the updates, work
    counters summed) with ``updates`` (optimizer steps taken), ``applied`` (those not skipped as non-finite) and
    ``old_logprob_s`` (the pi_old pass)."""
    parts = split_groups(samples, mini_batches)
    # always epochs x mini_batches optimizer steps, so versions and the learning-rate schedule advance the same
    # whatever the step holds (fewer groups than mini-batches: dead-lettered prompts, failed verifiers): a part
    # without samples is a step with nothing to learn (no weight change; the schedule moves on, as in TRL)
    parts += [[] for _ in range(mini_batches - len(parts))]
    old, old_s = None, 0.0
    if epochs * len(parts) > 1 and samples:
        t0 = time.perf_counter()
        old = old_logprobs(trainer, samples)
        old_s = time.perf_counter() - t0
    rows = []
    for _ in range(epochs):
        for idx in parts:
            sub = [samples[i] for i in idx]
            masks = None
            if top_entropy_quantile < 1.0 and sub:
                _, ents = trainer.logprobs_and_entropy(sub)
                masks = entropy_mask(ents, [_mask_tensor(loss_mask, s) for s in sub], top_entropy_quantile)
            kw = {} if masks is None else {"entropy_masks": masks}
            rows.append(trainer.step(sub, None if old is None else [old[i] for i in idx], **kw))
    return merge(rows, epochs, old_s)


def old_logprobs(trainer, samples: list[Sample]) -> list:
    """pi_old's log-probs of the samples the updates will compute (useful work: a sample that cannot move the
    weights is never forwarded, its entry zeros of its length)."""
    moves = getattr(trainer, "moves_weights", lambda s: True)
    idx = [i for i, s in enumerate(samples) if moves(s)]
    out = [torch.zeros(len(s.completion_ids)) for s in samples]
    for i, lp in zip(idx, trainer.logprobs([samples[i] for i in idx]) if idx else []):
        out[i] = lp
    return out


def _mask_tensor(loss_mask, s: Sample):
    return torch.tensor(loss_mask(s) if loss_mask is not None else s.loss_mask, dtype=torch.float32)


def merge(rows: list[dict[str, float]], epochs: int = 1, old_s: float = 0.0) -> dict[str, float]:
    """One step's metrics from its updates' rows (``epochs`` passes over the same samples: ``tokens`` counts the
    batch's loss tokens once)."""
    if len(rows) == 1:
        return {**rows[0], "updates": 1.0, "applied": 1.0 - rows[0].get("skipped", 0.0), "old_logprob_s": old_s}
    keys = {k for r in rows for k in r}
    out: dict[str, float] = {}
    for k in keys:
        vals = [r[k] for r in rows if k in r]
        if k in SUMMED:
            out[k] = float(sum(vals))
        else:  # a mean over the updates that measured it (an update that computed nothing has no ratio)
            seen = [v for v in vals if v == v]
            out[k] = float(sum(seen) / len(seen)) if seen else float("nan")
    skipped = sum(r.get("skipped", 0.0) for r in rows)
    out["skipped"] = float(skipped == len(rows))  # the step made no new version
    out["skipped_steps"] = rows[-1].get("skipped_steps", 0.0)
    out["grad_norm"] = rows[-1]["grad_norm"]
    out["tokens"] = float(sum(r["tokens"] for r in rows)) / epochs
    out.update(updates=float(len(rows)), applied=float(len(rows) - skipped), old_logprob_s=old_s)
    return out
