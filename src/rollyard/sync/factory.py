"""Start-up resolution of ``sync.*`` (one-line errors) and the mode x transport factory.

``resolve(cfg, device)`` turns ``sync.mode``/``sync.transport``/``rollout.dtype`` (``auto`` included)
into a ``SyncPlan`` or raises ``ConfigError`` stating the rule, both values and the fix.
``make_publisher(mode, dtype)`` and ``make_transport(name, bucket_mb)`` are the factory: a mode
never knows its transport. ``make_sender(name, bucket_mb)`` and ``make_receiver(name)`` register each
transport's two halves for ``sync.session`` (a new transport: one file, and one line in each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollyard.config import ConfigError, RunConfig
from rollyard.sync.delta import DeltaPublisher
from rollyard.sync.full import FullPublisher
from rollyard.sync.inprocess import SharedPublisher
from rollyard.sync.lora import LoraPublisher

MODES = ("auto", "inprocess", "full", "delta", "lora")
TRANSPORTS = ("auto", "inprocess", "dist", "ray")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class SyncPlan:
    mode: str  # inprocess | full | delta | lora
    transport: str  # inprocess | dist | ray
    dtype: torch.dtype  # the rollout copy's dtype


def make_publisher(mode: str, dtype: torch.dtype):
    if mode == "full":
        return FullPublisher(dtype)
    if mode == "delta":
        return DeltaPublisher(dtype)
    if mode == "lora":
        return LoraPublisher(dtype)
    return SharedPublisher()


def make_transport(name: str, bucket_mb: float = 64.0, **dist_kwargs):
    if name == "inprocess":
        from rollyard.sync.transport_inprocess import InProcessTransport
        return InProcessTransport()
    if name == "dist":
        from rollyard.sync.transport_dist import DistTransport
        return DistTransport(int(bucket_mb * 1e6), **dist_kwargs)
    from rollyard.sync.transport_ray import RayTransport
    return RayTransport()


def make_sender(name: str, bucket_mb: float = 64.0):
    """The trainer half of transport ``name`` (``connect``, ``handle``, ``send``; see ``sync/session.py``)."""
    if name == "inprocess":
        from rollyard.sync.transport_inprocess import InProcessSender
        return InProcessSender()
    if name == "dist":
        from rollyard.sync.transport_dist import DistSender
        return DistSender(max(1, int(bucket_mb * 1e6)))
    from rollyard.sync.transport_ray import RaySender
    return RaySender()


def make_receiver(name: str):
    """The receiver half a rollout actor holds for transport ``name`` (``join``, ``recv``); None where the
    transport needs no handshake (an update handle opens with ``session.receive``)."""
    if name == "dist":
        from rollyard.sync.transport_dist import DistReceiver
        return DistReceiver()
    return None


def resolve(cfg: RunConfig, device: str) -> SyncPlan:
    """The sync plan for ``cfg`` on ``device``; ``ConfigError`` (one line) for a combination that cannot work."""
    s, colocated, lora_r = cfg.sync, cfg.placement == "colocated", cfg.model.lora.r
    if s.mode not in MODES:
        raise ConfigError(f"sync.mode={s.mode!r} is not a sync mode: expected one of {', '.join(MODES)}; "
                          f"set e.g. sync.mode=full")
    if s.transport not in TRANSPORTS:
        raise ConfigError(f"sync.transport={s.transport!r} is not a transport: expected one of {', '.join(TRANSPORTS)}; "
                          f"set e.g. sync.transport=ray")
    dtype_name = cfg.rollout.dtype if cfg.rollout.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    dtype = DTYPES[dtype_name]
    mode = s.mode
    if mode == "auto":
        mode = "lora" if lora_r > 0 else ("inprocess" if colocated and dtype_name == "fp32" else "full")
    transport = s.transport if s.transport != "auto" else ("inprocess" if colocated else "ray")
    if lora_r > 0 and mode != "lora":
        raise ConfigError(f"model.lora.r={lora_r} trains an adapter, so sync.mode must be lora (or auto), got "
                          f"sync.mode={mode}; set sync.mode=lora or model.lora.r=0")
    if mode == "lora" and lora_r == 0:
        raise ConfigError("sync.mode=lora needs an adapter to sync, but model.lora.r=0; set model.lora.r=8 "
                          "(or another rank > 0) or sync.mode=full")
    if mode == "delta" and transport == "inprocess":
        raise ConfigError(f"sync.mode=delta with sync.transport=inprocess (given {s.transport}): a delta saves wire "
                          f"bytes and in-process sync moves none; use sync.mode=full or inprocess, or sync.transport=ray")
    if mode == "inprocess" and transport != "inprocess":
        raise ConfigError(f"sync.mode=inprocess shares the trainer's module, so sync.transport must be inprocess, "
                          f"got {transport}; set sync.mode=full (or delta) to ship weights over {transport}")
    if mode == "inprocess" and dtype_name != "fp32":
        raise ConfigError(f"sync.mode=inprocess shares the trainer's fp32 module, but rollout.dtype={dtype_name}; "
                          f"set sync.mode=full for a separate {dtype_name} rollout copy, or rollout.dtype=fp32")
    if mode == "inprocess" and s.every != 1:
        raise ConfigError(f"sync.every={s.every} with sync.mode=inprocess: the shared module changes every step, "
                          f"so the engine cannot lag it; set sync.every=1 or sync.mode=full")
    if transport == "dist" and colocated:
        raise ConfigError("sync.transport=dist broadcasts to another process, but placement=colocated runs one; "
                          "set sync.transport=inprocess (or ray), or placement=disaggregated")
    return SyncPlan(mode, transport, dtype)


def sync_facts(cfg: RunConfig, model, plan: SyncPlan) -> dict:
    """What ``run.json`` states about sync for ``review``: mode, cadence, synced bytes per parameter, LoRA fraction.

    ``plan``: the run's resolved sync plan (``roles.settings``). ``policy_params`` counts the base only; the LoRA
    fraction is adapter / base parameters.
    """
    adapter = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    return {"sync_mode": plan.mode, "sync_transport": plan.transport, "policy_params": base, "sync_every": cfg.sync.every,
            "initial_full_sync": True,  # the driver's start-up sync (then the equality check)
            "delta_index_bytes": 4,  # int32 indices while a tensor's changed fraction < 1/32 (see delta.py)
            "bytes_per_param": torch.empty(0, dtype=plan.dtype).element_size() if plan.mode != "inprocess"
            else next(model.parameters()).element_size(),
            "lora_fraction": adapter / base if adapter else None,
            # tensors on the wire (each adds a header entry, plan/bytes.py framing_bytes): a full sync's,
            # and a LoRA sync's (lora_A, lora_B, scaling per adapted module)
            "weight_tensors": sum(1 for n, _ in model.named_parameters() if "lora_" not in n),
            "lora_tensors": 3 * sum(1 for n, _ in model.named_parameters() if n.endswith("lora_A.default.weight")) or None}
