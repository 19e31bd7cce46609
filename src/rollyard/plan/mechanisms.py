"""The mechanisms the plan prices, one small pure function each, with the physics in the docstring.

No fitted factors: every input is a stated property of the workload (lengths, batch), the hardware
(bandwidths, memory) or the software (concurrency, bucketing, fixed costs), given in the plan file.
These functions are the plan's own; the runtime never calls them (the runtime measures, the plan
predicts, ``review`` compares).

Decode (rollout) model. Decode is memory-bound: one decode step of an engine replica on ``tp`` GPUs
reads the weights once (shared by every sequence in flight) and each sequence's KV cache:

    step_s(b) = (W + b * kv_bytes_per_seq) / (tp * mem_bw)

- A **synchronous round** (every response of the step must finish before training) lasts at least as
  many decode steps as its longest response: the weight-read term is paid ``longest`` times even when
  only one sequence is left. That idle tail is the *bubble*.
- **Continuous batching with partial rollout** (async: unfinished responses carry over, the next
  step's prompts are admitted as slots free up) keeps every slot busy: the weight-read term is paid
  ``tokens / concurrency`` times. The KV term is the same in both: it is per token decoded.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

# ---- response lengths and the bubble ----

def expected_longest(n: int, *, mean: float, sigma: float, cap: float, lengths: list[int] | None = None) -> float:
    """Longest of ``n`` responses, as the ``1 - 1/(n + 1)`` quantile of the length distribution.

    That quantile is where the largest of ``n`` draws falls on average (the order statistic's
    plotting position); the engine clips responses at ``cap``. ``lengths`` (e.g. a run's
    lengths.jsonl) replace the lognormal of ``mean`` and ``sigma``.
    """
    if n < 1:
        raise ValueError(f"expected_longest needs n >= 1 responses, got {n}")
    q = 1 - 1 / (n + 1)
    if lengths:
        s = sorted(lengths)
        return float(min(max(s[min(len(s) - 1, int(q * len(s)))], 1), cap))
    mu = math.log(mean) - sigma * sigma / 2  # a lognormal with this mean
    # The upper quantile by symmetry, -inv_cdf(1/(n+1)): 1 - 1/(n+1) rounds to 1.0 for n >= ~1e16.
    z = -NormalDist().inv_cdf(max(1 / (n + 1), 1e-300))
    return float(min(math.exp(min(mu + sigma * z, 700.0)), cap))


def decode_step_s(weight_bytes: float, in_flight: float, kv_bytes_per_seq: float, tp: int, mem_bw: float) -> float:
    """One decode step of a replica: weights read once + every in-flight sequence's KV, over tp GPUs' HBM."""
    return (weight_bytes + in_flight * kv_bytes_per_seq) / (tp * mem_bw)


@dataclass(frozen=True)
class Decode:
    """What one replica of the rollout pool decodes per step, and the per-step costs."""

    sequences: float  # responses per replica per step
    mean_len: float  # mean response tokens
    longest: float  # longest response of the step [tokens]
    concurrency: int  # KV-cache slots per replica
    weight_bytes: float  # bytes read per decode step for the weights
    kv_bytes_per_seq: float  # KV bytes read per sequence per step (mean context)
    tp: int
    mem_bw: float

    @property
    def weight_step_s(self) -> float:
        return self.weight_bytes / (self.tp * self.mem_bw)

    @property
    def kv_s(self) -> float:
        """KV reads of every token this replica decodes (the same in every schedule)."""
        return self.sequences * self.mean_len * self.kv_bytes_per_seq / (self.tp * self.mem_bw)


def replica_decode(*, sequences_total: int, gpus: int, tp: int, mean_len: float, longest: float, concurrency: int,
                   weight_bytes: float, kv_bytes_per_token: float, prompt_tokens: float, mem_bw: float) -> Decode:
    """The per-replica batch on ``gpus`` GPUs: ``gpus // tp`` replicas share the step's sequences.

    The rollout estimate uses this real per-replica batch, not a fixed concurrency: with few
    sequences per replica the weight read is shared by fewer tokens.
    """
    replicas = max(1, gpus // tp)
    per = math.ceil(sequences_total / replicas)
    ctx = prompt_tokens + mean_len / 2  # mean context while decoding
    return Decode(per, mean_len, longest, concurrency, weight_bytes, kv_bytes_per_token * ctx, tp, mem_bw)


def synchronous_round_s(d: Decode) -> float:
    """A round that waits for its longest response (plain synchronous RL).

    Weight reads: at least ``longest`` decode steps (the last sequence decodes alone), and at least
    ``sequences * mean / concurrency`` steps when the replica cannot hold all its sequences at once.
    """
    steps = max(d.longest, d.sequences * d.mean_len / d.concurrency)
    return steps * d.weight_step_s + d.kv_s


def continuous_s(d: Decode) -> float:
    """The bubble-free floor: continuous batching with partial rollout keeps all ``concurrency`` slots
    busy, so the weight read is shared by a full batch on every decode step."""
    return d.sequences * d.mean_len / d.concurrency * d.weight_step_s + d.kv_s


def balanced_round_s(d: Decode) -> float:
    """The best a synchronous round can do without working ahead: every response the mean length,
    so no slot idles inside the round (tail batching's limit; it cannot use the next step's prompts)."""
    steps = max(d.mean_len, d.sequences * d.mean_len / d.concurrency)
    return steps * d.weight_step_s + d.kv_s


def bubble_fraction(d: Decode) -> float:
    """Share of a synchronous round that a bubble-free schedule does not need: 1 - floor / round."""
    r = synchronous_round_s(d)
    return 1 - continuous_s(d) / r if r > 0 else 0.0


# ---- placements at equal hardware ----

@dataclass(frozen=True)
class PoolSplit:
    """One placement on G accelerators: seconds per step and where they go."""

    placement: str
    rollout_gpus: int
    trainer_gpus: int
    rollout_s: float  # rollout side per step (incl. unstreamed reward)
    trainer_s: float  # reference + train per step
    sync_s: float  # exposed weight-sync seconds per step
    step_s: float

    @property
    def steps_per_hour(self) -> float:
        return 3600.0 / self.step_s if self.step_s > 0 else math.inf

    def as_dict(self) -> dict:
        return {**asdict(self), "steps_per_hour": self.steps_per_hour}


def colocated_step_s(rollout_round_s: float, reward_s: float, trainer_s: float, reload_s: float) -> float:
    """One pool time-shares everything: rollout (synchronous round) + reward + trainer + weight reload."""
    return rollout_round_s + reward_s + trainer_s + reload_s


def streamed_s(rollout_side_s: float, trainer_s: float, minibatches: int) -> float:
    """On-policy streaming: the trainer accumulates gradients over ``minibatches`` pieces of the
    step's batch as they are generated (one optimizer step at the end, so still on-policy). A
    two-stage pipeline: the slower stage runs throughout, plus the faster stage's share of the
    first piece (fill) or the last (drain)."""
    if minibatches < 1:
        raise ValueError(f"streaming needs >= 1 mini-batches, got {minibatches}")
    return max(rollout_side_s, trainer_s) + min(rollout_side_s, trainer_s) / minibatches


def disaggregated_step_s(rollout_side_s: float, trainer_s: float, sync_s: float, staleness_bound: int = 1,
                         streamed_minibatches: int = 0) -> float:
    """Two pools one step apart in lockstep: the slower pool paces, and the broadcast holds both.
    With bound 0 they cannot be a step apart: they take turns, each idle while the other works,
    unless the trainer streams the step's mini-batches (``streamed_minibatches`` > 0)."""
    if staleness_bound < 1:
        if streamed_minibatches:
            return streamed_s(rollout_side_s, trainer_s, streamed_minibatches) + sync_s
        return rollout_side_s + trainer_s + sync_s
    return max(rollout_side_s, trainer_s) + sync_s


