"""What `rollyard plan` prices: one typed, documented plan file (TOML or YAML) plus overrides.

Every field states its unit and bounds; infinite and NaN values are refused everywhere. The
defaults are the runbook's reference workload (seed 000, ``rl_step_bytes.py``: a 14B dense policy
in bf16, LoRA 0.5%, delta 2%, DP 8, 256 prompts x 8 samples x 4096 tokens at 8 bytes per token, 60
syncs per hour), so no plan file (or an empty one with ``--defaults``) prints the runbook's figures.
Hardware defaults are H100-class GPUs; phase times left out are estimated (rollout from the decode
model of ``mechanisms``, training from 6 * P_active * tokens over sustained FLOP/s).

An unknown field anywhere is an error naming the field and the closest valid one; ``key.sub=value``
overrides (values read as TOML, else YAML) beat the file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rollyard.config import (
    ConfigError,
    _set_dotted,
    check_keys,
    describe_errors,
    parse_override,
    read_file,
)
from rollyard.telemetry import rundir

# Link bandwidths in bytes/s (decimal). NVLink and RDMA are seed 002's figures for a weight
# broadcast ("over NVLink (~600 GB/s)", "over InfiniBand (~50 GB/s)"); commodity is a
# 10 Gb/s cross-site / Ethernet link. Add others under [network.custom].
TIER_PRESETS: dict[str, float] = {"nvlink": 600e9, "rdma": 50e9, "commodity": 1.25e9}

# The software cost of a weight update on a CPU, per rollout backend (rollout.device = "cpu"): measured
# 2026-11-25 06:39 UTC on this project's 2-core machine (1 torch thread, load average ~4 from other work,
# fastest of 15 per figure) by
#   .venv/bin/python bench/sync.py --terms
# (bench/sync_terms.py: rollyard's own publish + pack, gloo DistTransport, and the engines' load_weights
# on Llama-shaped models of 867 vs 12 tensors at equal bytes, and 12 tensors at 4x the bytes; results
# in bench/README.md). pause_s is what an update pays once beyond its tensors and bytes (trainer side
# 5.7 ms + engine side; the engines pause at a step boundary, no call). Keys are SyncSection fields.
CPU_SYNC: dict[str, dict[str, float]] = {
    "native": {"pause_s": 5.8e-3, "send_per_tensor_s": 12e-6, "load_per_tensor_s": 34e-6, "per_bucket_s": 4.3e-4,
               "cast_bw": 3.0e9, "load_bw": 1.7e9},
    "vllm": {"pause_s": 8.9e-3, "send_per_tensor_s": 12e-6, "load_per_tensor_s": 211e-6, "per_bucket_s": 4.3e-4,
             "cast_bw": 3.0e9, "load_bw": 2.2e9},
}
# A colocated CPU run's native engine reads the trainer's own module (sync.mode=inprocess, the colocated default): a
# sync is the engine's refresh, each fused weight copy cast and laid out in one pass (model/fast.py refresh), bytes
# read + written per second. bench/sync_refresh.py `woken` (the copies rebuilt after the trainer's step), 2-core AMD
# EPYC, 2026-12-01: SmolLM2-135M's fp32 copy 1.08 GB in 0.051-0.054 s (its 113 MB LM head copy page-faulted afresh
# each time), its bf16 copy 0.81 GB in 0.017-0.019 s. The plan prices the copy in policy.bytes_per_param at the fp32
# rate: a bf16 copy costs ~half of that.
CPU_INPROCESS_REFRESH_BW = 21e9
# The same run measured the dist transport (gloo over loopback) at 3.0 GB/s: a CPU plan's sync link is
# then e.g. network.custom = {loopback = 3e9}, network.sync_link = "loopback".

# The software cost of a weight update on a GPU, by a rule from what the receiver does with each tensor
# (sync.receiver; auto: vllm and sglang run load_weights, rollyard's native engine copies). Each figure
# with its source (docs/calibration.md lists the rows that share a source or system with it: in-sample).
LOAD_WEIGHTS_PER_TENSOR_S = 127e-6  # SGLang load_weights per tensor on H100: the slime blog's per-bucket
# profile after flattening (https://hebiao064.github.io/rl-weight-sync): 20 ms per 512 MB bucket (IPC open 3 +
# rebuild 5 + load_weights 12 + close 0.2 ms) of ~157 tensors (Qwen3-30B-A3B: 18,867 tensors in ~120 buckets)
# The same profile split into its parts (rules of plan v6): a bucket's IPC open (3 ms) and close (0.2 ms) are
# paid once per flattened bucket, the rebuild (5 ms) and load_weights (12 ms) per tensor of it (~157): 108 us per
# tensor and 3.2 ms per bucket. load_weights and receiver_reshard price the split (the per-bucket part serial, as
# every side waits for a bucket's handle); the mechanisms that only reuse the per-tensor figure keep 127 us.
LOAD_WEIGHTS_SPLIT_PER_TENSOR_S = (5e-3 + 12e-3) / 157
LOAD_WEIGHTS_PER_BUCKET_S = 3e-3 + 0.2e-3
VLLM_PAUSE_S = 0.14  # vLLM's native update lifecycle (pause -> start_weight_update -> finish -> resume):
# huggingface/trl PR #5892, Qwen3-0.6B whole sync 0.18 s on H100, less its 310 tensors x 127 us and 1.5 GB of wire
# Each receive mechanism's own rule (plan/mechanisms.py: load_weights_terms, direct_write_terms,
# receiver_reshard_terms, pinned_rdma_terms); these are its software constants on a GPU (rules
# written 2026-11-27). A mechanism prices only the terms it has: no per-tensor receiver cost where the bytes
# land in place, no fixed floor where none is published for it.
GPU_SYNC: dict[str, dict[str, float]] = {
    # load_weights per tensor: name resolution, the weight loader slicing its TP/EP shard, a copy launch
    "load_weights": {"load_per_tensor_s": LOAD_WEIGHTS_SPLIT_PER_TENSOR_S, "per_bucket_s": LOAD_WEIGHTS_PER_BUCKET_S},
    # direct writes (NeMo-RL nccl_reshard: bulk FFN/expert shards received in place): only the misc tensors
    # (attention, norms, router, embeddings) ride load_weights, at its per-tensor cost
    "direct_write": {"load_per_tensor_s": LOAD_WEIGHTS_PER_TENSOR_S},
    # a reshard on the receiver (a broadcast of whole tensors): load_weights per tensor, and the read of the
    # whole tensor for its slice (mechanisms.receiver_reshard_terms)
    "receiver_reshard": {"load_per_tensor_s": LOAD_WEIGHTS_SPLIT_PER_TENSOR_S, "per_bucket_s": LOAD_WEIGHTS_PER_BUCKET_S},
    # rollyard's native engine: a name lookup and one copy_ per tensor; the Python work per tensor that
    # bench/sync.py --terms measured on a CPU (CPU_SYNC native), which a GPU host's driver process runs too
    "copy": {"load_per_tensor_s": CPU_SYNC["native"]["load_per_tensor_s"], "pause_s": CPU_SYNC["native"]["pause_s"]},
    # RDMA from pinned host memory (miles P2P, checkpoint-engine P2P): nothing runs per tensor on the receiver;
    # the sender reshards each tensor on the CPU with the engine's own weight loader (miles p2p: a CPU replica
    # of the SGLang model "provides the correct weight_loader functions to re-shard"), so load_weights'
    # per-tensor cost moves to the sending stream, once per receiver layout it serves
    "rdma_pinned": {"send_per_tensor_s": LOAD_WEIGHTS_PER_TENSOR_S},
    # the transfer alone (a benchmark that stops at the receiving buffer): no software term
    "none": {},
}
# Mechanisms that pay the cross-node control floor (CROSS_NODE_FIXED_S): the one NeMo-RL's anchor measured,
# a collective of whole tensors into load_weights. Direct writes and P2P publish no floor of their own.
FLOOR_MECHANISMS: tuple[str, ...] = ("load_weights", "receiver_reshard")
# Tensors per transformer layer that ride load_weights under direct writes (NeMo-RL's misc path): Qwen3's
# q, k, v, o, q_norm, k_norm, two layer norms and the MoE router (Hugging Face names), + 3 per model
# (embedding, final norm, lm_head) in MISC_TENSORS_PER_MODEL.
MISC_TENSORS_PER_LAYER, MISC_TENSORS_PER_MODEL = 9, 3
# Device -> pinned host memory: PCIe Gen5 x16, 32 GT/s x 16 lanes = 64 GB/s per direction (PCI-SIG; the
# H100 SXM's host link), the staging rate of RDMA from host memory.
PCIE5_X16_BW = 64e9
# A compressed payload (a sparse refit: NeMo-RL applies zstd level 1 to every payload): zstd 1.5.6 -1 on
# one core, 510 MB/s compress, 1580 MB/s decompress (facebook.github.io/zstd benchmark table, Core i7-9700K,
# Silesia; read 2026-11-27).
ZSTD1_ENCODE_BW, ZSTD1_DECODE_BW = 510e6, 1580e6
# The engine's pause and resume around an update, by backend (a receiver that pauses an engine):
# vLLM's from TRL; SGLang's is not published (miles and slime time their updates after pause_generation
# returns), so it is not priced; rollyard's native engine pauses at a step boundary (CPU_SYNC).
GPU_PAUSE_S: dict[str, float] = {"vllm": VLLM_PAUSE_S, "sglang": 0.0, "native": CPU_SYNC["native"]["pause_s"]}
RECEIVERS: tuple[str, ...] = tuple(GPU_SYNC)
# Once per update, a sync between nodes pays its control: metadata gather, the barrier and the Ray calls
# that start and end the collective on every rank. NeMo-RL's smallest NCCL refit anchor (tools/
# refit_bandwidth_calculator.py _NCCL_ANCHORS: 63.2 GB in 0.84 s, H100, 8 x 400 Gb/s) less its wire
# (63.2e9 / (8 x 50e9) = 0.16 s) and less the vLLM pause it includes (VLLM_PAUSE_S): 0.54 s. A sync
# within a node (colocated, or over a link of NVLINK_CLASS_BW or more, which no NIC gives) pays none.
CROSS_NODE_FIXED_S = 0.84 - 63.2e9 / (8 * 50e9) - VLLM_PAUSE_S
NVLINK_CLASS_BW = 200e9

# Amdahl's serial fraction of an RL trainer's step (trainer.serial_fraction): how a trainer time measured on one
# pool size scales to another. verl's own figures are far from time x GPUs constant (docs/advance/fully_async.md,
# Qwen2.5-Math-7B DAPO on H20, FSDP2, the fully_async_policy rows' update_actor as corrected after 2025-12 (read
# 2026-11-27 at volcengine/verl b178a3cd): 313.81 s on 16 trainer GPUs, 156.98 s on 32, 113.16 s on 64). Least
# squares of t = a + b / g over those three rows: a = 34.74 s, b = 4386 GPU-seconds (rows at 0.98 / 1.09 / 0.91 of
# the fit); the serial fraction is a / (a + b) = 0.0079. (Fitted 2026-11-27; before, 0.0165 from the
# table's earlier 269.80 s for 16:16, which the table now gives to colocate sync on 32.) docs/calibration.md marks
# the verl rows in sample (same table, same system).
TRAINER_SERIAL_FRACTION = 0.0079
# The engine's fixed work per decode step (rollout.step_overhead_s) when no round is measured, per backend:
# vLLM's from a published single-request decode: Llama-3.1-8B fp16 on one H100-80GB-HBM3, vLLM 0.21.0, TPOT p50
# 6.48 ms at concurrency 1 (yobitelcomm.github.io/bench recipes/concurrency-sweep, read 2026-11-27), less its
# roofline, the weight read 16.06e9 B / 3.35e12 B/s = 4.79 ms: 1.69 ms. SGLang's is not published (0); the
# native engine's is not measured on a GPU (0). Written 2026-11-27.
STEP_OVERHEAD_S: dict[str, float] = {"vllm": 6.48e-3 - 16.06e9 / 3.35e12, "sglang": 0.0, "native": 0.0}

# Trainer efficiency by architecture (trainer.mfu = null): model FLOPs per second over dense peak. Dense: IBM
# fms-fsdp's FSDP training on 96 H100 (7B 0.32, 13B 0.30, 34B 0.32 of 989 TFLOP/s). MoE: Megatron-Bridge's published
# pre-training table (NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md, read 2026-11-29 at 067f987d),
# its one BF16 MoE row on DGX-H100: GPT-OSS 120B (5.1B active of 117B), 64 GPUs, GBS 1280, MBS 1, sequence 4096,
# PP4 EP8: 158 model TFLOP/s per GPU, 0.160 of 989. Stated from the table, not fitted to any RL step.
DENSE_TRAINER_MFU = 0.31
MOE_TRAINER_MFU = 158e12 / 989e12
# A decode step of a tensor-parallel replica that spans nodes (rollout.tp > cluster.gpus_per_node) all-reduces its
# activations twice per layer (attention out, MLP/MoE out) across the node boundary; a small all-reduce there costs
# its latency: nccl-tests all_reduce_perf on 16 H100 over 2 nodes, 8 B in 123.5 us in place (lessizzmore/
# create-a3mega-ztan-fork ztan-NCCL-test-result, GCP A3 Mega, read 2026-11-29). An InfiniBand cluster's own
# all_reduce_perf figure replaces it (network.cross_node_allreduce_s).
CROSS_NODE_ALLREDUCE_S = 123.5e-6
# The expert all-to-all of an expert-parallel trainer (trainer.ep > 1): every MoE layer's forward sends each token's
# hidden state to the ranks of its top-k experts (dispatch) and sums their outputs back (combine); the backward runs
# the same pair (the gradient of a dispatch is a combine, of a combine a dispatch), a recomputed forward again.
# DeepEP's published rates for its normal (training) kernels (deepseek-ai/DeepEP docs/legacy.md at 0297fc80, read
# 2026-11-29; H800 with one CX7 400 Gb/s NIC each, DeepSeek-V3 pre-training shapes: 4,096 tokens per batch, hidden
# 7,168, top-8, FP8 dispatch, BF16 combine): intranode EP8 dispatch 153 GB/s and combine 158 GB/s over NVLink;
# internode EP16 43 / 43, EP32 58 / 57, EP64 51 / 50 GB/s over RDMA. The plan takes the dispatch figures (the slower
# of each pair) and the narrowest internode group's: a kernel written for this traffic, so the term is about the least
# the all-to-all can take. The network side is the same NIC on H100 (43 GB/s). NVLink is not: 153 GB/s is 96% of
# H800's ~160 GB/s; the same share of H100's NVLink 4 (18 links x 25 GB/s = 450 GB/s per direction) is 430 GB/s.
# (DeepEP's V2 README at the same commit: SM100 EP8 726 GB/s over NVLink 5; a GB200 plan states it.)
EP_NVLINK_BW = 153 / 160 * 450e9
EP_RDMA_BW = 43e9


def optimizer_passes(trainer) -> tuple[int, int]:
    """The hook between a run's trainer config and the plan: (epochs, mini-batches) a generation batch is trained
    in, read from ``trainer.epochs`` and ``trainer.mini_batches`` (an object's attributes or a mapping's keys; 1
    each where absent: a trainer config without them takes one optimizer step per batch). Each extra epoch is
    another forward + backward over the batch; epochs x mini-batches > 1 makes the trainer compute the previous
    policy's logprobs once per generation batch (the ratio is no longer 1 after the first step)."""
    get = trainer.get if isinstance(trainer, dict) else (lambda k, d: getattr(trainer, k, d))
    vals = []
    for key in ("epochs", "mini_batches"):
        v = get(key, 1)
        vals.append(v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else 1)
    return vals[0], vals[1]


