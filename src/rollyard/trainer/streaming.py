"""Streaming trainer: gradients from complete groups while the round is still running, one step at its end.

The loss of each group is a *sum* over its tokens (``denominators=(1, 1)``); ``finish`` divides
the accumulated gradient once by the step's token count (``token-mean``) or sequence count
(``seq-mean``), then clips and steps. Because the weights do not change until ``finish``, pi_old
of every group is the same policy, and the update equals ``Trainer.step`` on all the samples at
once, to float tolerance (tests/test_tail.py checks it).
"""

from __future__ import annotations

import torch

from rollyard.trainer.metrics import quantiles, step_metrics
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample


class StreamingStep:
    """One optimizer step assembled from groups: ``add(group)`` any number of times, then ``finish()``."""

    def __init__(self, trainer: Trainer, min_tokens: int | None = None):
        self.trainer = trainer
        # Complete groups wait until they fill a packed micro-batch (a group alone is often far
        # shorter than micro_batch_tokens, and a half-empty forward costs nearly a full one).
        self.min_tokens = trainer.micro_batch_tokens if min_tokens is None else min_tokens
        self.accs: list[dict] = []
        self.buffer: list[Sample] = []
        self.groups = 0
        trainer.optimizer.zero_grad(set_to_none=True)

    def add(self, samples: list[Sample]) -> None:
        """Take a complete group (advantages set); forward/backward once ``min_tokens`` are buffered."""
        self.buffer += samples
        self.groups += 1
        if sum(s.num_tokens for s in self.buffer) >= self.min_tokens:
            self._flush()

    def _flush(self) -> None:
        if self.buffer:
            self.accs.append(self.trainer.accumulate_gradients(self.buffer, denominators=(1, 1)))
            self.buffer = []

    def finish(self) -> dict[str, float]:
        """Scale the summed gradient once, clip, step; the same metrics as ``Trainer.step``."""
        self._flush()
        t, accs = self.trainer, self.accs
        tokens = sum(a["tokens"] for a in accs)
        seqs = sum(a["seqs"] for a in accs)
        den = max(tokens if t.loss_agg == "token-mean" else seqs, 1)

        def total(key: str) -> float:
            return float(sum(float(a[key]) for a in accs))

        skipped = False
        t.optimizer_s = 0.0
        lr = t.schedule_lr()  # the schedule advances on every step, one with nothing to learn too
        if tokens == 0:
            t.optimizer.zero_grad(set_to_none=True)
            grad_norm = 0.0
        else:
            if not any(a["micro_batches"] for a in accs):  # every sample skipped (zero advantage): the step
                grad_norm, skipped = t.zero_gradient_step(total("loss") / den)  # still runs, on zeros
            else:
                with torch.no_grad():
                    for p in t.params:
                        if p.grad is not None:
                            p.grad.div_(den)
                grad_norm, skipped = t._optimizer_step(total("loss") / den)  # clip, non-finite guard, step
        # every sample of the step may have been skipped (zero advantage): tokens counted, no ratio computed
        log_ratio = [x for a in accs for x in a["log_ratio"]]
        ratio = torch.cat(log_ratio).exp() if log_ratio else torch.zeros(0)
        p05, p50, p95 = quantiles(ratio, [0.05, 0.5, 0.95])
        metrics = {"loss": total("loss") / den, "pg_loss": total("pg_loss") / den, "grad_norm": grad_norm,
                   "ratio_p05": p05, "ratio_p50": p50, "ratio_p95": p95, **step_metrics(accs),
                   "groups": float(self.groups), "skipped": float(skipped), "skipped_steps": float(t.skips.total),
                   "optimizer_s": t.optimizer_s, "lr": lr}
        self.accs, self.groups = [], 0
        return metrics
