"""Phase times of one step: given in the plan, or estimated from first principles (seed 002).

- rollout: decode is memory-bandwidth-bound, so time = decoded tokens x bytes read per decoded
  token / (HBM bandwidth x rollout GPUs). Bytes per decoded token = one weight read shared by the
  ``concurrency`` sequences in flight + the KV cache of the token's context (mean context =
  prompt + half the response).
- train: 6 x P x tokens FLOPs (forward 2, backward 4) / (sustained FLOP/s x trainer GPUs).
- reference: forward only, 2 x P x tokens on the trainer GPUs.
- sync: the chosen mode's bytes over the sync link (disaggregated, async); colocated moves an IPC
  handle, which is taken as 0 s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rollyard.plan.bytes import StepBytes
from rollyard.plan.inputs import PlanInputs


@dataclass(frozen=True)
class Phases:
    """Seconds per step of each role (rundir.ROLES) and where each figure came from."""

    rollout: float
    reward: float
    reference: float
    algorithm: float
    train: float
    sync: float  # per step: one sync over the sync link / every_steps (0 when colocated)
    source: dict[str, str] = field(default_factory=dict, compare=False)

    def seconds(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if k != "source"}



def bytes_per_decoded_token(p: PlanInputs) -> float:
    ro = p.rollout
    if ro.bytes_per_decoded_token is not None:
        return ro.bytes_per_decoded_token
    weights = p.policy.params * p.policy.bytes_per_param / ro.concurrency
    return weights + ro.kv_bytes_per_token * (ro.prompt_tokens + ro.avg_tokens / 2)


def trainer_gpus(p: PlanInputs) -> int:
    return p.trainer.gpus or p.trainer.dp


def train_tokens(p: PlanInputs) -> float:
    """Tokens the trainer processes per step: prompt + response for every sample."""
    ro = p.rollout
    return ro.prompts * ro.samples * (ro.prompt_tokens + ro.avg_tokens)


def estimate(p: PlanInputs, b: StepBytes, sync_seconds: float) -> Phases:
    ph = p.phases
    src: dict[str, str] = {}
    flops = p.trainer.flops_per_gpu * trainer_gpus(p)
    if ph.rollout_s is not None:
        rollout, src["rollout"] = ph.rollout_s, "given"
    else:
        bpt = bytes_per_decoded_token(p)
        rollout = b.rollout_tokens * bpt / (p.rollout.mem_bandwidth * p.rollout.gpus)
        src["rollout"] = (f"estimated: {b.rollout_tokens:.3g} tokens x {bpt:.3g} B/token / "
                          f"({p.rollout.mem_bandwidth:.3g} B/s x {p.rollout.gpus} GPUs)")
    if ph.train_s is not None:
        train, src["train"] = ph.train_s, "given"
    else:
        train = 6 * p.policy.params * train_tokens(p) / flops
        src["train"] = f"estimated: 6 x {p.policy.params:.3g} x {train_tokens(p):.3g} tokens / {flops:.3g} FLOP/s"
    if not ph.use_reference:
        reference, src["reference"] = 0.0, "no reference model"
    elif ph.reference_s is not None:
        reference, src["reference"] = ph.reference_s, "given"
    else:
        reference = 2 * p.policy.params * train_tokens(p) / flops
        src["reference"] = "estimated: 2 x P x tokens (forward only) on the trainer GPUs"
    src["reward"] = src["algorithm"] = "given"
    src["sync"] = f"one sync's bytes over {p.network.sync_link}, per {p.sync.every_steps} step(s)"
    return Phases(rollout=rollout, reward=ph.reward_s, reference=reference, algorithm=ph.algorithm_s,
                  train=train, sync=sync_seconds / p.sync.every_steps, source=src)
