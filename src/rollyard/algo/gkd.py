"""Generalized knowledge distillation (GKD, Agarwal et al. 2024; TRL's ``GKDTrainer``): ``algo.objective=gkd``.

At every completion position ``t`` the student is pulled towards the teacher's whole next-token distribution, not
only the token sampled there. rollyard keeps that distribution to the teacher's top-k tokens ``S_t``
(``algo.gkd_top_k``): the teacher sends ``k`` ids and log-probs per position instead of a vocabulary's worth, and
both distributions are renormalised over ``S_t``::

    s_t(v) = log pi_student(v) - logsumexp_{u in S_t} log pi_student(u)        # v in S_t, all under log_softmax(z / T)
    q_t(v) = log pi_teacher(v) - logsumexp_{u in S_t} log pi_teacher(u)
    m_t    = log((1 - beta) exp(s_t) + beta exp(q_t))                           # the mixture
    JSD_t  = beta x KL(q_t || m_t) + (1 - beta) x KL(s_t || m_t)                 # 0 < beta < 1
    JSD_t  = KL(q_t || s_t)  at beta = 0 (forward KL),  KL(s_t || q_t)  at beta = 1 (reverse KL)

TRL's ``generalized_jsd_loss`` is the same formula over the whole vocabulary; with ``k`` = the vocabulary size the
support is every token, the renormalisation is the identity and the two agree (``tests/test_gkd.py`` holds the
value and the gradient equal to TRL's in fp32). Like TRL's, ``beta`` 0 and 1 are their own cases: the mixture's
formula tends to 0, not to a KL, at either end. The teacher's side carries no gradient.

Functions here are pure: ``[N, k]`` tensors in, ``[N]`` (one divergence per position) out; aggregation over
positions is the loss's (``algo/loss.aggregate``), as for every other per-token term.
"""

from __future__ import annotations

import hashlib
import math

import torch


def renormalise(logp: torch.Tensor) -> torch.Tensor:
    """``[N, k]`` log-probabilities of ``k`` tokens -> the log-probabilities of the distribution restricted to them."""
    return logp - torch.logsumexp(logp, dim=-1, keepdim=True)


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """``[N, k]`` x2 -> ``[N]``: ``KL(p || q) = sum_v p(v) (log p(v) - log q(v))`` (both normalised over ``k``)."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """``[N]``: the generalized JSD of the module docstring between the student's and the teacher's log-probs of the
    same ``[N, k]`` support tokens (each renormalised over its row here); ``beta`` in [0, 1]. Differentiable in
    ``student_logp``; ``teacher_logp`` is detached."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta}: the generalized JSD interpolates with beta in [0, 1]")
    s, q = renormalise(student_logp), renormalise(teacher_logp.detach())
    if beta == 0.0:
        return kl(q, s)
    if beta == 1.0:
        return kl(s, q)
    m = torch.logsumexp(torch.stack([s + math.log1p(-beta), q + math.log(beta)]), dim=0)
    return beta * kl(q, m) + (1.0 - beta) * kl(s, m)


def top_k(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [N, V]`` -> ``(ids [N, k], logp [N, k])``: the ``k`` most likely tokens per row under
    ``log_softmax(logits / temperature)``, most likely first (``k`` >= V: every token)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    vals, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return ids, vals


def jsd_of_logits(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float = 1.0,
                  k: int | None = None) -> torch.Tensor:
    """``[N, V]`` logits x2 -> ``[N]``: the divergence over the teacher's top-``k`` (None: the whole vocabulary, TRL's
    form), the student's log-probs gathered at the teacher's ids: the trainer's computation in one call."""
    ids, teacher = top_k(teacher_logits, k or teacher_logits.shape[-1], temperature)
    student = torch.log_softmax(student_logits.float() / temperature, dim=-1).gather(-1, ids)
    return generalized_jsd(student, teacher, beta)


def on_policy(request_id: str, seed: int, lmbda: float) -> bool:
    """Whether a prompt's completions are the student's own samples (else the dataset's reference completion):
    a draw that is ``True`` with probability ``lmbda``, fixed by ``(seed, prompt)`` so a resume, a streamed round and
    every placement make the same choice (TRL draws once per batch with ``random.random() <= lmbda``)."""
    if lmbda >= 1.0:
        return True
    h = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0 ** 64 < lmbda
