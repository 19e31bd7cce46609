"""The sampling support: which tokens top-k and top-p leave, and the distribution renormalised over them.

Sampling at ``top_p < 1`` or ``top_k > 0`` draws from the truncated, renormalised distribution

    q(v) = p(v) / sum_{u in S} p(u)  for v in S,  0 outside,   p = softmax(logits / T)

so the behaviour logprob of a sampled token is ``log q``, not ``log p``. The rollout engine records
``log q`` (``rollout/engine.py``; vLLM's ``processed_logprobs`` are the same quantity) and the trainer
computes its ratio and loss over the same support (``trainer.chunked_token_logprobs``): both call
:func:`restrict`, so at equal weights the two agree to the kernels' rounding and the ratio is 1 on-policy.
Taking ``log p`` on either side instead biases every ratio by ``log sum_{u in S} p(u)`` (TRL #6789, verl
#6240: a top_k=50 run kept 17% of its gradient).

The support, in the order vLLM and ``transformers.generate`` apply it (temperature, top-k, top-p):

- top-k: the tokens whose logit is at least the k-th largest (ties at the k-th value all stay);
- top-p: over the top-k survivors' renormalised probabilities, sorted in descending order, every token
  whose predecessors' mass is below ``top_p`` (the smallest prefix reaching ``top_p``; the top token always
  stays).

Tokens outside the support get the logit ``finfo.min`` rather than ``-inf``: their probability is exactly 0
after a softmax, and ``0 * logit`` stays finite where an entropy is summed over the vocabulary.
"""

from __future__ import annotations

import torch


def active(top_p: float, top_k: int) -> bool:
    """Whether ``(top_p, top_k)`` truncates anything (``top_p = 1`` and ``top_k = 0`` keep the full vocabulary)."""
    return top_p < 1.0 or top_k > 0


@torch.no_grad()
def support_mask(logits: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """``[N, V]`` bool: the tokens of each row of ``logits [N, V]`` (already divided by the temperature) that
    top-k then top-p keep (module docstring). Every row keeps at least its top token."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        keep = logits >= kth
    if top_p < 1.0:
        probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
        sp, si = probs.sort(dim=-1, descending=True)
        drop_sorted = (sp.cumsum(dim=-1) - sp) >= top_p  # mass before the token already reaches top_p
        keep = keep & ~torch.zeros_like(keep).scatter_(-1, si, drop_sorted)
    return keep


def restrict(logits: torch.Tensor, top_p: float = 1.0, top_k: int = 0,
             targets: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [N, V]`` with every token outside the support set to ``finfo.min``: ``log_softmax`` of the result
    is ``log q``. Differentiable in the kept logits (the mask itself carries no gradient).

    ``targets [N]`` (the trainer): each row's target token is kept even if the support computed from these
    logits excludes it, so a token sampled under other weights (stale, or a near-tie at the top-p edge that
    rounding flipped) gets a finite logprob, renormalised over the support plus itself, instead of ``-inf``.
    On-policy at equal weights the sampled token is always in the support, so this changes nothing there.
    """
    if not active(top_p, top_k):
        return logits
    keep = support_mask(logits.detach(), top_p, top_k)
    if targets is not None:
        keep.scatter_(-1, targets.reshape(-1, 1).to(keep.device), True)
    return logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