Placement = Literal["colocated", "disaggregated", "async"]
PLACEMENTS: tuple[str, ...] = ("colocated", "disaggregated", "async")
SYNC_MODES: tuple[str, ...] = ("full", "delta", "lora")


# Bounds that keep a step physical: 1e9 prompts x 1e6 samples is already ~1e15 sequences per step,
# beyond any cluster; larger counts are typos (1e16) and would overflow the order statistics.
MAX_PROMPTS, MAX_SAMPLES = 10**9, 10**6
# Every other count has a bound too, so that a typo is one line (exit 2) and a count at its bound still
# prices in well under a second (the split search is bounded: hardware.search_splits). The largest
# published training clusters hold ~1e5 GPUs; 1e6 leaves room without admitting 1e15.
MAX_GPUS = 10**6
MAX_STEPS = 10**6  # sync cadence and staleness, in optimizer steps
MAX_TOKENS = 10**7  # a response or prompt length, in tokens


class PlanError(ConfigError):
    """A plan file, field or value is wrong; the message says which, and the fix."""


class Section(BaseModel):
    # allow_inf_nan=False: an infinite or NaN figure is a typo, never a property of hardware.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value, info):
        """``true``/``false`` for a number is a typo (pydantic would read it as 1 or 0): refuse it."""
        f = cls.model_fields.get(info.field_name)
        if isinstance(value, bool) and f is not None and "bool" not in str(f.annotation):
            raise ValueError(f"a yes/no value where a number is expected ({f.description.split(';')[0]}); "
                             f"fix: give a number, e.g. {info.field_name} = {f.default!r}")
        return value


