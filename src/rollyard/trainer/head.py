"""The LM head's token logprobs with a hand-written backward that holds one weight gradient.

``trainer.chunked_token_logprobs`` under autograd checkpoints each ``chunk`` of rows: its backward recomputes the
chunk's logits, runs autograd through ``logsumexp`` / ``gather`` (several ``[chunk, V]`` buffers) and hands the
head weight a fresh ``[V, D]`` gradient per chunk, which autograd then adds to the one it holds. At a 262,144-token
vocabulary (Gemma 3) each of those is 0.67 GB in fp32: two weight-sized gradients and a few logits buffers at once
were the trainer's peak (measured on Gemma-3-270M's head alone, 768 rows, chunk 256: 2.15 GB above the weights).

:class:`HeadLogprobs` does the same arithmetic with the gradient written where it ends: ``d logp_i / d z_ij =
(1[j = y_i] - p_ij) / T`` for ``z = h W^T / T``, so a chunk's logits are recomputed once, turned into their gradient
in place (``exp``, scale, one scatter-add for the targets), and ``W``'s gradient is accumulated into one buffer with
``addmm_`` (1.35 GB above the weights on the same case). Forward values are the checkpointed path's; gradients
equal it to float rounding (``tests/test_trainer_head.py``).

Used for a plain ``nn.Linear`` head without bias, soft cap or a truncated support (top-p / top-k), outside autocast;
every other head keeps the checkpointed path.
"""

from __future__ import annotations

import time

import torch

from rollyard.model import gemm as cpu_gemm


class Clock:
    """Seconds spent in :class:`HeadLogprobs`, forward and backward, since the last :meth:`take` (the trainer's
    ``lm_head_s`` metric: the LM head's share of a train step, 63% of Gemma-3-270M's multiply-adds)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


CLOCK = Clock()


class HeadLogprobs(torch.autograd.Function):
    """``(logp [N], entropy [N] or empty)`` of ``hidden [N, D]`` under ``log_softmax(hidden @ weight.T / T)`` at
    ``targets``, ``chunk`` rows at a time; entropy carries no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, with_entropy: bool):
        t0 = time.perf_counter()
        lps, logzs, ents = [], [], []
        for s in range(0, hidden.shape[0], chunk):
            logits = _logits(hidden[s:s + chunk], weight, temperature)
            logz = torch.logsumexp(logits, dim=-1)
            lps.append(logits.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - logz)
            logzs.append(logz)
            if with_entropy:  # H = logz - sum_v p_v * z_v (as trainer.chunked_token_logprobs)
                p = logits.sub(logz[:, None]).exp_()
                ents.append(logz - torch.bmm(p[:, None, :], logits[:, :, None]).view(-1))
        ctx.save_for_backward(hidden, weight, targets, torch.cat(logzs))
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.leaf = weight if weight.is_leaf and weight.requires_grad else None  # the parameter, for its .grad
        ent = torch.cat(ents) if with_entropy else hidden.new_zeros(0, dtype=torch.float32)
        ctx.mark_non_differentiable(ent)
        out = torch.cat(lps), ent
        CLOCK.seconds += time.perf_counter() - t0
        return out

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        t0 = time.perf_counter()
        hidden, weight, targets, logz = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # a later micro-batch adds into the gradient held, not into a second weight-sized buffer
        into = _held_grad(ctx.leaf) if ctx.needs_input_grad[1] else None
        grad_w = into if into is not None else torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s:s + chunk], grad_lp[s:s + chunk].float() / T
            dz = _logits(h, weight, T).sub_(logz[s:s + chunk, None]).exp_().mul_(-g[:, None])  # -g p
            dz = dz.scatter_add_(1, targets[s:s + chunk, None], g[:, None]).to(hidden.dtype)  # + g at the target
            if grad_h is not None:
                torch.mm(dz, weight, out=grad_h[s:s + chunk])
            if grad_w is not None:
                grad_w.addmm_(dz.t(), h)
        CLOCK.seconds += time.perf_counter() - t0
        return grad_h, (None if into is not None else grad_w), None, None, None, None


def _held_grad(weight: torch.Tensor | None) -> torch.Tensor | None:
    """``weight.grad`` when this backward may add into it in place: a leaf parameter that already holds a dense
    gradient of its own shape and dtype (a second micro-batch of one step), outside a double backward.

    Autograd would add the returned gradient into ``.grad`` itself, with the returned weight-sized buffer alive
    meanwhile: at Gemma 3's 262k x 640 head, 0.67 GB on top of the one held (the trainer's peak, on the steps
    that pack two micro-batches, measured 5.7 GB against 4.8 GB with one). Returning no gradient for the weight
    leaves its tied uses (the embedding lookup) to accumulate as before."""
    g = None if weight is None else weight.grad
    if g is None or torch.is_grad_enabled() or g.is_sparse or g.shape != weight.shape or g.dtype != weight.dtype:
        return None
    if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return None  # a hook on the weight's gradient sees what autograd accumulates: leave it to autograd
    return g


def _logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        z = cpu_gemm.linear(h, weight).float()
    return z.div_(temperature) if temperature != 1.0 else z


def applies(lm_head: torch.nn.Module, hidden: torch.Tensor, softcap: float | None, truncated: bool) -> bool:
    """Whether :class:`HeadLogprobs` computes this head (module docstring)."""
    return (type(lm_head) is torch.nn.Linear and lm_head.bias is None and not softcap and not truncated
            and not (lm_head._forward_hooks or lm_head._forward_pre_hooks)
            and not torch.is_autocast_enabled(hidden.device.type) and hidden.dtype == lm_head.weight.dtype)
