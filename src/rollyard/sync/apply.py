"""The receiving half of every sync mode: staged apply.

``Receiver(model, version)`` owns the rollout copy's sync state (the version it holds, the LoRA
bases). Applying is two calls so that nothing is ever half-applied:

- ``staged = receiver.stage(update)``: verify the payload checksum, check the update fits (shapes,
  names, a delta's ``base_version`` equal to the held version), and build the new tensors *beside*
  the live ones. Raises ``SyncRejected`` (its ``needs_full`` is true: publish with ``full=True``)
  and leaves the model and the held version untouched.
- ``receiver.swap(staged)``: copy the staged tensors (scatter a delta's validated indices and
  values) into the live parameters and take the new version. Only memory writes remain, so it
  cannot fail half-way on a bad update.

``receiver.apply(update)`` is both in one call. ``inprocess`` updates carry no tensors: the
trainer already changed the shared module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollyard.sync import delta, full, lora
from rollyard.sync.wire import SyncRejected, payload_checksum
from rollyard.types import WeightUpdate


def named_params(model) -> dict[str, torch.nn.Parameter]:
    # remove_duplicate=False: a tied weight (lm_head.weight == embed_tokens.weight) answers to
    # both names, so an update naming either one lands on the shared tensor.
    return dict(model.named_parameters(remove_duplicate=False))


@dataclass
class Staged:
    """An update ready to swap in: new tensors by parameter name, the version they make."""

    version: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scatters: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # delta: (flat idx, values)
    bases: dict[str, torch.Tensor] | None = None  # LoRA: the receiver's new unmerged bases


class Receiver:
    """Stages and swaps weight updates into ``model`` (see the module docstring)."""

    def __init__(self, model, version: int = 0):
        self.model = model
        self.version = int(version)
        self.bases: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def stage(self, update: WeightUpdate) -> Staged:
        if update.mode == "inprocess":
            if update.tensors or update.indices:
                raise ValueError(f"an 'inprocess' update carries no tensors (the trainer shares the module), got "
                                 f"{len(update.tensors)}; publish mode 'full' or 'delta' to ship tensors")
            return Staged(update.version)
        # ``pack`` stamps a checksum on every update that crossed a wire; an in-process one has none.
        if update.checksum is not None and payload_checksum(update) != update.checksum:
            raise SyncRejected(f"weight update v{update.version} ({update.mode}) fails its payload checksum "
                               f"(corrupted or truncated in transit); the rollout copy stays at v{self.version} "
                               f"and a full sync is requested")
        live = named_params(self.model)
        if update.mode == "full":
            return Staged(update.version, full.stage(live, update))
        if update.mode == "delta":
            tensors, scatters = delta.stage(live, update, self.version)
            return Staged(update.version, tensors, scatters)
        if update.mode == "lora":
            tensors, bases = lora.stage(live, update, self.bases)
            return Staged(update.version, tensors, bases=bases)
        raise ValueError(f"unknown weight update mode {update.mode!r}: expected inprocess, full, delta or lora")

    @torch.no_grad()
    def swap(self, staged: Staged) -> None:
        live = named_params(self.model)
        for name, t in staged.tensors.items():
            live[name].copy_(t)
        for name, (idx, vals) in staged.scatters.items():
            live[name].view(-1)[idx] = vals
        if staged.bases is not None:
            self.bases = staged.bases
        self.version = staged.version

    def apply(self, update: WeightUpdate) -> None:
        self.swap(self.stage(update))


__all__ = ["Receiver", "Staged", "SyncRejected", "named_params"]