class PolicySection(Section):
    params: float = Field(14e9, gt=0, le=1e13, description="policy parameters [count]; runbook: 14e9")
    bytes_per_param: float = Field(2, gt=0, le=8, description="bytes per parameter in the synced (rollout) dtype [bytes]; 2 = bf16, 1 = fp8, 4 = fp32")
    lora: bool = Field(False, description="train LoRA adapters only: the adapter is then all that must sync")
    active_params: float | None = Field(None, gt=0, le=1e13, description="parameters active per token [count] (MoE: the routed experts' share plus the dense layers); FLOPs use these, sync and memory use params; null = params (dense)")
    lora_fraction: float = Field(0.005, ge=0, le=1, description="adapter parameters / base parameters [fraction]; runbook: 0.005")
    delta_fraction: float = Field(0.02, gt=0, le=1, description="share of weights that change per sync [fraction]; 1-3% per the delta weight sync page; runbook: 0.02")
    delta_index_bytes: float = Field(0, ge=0, le=8, description="index bytes sent per changed element in delta sync [bytes]; the runbook ignores indexes (0); rollyard's delta sync sends int64 (8)")
    weight_tensors: int = Field(0, ge=0, le=10**8, description="weight tensors of the model, as a full sync sends them (Hugging Face names; MoE: one per expert matrix) [count]; prices the per-tensor sync terms and the wire framing (0 = not priced)")
    lora_tensors: int = Field(0, ge=0, le=10**8, description="tensors a LoRA sync sends: lora_A, lora_B and a scaling scalar per adapted module [count] (3 per module); 0 = not priced")
    layers: int | None = Field(None, ge=1, le=10_000, description="transformer layers [count]; with hidden and vocab, prices the trainer's activations (null: not priced, and the plan says so); Qwen2.5-14B (the runbook's class): 48")
    hidden: int | None = Field(None, ge=1, le=10**6, description="hidden size [elements]; prices the trainer's activations; Qwen2.5-14B: 5120")
    vocab: int | None = Field(None, ge=1, le=10**8, description="vocabulary size [tokens]; prices the trainer's fp32 logits per micro-batch; Qwen2.5-14B: 152064")
    experts_per_token: int | None = Field(None, ge=1, le=4096, description="routed experts per token of a MoE (top-k) [count]: with trainer.ep > 1, policy.hidden and policy.layers, prices the trainer's expert all-to-all (each token's hidden state to k experts' ranks and back, per MoE layer per pass, at DeepEP's published rates: inputs.EP_NVLINK_BW, EP_RDMA_BW); null = not priced; Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3: 8")
    moe_layers: int | None = Field(None, ge=1, le=10_000, description="layers with routed experts [count] (the expert all-to-all runs in these); null = policy.layers; DeepSeek-V3: 58 of 61 (its first 3 are dense)")


