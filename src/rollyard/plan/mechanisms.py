"""The mechanisms the plan prices, one small pure function each, with the physics in the docstring.

No fitted factors: every input is a stated property of the workload (lengths, batch), the hardware
(bandwidths, memory) or the software (concurrency, bucketing, fixed costs), given in the plan file.
These functions are the plan's own; the runtime never calls them (the runtime measures, the plan
predicts, ``review`` compares).

Decode (rollout) model. One decode step of an engine replica on ``tp`` GPUs with ``b`` sequences in
flight reads the weights once (shared by every sequence) and each sequence's KV cache, and does
``2 x P_active`` FLOPs per sequence; it takes the slower of the two (a roofline) plus the engine's fixed
work per step (scheduling, sampling, kernel launches):

    step_s(b) = max((W + b * kv_bytes_per_seq) / (tp * mem_bw), b * 2 * P_active / (tp * peak_flops)) + o

Small batches are memory-bound (the weight read is the step); past the knee
``b* = W / (tp * mem_bw) / (2 P / (tp * peak) - kv / (tp * mem_bw))`` the step grows with the batch (H20:
148 TFLOP/s over 4.0 TB/s, a 7B model's knee is ~54 sequences). A round is priced on its totals:
``max(steps x weight read + KV reads, tokens x FLOPs) + steps x o`` (the roofline of the whole round, exact
when one bound holds at every step, a lower bound otherwise).

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


def decode_step_s(weight_bytes: float, in_flight: float, kv_bytes_per_seq: float, tp: int, mem_bw: float,
                  flops_per_token: float = 0.0, peak_flops: float = math.inf, overhead_s: float = 0.0) -> float:
    """One decode step of a replica: the slower of its HBM reads (weights once + every in-flight
    sequence's KV, over tp GPUs' bandwidth) and its FLOPs (``flops_per_token`` per sequence over tp
    GPUs' peak), plus the engine's fixed work per step."""
    memory = (weight_bytes + in_flight * kv_bytes_per_seq) / (tp * mem_bw)
    return max(memory, in_flight * flops_per_token / (tp * peak_flops)) + overhead_s


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
    flops_per_token: float = 0.0  # 2 x P_active: FLOPs per decoded token (0: no compute bound)
    peak_flops: float = math.inf  # dense peak FLOP/s per GPU
    step_overhead_s: float = 0.0  # the engine's fixed work per decode step

    @property
    def weight_step_s(self) -> float:
        return self.weight_bytes / (self.tp * self.mem_bw)

    @property
    def kv_s(self) -> float:
        """KV reads of every token this replica decodes (the same in every schedule)."""
        return self.sequences * self.mean_len * self.kv_bytes_per_seq / (self.tp * self.mem_bw)

    @property
    def compute_s(self) -> float:
        """FLOPs of every token this replica decodes at the replica's peak (the same in every schedule)."""
        return self.sequences * self.mean_len * self.flops_per_token / (self.tp * self.peak_flops)

    def round_s(self, steps: float) -> float:
        """``steps`` decode steps that decode every token of the replica: the roofline of their totals
        (weight reads per step + KV reads, against the FLOPs) plus the engine's work per step."""
        return max(steps * self.weight_step_s + self.kv_s, self.compute_s) + steps * self.step_overhead_s

    def round_terms(self, steps: float) -> dict[str, float]:
        """``round_s(steps)`` term by term: the bound that holds (the weight reads of every decode step and the KV
        reads of every token, or the FLOPs of every token when those take longer) and the engine's work per step;
        the terms add up to ``round_s(steps)``."""
        memory = {"weight reads (one per decode step)": steps * self.weight_step_s, "KV reads": self.kv_s}
        bound = memory if sum(memory.values()) >= self.compute_s else {"FLOPs (compute-bound)": self.compute_s}
        return {**bound, "engine work per decode step": steps * self.step_overhead_s}


def replica_decode(*, sequences_total: int, gpus: int, tp: int, mean_len: float, longest: float, concurrency: int,
                   weight_bytes: float, kv_bytes_per_token: float, prompt_tokens: float, mem_bw: float,
                   flops_per_token: float = 0.0, peak_flops: float = math.inf, step_overhead_s: float = 0.0) -> Decode:
    """The per-replica batch on ``gpus`` GPUs: ``gpus // tp`` replicas share the step's sequences.

    The rollout estimate uses this real per-replica batch, not a fixed concurrency: with few
    sequences per replica the weight read is shared by fewer tokens.
    """
    replicas = max(1, gpus // tp)
    per = math.ceil(sequences_total / replicas)
    ctx = prompt_tokens + mean_len / 2  # mean context while decoding
    return Decode(per, mean_len, longest, concurrency, weight_bytes, kv_bytes_per_token * ctx, tp, mem_bw,
                  flops_per_token, peak_flops, step_overhead_s)


def synchronous_round_s(d: Decode) -> float:
    """A round that waits for its longest response (plain synchronous RL).

    Decode steps: at least ``longest`` (the last sequence decodes alone), and at least
    ``sequences * mean / concurrency`` when the replica cannot hold all its sequences at once.
    """
    return d.round_s(round_steps(d))


def round_steps(d: Decode) -> float:
    """Decode steps of a synchronous round: ``max(longest, sequences x mean / concurrency)``."""
    return max(d.longest, d.sequences * d.mean_len / d.concurrency)


def continuous_s(d: Decode) -> float:
    """The bubble-free floor: continuous batching with partial rollout keeps all ``concurrency`` slots
    busy, so the weight read is shared by a full batch on every decode step."""
    return d.round_s(continuous_steps(d))


def continuous_steps(d: Decode) -> float:
    """Decode steps with every slot busy: ``sequences x mean / concurrency``."""
    return d.sequences * d.mean_len / d.concurrency


def balanced_round_s(d: Decode) -> float:
    """The best a synchronous round can do without working ahead: every response the mean length,
    so no slot idles inside the round (tail batching's limit; it cannot use the next step's prompts)."""
    return d.round_s(balanced_steps(d))


def balanced_steps(d: Decode) -> float:
    """Decode steps of a round of mean-length responses: ``max(mean, sequences x mean / concurrency)``."""
    return max(d.mean_len, d.sequences * d.mean_len / d.concurrency)


def bubble_fraction(d: Decode) -> float:
    """Share of a synchronous round that a bubble-free schedule does not need: 1 - floor / round."""
    r = synchronous_round_s(d)
    return 1 - continuous_s(d) / r if r > 0 else 0.0


def tokens_at_peak(seconds: float, gpus: int, peak_flops: float, flops_per_token: float) -> float:
    """The most tokens a phase measured at ``seconds`` on ``gpus`` GPUs can have processed: no GPU does
    more than its peak FLOP/s, so ``tokens <= seconds x gpus x peak_flops / flops_per_token`` (the
    compute roofline read backwards; at any efficiency below 100% of peak the phase processed fewer)."""
    if not (seconds >= 0 and gpus >= 1 and peak_flops > 0 and flops_per_token > 0):
        raise ValueError(f"tokens_at_peak needs seconds >= 0, GPUs >= 1, peak and FLOPs per token > 0, got "
                         f"{seconds}, {gpus}, {peak_flops}, {flops_per_token}")
    return seconds * gpus * peak_flops / flops_per_token


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


def amdahl_s(seconds: float, measured_gpus: int, gpus: int, serial_fraction: float) -> float:
    """A step measured at ``seconds`` on ``measured_gpus`` GPUs, on ``gpus``: Amdahl's law. A share
    ``serial_fraction`` of the one-GPU work is not divided among GPUs (per optimizer step: the collectives'
    latency, the optimizer's launch, the driver's dispatch, the rank that holds the longest sequence), the
    rest is: ``t(g) = t1 x (s + (1 - s) / g)``, so ``t(g) = t(m) x (s + (1 - s) / g) / (s + (1 - s) / m)``.
    At ``serial_fraction`` 0 it is FLOP-bound (time x GPUs constant)."""
    if measured_gpus < 1 or gpus < 1 or not 0 <= serial_fraction <= 1:
        raise ValueError(f"amdahl_s needs GPUs >= 1 and a serial fraction in [0, 1], got {measured_gpus}, {gpus}, "
                         f"{serial_fraction}")
    s = serial_fraction
    return seconds * (s + (1 - s) / gpus) / (s + (1 - s) / measured_gpus)


def pipeline_bubble(microbatches: int, stages: int) -> float:
    """A 1F1B pipeline of ``stages`` stages over ``microbatches`` micro-batches per data-parallel rank takes
    ``(m + p - 1) / m`` of its work time: the first micro-batch's fill and the last one's drain idle every stage
    but one (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", SC '21, sec. 2.2: bubble fraction (p - 1) / m). A forward-only pass fills and drains alike."""
    if microbatches < 1 or stages < 1:
        raise ValueError(f"a pipeline needs >= 1 micro-batch and >= 1 stage, got {microbatches}, {stages}")
    return (microbatches + stages - 1) / microbatches


def host_copies_s(nbytes: float, host_bw: float) -> float:
    """Bytes one GPU copies between its memory and the host's, one after another, over its host link."""
    if not host_bw > 0:
        raise ValueError(f"a host link needs > 0 bytes/s, got {host_bw}")
    return nbytes / host_bw


def expert_all_to_all_s(tokens: float, hidden: int, top_k: int, layers: float, ep: int, local: int,
                        nvlink_bw: float, rdma_bw: float, bytes_per_element: float = 2) -> float:
    """One all-to-all (a dispatch or a combine) of every MoE layer a GPU holds, over ``tokens`` tokens on that GPU:
    each token's hidden state (``hidden`` x ``bytes_per_element``) goes to ``top_k`` experts spread evenly over ``ep``
    ranks, of which ``local`` share the GPU's node: ``(local - 1) / ep`` of the copies cross NVLink, ``(ep - local) /
    ep`` the network, both at once (DeepEP forwards NVLink and RDMA traffic concurrently), so the slower link sets
    the time; ``1 / ep`` stay on the GPU."""
    if not (0 < local <= ep) or not (nvlink_bw > 0 and rdma_bw > 0):
        raise ValueError(f"an expert all-to-all needs 0 < local <= ep and > 0 bytes/s links, got local {local}, "
                         f"ep {ep}, {nvlink_bw}, {rdma_bw}")
    copies = tokens * top_k * hidden * bytes_per_element * layers
    return max(copies * (local - 1) / ep / nvlink_bw, copies * (ep - local) / ep / rdma_bw)


def cross_node_tp_step_s(layers: int, allreduce_s: float) -> float:
    """A decode step of a tensor-parallel replica wider than a node: two all-reduces per layer (after attention
    and after the MLP or MoE block, Megatron-style tensor parallelism) cross the node boundary, each a small
    message whose time is the collective's latency ``allreduce_s``."""
    return 2 * layers * allreduce_s


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


# A split search prices at most this many splits per pass (``grid``), so a plan answers in a bounded
# time at any cluster size (pricing every split of 1e6 GPUs took 41 s).
SPLIT_POINTS = 129


def grid(lo: int, hi: int, points: int | None = None) -> list[int]:
    """Whole numbers from ``lo`` to ``hi`` (both included): all of them when there are at most
    ``points`` (default ``SPLIT_POINTS``), else ``points`` evenly spaced ones."""
    points = points or SPLIT_POINTS
    if hi - lo + 1 <= points:
        return list(range(lo, hi + 1))
    return sorted({lo + round(i * (hi - lo) / (points - 1)) for i in range(points)})


# ---- weight sync ----
#
# One weight update, term by term. Three sides work on successive buckets of the update at once:
#
# - the trainer (per sending stream): gather the shards into whole tensors (FSDP -> whole, bytes over
#   the gather link), cast/copy them into the send buffer (bytes read + written), its software per
#   tensor (name, metadata, serialization, a handle);
# - the link: the bytes over the sync link, one stream per sender, each on its own NIC;
# - the engine (per receiving GPU): its load per tensor (``load_weights``: name resolution, the
#   weight loader slicing its shard, a copy launch) and the bytes it copies into its weights.
#
# Bucketing rule: with ``overlap`` the three sides pipeline over ``buckets`` buckets, so one update
# takes the slowest side plus the other sides' share of one bucket (fill and drain):
# ``max(s) + (sum(s) - max(s)) / buckets``; with one bucket, or without overlap, the sides add.
# Each bucket also ends in a handshake every side waits for (a collective launch and synchronize, the
# bucket's metadata message or handle, the receiver's reply): ``per_bucket_s`` x buckets, serial.
# Once per sync, whatever the bytes: a fixed cost (metadata gather, group setup), the engine's
# pause + resume, and a delta's compare on the trainer.

@dataclass(frozen=True)
class SyncTime:
    """One weight sync's seconds, term by term; ``total`` follows the bucketing rule."""

    fixed_s: float  # once per sync: metadata gather, process-group setup
    pause_s: float  # once per sync: engine pause + resume
    compare_s: float  # once per sync: a delta's export/compare on the trainer
    gather_s: float  # trainer: shards -> whole tensors over the gather link
    cast_s: float  # trainer: weights copied (and cast) into the send buffer
    send_tensor_s: float  # trainer: software per tensor x tensors per stream
    bucket_s: float  # every side waits: handshake per bucket x buckets per stream
    wire_s: float  # link: bytes per stream / link bandwidth
    load_tensor_s: float  # engine: load per tensor x tensors each receiving GPU loads
    copy_s: float  # engine: bytes copied into the engine's weights (HBM read + write)
    buckets: int  # buckets per stream
    tensors: float  # tensors the update carries
    overlap: bool
    stage_s: float = 0.0  # trainer: device -> pinned host staging (P2P from host memory)
    encode_s: float = 0.0  # trainer: a compressed payload's encode (sparse refit)
    decode_s: float = 0.0  # engine: the payload's decode
    round_trip_s: float = 0.0  # serial: request/acknowledge round trips per payload
    mechanism: str = "load_weights"  # the receive path priced (RECEIVE_WORDS)

    @property
    def trainer_s(self) -> float:
        return self.gather_s + self.cast_s + self.send_tensor_s + self.stage_s + self.encode_s

    @property
    def engine_s(self) -> float:
        return self.load_tensor_s + self.copy_s + self.decode_s

    @property
    def words(self) -> str:
        """The receive mechanism, in words."""
        return RECEIVE_WORDS.get(self.mechanism, self.mechanism)

    @property
    def moving_s(self) -> float:
        """The three sides over the buckets, pipelined (slowest side + fill/drain) or added, plus the
        per-bucket handshakes."""
        sides = (self.trainer_s, self.wire_s, self.engine_s)
        return (pipelined_s(sides, self.buckets) if self.overlap else sum(sides)) + self.bucket_s + self.round_trip_s

    @property
    def total(self) -> float:
        return self.fixed_s + self.pause_s + self.compare_s + self.moving_s

    def terms(self) -> dict[str, float]:
        """``total`` term by term (they add up to it): what is paid once per update, the slowest side of the bucket
        pipeline and what the others add (their share of one bucket when pipelined, all of them when not), the
        per-bucket handshakes and round trips."""
        sides = (self.trainer_s, self.wire_s, self.engine_s)
        moving = pipelined_s(sides, self.buckets) if self.overlap else sum(sides)
        return {"control once per update (fixed)": self.fixed_s, "engine pause and resume": self.pause_s,
                "delta compare on the trainer": self.compare_s,
                "slowest side of the bucket pipeline (trainer, wire or engine)": max(sides),
                "the other sides (one bucket's share when pipelined, all when not)": moving - max(sides),
                "per-bucket handshakes": self.bucket_s, "request/acknowledge round trips": self.round_trip_s}

    def as_dict(self) -> dict:
        return {**asdict(self), "trainer_s": self.trainer_s, "engine_s": self.engine_s,
                "moving_s": self.moving_s, "total": self.total, "mechanism_words": self.words}


def pipelined_s(stages: tuple[float, ...], buckets: int) -> float:
    """Stages that work on successive buckets at once: each bucket spends ``stage / buckets`` in each
    stage, so the update takes the slowest stage plus the others' share of one bucket (the pipeline's
    fill and drain): ``max + (sum - max) / buckets`` (the plain sum at one bucket)."""
    if buckets < 1:
        raise ValueError(f"a sync has >= 1 bucket, got {buckets}")
    slowest = max(stages)
    return slowest + (sum(stages) - slowest) / buckets


def buckets_of(nbytes: float, bucket_bytes: float, streams: int = 1) -> int:
    """Buckets one sending stream cuts its ``nbytes / streams`` into (at least one)."""
    if not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    return max(1, math.ceil(nbytes / streams / bucket_bytes))


def gather_s(nbytes: float, shards: int, streams: int, gather_bw: float) -> float:
    """FSDP -> whole tensors: each stream all-gathers its share of the update; it holds 1/shards of
    each tensor and receives the other (shards-1)/shards over the gather link (0 when unsharded)."""
    if shards < 1:
        raise ValueError(f"gather needs >= 1 shards, got {shards}")
    return nbytes / streams * (shards - 1) / shards / gather_bw


def cast_s(params: float, source_bpp: float, dest_bpp: float, streams: int, cast_bw: float) -> float:
    """The trainer's weights copied into the send buffer in the rollout dtype (a cast when the dtypes
    differ, fp32 -> bf16: 4 + 2 bytes per element): ``params / streams x (source + dest) / cast_bw``,
    ``cast_bw`` in bytes read + written per second (HBM-bound on a GPU)."""
    return params / streams * (source_bpp + dest_bpp) / cast_bw


def copy_s(nbytes: float, receivers: int, load_bw: float) -> float:
    """The engine copies what arrived into its weights: one read + one write per byte, each of the
    replica's ``receivers`` GPUs its 1/receivers share."""
    return 2 * nbytes / (receivers * load_bw)


# ---- the receive path: one rule per mechanism ----
#
# What an update costs on the receiving side depends on how the engine takes it, not on one constant per
# tensor. Each rule below prices (per-tensor seconds, byte seconds) for one receiving GPU, or, for P2P, the
# sending stream that took the receiver's work over. ``RECEIVE_WORDS`` says each in words for the plan's output.

RECEIVE_WORDS = {
    "load_weights": "the engine's load_weights per tensor (name lookup, weight loader slices its shard, copy)",
    "direct_write": "bulk bytes written straight into the engine's buffers; only the misc tensors go through "
                    "load_weights",
    "receiver_reshard": "every receiving GPU takes whole tensors and reshards them (reads all, keeps its slice)",
    "rdma_pinned": "RDMA writes from pinned host memory: the sender reshards each tensor on the CPU into a host "
                   "replica of every peer layout it serves; nothing runs on the receiver",
    "copy": "rollyard's native engine: a name lookup and one copy per tensor",
    "none": "the transfer alone (no engine)",
}


def load_weights_terms(tensors: float, nbytes: float, receivers: int, per_tensor_s: float,
                       copy_bw: float) -> tuple[float, float]:
    """load_weights (and rollyard's copy): every tensor each receiving GPU loads pays the per-tensor cost,
    and its 1/receivers share of the bytes is copied into the weights (one read + one write)."""
    return tensors * per_tensor_s, copy_s(nbytes, receivers, copy_bw)


def direct_write_terms(misc_tensors: float, bulk_bytes: float, misc_bytes: float, receivers: int,
                       per_tensor_s: float, copy_bw: float) -> tuple[float, float]:
    """Direct writes (NeMo-RL's NCCL reshard refit): the bulk (FFN/expert) bytes are received shard to shard
    into the engine's storage and fused slices copied back once (one read + one write of the GPU's share);
    the misc tensors (attention, norms, router, embeddings) arrive whole by broadcast and ride load_weights:
    ``misc_tensors`` x the per-tensor cost, and a reshard pass over ``misc_bytes`` (``receiver_reshard_terms``)."""
    misc_t, misc_copy = receiver_reshard_terms(misc_tensors, misc_bytes, receivers, per_tensor_s, copy_bw)
    return misc_t, copy_s(bulk_bytes, receivers, copy_bw) + misc_copy


def direct_write_wire_s(bulk_bytes: float, misc_bytes: float, links: int, link_bw: float) -> float:
    """The wire of a direct-write update per receiving GPU: its share of the bulk over ``links`` streams, plus
    the whole misc broadcast on its own link (every generation rank takes every misc tensor)."""
    return bulk_bytes / (links * link_bw) + misc_bytes / link_bw


def bulk_fraction(moe: bool) -> float:
    """Share of a model's bytes in its FFN/expert weights (the direct-write bulk path). MoE: 0.975, NeMo-RL's
    profiling ("the MoE FFN layers account for 97%-98% of the model weights", nccl-reshard-refit.md). Dense:
    2/3, a SwiGLU FFN of width 8h/3 (3 x h x 8h/3 = 8h^2 per layer) against attention's 4h^2 (embeddings
    left out)."""
    return 0.975 if moe else 2 / 3


def receiver_reshard_terms(tensors: float, nbytes: float, receivers: int, per_tensor_s: float,
                           copy_bw: float) -> tuple[float, float]:
    """A reshard on the receiver: a broadcast hands every receiving GPU each whole tensor; its loader reads
    all of it and writes its 1/receivers slice: ``(nbytes + nbytes / receivers) / copy_bw``, plus the
    per-tensor loader cost for every tensor."""
    if receivers < 1:
        raise ValueError(f"a reshard needs >= 1 receiving GPUs, got {receivers}")
    return tensors * per_tensor_s, (nbytes + nbytes / receivers) / copy_bw


def pinned_rdma_terms(stage_tensors: float, shard_bytes: float, layouts: int, per_tensor_s: float,
                      host_bw: float) -> tuple[float, float]:
    """RDMA from pinned host memory (P2P; miles, checkpoint-engine P2P): a sending stream serves ``layouts``
    distinct receiver layouts (the peers' TP ranks it writes, at least 1); for each it reshards every tensor of
    its pipeline stage on the CPU with the engine's weight loader (``stage_tensors`` x ``per_tensor_s``) into a
    pinned host replica of that rank, copying the rank's ``shard_bytes`` device -> host at ``host_bw``; the
    RDMA writes then go from there. Returns (CPU reshard seconds, staging seconds), both on the sender."""
    if layouts < 1 or not host_bw > 0:
        raise ValueError(f"pinned RDMA needs >= 1 layouts and a host link > 0 bytes/s, got {layouts}, {host_bw}")
    return stage_tensors * layouts * per_tensor_s, shard_bytes * layouts / host_bw


def codec_terms(nbytes: float, producers: int, receivers: int, encode_bw: float,
                decode_bw: float) -> tuple[float, float]:
    """A compressed payload (a sparse refit's zstd): each producer encodes its 1/producers share at
    ``encode_bw``; each receiving node decodes every payload at ``decode_bw`` (it applies the whole update),
    spread over its ``receivers`` GPUs' host threads. Returns (encode seconds, decode seconds)."""
    if producers < 1 or receivers < 1 or not (encode_bw > 0 and decode_bw > 0):
        raise ValueError(f"codec needs producers, receivers >= 1 and rates > 0, got {producers}, {receivers}, "
                         f"{encode_bw}, {decode_bw}")
    return nbytes / producers / encode_bw, nbytes / receivers / decode_bw


def round_trips_s(payloads: float, producers: int, rtt_s: float) -> float:
    """Requests a producer waits on, one after another: ``ceil(payloads / producers)`` round trips of
    ``rtt_s`` (an object store's PUT and the receivers' GET, a relay's acknowledgement)."""
    if producers < 1:
        raise ValueError(f"round trips need >= 1 producers, got {producers}")
    return math.ceil(payloads / producers) * rtt_s if payloads > 0 else 0.0


def sync_time(nbytes: float, *, link_bw: float, links: int, gather_bw: float, load_bw: float, receivers: int,
              fixed_s: float = 0.0, pause_s: float = 0.0, compare_s: float = 0.0, tensors: float = 0.0,
              load_tensors: float | None = None, load_bytes: float | None = None, send_per_tensor_s: float = 0.0,
              load_per_tensor_s: float = 0.0, per_bucket_s: float = 0.0, bucket_bytes: float = math.inf,
              shards: int = 1, params: float = 0.0, source_bpp: float = 0.0, dest_bpp: float = 0.0,
              cast_bw: float = math.inf, overlap: bool = True, send_streams: int | None = None,
              engine_terms: tuple[float, float] | None = None, sender_terms: tuple[float, float] | None = None,
              codec: tuple[float, float] = (0.0, 0.0), round_trip_s: float = 0.0,
              mechanism: str = "load_weights", wire_s: float | None = None) -> SyncTime:
    """Seconds to move one sync of ``nbytes`` (``tensors`` tensors) from the trainer into a rollout
    replica, term by term (the rule above):

    - ``links`` parallel sending streams, each its own NIC at ``link_bw`` and its own share of the
      tensors and buckets (``ceil(nbytes / links / bucket_bytes)`` buckets each);
    - trainer side per stream: ``gather_s`` (``shards``-way FSDP), ``cast_s`` (``params`` from
      ``source_bpp`` to ``dest_bpp`` at ``cast_bw``; 0 bytes per element = not priced), tensors x
      ``send_per_tensor_s``, the tensors split over ``send_streams`` (default ``links``; a P2P sender
      reshards every tensor of its pipeline stage whatever its share of the bytes);
    - per bucket, serial: buckets x ``per_bucket_s``;
    - engine side per receiving GPU: ``load_tensors`` (default: the update's tensors) x
      ``load_per_tensor_s`` and ``copy_s`` of ``load_bytes`` (default: ``nbytes``); an engine that
      reloads its whole model on every update loads more than the update carries;
    - once: ``fixed_s``, ``pause_s``, ``compare_s``;
    - a receive mechanism's own rule (``load_weights_terms`` and its siblings) replaces the engine side with
      ``engine_terms`` (per-tensor s, byte s) and adds ``sender_terms`` (per-tensor s, staging s) to each
      sending stream; ``codec`` (encode s per producer, decode s per receiver) and ``round_trip_s`` (serial)
      price a compressed, request/acknowledge path (a sparse refit); ``wire_s`` replaces the link term where
      the mechanism moves other bytes than ``nbytes / links`` per stream (``direct_write_wire_s``).
    """
    for name, v in (("link_bw", link_bw), ("gather_bw", gather_bw), ("load_bw", load_bw), ("cast_bw", cast_bw)):
        if not v > 0:
            raise ValueError(f"sync_time: {name} must be > 0 bytes/s, got {v}")
    if links < 1 or receivers < 1:
        raise ValueError(f"sync_time: links and receivers must be >= 1, got {links}, {receivers}")
    buckets = buckets_of(nbytes, bucket_bytes, links)
    load_tensors = tensors if load_tensors is None else load_tensors
    load_bytes = nbytes if load_bytes is None else load_bytes
    load_t, copy_t = engine_terms or (load_tensors * load_per_tensor_s, copy_s(load_bytes, receivers, load_bw))
    send_t, stage_t = sender_terms or (tensors / (send_streams or links) * send_per_tensor_s, 0.0)
    return SyncTime(
        fixed_s=fixed_s, pause_s=pause_s, compare_s=compare_s,
        gather_s=gather_s(nbytes, shards, links, gather_bw),
        cast_s=cast_s(params, source_bpp, dest_bpp, links, cast_bw),
        send_tensor_s=send_t, bucket_s=buckets * per_bucket_s,
        wire_s=nbytes / (links * link_bw) if wire_s is None else wire_s,
        load_tensor_s=load_t, copy_s=copy_t,
        buckets=buckets, tensors=tensors, overlap=overlap, stage_s=stage_t, encode_s=codec[0], decode_s=codec[1],
        round_trip_s=round_trip_s, mechanism=mechanism)


def delta_compare_s(full_bytes: float, trainer_gpus: int, mem_bw: float) -> float:
    """Exporting a delta is compute on the trainer, not wire: each GPU reads its shard of the new
    weights and of the last-sent copy and writes the copy back (3 passes of HBM traffic)."""
    return 3 * full_bytes / (trainer_gpus * mem_bw)


# ---- the bytes a sync puts on the wire ----

# The wire form (sync/wire.py): per sync a 16-byte length prefix (the dist transport) and a JSON header
#   {"version":V,"mode":"M","checksum":"<64 hex>","base_version":B,"tensors":[E,E,...]}
# and per tensor one header entry E = ["<name>","v","<dtype>",[d0,d1],<nbytes>] plus zero padding
# that starts the next tensor at a multiple of 8 bytes.
WIRE_PREFIX_BYTES = 16
WIRE_ALIGN = 8
# {"version":,"mode":"","checksum":"","base_version":,"tensors":[]} is 65 characters; the values: a
# 64-hex sha256, a mode of 4 letters (full, lora; delta 5), a version of 2 digits and a base version of
# 4 characters (null, or digits); the last entry has no comma after it (-1).
WIRE_HEADER_BYTES = 65 + 64 + 4 + 2 + 4 - 1
# The characters around one entry's fields, [ "name" , "v" , "dtype" , shape , nbytes ] and the comma
# between entries: 1 + 2 + 1 + 2 + 1 + 2 + 1 + 1 + 1 + 1 = 13 (the role letter and the shape are counted apart).
WIRE_ENTRY_PUNCT = 13


def tensor_framing_bytes(name_chars: float, dtype: str, shape: tuple[int, ...], nbytes: int) -> float:
    """Header bytes of one tensor's entry in the wire form, counted from the format: the punctuation,
    its name, role ``v``, ``torch.<dtype>``, the shape as ``[d0,d1]``, the byte length; plus the
    padding that aligns the next tensor to 8 bytes."""
    shape_chars = 2 + sum(len(str(d)) for d in shape) + max(len(shape) - 1, 0)
    entry = WIRE_ENTRY_PUNCT + name_chars + 1 + len(f"torch.{dtype}") + shape_chars + len(str(nbytes))
    return entry + (-nbytes) % WIRE_ALIGN


# ---- trainer traffic and memory ----

def fsdp_bytes_per_rank(param_bytes: float, grad_bytes: float, k: int) -> float:
    """Per-rank wire traffic of one FSDP (ZeRO-3) step over ``k`` ranks: a reduce-scatter of the
    gradients plus two all-gathers of the parameters (forward and backward), each (k-1)/k of the
    full tensor (0 at k = 1)."""
    if k < 1:
        raise ValueError(f"FSDP needs k >= 1 ranks, got {k}")
    share = (k - 1) / k
    return share * grad_bytes + 2 * share * param_bytes


# Activation bytes per token per layer in a bf16 transformer (Korthikanti et al. 2022, "Reducing
# Activation Recomputation in Large Transformer Models", arXiv 2205.05198, sec. 4: s*b*h*(34 + 5*a*s/h)
# per layer without parallelism; flash attention keeps no attention scores, which drops the 5*a*s/h
# term); with full recomputation a layer keeps only its input, 2*s*b*h. Logits: fp32 per token of the
# vocabulary for the log-softmax (a chunked or fused log-softmax holds less).
ACT_BYTES_PER_HIDDEN, CKPT_BYTES_PER_HIDDEN, LOGIT_BYTES = 34, 2, 4


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU each role needs, against what a GPU holds. Trainer: model (weights in the synced
    dtype), optimizer (the rest of the training state: gradients, fp32 master, Adam moments), the
    reference model's weights when the algorithm needs one, activations of one micro-batch. Rollout:
    its shard of the weights and the KV cache of the sequences in flight."""

    trainer_per_gpu: float  # training state: model + optimizer
    rollout_weights_per_gpu: float
    kv_per_gpu: float
    gpu_memory: float
    trainer_model_per_gpu: float = 0.0
    trainer_optimizer_per_gpu: float = 0.0
    reference_per_gpu: float = 0.0
    activations_per_gpu: float = 0.0  # as configured (with or without checkpointing)
    activations_ckpt_per_gpu: float = 0.0  # with activation checkpointing
    activations_full_per_gpu: float = 0.0  # without

    @property
    def rollout_per_gpu(self) -> float:
        return self.rollout_weights_per_gpu + self.kv_per_gpu

    @property
    def trainer_total_per_gpu(self) -> float:
        return self.trainer_per_gpu + self.reference_per_gpu + self.activations_per_gpu

    def roles(self) -> dict[str, float]:
        """Predicted peak bytes per GPU of each pool (what `review` holds a measured peak against)."""
        return {"trainer": self.trainer_total_per_gpu, "rollout": self.rollout_per_gpu}

    def as_dict(self) -> dict:
        return {**asdict(self), "rollout_per_gpu": self.rollout_per_gpu,
                "trainer_total_per_gpu": self.trainer_total_per_gpu}


def activations(*, tokens: float, layers: int, hidden: int, vocab: int, checkpointing: bool,
                logits_tokens: float | None = None) -> float:
    """Activation bytes of one micro-batch of ``tokens`` on one GPU (constants above); the fp32 logits
    of ``logits_tokens`` at once (a chunked log-softmax; None = the whole micro-batch)."""
    per = CKPT_BYTES_PER_HIDDEN if checkpointing else ACT_BYTES_PER_HIDDEN
    held = tokens if logits_tokens is None else min(tokens, logits_tokens)
    return tokens * layers * hidden * per + held * vocab * LOGIT_BYTES


def memory(*, params: float, train_bytes_per_param: float, trainer_gpus: int, sharded: bool, weight_bytes: float,
           tp: int, in_flight: float, kv_bytes_per_token: float, context: float, gpu_memory: float,
           model_bytes_per_param: float = 0.0, reference: bool = False, micro_batch_tokens: float = 0.0,
           layers: int = 0, hidden: int = 0, vocab: int = 0, checkpointing: bool = True,
           logits_tokens: float | None = None, teacher_params: float = 0.0) -> Memory:
    """Training state (weights + grads + fp32 master + Adam, ~18 B/param) per trainer GPU (sharded
    over the trainer GPUs under FSDP, whole on each under DDP), the reference weights (sharded alike),
    one micro-batch's activations, a distillation teacher held in the trainer (``teacher_params``, sharded alike); rollout weights per engine GPU and the KV cache of the sequences in
    flight at full context."""
    shards = trainer_gpus if sharded else 1
    train = params * train_bytes_per_param / shards
    model = min(params * model_bytes_per_param / shards, train)
    kv = in_flight * context * kv_bytes_per_token / tp
    act = {c: activations(tokens=micro_batch_tokens, layers=layers, hidden=hidden, vocab=vocab, checkpointing=c,
                          logits_tokens=logits_tokens) for c in (True, False)}
    return Memory(train, weight_bytes / tp, kv, gpu_memory, trainer_model_per_gpu=model,
                  trainer_optimizer_per_gpu=train - model,
                  reference_per_gpu=((params if reference else 0.0) + teacher_params) * model_bytes_per_param / shards,
                  activations_per_gpu=act[checkpointing], activations_ckpt_per_gpu=act[True],
                  activations_full_per_gpu=act[False])
