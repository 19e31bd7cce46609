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

The logprob canary (``sync/canary.py``) scores its fixed probe on the same support on both sides (``restrict`` with
the probe's tokens as ``targets``, as the trainer keeps a sampled token): a rollout whose support differs from the
trainer's shows there, not only in the samples' own gap (``train/logprob_diff``).

Tokens outside the support get the logit ``finfo.min`` rather than ``-inf``: their probability is exactly 0
after a softmax, and ``0 * logit`` stays finite where an entropy is summed over the vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def active(top_p: float, top_k: int) -> bool:
    """Whether ``(top_p, top_k)`` truncates anything (``top_p = 1`` and ``top_k = 0`` keep the full vocabulary)."""
    return top_p < 1.0 or top_k > 0


@torch.no_grad()
def support_mask(logits: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """``[N, V]`` bool: the tokens of each row of ``logits [N, V]`` (already divided by the temperature) that
    top-k then top-p keep (module docstring). Every row keeps at least its top token.

    No full sort: the support lies among the most likely tokens, so the candidates are the top ``m``
    (``torch.topk``, sorted; with top-k, ``m`` = k and ties), ``m`` doubling from 64 until every row's top-p
    support ends inside them. 256 rows x 49152 logits, one loaded core: a full sort 9-17 s; this 1.3 s (peaked
    rows, 3 tokens kept) to 4.8 s (flat rows, 2185 kept) at top_p=0.9, 0.4-0.8 s at top_k=20, against 0.3-0.4 s
    for one log-softmax."""
    N, V = logits.shape
    if top_k > 0 and top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        keep = logits >= kth  # ties at the k-th value all stay
        if top_p >= 1.0:
            return keep
        m = int(keep.sum(-1).max())  # every row's top-k set (ties included) is among its top m
        vals, idx = torch.topk(logits, m, dim=-1)
        in_set = vals >= kth
        vals = vals.masked_fill(~in_set, float("-inf"))
        p = (vals - torch.logsumexp(vals, dim=-1, keepdim=True)).exp()
        kept = ((p.cumsum(dim=-1) - p) < top_p) & in_set
    elif top_p < 1.0:
        log_z = torch.logsumexp(logits, dim=-1, keepdim=True)
        m = min(V, 64)
        while True:
            vals, idx = torch.topk(logits, m, dim=-1)  # [N, m], descending
            p = (vals - log_z).exp()
            before = p.cumsum(dim=-1) - p  # mass of the tokens ranked above each candidate
            if m == V or bool((before[:, -1] >= top_p).all()):  # every row's support ends inside the candidates
                break
            m = min(2 * m, V)
        kept = before < top_p
    else:
        return torch.ones_like(logits, dtype=torch.bool)
    return torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, kept)


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


class Support(NamedTuple):
    """The distribution a rollout samples from, as the logprob canary (``sync/canary.py``) scores its probe on
    both sides: the engine from its own settings (:meth:`of_engine`), the trainer from those its ratio uses."""

    temperature: float = 1.0  # the logits are divided by it
    top_p: float = 1.0  # nucleus mass kept (1: all)
    top_k: int = 0  # most likely tokens kept (0: all)

    @classmethod
    def of(cls, temperature: float, top_p: float, top_k: int) -> Support:
        """The support of a rollout sampling at ``(temperature, top_p, top_k)``. Greedy (T = 0) records the full
        ``log_softmax(logits)`` (truncation does not change an argmax), as the trainer takes it
        (``trainer_kwargs``); a support that truncates nothing is :data:`FULL`, at T = 1 (the probe then checks
        weights and kernels, and vLLM needs no more than the probe tokens' own logprobs: ``rollout/vllm.py``)."""
        if not temperature or not active(top_p, top_k):
            return cls()
        return cls(float(temperature), float(top_p), int(top_k))

    @classmethod
    def of_engine(cls, engine) -> Support:
        """The support ``engine`` samples from (its ``temperature``, ``top_p``, ``top_k``)."""
        return cls.of(engine.temperature, engine.top_p, engine.top_k)

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``[C]`` fp32 ``log q(targets[i])`` for ``logits [C, V]`` (any shift per row: raw logits or
        log-probabilities): divided by the temperature, restricted with the target kept (:func:`restrict`, as
        ``trainer.chunked_token_logprobs`` does), renormalised."""
        x = logits.float()
        if self.temperature != 1.0:
            x = x / self.temperature
        targets = targets.reshape(-1).to(x.device)
        x = restrict(x, self.top_p, self.top_k, targets)
        return torch.log_softmax(x, dim=-1).gather(1, targets[:, None])[:, 0]


FULL = Support()  # nothing truncated, T = 1