class TrainerSection(Section):
    dp: int = Field(8, ge=1, le=MAX_GPUS, description="trainer data-parallel width [ranks]; the gradient ring all-reduce runs over these")
    grad_bytes_per_param: float | None = Field(None, gt=0, le=8, description="bytes per gradient element on the wire [bytes]; null = policy.bytes_per_param (the runbook's model)")
    gpus: int | None = Field(None, ge=1, le=MAX_GPUS, description="GPUs in the trainer pool [count]; null = dp")
    peak_flops: float = Field(989e12, gt=0, le=1e17, description="dense bf16 peak FLOP/s per trainer GPU [FLOP/s]; 989e12 = H100 SXM (NVIDIA datasheet); H20 1.48e14, H200 989e12, B200 2.25e15")
    mfu: float | None = Field(None, gt=0, le=1, description="model FLOPs utilization of the trainer [fraction]: 6 x P_active x tokens done per second over peak_flops; null = by architecture: dense 0.31 (IBM fms-fsdp's FSDP training on 96 H100: 7B no AC 7,500, 13B selective AC 3,800, 34B full AC 1,550 tokens/s/GPU: 0.32, 0.30, 0.32 of 989 TFLOP/s), MoE (policy.active_params < params) 0.160 (Megatron-Bridge's BF16 MoE row on H100: GPT-OSS 120B, 158 TFLOP/s per GPU; inputs.MOE_TRAINER_MFU)")
    flops_per_gpu: float | None = Field(None, gt=0, description="sustained training FLOP/s per GPU [FLOP/s]; null = peak_flops x mfu (3.07e14 on the defaults); a stated figure wins (e.g. one measured by --calibrate-from)")
    serial_fraction: float = Field(TRAINER_SERIAL_FRACTION, ge=0, le=1, description="Amdahl's serial fraction of a trainer step [fraction]: the share of the one-GPU work more GPUs do not divide, so a train or reference time measured on m GPUs takes t x (s + (1-s)/g) / (s + (1-s)/m) on g; 0 = FLOP-bound (time x GPUs constant); 0.0079 = verl's fully-async trainer rows (update_actor 313.81 / 156.98 / 113.16 s on 16 / 32 / 64 H20, least squares; inputs.TRAINER_SERIAL_FRACTION)")
    minibatches: int = Field(1, ge=1, le=100_000, description="pieces the trainer consumes a step's batch in when training is streamed (phases.train_streamed) [count]")
    epochs: int = Field(1, ge=1, le=1000, description="passes over each generation batch [count]: each extra epoch is another forward + backward over the batch (a run's trainer.epochs: inputs.optimizer_passes)")
    optimizer_minibatches: int = Field(1, ge=1, le=100_000, description="optimizer steps per epoch [count]: the batch is cut into this many mini-batches, one optimizer step each (NeMo-RL: G-GBS / T-GBS; a run's trainer.mini_batches); sets the micro-batches per optimizer step of the pipeline bubble")
    old_logprob_forward: bool | None = Field(None, description="the trainer recomputes the previous policy's logprobs, a forward of 2 x P_active x tokens beside the reference one (NeMo-RL's prev_logprobs unless loss_fn.force_on_policy_ratio; verl's old_log_prob); null = true when epochs x optimizer_minibatches > 1 (the ratio is no longer 1 after the first optimizer step)")
    recompute: bool = Field(False, description="price activation recompute: the backward re-runs each layer's forward, 8 instead of 6 x P_active FLOPs per token (Megatron's full recompute; NeMo-RL megatron_cfg.activation_checkpointing); the memory side is trainer.activation_checkpointing's")
    micro_batch_sequences: int = Field(1, ge=1, le=100_000, description="sequences per micro-batch per data-parallel rank [count] (NeMo-RL train_micro_batch_size); with trainer.pp > 1 a train or logprob pass pays the 1F1B bubble (m + pp - 1) / m, m = the micro-batches per rank per optimizer step")
    reference_swap: bool = Field(False, description="the reference weights live in host memory and are swapped in for their forward (NeMo-RL's Megatron use_reference_model: the policy's shard copied out, the reference's in, the policy's back): 3 copies of the trainer's model shard per step over cluster.host_bw")
    offload: bool = Field(False, description="colocated: the trainer's state (optimizer, gradients, weights) is offloaded to host memory around generation and reloaded after (NeMo-RL colocated: offload_before_refit, offload_after_refit, prepare_for_training): each of those bytes out and back per step over cluster.host_bw")
    pp: int = Field(1, ge=1, le=1024, description="pipeline stages of the trainer [count]: each stage sends its own layers' tensors in parallel (miles/slime: one weight transfer per PP stage); splits a P2P sender's per-tensor reshard (sync.receiver = rdma_pinned); at most policy.layers (a stage holds >= 1 layer) and pp x tp and pp x ep at most the trainer's GPUs")
    tp: int = Field(1, ge=1, le=MAX_GPUS, description="tensor-parallel width of the trainer [ranks] (Megatron TP): the GPUs of one pipeline stage that each hold 1/tp of every layer; pp x tp at most the trainer's GPUs")
    ep: int = Field(1, ge=1, le=MAX_GPUS, description="expert-parallel width of the trainer [ranks] (Megatron EP, carved from a stage's GPUs): the ranks one MoE layer's experts are spread over; pp x ep at most the trainer's GPUs")
    micro_batch_tokens: int = Field(16384, ge=1, le=10**9, description="tokens per micro-batch per trainer GPU [tokens]: the activations held at once; 16384 = verl's ppo_max_token_len_per_gpu default")
    logits_tokens: int | None = Field(None, ge=1, le=10**9, description="tokens whose fp32 logits are held at once [tokens] (a chunked log-softmax: rollyard's trainer.logprob_chunk); null = micro_batch_tokens (whole micro-batch)")
    activation_checkpointing: bool = Field(True, description="recompute each layer in the backward pass: a layer keeps only its input (2 x hidden bytes per token) instead of ~34 x hidden (Korthikanti et al. 2022, bf16, flash attention)")
    sharding: Literal["ddp", "fsdp"] = Field("ddp", description="ddp: every rank holds all training state and ring-all-reduces gradients (the runbook); fsdp: state sharded over dp ranks, gradients reduce-scattered and parameters all-gathered twice per step (forward, backward)")
    prefix_shared: bool = Field(False, description="the trainer computes each group's prompt once, followed by its samples' responses (rollyard's trainer.useful_work, its default, on a Llama-family model: prefix-shared attention), so a step's positions are prompts x prompt_tokens + sequences x avg_tokens; false (the runbook's model, and most trainers'): every sample carries its prompt, sequences x (prompt_tokens + avg_tokens); a plan of a rollyard run sets true (review's run-implied plan reads it from the run)")
    zero_advantage_share: float = Field(0.0, ge=0, lt=1, description="expected share of samples whose advantage is exactly 0 (groups whose rewards are all equal: TRL's frac_reward_zero_std) that the trainer leaves out of the forward/backward (rollyard's trainer.useful_work with no KL term) [fraction]; 0 = every sample computed (the conservative default; keep 0 with a KL term, which needs every sample); a run's mean train/skipped_frac measures it")


class RolloutSection(Section):
    backend: Literal["native", "vllm", "sglang"] = Field("native", description="rollout engine that receives weight syncs (the run's rollout.backend): native (rollyard's own engine: weights copied into its tensors), vllm or sglang (weights go through the engine's load_weights); picks the engine-side sync defaults (sync.receiver = auto)")
    device: Literal["gpu", "cpu"] = Field("gpu", description="where trainer and rollout engine run: gpu (software sync terms by the receiver's rule, sync.receiver, with sourced constants: inputs.GPU_SYNC; rates from rollout.mem_bandwidth) or cpu (sync terms measured on this project's machines by bench/sync.py, per backend)")
    prompts: int = Field(256, ge=1, le=MAX_PROMPTS, description="prompts per step [count]; runbook: 256")
    samples: int = Field(8, ge=1, le=MAX_SAMPLES, description="samples per prompt (GRPO group size) [count]; runbook: 8")
    avg_tokens: float = Field(4096, gt=0, le=MAX_TOKENS, description="mean generated tokens per sample [tokens]; runbook: 4096")
    bytes_per_token: float = Field(8, gt=0, le=1e6, description="rollout payload per generated token [bytes]; 8 = int32 id + fp32 logprob")
    prompt_tokens: float = Field(0, ge=0, le=1e7, description="mean prompt tokens per prompt [tokens]; priced at 4 bytes (int32) on the prompts edge; the runbook leaves prompts out (0)")
    gpus: int = Field(8, ge=1, le=MAX_GPUS, description="GPUs in the rollout pool [count] (colocated: the same GPUs as the trainer)")
    tp: int = Field(1, ge=1, le=MAX_GPUS, description="GPUs per inference engine replica (tensor parallel) [count]; a replica decodes its sequences in lockstep, and its GPUs each receive 1/tp of a weight sync on their own NIC")
    mem_bandwidth: float = Field(3.35e12, gt=0, description="HBM bandwidth per GPU [bytes/s]; 3.35e12 = H100 SXM (NVIDIA datasheet); 4.0e12 = H20; 4.8e12 = H200")
    concurrency: int = Field(256, ge=1, le=10**9, description="most sequences decoded at once per engine replica [count] (KV-cache slots); one weight read per decode step is shared by those in flight")
    peak_flops: float | None = Field(None, gt=0, le=1e17, description="dense bf16 peak FLOP/s per rollout GPU [FLOP/s]: a decode step takes the slower of its HBM reads and 2 x P_active FLOPs per sequence in flight at this peak (past ~peak/mem_bandwidth FLOPs per weight byte the batch is compute-bound); null = trainer.peak_flops (the same GPUs)")
    step_overhead_s: float | None = Field(None, ge=0, le=10, description="the engine's fixed work per decode step [s] (scheduling, sampling, kernel launches; the tail of a synchronous round pays it once per token of its longest response); null = the backend's published figure on a GPU (inputs.STEP_OVERHEAD_S: vLLM 1.69 ms from a single-request TPOT on H100, SGLang and native 0: not published) and 0 on a CPU; a given phases.rollout_s sets it from the measured round instead")
    kv_bytes_per_token: float = Field(196608, ge=0, le=1e9, description="KV-cache bytes per token of context [bytes]; 196608 = 48 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 bytes")
    bytes_per_decoded_token: float | None = Field(None, gt=0, le=1e15, description="bytes read from HBM per decoded token [bytes]; null = params*bytes_per_param/concurrency + kv_bytes_per_token * (prompt_tokens + avg_tokens/2)")
    sleep_offload: bool = Field(False, description="colocated: the engine sleeps while the trainer runs, its weights copied to host memory and back on wake (vLLM sleep level 1: weights offloaded, KV cache discarded; NeMo-RL's colocated vLLM worker): the engine's weight shard (policy.params x bytes_per_param / rollout.tp) out and back per step over cluster.host_bw")


