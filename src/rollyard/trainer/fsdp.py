"""``trainer.sharding=fsdp``: decoder layers sharded with PyTorch FSDP2 ``fully_shard``.

Why FSDP2 and why per layer: FSDP2 runs on CPU over gloo in this torch (2.13), so FSDP1 is not
needed. The trainer calls the decoder and the (tied) lm_head separately, never the root module's
``forward`` (the chunked log-softmax, trainer.py), so a root FSDP unit would never see its hooks
fire. Each decoder layer is therefore its own FSDP unit; the embeddings, final norm and tied
lm_head (a few percent of a model's parameters) stay replicated and are all-reduced with the
plain data-parallel path (dp.py). Layers' parameters, gradients and optimizer state are sharded.

Collectives per step and rank, on k ranks, for L bytes of layer parameters:

- one all-gather of the layers ((k-1)/k x L sent) at the first micro-batch's forward;
  ``reshard_after_forward=False`` and no resharding between micro-batches keep them gathered
- one reduce-scatter of the layers' gradients at the last micro-batch's backward (gradient sync is
  off for the others). gloo has no native reduce-scatter: it runs an all-reduce and keeps a slice,
  so it sends 2(k-1)/k x L, not (k-1)/k (measured, bench/dp.py); NCCL's is native.

So between steps a rank holds 1/k of the layers; during a step it holds them whole (the price of
one gather per step instead of one per micro-batch).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def _layers(model) -> torch.nn.ModuleList:
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    layers = getattr(dec, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"trainer.sharding=fsdp shards decoder layers, but {type(model).__name__}'s decoder has no "
                         f"`layers` list; use trainer.sharding=none")
    return layers


def shard(model) -> list[FSDPModule]:
    """Shard each decoder layer of ``model`` in place over the default process group."""
    units = []
    for layer in _layers(model):
        fully_shard(layer, reshard_after_forward=False)
        layer.set_gradient_divide_factor(1.0)  # sum, like the all-reduce: the loss already has global denominators
        layer.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        units.append(layer)
    return units


def reshard(units: list[FSDPModule]) -> None:
    for u in units:
        u.reshard()


@contextlib.contextmanager
def one_sync_per_step(model, units: list[FSDPModule], micro_batches: int):
    """Reduce-scatter gradients (and reshard) only after the last of ``micro_batches`` backwards.

    Counts decoder forwards: the last one turns gradient sync and resharding back on, so its
    backward reduce-scatters what every micro-batch accumulated.
    """
    seen = [0]

    def before_forward(module, args, kwargs):
        last = seen[0] >= micro_batches - 1
        for u in units:
            u.set_requires_gradient_sync(last)
            u.set_reshard_after_backward(last)
        seen[0] += 1

    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    hook = dec.register_forward_pre_hook(before_forward, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()
        for u in units:
            u.set_requires_gradient_sync(True)
            u.set_reshard_after_backward(True)


def idle_backward(model) -> None:
    """A rank with no samples this step still joins the layers' gather and reduce-scatter (zero gradient)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    ids = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    out = dec(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False).last_hidden_state
    (out.sum() * 0.0).backward()


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients: sharded ones summed over ranks, replicated ones counted once."""
    dev = params[0].device
    sharded = torch.zeros((), dtype=torch.float64, device=dev)
    replicated = torch.zeros((), dtype=torch.float64, device=dev)
    for p in params:
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor):
            sharded += p.grad.to_local().double().pow(2).sum()
        else:
            replicated += p.grad.double().pow(2).sum()
    dist.all_reduce(sharded)
    return (sharded + replicated).sqrt().float()


@torch.no_grad()
def clip_(params: list[torch.Tensor], max_norm: float, norm: float) -> None:
    """clip_grad_norm_'s rule (coefficient max_norm / (norm + 1e-6), at most 1) given the global ``norm``."""
    coef = min(max_norm / (norm + 1e-6), 1.0)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


@torch.no_grad()
def gather_into(sharded_model, full_model=None) -> None:
    """Copy ``sharded_model``'s parameters, layers all-gathered, into the plain ``full_model`` (collective;
    ``None`` on ranks that only contribute their shards)."""
    full = dict(full_model.named_parameters()) if full_model is not None else {}
    for name, p in sharded_model.named_parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        if name in full:
            full[name].copy_(whole)


def local_optimizer_state(optimizer) -> dict:
    """``optimizer.state_dict()`` with sharded (DTensor) state as this rank's local shard."""
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: (v.to_local().clone() if isinstance(v, DTensor) else v) for k, v in st.items()}
                   for i, st in sd["state"].items()}
    return sd


def load_local_optimizer_state(optimizer, params: list[torch.Tensor], sd: dict) -> None:
    """Inverse of :func:`local_optimizer_state` on the same rank of the same k."""
    state = {}
    for i, st in sd["state"].items():
        p = params[int(i)]
        state[i] = {k: (DTensor.from_local(v, p.device_mesh, p.placements, run_check=False)
                        if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() > 0 else v)
                    for k, v in st.items()}
    optimizer.load_state_dict({**sd, "state": state})
