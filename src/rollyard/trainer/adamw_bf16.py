"""AdamW with bf16 moments (``trainer.optimizer_state=bf16``): 4 bytes of optimizer state per trainable
parameter instead of fp32 AdamW's 8, for a model whose optimizer state dominates the trainer's memory
(SmolLM2-135M: 0.54 GB of 1.08).

The update is torch.optim.AdamW's (decoupled weight decay, bias corrections) computed in fp32 on fp32
weights and gradients; only the stored moments are bf16. They are written back with stochastic rounding:
with beta2 = 0.99 v moves by ~1% of itself per step, 0.999 by 0.1%, both near or below bf16's resolution
(2^-8 relative), so round-to-nearest would freeze v (and m where g ~ m). Stochastic rounding keeps each
moment unbiased in expectation. On CPU one pass per parameter in rollyard's kernels (``kernels.cc``; the
random bits hash (step, parameter, index): reproducible and identical on every data-parallel rank); elsewhere
(a GPU, the kernels off) the same arithmetic in torch ops with a seeded generator.

A checkpoint holds the bf16 moments; torch's ``load_state_dict`` casts them to the weight's dtype, and the
next step casts them back (the values are bf16-exact either way), so a resumed run continues bit-for-bit.
"""

from __future__ import annotations

import math

import torch

from rollyard.model import kernels

MOMENTS = ("exp_avg", "exp_avg_sq")  # torch.optim.AdamW's state names: a checkpoint reads the same either way


def round_stochastic(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """fp32 ``x`` to bf16, rounded up with probability equal to the dropped fraction (finite ``x``)."""
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=gen, device=x.device)
    return (x.contiguous().view(torch.int32) + noise).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)


def torch_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float, bc1: float, bc2: float, seed: int) -> None:
    """The kernel's update in torch ops (any device): fp32 arithmetic, moments stored stochastically rounded."""
    m32 = m.float().mul_(beta1).add_(g, alpha=1 - beta1)
    v32 = v.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
    p.mul_(1 - lr * weight_decay)
    p.addcdiv_(m32, v32.sqrt().div_(math.sqrt(bc2)).add_(eps), value=-lr / bc1)
    gen = torch.Generator(device=p.device).manual_seed(seed & (2 ** 63 - 1))
    m.copy_(round_stochastic(m32, gen))
    v.copy_(round_stochastic(v32, gen))


def step_seed(step: int, group: int, index: int) -> int:
    """The random bits' seed for one parameter's update: distinct per (step, group, parameter), the same on every rank."""
    return ((step * 1_000_003 + group) * 1_000_033 + index) * 0x9E3779B97F4A7C15 & (2 ** 64 - 1)


class AdamWBf16(torch.optim.Optimizer):
    """``torch.optim.AdamW``'s update with bf16 moments (module docstring); plain tensors only (no DTensor)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
            kernels.kernel()  # load (or build) the CPU kernels once; torch ops if they are off or unavailable

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None:
                    self._update(group, gi, pi, p, p.grad.contiguous())
        return loss

    @torch.no_grad()
    def step_on_zero_gradient(self) -> bool:
        """:meth:`step` on an exactly zero gradient without one (no gradient allocated or read: the kernel's
        ``g = None``; the same bits as stepping on zero-filled gradients). ``False``, nothing changed, where a
        parameter has a gradient or no moments yet, or the kernel does not take it (the caller steps on zeros)."""
        todo = [(gi, pi, group, p) for gi, group in enumerate(self.param_groups) for pi, p in enumerate(group["params"])]
        if any(p.grad is not None or not self.state.get(p) or not kernels.f32_cpu(p) for _, _, _, p in todo):
            return False
        if kernels.kernel() is None:
            return False
        for gi, pi, group, p in todo:
            self._update(group, gi, pi, p, None)
        return True

    def _update(self, group: dict, gi: int, pi: int, p: torch.Tensor, g: torch.Tensor | None) -> None:
        """One parameter's update from its gradient ``g`` (None: zero, through the kernel only)."""
        beta1, beta2 = group["betas"]
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            for k in MOMENTS:
                st[k] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
        for k in MOMENTS:  # a loaded state dict comes back in the weight's dtype (bf16-exact values)
            if st[k].dtype != torch.bfloat16:
                st[k] = st[k].to(torch.bfloat16).contiguous()
        st["step"] += 1
        t = int(st["step"].item())
        kw = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                  bc1=1 - beta1 ** t, bc2=1 - beta2 ** t, seed=step_seed(t, gi, pi))
        if not kernels.adamw_bf16_state(p, g, st["exp_avg"], st["exp_avg_sq"], **kw):
            torch_update(p, torch.zeros_like(p) if g is None else g, st["exp_avg"], st["exp_avg_sq"], **kw)