class SyncSection(Section):
    mode: Literal["auto", "full", "delta", "lora"] = Field("auto", description="weight-sync mode; auto = lora when policy.lora, else full if a full sync costs <= 5% of the step on the sync link, else delta")
    per_hour: float = Field(60, gt=0, le=1e6, description="weight syncs per hour [1/h]; with every_steps it also sets the stated step cadence for per-hour figures; runbook: 60")
    every_steps: int = Field(1, ge=1, le=MAX_STEPS, description="optimizer steps between weight syncs [steps]")
    staleness_bound: int = Field(1, ge=0, le=MAX_STEPS, description="largest allowed (trainer version - sample version) [steps]; 0 = on-policy (a barrier every step)")
    fixed_s: float | None = Field(None, ge=0, le=1e6, description="once per sync [s]: metadata gather, process-group setup, the control calls around a transfer; null = the GPU default: 0.54 s for a load_weights or receiver_reshard sync that crosses nodes (inputs.CROSS_NODE_FIXED_S, from NeMo-RL's refit anchor of that mechanism), 0 for direct_write and rdma_pinned (none published), 0 within a node (colocated, or a sync link of 200 GB/s or more) and on a CPU")
    receiver: Literal["auto", "load_weights", "direct_write", "receiver_reshard", "rdma_pinned", "copy", "none"] = Field("auto", description="how the receiving engine takes the update, each priced by its own rule (plan/mechanisms.py; constants inputs.GPU_SYNC): load_weights (vLLM/SGLang: load_weights per tensor + its shard copied), direct_write (NeMo-RL nccl_reshard: bulk shards written into the engine's buffers, only sync.misc_tensors through load_weights), receiver_reshard (a broadcast of whole tensors: each GPU reads all and keeps its slice), rdma_pinned (P2P: RDMA writes from pinned host memory, the sender stages to the host and reshards per tensor on the CPU for each peer layout; nothing on the receiver), copy (rollyard's native engine), none (the transfer alone); auto = load_weights for vllm and sglang, copy for native")
    misc_tensors: int | None = Field(None, ge=0, le=10**8, description="tensors that still go through load_weights under sync.receiver = direct_write [count] (attention, norms, router, embeddings, lm_head); null = policy.layers x 9 + 3 (Qwen3's names), or every weight tensor when policy.layers is not given")
    host_bw: float | None = Field(None, gt=0, le=1e15, description="device -> pinned host memory per sending GPU [bytes/s], the staging of sync.receiver = rdma_pinned; null = 64e9 (PCIe Gen5 x16 per direction)")
    codec: Literal["none", "zstd1"] = Field("none", description="compression of every payload (a sparse refit): zstd1 = zstd level 1, encoded by each sending stream at 510 MB/s and decoded by each receiving replica at 1580 MB/s (zstd's published single-core figures); none = raw bytes")
    round_trip_s: float = Field(0.0, ge=0, le=1e3, description="a request/acknowledge round trip each sending stream waits for per payload (sync.bucket_bytes) [s]: an object store's PUT and the receivers' GET (AWS S3: 100-200 ms first-byte latency), a relay's acknowledgement; 0 = a collective (no per-payload round trip)")
    pause_s: float | None = Field(None, ge=0, le=1e6, description="once per sync [s]: the engine's pause before the load and resume after it; null = the backend's default (rollout.backend, rollout.device; GPU: vLLM 0.14 s from TRL, SGLang not published: 0)")
    send_per_tensor_s: float | None = Field(None, ge=0, le=10, description="trainer side, per tensor a sending stream handles [s]: name/metadata, serialization, an IPC handle, the checksum's per-tensor part, a reshard into the receiver's layout; null = the default for sync.receiver (GPU: rdma_pinned 127 us per tensor per peer layout, else 0)")
    load_per_tensor_s: float | None = Field(None, ge=0, le=10, description="engine side, per tensor each receiving GPU loads [s]: load_weights' name resolution, the weight loader slicing its shard, a copy launch; null = the default for sync.receiver (GPU: load_weights, direct_write (its misc tensors) and receiver_reshard 127 us, copy 34 us, rdma_pinned and none 0)")
    per_bucket_s: float | None = Field(None, ge=0, le=1e3, description="per bucket, a handshake every side waits for [s]: a collective launch and synchronize, the bucket's metadata message or IPC handle, the receiver's reply; null = the backend's default (0 on a GPU)")
    bucket_bytes: float = Field(1e9, gt=0, le=1e15, description="bytes per bucket a sending stream cuts the update into [bytes]; 1e9: vLLM's packed weight transfer (1 GiB), slime/miles --update-weight-buffer-size 0.5-1 GB")
    source_bytes_per_param: float | None = Field(None, gt=0, le=8, description="bytes per parameter of the trainer's weights a sync reads [bytes] (4 = fp32 master weights cast to the rollout dtype); null = policy.bytes_per_param (a plain copy)")
    cast_bw: float | None = Field(None, gt=0, le=1e15, description="trainer side: bytes read + written per second copying (and casting) weights into the send buffer [bytes/s]; null = rollout.mem_bandwidth on a GPU (HBM-bound), the backend's measured rate on a CPU")
    load_bw: float | None = Field(None, gt=0, le=1e15, description="engine side: bytes per second of the copy into the engine's weights (one read + one write per byte) [bytes/s]; null = rollout.mem_bandwidth on a GPU, the backend's measured rate on a CPU")
    reload_whole_model: bool | None = Field(None, description="the engine reloads its whole model on every update (all tensors and bytes, whatever the mode carries); null = the backend's behaviour (rollyard's vllm backend: true, every mode ends as one in-place reload_weights; native: false)")
    bucket_overlap: bool = Field(True, description="the sync is bucketed and pipelined: trainer side, wire and engine load of successive buckets overlap, so the slowest side plus one bucket's fill/drain sets the time (plus the per-bucket handshakes); false = the sides add up")


