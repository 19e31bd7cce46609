"""Applying a ``WeightUpdate`` to the rollout side's module, and the checksum that proves equality.

``apply_update`` is the receiving half of every sync mode: ``inprocess`` (colocated: the trainer
already changed the shared module, nothing to copy), ``full`` (every parameter by name) and
``delta`` (flat int64 indices of the changed elements and their new values). ``lora`` is a later
issue and fails loudly rather than pretending to work.

``weights_checksum`` hashes every parameter in name order (name, dtype, shape and raw bytes), so
two modules have the same checksum exactly when they hold bit-identical weights. When an update
carries a checksum, ``apply_update`` verifies the result against it.
"""

from __future__ import annotations

import hashlib

import torch

from rollyard.types import WeightUpdate


def _named_params(model) -> dict[str, torch.nn.Parameter]:
    # remove_duplicate=False: a tied weight (lm_head.weight == embed_tokens.weight) answers to
    # both names, so an update naming either one lands on the shared tensor.
    return dict(model.named_parameters(remove_duplicate=False))


def weights_checksum(model) -> str:
    """sha256 over (name, dtype, shape, bytes) of every parameter, in sorted name order.

    Tied parameters are hashed once (under their first name). Equal checksums mean bit-identical
    weights; the trainer publishes this with an update and the receiver recomputes it.
    """
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        t = p.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _has_adapter(model) -> bool:
    return any("lora_" in name for name, _ in model.named_parameters())


@torch.no_grad()
def apply_update(model, update: WeightUpdate) -> None:
    """Make ``model`` hold the weights ``update`` describes (in place); verify ``update.checksum`` if set.

    Raises ``KeyError`` for a parameter name the model lacks, ``ValueError`` for a shape or index
    mismatch or a checksum mismatch, ``NotImplementedError`` for ``lora``.
    """
    mode = update.mode
    if mode == "inprocess":
        if update.tensors:
            raise ValueError(
                f"an 'inprocess' update carries no tensors (the trainer shares the module), got "
                f"{len(update.tensors)}; publish mode 'full' or 'delta' to ship tensors"
            )
    elif mode in ("full", "delta"):
        params = _named_params(model)
        for name, value in update.tensors.items():
            if name not in params:
                close = [n for n in params if n.split(".")[-1] == name.split(".")[-1]][:3]
                raise KeyError(
                    f"weight update (version {update.version}, mode {mode}) names parameter {name!r}, "
                    f"which the rollout model does not have (similar: {close}); trainer and rollout "
                    f"must load the same architecture"
                )
            p = params[name]
            if mode == "full":
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(
                        f"full update: parameter {name!r} has shape {tuple(p.shape)} in the rollout model, "
                        f"the update sends {tuple(value.shape)}"
                    )
                p.copy_(value.to(device=p.device, dtype=p.dtype))
            else:
                if name not in update.indices:
                    raise ValueError(f"delta update: values for {name!r} but no indices[{name!r}]")
                idx = update.indices[name].to(device=p.device, dtype=torch.long).view(-1)
                vals = value.to(device=p.device, dtype=p.dtype).view(-1)
                if idx.numel() != vals.numel():
                    raise ValueError(
                        f"delta update: {name!r} has {idx.numel()} indices but {vals.numel()} values; "
                        f"they must pair one to one"
                    )
                if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= p.numel()):
                    raise ValueError(
                        f"delta update: index out of range for {name!r} ({p.numel()} elements): "
                        f"min {int(idx.min())}, max {int(idx.max())}"
                    )
                p.view(-1).index_put_((idx,), vals)
    elif mode == "lora":
        if not _has_adapter(model):
            raise ValueError(
                "a 'lora' weight update needs a model with a LoRA adapter (parameters named '*lora_*'); "
                "this rollout model has none. Sync with mode 'full' or 'delta', or attach the adapter first"
            )
        raise NotImplementedError(
            "LoRA weight sync is not implemented yet; sync with mode 'full' or 'delta'"
        )
    else:
        raise ValueError(f"unknown weight update mode {mode!r}: expected inprocess, full, delta or lora")

    if update.checksum is not None:
        got = weights_checksum(model)
        if got != update.checksum:
            raise ValueError(
                f"weight sync check failed at version {update.version} (mode {mode}): the rollout "
                f"weights hash to {got[:16]}..., the trainer's to {update.checksum[:16]}...; the copies "
                f"differ, so samples would come from a policy the trainer never had"
            )
