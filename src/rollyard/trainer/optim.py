"""The optimizer: fused AdamW, transformers' weight-decay groups, and the keys the trainer keeps in its
param groups (the schedule's position, the adaptive entropy bonus) so a checkpoint carries them."""

from __future__ import annotations

import math
import re

import torch

from rollyard.model import kernels
from rollyard.trainer.adamw_bf16 import AdamWBf16

OPTIMIZER_STATES = ("fp32", "bf16")  # AdamW moments: torch.optim.AdamW, or bf16 (trainer/adamw_bf16.py)


SCHEDULE_STEP = "schedule_step"  # param-group key: optimizer steps taken, the learning-rate schedule's position


ENTROPY_STATE = "entropy_control"  # param-group key: the adaptive entropy bonus's state (algo/entropy_control.py)


def adamw(params: list, **kw) -> torch.optim.AdamW:
    """AdamW over ``params`` (tensors, or param groups), fused (one kernel per parameter: ~2.5x less optimizer time
    on CPU than the per-op loop; what transformers' Trainer, and so TRL, use by default) where every parameter is a
    plain floating tensor on CPU or CUDA; the per-op loop otherwise (sharded DTensors, other devices)."""
    from torch.distributed.tensor import DTensor

    flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.is_floating_point()
                for p in flat)
    opt = torch.optim.AdamW(params, fused=fused or None, **kw)
    # The kernel is this process's choice, not the checkpoint's: load_state_dict would otherwise
    # bring back the saving run's flag (a fused one on sharded parameters fails at the next step).
    opt.register_load_state_dict_post_hook(_keep_kernel_choice)
    return opt


def _keep_kernel_choice(opt: torch.optim.Optimizer) -> None:
    for g in opt.param_groups:
        g["fused"] = opt.defaults["fused"]


# transformers' Trainer (and so TRL) leaves biases and normalisation weights out of weight decay: a parameter of a
# LayerNorm module, or one whose lower-cased name holds "bias", "layernorm", "rmsnorm", a part "norm" or "..._norm"
NO_DECAY_NAME = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def decayed(model) -> set[str]:
    """Names of ``model``'s parameters that transformers' Trainer applies weight decay to (see NO_DECAY_NAME)."""
    in_norm = {f"{m}.{n}" if m else n for m, mod in model.named_modules() if isinstance(mod, torch.nn.LayerNorm)
               for n, _ in mod.named_parameters(recurse=False)}
    return {n for n, _ in model.named_parameters() if n not in in_norm and not NO_DECAY_NAME.search(n.lower())}


def build_optimizer(model, optimizer_state: str, *, lr: float, betas, eps: float, weight_decay: float,
                    decay_norms_and_biases: bool = True):
    """``(optimizer, params)`` over ``model``'s trainable parameters: AdamW with fp32 moments (fused) or bf16 ones
    (``trainer/adamw_bf16.py``), transformers' decay groups where asked (no decay on biases and norms), and the
    run's betas, eps and weight decay kept over a checkpoint's on load. ``params`` is the optimizer's order."""
    if optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_state={optimizer_state!r}: expected one of {OPTIMIZER_STATES}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in named]}]
    if weight_decay and not decay_norms_and_biases:  # transformers' rule: no decay on biases and norms
        keep = decayed(model)
        groups = [g for g in ({"params": [p for n, p in named if n in keep]},
                              {"params": [p for n, p in named if n not in keep], "weight_decay": 0.0}) if g["params"]]
    params = [p for g in groups for p in g["params"]]
    if optimizer_state == "bf16":  # bf16 moments, stochastically rounded
        optimizer = AdamWBf16(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    else:
        optimizer = adamw(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    # The run's AdamW settings, not a checkpoint's: load_state_dict brings back the saving run's betas, eps and
    # weight decay, so a resume that changes them (trainer.adam_beta2=...) would otherwise keep the old ones.
    settings = [{k: g[k] for k in ("betas", "eps", "weight_decay")} for g in optimizer.param_groups]

    def keep_settings(opt: torch.optim.Optimizer) -> None:
        for group, mine in zip(opt.param_groups, settings, strict=True):
            group.update(mine)
    optimizer.register_load_state_dict_post_hook(keep_settings)
    return optimizer, params


def step_on_zero_gradient(optimizer: torch.optim.Optimizer) -> bool:
    """torch.optim.AdamW's step on an exactly zero gradient, taken without one: a step whose every sample was skipped
    (zero advantage) moves the weights by the decayed moments alone, so no gradient is allocated, zero-filled,
    clipped (its norm is 0) or read (``kernels.adamw_zero_grad``: one pass over weight and moments). ``False``, with
    nothing changed, where it does not apply: another optimizer, a parameter with a gradient, no moments yet (the
    first step), amsgrad or maximize, a tensor the kernel does not take; the caller then steps on zero gradients.
    bf16 moments (``AdamWBf16``): its own step on a zero gradient (the same bits as on zero-filled gradients)."""
    if isinstance(optimizer, AdamWBf16):
        return optimizer.step_on_zero_gradient()
    if type(optimizer) is not torch.optim.AdamW or kernels.kernel() is None:
        return False
    work = []
    for g in optimizer.param_groups:
        if g.get("amsgrad") or g.get("maximize"):
            return False
        for p in g["params"]:
            st = optimizer.state.get(p, {})
            if p.grad is not None or not all(k in st for k in ("step", "exp_avg", "exp_avg_sq")):
                return False
            if not kernels.f32_cpu(p, st["exp_avg"], st["exp_avg_sq"]):
                return False
            work.append((g, p, st))
    for g, p, st in work:
        (beta1, beta2), lr = g["betas"], float(g["lr"])
        t = float(st["step"]) + 1
        kernels.adamw_zero_grad(p.data, st["exp_avg"], st["exp_avg_sq"], step_size=lr / (1 - beta1 ** t),
                                decay=1 - lr * g["weight_decay"], beta1=beta1, beta2=beta2,
                                sqrt_bc2=math.sqrt(1 - beta2 ** t), eps=g["eps"])
        st["step"] += 1
    return True