class NetworkSection(Section):
    sync_link: str = Field("rdma", description="tier that carries the weight sync between pools (a preset: nvlink, rdma, commodity, or a name in custom)")
    trainer_link: str = Field("nvlink", description="tier that carries the trainer's gradient collectives")
    gather_link: str = Field("nvlink", description="tier over which trainer shards are gathered into whole tensors before a sync (inside a node)")
    senders: int | None = Field(None, ge=1, le=MAX_GPUS, description="parallel links a sync uses, each at the sync_link bandwidth [count] (one NIC per GPU; at most rollout.gpus: each link ends on a receiving GPU); null = rollout.tp (each GPU of a receiving replica takes its 1/tp share on its own NIC)")
    custom: dict[str, float] = Field(default_factory=dict, max_length=100, description="extra tiers: name = bandwidth [bytes/s] (> 0, finite), e.g. {roce = 25e9}")
    cross_node_allreduce_s: float | None = Field(None, ge=0, le=1, description="one small all-reduce across the node boundary [s]: a decode step of a rollout replica wider than a node (rollout.tp > cluster.gpus_per_node) pays two per layer (policy.layers); null = 123.5 us (nccl-tests on 16 H100 over 2 nodes, inputs.CROSS_NODE_ALLREDUCE_S)")
    ep_nvlink_bw: float | None = Field(None, gt=0, le=1e15, description="the trainer's expert all-to-all inside a node, per GPU [bytes/s]: the tokens a GPU sends to the node's other expert ranks; null = 430e9 (DeepEP's intranode EP8 dispatch, 153 GB/s on H800's ~160 GB/s NVLink, as the same share of H100's 450 GB/s; inputs.EP_NVLINK_BW); B200/GB200: 726e9 (DeepEP V2, SM100 EP8)")
    ep_rdma_bw: float | None = Field(None, gt=0, le=1e15, description="the trainer's expert all-to-all between nodes, per GPU [bytes/s]: the tokens a GPU sends to expert ranks on other nodes (trainer.tp x trainer.ep > cluster.gpus_per_node); null = 43e9 (DeepEP's internode EP16 dispatch over CX7 400 Gb/s, inputs.EP_RDMA_BW)")


class PhasesSection(Section):
    rollout_s: float | None = Field(None, gt=0, le=1e9, description="rollout generation per step, synchronous rounds (the step waits for its longest response) [s]; null = estimated from the decode model")
    reward_s: float = Field(0.0, ge=0, le=1e9, description="reward / verifier scoring per step [s] (not estimated)")
    reference_s: float | None = Field(None, ge=0, le=1e9, description="reference forward per step [s]; null = estimated as 2*P*tokens over trainer FLOP/s (0 when use_reference is false)")
    train_s: float | None = Field(None, gt=0, le=1e9, description="forward + backward + optimizer per step [s]; null = estimated as 6*P_active*tokens over trainer FLOP/s")
    gpus: int | None = Field(None, ge=1, le=MAX_GPUS, description="GPUs the given phase times were measured on [count] (rollout_s, reference_s and train_s scale from this count); null = the configured pools")
    train_s_measured: dict[int, float] = Field(default_factory=dict, description="train seconds per step measured on other GPU counts, {gpus = seconds}; a trainer pool of a measured size takes the measured time, sizes between two measured ones are interpolated, others scale from the nearest measured size by trainer.serial_fraction (Amdahl)")
    algorithm_s: float = Field(0.0, ge=0, le=1e9, description="advantages / loss bookkeeping per step [s]")
    use_reference: bool = Field(True, description="the algorithm needs reference logprobs every step (PPO, GRPO with KL)")
    teacher_params: float = Field(0.0, ge=0, le=1e15, description="on-policy distillation (rollyard's algo.objective=distill | rl+distill): the teacher's active parameters [count], whose forward scores every sampled token (2 x P_teacher x tokens on the trainer GPUs, or on its own pool); 0 = no teacher")
    teacher_s: float | None = Field(None, ge=0, le=1e9, description="the teacher's forward per step [s] (on phases.gpus; its own phase, teacher: a run's mean teacher span per step); null = estimated as 2 x teacher_params x tokens over trainer FLOP/s")
    teacher_top_k: int = Field(0, ge=0, le=1_000_000, description="GKD (rollyard's algo.objective=gkd, algo.gkd_top_k): the teacher also sends its k most likely tokens per completion token, an int32 id and an fp32 log-prob each; 0 = the sampled tokens' log-probs only")
    teacher_sample_share: float = Field(0.0, ge=0, le=1, description="GKD's sequence-level KD (rollyard's algo.gkd_seq_kd, TRL's seq_kd): the share of the step's sequences whose completions the teacher generates before it scores them [fraction] (1 - algo.gkd_lmbda: the off-policy prompts, one completion per sample); the teacher decodes them with rollyard's engine on the trainer's GPUs, serial with the step (hardware.teacher_sample_terms: the decode model with the teacher's weights); needs phases.teacher_params > 0 and teacher_placement = inline; 0 = the teacher only scores")
    teacher_sample_tokens: float | None = Field(None, gt=0, le=MAX_TOKENS, description="mean tokens of a completion the teacher generates [tokens] (a run's teacher_sample spans: tokens / sequences); null = rollout.avg_tokens")
    teacher_sample_s: float | None = Field(None, ge=0, le=1e9, description="the teacher's sampling per step [s] (on phases.gpus; a run's mean teacher_sample span per step, 0 in steps that drew no prompt off-policy); null = estimated from phases.teacher_sample_share by the decode model")
    teacher_placement: Literal["inline", "pool"] = Field("inline", description="where the teacher's forward runs (rollyard's teacher.placement): inline on the trainer's critical path, holding the teacher in the trainer's memory; pool on its own actors overlapped with rollout and training (split placements; colocated keeps it inline)")
    reference_placement: Literal["inline", "pool", "fused"] = Field("inline", description="where the reference forward runs (rollyard's reference.placement): inline and fused on the trainer's critical path, fused holding no reference copy (LoRA: the base with the adapter off); pool on its own actors overlapped with rollout and training (split placements: off the trainer's path and its memory; colocated keeps it inline)")
    async_rollout_logprobs: bool = Field(False, description="async: the trainer takes the rollout engine's logprobs as the old logprobs (verl fully-async's default), so the trainer pool runs no old-logprob/reference forward")
    train_streamed: bool = Field(False, description="split pools: the trainer accumulates gradients over trainer.minibatches pieces of the batch as they are generated (one optimizer step per batch, so on-policy): with staleness bound 0 the pools overlap within the step")
    reward_streamed: bool = Field(False, description="reward scoring is streamed while decode continues (then reward and rollout must overlap)")


class ClusterSection(Section):
    gpus: int | None = Field(None, ge=2, le=MAX_GPUS, description="accelerators in the pool every placement is priced on [count] (equal hardware); null = rollout.gpus + trainer GPUs")
    gpus_per_node: int = Field(8, ge=1, le=1024, description="GPUs per node [count]")
    gpu_memory: float = Field(80e9, gt=0, description="memory per GPU [bytes]")
    host_bw: float | None = Field(None, gt=0, le=1e15, description="GPU <-> host memory per GPU per direction [bytes/s]: the reference swap and the colocated offload; null = 64e9 (PCIe Gen5 x16, inputs.PCIE5_X16_BW; pageable copies run slower, so this is the fastest the copies can go)")
    train_bytes_per_param: float = Field(18, gt=0, le=100, description="training state per parameter [bytes]: weights + grads + fp32 master + Adam (~18, lesson 22)")
    prototype: bool = Field(False, description="a low-effort prototype (decision tree step 1)")


class BudgetSection(Section):
    tolerance: float = Field(0.2, ge=0, le=10, description="a measured phase more than this fraction over its budget is flagged [fraction]; runbook: start at 0.2")
    shares: dict[str, float] = Field(default_factory=dict, description="what-if: role -> share of step time (roles: " + ", ".join(rundir.ROLES) + "); empty = from the phase times")
    step_s: float | None = Field(None, gt=0, description="what-if: the step time the shares apply to [s]; null = the sum of the phase times")
    optimizations: list[str] = Field(default_factory=lambda: ["prefix_caching"], max_length=100, description="what-if: optimizations applied (names from seed 002's tables; `rollyard plan --list-optimizations`)")
    factors: dict[str, float] = Field(default_factory=dict, description="what-if: optimization -> speed-up factor overriding the default (e.g. {prefix_caching = 5})")


