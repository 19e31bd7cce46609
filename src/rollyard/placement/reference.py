"""The reference model's placement (``reference.placement``): who scores the reference logprobs of the KL term.

Every variant answers the same two calls, used by ``step.score`` and the tail path (``streamed.py``):

- ``submit(samples)``: a group has finished (no-op unless the scoring can start early);
- ``fill(trainer, samples, step) -> spans``: set ``sample.ref_logprobs`` on every sample, waiting for what
  is not scored yet; returns spans other processes recorded (on this process's clock);
- ``metrics()``: counters for the step's row (reset); ``stop()``.

``inline`` (here): a frozen copy of the initial policy in the trainer's process, scored through the
trainer's packed path after the rewards; on the critical path every step, and one more model copy
in the trainer's memory. ``fused`` (here): the trainer's own module with its LoRA adapter disabled
is the initial policy (the adapter starts as the identity, the base weights are frozen), so no copy
exists: it saves the copy's memory and its start-up, not time. ``pool`` (``reference_pool.py``):
Ray actors hold the copy and score each group as soon as its rollout worker ships it.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from rollyard.config import ConfigError, RunConfig
from rollyard.types import Sample


class InlineReference:
    """A frozen copy of the initial policy in the trainer's process."""

    def __init__(self, model):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.syncs = 0  # reference updates towards the policy (reference.sync_every)

    def submit(self, samples: list[Sample]) -> None:
        return None

    def fill(self, trainer, samples: list[Sample], step: int = 0) -> list[dict]:
        with self._scoring():
            logprobs = trainer.logprobs(samples, model=self.model)
        for s, lp in zip(samples, logprobs):
            s.ref_logprobs = lp.tolist()
        return []

    def _scoring(self):
        return contextlib.nullcontext()

    @torch.no_grad()
    def follow(self, trainer, before: int, after: int, ref_cfg) -> None:
        """TR-DPO's reference update (TRL ``sync_ref_model``): each time the policy's version crosses a multiple of
        ``ref_cfg.sync_every`` (``before`` -> ``after``), ``ref = alpha x policy + (1 - alpha) x ref``."""
        every, alpha = ref_cfg.sync_every, ref_cfg.mixup_alpha
        policy = dict(trainer.model.named_parameters())
        for _ in range(after // every - before // every):
            for name, p in self.model.named_parameters():
                p.mul_(1.0 - alpha).add_(policy[name].detach().to(p.dtype), alpha=alpha)
            self.syncs += 1

    def metrics(self) -> dict:
        return {"reference/syncs": float(self.syncs)} if self.syncs else {}

    def stop(self) -> None:
        return None


class FusedReference(InlineReference):
    """The trainer's own LoRA policy with its adapter disabled: the frozen base is the reference."""

    def __init__(self, policy):
        self.model = policy  # no copy: the same module, scored with its adapter off
        self.syncs = 0

    def _scoring(self):
        return self.model.disable_adapter()


def check(cfg: RunConfig) -> None:
    """Raise ``ConfigError`` (one line, with the fix) for a reference placement that cannot work."""
    where = cfg.reference.placement
    if cfg.reference.sync_every and cfg.algo.kl_coef == 0:
        raise ConfigError(f"reference.sync_every={cfg.reference.sync_every} moves the reference towards the policy, "
                          f"but algo.kl_coef=0 uses no reference; set algo.kl_coef > 0 (e.g. 0.04) or "
                          f"reference.sync_every=0")
    if cfg.reference.sync_every and (where != "inline" or cfg.model.lora.r > 0):
        what = f"reference.placement={where}" if where != "inline" else f"model.lora.r={cfg.model.lora.r}"
        raise ConfigError(f"reference.sync_every={cfg.reference.sync_every} mixes the policy's weights into a reference "
                          f"copy in the trainer's process, which {what} does not have (as TRL refuses it with PEFT); "
                          f"set reference.placement=inline and model.lora.r=0, or reference.sync_every=0")
    if where == "inline":
        return
    if cfg.algo.kl_coef == 0:
        raise ConfigError(f"reference.placement={where} places the reference model, but algo.kl_coef=0 uses none; "
                          f"set algo.kl_coef > 0 (e.g. 0.04) or reference.placement=inline")
    if where == "fused" and cfg.model.lora.r == 0:
        raise ConfigError("reference.placement=fused scores with the policy's LoRA adapter disabled, but "
                          "model.lora.r=0 trains every weight (no frozen base to score with); set model.lora.r > 0 "
                          "(e.g. 8) or reference.placement=inline")
    if where == "pool" and cfg.placement == "colocated":
        raise ConfigError("reference.placement=pool runs the reference on Ray actors beside the Ray rollout workers, "
                          "but placement=colocated runs one process without Ray (nothing to overlap with: rollout "
                          "and training take turns); set placement=disaggregated or async, or "
                          "reference.placement=inline (or fused with LoRA)")


def build(cfg: RunConfig, model):
    """The reference scorer for ``cfg``'s placement over the initial policy ``model``; None when ``kl_coef == 0``."""
    if cfg.algo.kl_coef == 0:
        return None
    if cfg.reference.placement == "fused":
        return FusedReference(model)
    if cfg.reference.placement == "pool":
        from rollyard.placement.reference_pool import ReferencePool
        return ReferencePool(cfg, model)
    return InlineReference(model)
