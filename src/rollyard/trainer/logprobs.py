"""Per-token log-probabilities of chosen tokens through the LM head, ``chunk`` rows at a time (the trainer's
hot path): the full ``[N, V]`` logits never exist, and under autograd each chunk is recomputed in the backward."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from rollyard.algo import support
from rollyard.model import gemm as cpu_gemm
from rollyard.trainer import head as head_grad


def chunked_token_logprobs(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 1024,
    softcap: float | None = None,
    with_entropy: bool = False,
    top_p: float = 1.0,
    top_k: int = 0,
    entropy_grad: bool = False,
    fp32_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(lm_head(hidden) / temperature)[i, targets[i]]`` for ``hidden [N, H]``.

    Returns ``(logp [N] fp32, entropy [N] fp32 or None)``; entropy carries a gradient only with ``entropy_grad``
    (a loss with an entropy bonus). ``fp32_head``: the head's matmul in fp32 under bf16 autocast. At most
    ``chunk x V`` logits exist at a time, forward and backward (each chunk is checkpointed when
    gradients are needed). ``softcap``: the model's final-logit soft cap (Gemma-2 style), if any.
    """
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters()))

    if need_grad and not entropy_grad and hidden.shape[0] and head_grad.applies(lm_head, hidden, softcap, support.active(top_p, top_k)):
        # one weight-sized gradient instead of one per chunk plus the sum (trainer/head.py: 262k-vocab heads)
        lp, ent = head_grad.HeadLogprobs.apply(hidden, lm_head.weight, targets, float(temperature), int(chunk),
                                               with_entropy)
        return lp, (ent if with_entropy else None)
    if need_grad and not entropy_grad and hidden.shape[0] and head_grad.applies_bf16(
            lm_head, hidden, softcap, support.active(top_p, top_k), fp32_head):
        # the same arithmetic without a bf16 copy of the head beside its gradient (trainer/head.py)
        lp, ent = head_grad.HeadLogprobsBf16.apply(hidden, lm_head.weight, targets, float(temperature), int(chunk),
                                                   with_entropy)
        return lp, (ent if with_entropy else None)
    plain = type(lm_head) is torch.nn.Linear and not (lm_head._forward_hooks or lm_head._forward_pre_hooks)

    def one_chunk(h: torch.Tensor, y: torch.Tensor):
        logits = _logits(h, lm_head, plain, fp32_head, softcap, temperature)
        if support.active(top_p, top_k):  # the support the rollout sampled from, renormalised (algo/support.py)
            logits = support.restrict(logits, top_p, top_k, y)
        logz = torch.logsumexp(logits, dim=-1)
        lp = logits.gather(-1, y[:, None]).squeeze(-1) - logz
        return lp, (_entropy(logits, logz, entropy_grad and need_grad) if with_entropy else None)

    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk):
        h, y = hidden[s:s + chunk], targets[s:s + chunk]
        if need_grad:
            lp, ent = checkpoint(one_chunk, h, y, use_reentrant=False)
        else:
            lp, ent = one_chunk(h, y)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def _logits(h: torch.Tensor, lm_head, plain: bool, fp32_head: bool, softcap: float | None,
            temperature: float) -> torch.Tensor:
    """One chunk's fp32 logits over the vocabulary, soft-capped and divided by the temperature."""
    if fp32_head and torch.is_autocast_enabled(h.device.type):  # TRL's cast_lm_head_to_fp32
        with torch.autocast(h.device.type, enabled=False):
            logits = torch.nn.functional.linear(h.float(), lm_head.weight.float(),
                                                None if lm_head.bias is None else lm_head.bias.float())
    else:
        logits = (cpu_gemm.linear(h, lm_head.weight, lm_head.bias) if plain else lm_head(h)).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    return logits


def _entropy(logits: torch.Tensor, logz: torch.Tensor, grad: bool) -> torch.Tensor:
    """Each row's entropy ``H = logz - sum_v p_v logit_v``; with ``grad`` differentiable (an entropy bonus).
    Without: computed after every tensor the backward needs has been saved, so a checkpointed chunk's
    recomputation stops before it (one pass, not two), as a batched dot product (no second ``[n, V]`` buffer)."""
    if grad:
        return logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    with torch.no_grad():
        p = (logits - logz[:, None]).exp_()
        return logz - torch.bmm(p[:, None, :], logits[:, :, None]).view(-1)



def chunked_support_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor,
                             support: int | torch.Tensor, temperature: float = 1.0, chunk: int = 1024,
                             softcap: float | None = None, fp32_head: bool = False, with_entropy: bool = False):
    """GKD's pass over the LM head (``algo/gkd.py``), one logits chunk at a time, all under
    ``log_softmax(lm_head(hidden) / temperature)`` over the whole vocabulary (no top-p / top-k restriction):
    ``(logp [N] at targets, entropy [N] or None, ids [N, k], logp [N, k] at ids)``. ``support``: an int ``k``, the
    ``k`` most likely tokens of each row, most likely first (a teacher's; no gradient through them); or ``ids [N, k]``,
    the log-probs at those (the student's, with a gradient when one is needed, each chunk checkpointed as
    :func:`chunked_token_logprobs`). Entropy carries no gradient."""
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters()))
    plain = type(lm_head) is torch.nn.Linear and not (lm_head._forward_hooks or lm_head._forward_pre_hooks)
    k = support if isinstance(support, int) else support.shape[-1]

    def one_chunk(h: torch.Tensor, y: torch.Tensor, at: torch.Tensor | None):
        logits = _logits(h, lm_head, plain, fp32_head, softcap, temperature)
        logz = torch.logsumexp(logits, dim=-1)
        lp = logits.gather(-1, y[:, None]).squeeze(-1) - logz
        if at is None:
            at = logits.detach().topk(min(k, logits.shape[-1]), dim=-1).indices
        return lp, (_entropy(logits, logz, False) if with_entropy else None), at, logits.gather(-1, at) - logz[:, None]

    parts = []
    for s in range(0, hidden.shape[0], chunk):
        args = (hidden[s:s + chunk], targets[s:s + chunk], None if isinstance(support, int) else support[s:s + chunk])
        parts.append(checkpoint(one_chunk, *args, use_reentrant=False) if need_grad else one_chunk(*args))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None), targets.new_zeros(0, k), hidden.new_zeros(0, k, dtype=torch.float32)
    lp, ent, ids, at = zip(*parts)
    return torch.cat(lp), (torch.cat(ent) if with_entropy else None), torch.cat(ids), torch.cat(at)
