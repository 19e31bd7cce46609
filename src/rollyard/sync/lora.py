"""LoRA sync: the trainer's PEFT adapter tensors only; the rollout side merges them into its copy.

The trainer's policy is a PEFT ``PeftModel`` (``models.attach_lora``: base frozen, adapter
trained); the rollout copy is a plain model holding the *merged* weights in the rollout dtype
``d``. For an adapted linear ``W`` (base), ``A [r, in]``, ``B [out, r]``, scaling ``s = alpha / r``::

    merged(W) = (W.to(d).float() + (B.to(d).float() @ A.to(d).float()) * s).to(d)

i.e. exactly what the receiver can compute from what it received (the adapter ships in the
rollout dtype), and in fp32 exactly PEFT's own ``merge_and_unload`` (``W + (B @ A) * s``).

Publish side: ``LoraPublisher(dtype).publish(model, version, full=False)`` sends, per adapted
module (rollout name ``m``), ``m.lora_A``, ``m.lora_B`` and ``m.scaling`` (fp32 scalar). With
``full=True`` (start-up, or after a rejected update) it also sends every base parameter by its
rollout name, so the receiver (re)learns the base it merges onto.

Apply side: ``stage(live, update, bases)`` returns the new merged weights of the adapted modules
(and the base parameters, on a full LoRA sync); ``bases`` is the receiver's store of unmerged
base weights, updated only when the stage succeeds (``apply.Receiver``).
"""

from __future__ import annotations

import torch

from rollyard.sync.wire import SyncRejected
from rollyard.types import WeightUpdate

PREFIX = "base_model.model."
ADAPTER_SUFFIXES = (".lora_A", ".lora_B", ".scaling")


def rollout_name(peft_name: str) -> str:
    """PEFT parameter name -> the plain model's name (``...q_proj.base_layer.weight`` -> ``...q_proj.weight``)."""
    return peft_name.removeprefix(PREFIX).replace(".base_layer.", ".")


def adapted_modules(model) -> dict[str, torch.nn.Module]:
    """Rollout module name -> PEFT LoRA layer, for every adapted module of ``model``."""
    return {rollout_name(n): m for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}


def base_weights(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every non-adapter parameter under its rollout name, cast to ``dtype`` (unmerged)."""
    return {rollout_name(n): p.detach().to(dtype=dtype, copy=True)
            for n, p in model.named_parameters() if "lora_" not in n}


def adapter_tensors(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, m in adapted_modules(model).items():
        out[name + ".lora_A"] = m.lora_A["default"].weight.detach().to(dtype=dtype, copy=True)
        out[name + ".lora_B"] = m.lora_B["default"].weight.detach().to(dtype=dtype, copy=True)
        out[name + ".scaling"] = torch.tensor(float(m.scaling["default"]), dtype=torch.float32)
    return out


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
    """``(base + (B @ A) * s)`` in fp32, cast back to ``base.dtype`` (all inputs in the rollout dtype)."""
    return (base.float() + (b.float() @ a.float()) * scaling.float()).to(base.dtype)


class LoraPublisher:
    mode = "lora"

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    @torch.no_grad()
    def publish(self, model, version: int, full: bool = False) -> WeightUpdate:
        if not adapted_modules(model):
            raise ValueError("sync.mode=lora needs a policy with a LoRA adapter; set model.lora.r > 0")
        tensors = adapter_tensors(model, self.dtype)
        if full:
            tensors.update(base_weights(model, self.dtype))
        return WeightUpdate(version=version, mode="lora", tensors=tensors)

    @torch.no_grad()
    def expected(self, model) -> dict[str, torch.Tensor]:
        """The merged weights a rollout copy in sync with ``model`` holds."""
        return merged({**base_weights(model, self.dtype), **adapter_tensors(model, self.dtype)})


@torch.no_grad()
def merged(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rollout copy's weights from a full LoRA update's tensors (bases + adapters): adapted
    weights merged, the adapter tensors themselves left out."""
    out = {n: t for n, t in tensors.items() if not n.endswith(ADAPTER_SUFFIXES)}
    for m in sorted({n.rsplit(".", 1)[0] for n in tensors if n.endswith(ADAPTER_SUFFIXES)}):
        w = m + ".weight"
        out[w] = merge(out[w], *(tensors[m + suf] for suf in ADAPTER_SUFFIXES))
    return out


def stage(live: dict[str, torch.Tensor], update: WeightUpdate, bases: dict[str, torch.Tensor]
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(new live tensors, new bases)`` for a LoRA update; ``live`` and ``bases`` are not written."""
    modules = sorted({n.rsplit(".", 1)[0] for n in update.tensors if n.endswith(ADAPTER_SUFFIXES)})
    plain = {n: t for n, t in update.tensors.items() if not n.endswith(ADAPTER_SUFFIXES)}
    for n, t in plain.items():
        if n not in live or tuple(live[n].shape) != tuple(t.shape):
            raise SyncRejected(f"lora update v{update.version}: base parameter {n!r} does not match the rollout model")
    # copies: a view would keep the whole received payload alive
    new_bases = {m + ".weight": plain[m + ".weight"].clone() for m in modules if m + ".weight" in plain}
    out = {n: t.to(device=live[n].device, dtype=live[n].dtype) for n, t in plain.items() if n not in new_bases}
    for m in modules:
        w = m + ".weight"
        base = new_bases.get(w, bases.get(w))
        if base is None or w not in live:
            raise SyncRejected(f"lora update v{update.version}: the receiver holds no base weight for {w!r} "
                               f"(no full LoRA sync yet); a full sync is requested")
        try:
            a, b, s = (update.tensors[m + suf] for suf in ADAPTER_SUFFIXES)
            merged = merge(base.to(live[w].dtype), a.to(live[w].dtype), b.to(live[w].dtype), s)
        except (KeyError, RuntimeError) as e:
            raise SyncRejected(f"lora update v{update.version}: adapter of {m!r} is incomplete or misshapen ({e})") from None
        if merged.shape != live[w].shape:
            raise SyncRejected(f"lora update v{update.version}: merged {w!r} is {tuple(merged.shape)}, "
                               f"the rollout model has {tuple(live[w].shape)}")
        out[w] = merged.to(live[w].device)
    return out, {**bases, **new_bases}
