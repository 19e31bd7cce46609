"""A step's counting metrics from its accumulators."""

from __future__ import annotations

import math

import torch


def quantiles(x: torch.Tensor, qs: list[float]) -> list[float]:
    """Linear-interpolated quantiles (torch.quantile's definition) without its 16M-element cap."""
    if x.numel() == 0:
        return [float("nan")] * len(qs)
    v = x.float().sort().values
    n = v.numel()
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, n - 1)
        out.append(float(v[lo] + (v[hi] - v[lo]) * (pos - lo)) if hi != lo else float(v[lo]))
    return out


def step_metrics(accs: list[dict]) -> dict[str, float]:
    """The counting metrics of one step from its accumulators (one per ``accumulate_gradients`` call).

    ``clip_frac`` is over every loss token (a skipped sample's tokens are never clipped); ``entropy``,
    ``tis_capped_frac``, ``logprob_diff`` and ``kl`` are means over the tokens the forward computed.
    ``skipped_frac``: the share of the step's sequences left out of the forward/backward because they
    cannot move the weights (:meth:`Trainer.moves_weights`); ``skipped_positions_frac``: their share of
    the step's positions (``len(prompt) + len(completion) - 1`` per sequence, before any packing).
    ``positions``: that count over every sequence (what an unshared, unskipped step computes without
    padding); ``computed_positions``: the real (not pad) positions the micro-batches computed, each
    shared prompt prefix once: the work 6 x params x positions prices (``packed_tokens`` adds the pads);
    ``recomputed_positions``: those positions weighted by the share of decoder layers activation checkpointing
    computed again (2 x decoder params x it: the recompute's work; ``trainer/recompute.py``).
    ``lm_head_s``: seconds in the LM head's logprobs, forward and backward, when ``trainer/head.py`` computed them
    (a 262k-vocabulary head is most of Gemma 3's step).
    """
    def total(key: str) -> float:
        return float(sum(float(a[key]) for a in accs))

    n, computed = max(total("tokens"), 1.0), max(total("computed_tokens"), 1.0)
    out = {"clip_frac": total("clipped") / n, "entropy": total("entropy_sum") / computed,
           "tis_capped_frac": total("capped") / computed, "logprob_diff": total("diff_sum") / computed,
           "logprob_diff_max": max((float(a["diff_max"]) for a in accs), default=0.0),
           "tokens": total("tokens"), "packed_tokens": total("packed_tokens"), "micro_batches": total("micro_batches"),
           "skipped_frac": total("skipped_seqs") / max(total("seqs"), 1.0),
           "skipped_positions_frac": total("skipped_positions") / max(total("positions"), 1.0),
           "positions": total("positions"), "computed_positions": total("computed_positions"),
           "recomputed_positions": total("recomputed_positions")}
    if accs and all(a["want_kl"] for a in accs):
        out["kl"] = total("kl_sum") / computed
    if any(a.get("distill") for a in accs):  # the student's reverse KL to the teacher, per token (algo/distill.py)
        out["distill_kl"] = total("distill_kl_sum") / computed
    if any(a.get("gkd") for a in accs):  # the generalized JSD to the teacher over its top-k, per token (algo/gkd.py)
        out["gkd_jsd"] = total("gkd_jsd_sum") / computed
    head_s = sum(float(a.get("lm_head_s", 0.0)) for a in accs)
    if head_s:  # seconds of the step in the LM head (trainer/head.py's path: a plain head, fp32 or bf16 weights)
        out["lm_head_s"] = head_s
    return out