def async_step_s(rollout_side_s: float, trainer_s: float, sync_s: float, staleness_bound: int = 1,
                 streamed_minibatches: int = 0) -> float:
    """Two pools decoupled by a staleness bound >= 1: each runs at its own rate, the sync is a
    background transfer; the slowest of the three (rollout, trainer, one sync per step) paces.
    With bound 0 nothing may run ahead: generation waits for the new weights every step (streaming
    the trainer's mini-batches then overlaps within the step)."""
    if staleness_bound < 1:
        if streamed_minibatches:
            return streamed_s(rollout_side_s, trainer_s, streamed_minibatches) + sync_s
        return rollout_side_s + trainer_s + sync_s
    return max(rollout_side_s, trainer_s, sync_s)


def splits(total: int, tp: int) -> list[tuple[int, int]]:
    """Every (rollout, trainer) split of ``total`` GPUs in whole engine replicas, both pools non-empty."""
    return [(r, total - r) for r in range(tp, total, tp)]


# ---- weight sync ----

@dataclass(frozen=True)
class SyncTime:
    """One weight sync's seconds by stage; ``total`` follows the bucketing rule."""

    fixed_s: float
    gather_s: float
    wire_s: float
    load_s: float
    compare_s: float
    per_tensor_s: float
    overlap: bool

    @property
    def total(self) -> float:
        stages = (self.gather_s, self.wire_s, self.load_s)
        moving = max(stages) if self.overlap else sum(stages)
        return self.fixed_s + self.per_tensor_s + self.compare_s + moving

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def sync_time(nbytes: float, *, link_bw: float, links: int, gather_bw: float, load_bw: float, receivers: int,
              fixed_s: float = 0.0, per_tensor_s: float = 0.0, compare_s: float = 0.0,
              overlap: bool = True) -> SyncTime:
    """Seconds to move one sync of ``nbytes`` from the trainer into a rollout replica.

    - gather: each sender assembles its share of whole tensors over the intra-node link
      (``nbytes / (links * gather_bw)``);
    - wire: ``links`` parallel senders, each on its own NIC at ``link_bw`` (``nbytes / (links * link_bw)``);
    - load: the receiving replica's ``receivers`` GPUs copy what arrived into the engine's weights,
      one HBM read + one write per byte (``2 * nbytes / (receivers * load_bw)``);
    - bucketing: with ``overlap`` successive buckets pipeline, so the slowest stage sets the time;
      otherwise the stages add. Fixed and per-tensor software costs and a delta compare come on top.
    """
    for name, v in (("link_bw", link_bw), ("gather_bw", gather_bw), ("load_bw", load_bw)):
        if not v > 0:
            raise ValueError(f"sync_time: {name} must be > 0 bytes/s, got {v}")
    if links < 1 or receivers < 1:
        raise ValueError(f"sync_time: links and receivers must be >= 1, got {links}, {receivers}")
    return SyncTime(fixed_s, nbytes / (links * gather_bw), nbytes / (links * link_bw),
                    2 * nbytes / (receivers * load_bw), compare_s, per_tensor_s, overlap)