class TailSection(Section):
    lengths: list[Annotated[int, Field(ge=1, le=MAX_TOKENS)]] = Field(default_factory=list, max_length=10**6, description="response lengths to draw from [tokens]; empty = a lognormal with mean rollout.avg_tokens (or --lengths-from RUN_DIR)")
    sigma: float = Field(0.6, gt=0, le=5, description="lognormal shape of response lengths when no lengths are given")
    max_tokens: int = Field(16384, ge=1, le=MAX_TOKENS, description="response length cap [tokens] (lengths above are clipped, as the engine does)")
    overprovision: float = Field(0.25, gt=0, le=4, description="tail batching: extra prompts issued per short round [fraction of prompts] (RollPacker's speculative over-provisioning)")
    steps: int = Field(32, ge=2, le=64, description="steps simulated per strategy [count]; at most 64 (the what-if's time grows with it: 200 took 2 s)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the length draws (the what-if is deterministic)")


class SimSection(Section):
    steps: int = Field(6, ge=2, le=200, description="training steps drawn in each placement's timeline [count]; the steps/hour figures come from a longer run to steady state")


class ToolsSection(Section):
    """Multi-turn rollouts with tools (plan/tools.py prices them): tool waits lengthen the rollout round's tail."""

    calls_per_sample: float = Field(0.0, ge=0, le=1000, description="tool calls per sample, mean [count] (a run's tools/calls over its samples); 0 = no tools")
    latency_s: float = Field(1.0, gt=0, le=1e5, description="median seconds of one tool call [s] (lognormal; a run's tools/latency_p50_s)")
    latency_sigma: float = Field(1.0, ge=0, le=5, description="lognormal shape of tool latency (0: every call takes latency_s)")
    latencies: list[Annotated[float, Field(ge=0, le=1e5)]] = Field(default_factory=list, max_length=10**6, description="measured per-call seconds to draw from instead of the lognormal [s]")
    bytes_per_call: float = Field(0.0, ge=0, le=1e12, description="bytes one call moves, arguments out + output back [bytes]; the tools edge")