def delta_compare_s(full_bytes: float, trainer_gpus: int, mem_bw: float) -> float:
    """Exporting a delta is compute on the trainer, not wire: each GPU reads its shard of the new
    weights and of the last-sent copy and writes the copy back (3 passes of HBM traffic)."""
    return 3 * full_bytes / (trainer_gpus * mem_bw)


def colocated_reload_s(weight_bytes: float, gpus: int, mem_bw: float) -> float:
    """Colocated sync is not free: every GPU copies its shard of the new weights into the engine's
    buffers (one HBM read + one write per byte)."""
    return 2 * weight_bytes / (gpus * mem_bw)


# ---- trainer traffic and memory ----

def fsdp_bytes_per_rank(param_bytes: float, grad_bytes: float, k: int) -> float:
    """Per-rank wire traffic of one FSDP (ZeRO-3) step over ``k`` ranks: a reduce-scatter of the
    gradients plus two all-gathers of the parameters (forward and backward), each (k-1)/k of the
    full tensor (0 at k = 1)."""
    if k < 1:
        raise ValueError(f"FSDP needs k >= 1 ranks, got {k}")
    share = (k - 1) / k
    return share * grad_bytes + 2 * share * param_bytes


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU each role needs, against what a GPU holds."""

    trainer_per_gpu: float
    rollout_weights_per_gpu: float
    kv_per_gpu: float
    gpu_memory: float

    @property
    def rollout_per_gpu(self) -> float:
        return self.rollout_weights_per_gpu + self.kv_per_gpu

    def as_dict(self) -> dict:
        return {**asdict(self), "rollout_per_gpu": self.rollout_per_gpu}


def memory(*, params: float, train_bytes_per_param: float, trainer_gpus: int, sharded: bool, weight_bytes: float,
           tp: int, in_flight: float, kv_bytes_per_token: float, context: float, gpu_memory: float) -> Memory:
    """Training state (weights + grads + fp32 master + Adam, ~18 B/param) per trainer GPU (sharded
    over the trainer GPUs under FSDP, whole on each under DDP); rollout weights per engine GPU and
    the KV cache of the sequences in flight at full context."""
    train = params * train_bytes_per_param / (trainer_gpus if sharded else 1)
    kv = in_flight * context * kv_bytes_per_token / tp
    return Memory(train, weight_bytes / tp, kv, gpu_memory)