class PlanInputs(Section):
    name: str = Field("plan", description="a label for the configuration (used in the decision record)")
    placement: Literal["auto", "colocated", "disaggregated", "async"] = Field("auto", description="auto = the lesson's decision tree picks")
    policy: PolicySection = Field(default_factory=PolicySection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    sync: SyncSection = Field(default_factory=SyncSection)
    network: NetworkSection = Field(default_factory=NetworkSection)
    phases: PhasesSection = Field(default_factory=PhasesSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    budget: BudgetSection = Field(default_factory=BudgetSection)
    tail: TailSection = Field(default_factory=TailSection)
    sim: SimSection = Field(default_factory=SimSection)
    tools: ToolsSection = Field(default_factory=ToolsSection)

    @model_validator(mode="after")
    def _cross_checks(self) -> PlanInputs:
        tiers = self.tiers()
        for key in ("sync_link", "trainer_link", "gather_link"):
            name = getattr(self.network, key)
            if name not in tiers:
                raise ValueError(f"network.{key} = {name!r} is not a tier; valid tiers: {', '.join(tiers)} "
                                 f"(add one under [network.custom] as name = bytes_per_second)")
        for role in self.budget.shares:
            if role not in rundir.ROLES:
                raise ValueError(f"budget.shares has role {role!r}; valid roles: {', '.join(rundir.ROLES)}")
        for role, share in self.budget.shares.items():
            if not (isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share <= 1):
                raise ValueError(f"budget.shares.{role} = {share!r}: a share of step time must be a fraction in "
                                 f"[0, 1]; fix: give each role's fraction of the step, summing to 1, e.g. "
                                 f"{{rollout = 0.6, train = 0.4}}")
        if self.budget.shares and abs(sum(self.budget.shares.values()) - 1.0) > 0.01:
            raise ValueError(f"budget.shares must sum to 1, got {sum(self.budget.shares.values()):.3f} "
                             f"({self.budget.shares})")
        for name, bw in self.network.custom.items():
            if not (isinstance(bw, (int, float)) and math.isfinite(bw) and bw > 0):
                raise ValueError(f"network.custom.{name} = {bw!r}: a tier's bandwidth must be a finite number > 0 "
                                 f"bytes/s; fix: give its bytes per second, e.g. {name} = 25e9")
        if self.sync.every_steps > 1 and self.sync.staleness_bound < self.sync.every_steps:
            # A version serves every_steps batches and the pools run one batch apart, so the last
            # batch sampled on a version is trained every_steps versions later.
            raise ValueError(f"sync.every_steps = {self.sync.every_steps} needs sync.staleness_bound >= "
                             f"{self.sync.every_steps} (a version serves {self.sync.every_steps} batches, one "
                             f"batch ahead of the trainer), got staleness_bound = {self.sync.staleness_bound}; "
                             f"fix: raise the bound or sync more often")
        for g, secs in self.phases.train_s_measured.items():
            if g < 1 or not (isinstance(secs, (int, float)) and math.isfinite(secs) and secs > 0):
                raise ValueError(f"phases.train_s_measured has {g} GPUs = {secs!r}: expected GPUs >= 1 and a finite "
                                 f"time > 0 s; fix: e.g. {{64 = 133.4}}")
        if self.policy.lora and self.policy.lora_fraction == 0:
            raise ValueError("policy.lora_fraction = 0 with policy.lora = true: the adapter has no parameters; "
                             "fix: give the adapter's share of the base parameters, e.g. 0.005")
        if self.policy.active_params is not None and self.policy.active_params > self.policy.params:
            raise ValueError(f"policy.active_params = {self.policy.active_params:g} exceeds policy.params = "
                             f"{self.policy.params:g}; fix: active parameters are a subset of all parameters")
        ro = self.rollout
        if ro.tp > ro.gpus or ro.gpus % ro.tp:
            raise ValueError(f"rollout.tp = {ro.tp} does not fit rollout.gpus = {ro.gpus}: the rollout pool holds whole "
                             f"engine replicas of tp GPUs each; fix: make rollout.gpus a multiple of rollout.tp "
                             f"(e.g. rollout.gpus = {max(ro.tp, ro.gpus + (-ro.gpus) % ro.tp)}) or lower rollout.tp")
        if self.cluster.gpus is not None and self.cluster.gpus < ro.tp:
            raise ValueError(f"cluster.gpus = {self.cluster.gpus} cannot hold one rollout replica of rollout.tp = "
                             f"{ro.tp} GPUs; fix: raise cluster.gpus to at least {ro.tp} or lower rollout.tp")
        senders = self.network.senders
        if senders is not None and senders > ro.gpus:
            raise ValueError(f"network.senders = {senders} exceeds rollout.gpus = {ro.gpus}: each sync stream ends on a "
                             f"receiving GPU's own link, so a pool of {ro.gpus} GPUs takes at most {ro.gpus}; fix: set "
                             f"network.senders <= {ro.gpus} (1 for a broadcast, rollout.tp for one stream per GPU of a "
                             f"replica) or raise rollout.gpus")
        if ro.avg_tokens > self.tail.max_tokens:
            raise ValueError(f"rollout.avg_tokens = {ro.avg_tokens:g} exceeds tail.max_tokens = {self.tail.max_tokens}: "
                             f"a mean response cannot be longer than the cap every response is clipped to; fix: lower "
                             f"rollout.avg_tokens or raise tail.max_tokens to at least {math.ceil(ro.avg_tokens)}")
        if len(self.phases.train_s_measured) > 1000 or any(g > MAX_GPUS for g in self.phases.train_s_measured):
            raise ValueError(f"phases.train_s_measured has {len(self.phases.train_s_measured)} entries, GPUs up to "
                             f"{max(self.phases.train_s_measured)}: expected at most 1000 entries of at most {MAX_GPUS} "
                             f"GPUs; fix: give the pool sizes you measured, e.g. {{64 = 133.4}}")
        self._trainer_parallelism_fits()
        self._teacher_sampling_fits()
        if self.sync.mode == "lora" and not self.policy.lora:
            raise ValueError("sync.mode = 'lora' needs policy.lora = true (only adapters can sync when only adapters train)")
        return self

    def _teacher_sampling_fits(self) -> None:
        """The teacher's sampling (phases.teacher_sample_*) needs a teacher held inline, and its time a share to
        sample; its mean completion, like the rollout's, fits under the cap."""
        ph = self.phases
        if ph.teacher_sample_share > 0 and ph.teacher_params <= 0:
            raise ValueError(f"phases.teacher_sample_share = {ph.teacher_sample_share:g} with phases.teacher_params = "
                             f"0: there is no teacher to sample; fix: give the teacher's parameters (e.g. "
                             f"phases.teacher_params = 7e9) or set phases.teacher_sample_share = 0")
        if ph.teacher_sample_share > 0 and ph.teacher_placement != "inline":
            raise ValueError(f"phases.teacher_sample_share = {ph.teacher_sample_share:g} with phases.teacher_placement "
                             f"= {ph.teacher_placement!r}: the teacher samples beside the inline teacher, in the "
                             f"trainer's process (rollyard refuses algo.gkd_seq_kd with teacher.placement=pool); fix: "
                             f"set phases.teacher_placement = 'inline' or phases.teacher_sample_share = 0")
        if ph.teacher_sample_s and ph.teacher_sample_share == 0:
            raise ValueError(f"phases.teacher_sample_s = {ph.teacher_sample_s:g} with phases.teacher_sample_share = 0: "
                             f"a time for sampling nothing; fix: give the share the teacher samples (1 - "
                             f"algo.gkd_lmbda, e.g. phases.teacher_sample_share = 0.5) or drop phases.teacher_sample_s")
        tokens = ph.teacher_sample_tokens
        if tokens is not None and tokens > self.tail.max_tokens:
            raise ValueError(f"phases.teacher_sample_tokens = {tokens:g} exceeds tail.max_tokens = "
                             f"{self.tail.max_tokens}: the teacher's completions are cut at the same cap; fix: lower "
                             f"phases.teacher_sample_tokens or raise tail.max_tokens to at least {math.ceil(tokens)}")

    def _trainer_parallelism_fits(self) -> None:
        """trainer.pp, tp and ep partition the trainer's GPUs (a stage holds >= 1 layer): a width above them
        would divide per-stage work by stages that do not exist (pp = 1024 on 8 ranks)."""
        tr, ranks, layers = self.trainer, self.trainer.gpus or self.trainer.dp, self.policy.layers
        if layers is not None and tr.pp > layers:
            raise ValueError(f"trainer.pp = {tr.pp} exceeds policy.layers = {layers}: a pipeline stage holds at least "
                             f"one layer; fix: set trainer.pp <= {layers}")
        moe = self.policy.moe_layers
        if layers is not None and moe is not None and moe > layers:
            raise ValueError(f"policy.moe_layers = {moe} exceeds policy.layers = {layers}: the MoE layers are some of the "
                             f"model's layers; fix: set policy.moe_layers <= {layers}")
        for name, width in (("tp", tr.tp), ("ep", tr.ep)):
            if tr.pp * width > ranks:
                raise ValueError(f"trainer.pp x trainer.{name} = {tr.pp} x {width} = {tr.pp * width} exceeds the trainer's "
                                 f"{ranks} GPUs (trainer.gpus, else trainer.dp): each stage's {name.upper()} group needs its "
                                 f"own GPUs; fix: lower trainer.pp or trainer.{name}, or raise trainer.gpus to at least "
                                 f"{tr.pp * width}")

    def tiers(self) -> dict[str, float]:
        """Every network tier by name -> bandwidth in bytes/s (presets, then custom)."""
        return {**TIER_PRESETS, **self.network.custom}

    def total_gpus(self) -> int:
        """G: the accelerators every placement is priced on (equal hardware)."""
        return self.cluster.gpus or (self.rollout.gpus + (self.trainer.gpus or self.trainer.dp))


def validate_plan(data: dict) -> PlanInputs:
    """A plan as nested dicts -> PlanInputs, or PlanError naming each bad field on one line."""
    check_keys(data, PlanInputs)
    try:
        return PlanInputs.model_validate(data)
    except ValidationError as e:
        lines = [ln.strip() for ln in describe_errors(e, model=PlanInputs).splitlines() if ln.strip()]
        said = "; ".join(lines)
        fix = "" if "fix:" in said else "; fix: correct the value in the plan file or override it with key.sub=value"
        raise PlanError("invalid plan: " + said + fix) from None


def load_plan(path: str | Path | None = None, overrides: list[str] = (), defaults: bool = True) -> PlanInputs:
    """Plan file (optional, TOML or YAML) + ``key.sub=value`` overrides -> validated PlanInputs.

    An empty plan file is an error unless ``defaults`` is true: it most likely means the wrong
    file, and silently pricing the runbook workload instead would mislead.
    """
    try:
        data = read_file(path) if path else {}
        if path and not data and not defaults:
            raise PlanError(f"plan file {path} is empty: expected at least one section (e.g. [policy]); "
                            f"fix: fill it in, or pass --defaults to price the runbook's reference workload")
        for text in overrides:
            key, value = parse_plan_override(text)
            _set_dotted(data, key, value)
    except PlanError:
        raise
    except ConfigError as e:
        raise PlanError(str(e).replace("config file", "plan file")) from None
    try:
        return validate_plan(data)
    except PlanError:
        raise
    except ConfigError as e:  # check_keys: unknown field
        raise PlanError(str(e).replace("unknown config key", "unknown plan field")) from None


def load_plan_data(data: dict, overrides: list[str] = ()) -> PlanInputs:
    """Plan data already in nested dicts (e.g. a calibrated plan) + ``key.sub=value`` overrides."""
    import copy

    data = copy.deepcopy(data)
    try:
        for text in overrides:
            key, value = parse_plan_override(text)
            _set_dotted(data, key, value)
        return validate_plan(data)
    except PlanError:
        raise
    except ConfigError as e:
        raise PlanError(str(e).replace("unknown config key", "unknown plan field")) from None


def parse_plan_override(text: str) -> tuple[str, object]:
    """``key.sub=value`` -> (key, value): the value is read as a TOML value first (what plan files are
    written in: ``{roce = 25e9}``, ``1e16``, ``[a, b]`` of quoted strings), else as YAML (``{slow: 0}``,
    ``.inf``, bare words)."""
    import tomllib

    key, value = parse_override(text)
    raw = text.split("=", 1)[1].strip()
    if raw:
        try:
            return key, tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            pass
    if isinstance(value, dict) and any(v is None and "=" in str(k) for k, v in value.items()):
        raise PlanError(f"override {text!r}: the table does not parse; write it as TOML, e.g. "
                        f"{key}={{name = 25e9}} (quote the whole override in the shell)")
    return key, value


def describe(model: type[BaseModel] = PlanInputs, prefix: str = "") -> list[str]:
    """One line per plan field: dotted key, default, bounds, description (unit included)."""
    out = []
    for name, f in model.model_fields.items():
        sub = f.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += describe(sub, prefix + name + ".")
            continue
        default = f.default_factory() if f.default_factory else f.default
        bounds = [f"{op} {getattr(m, attr)!r}" for m in f.metadata
                  for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if hasattr(m, attr)]
        where = f" [{', '.join(bounds)}]" if bounds else ""
        out.append(f"{prefix + name} = {default!r}{where}  # {f.description}")
    return out
