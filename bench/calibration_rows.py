"""Published weight-sync figures and async speed-ups against `rollyard plan` on its defaults
(docs/calibration.md).

    .venv/bin/python bench/calibration_rows.py          # the tables, one row per published figure
    .venv/bin/python bench/calibration_rows.py --json   # the same as JSON ({"sync": [...], "speedups": [...]})

Each row is a plan file in examples/ plus overrides that describe the published configuration only
(model size, tensor count, pool shape, bucket, link, the receiver's kind): no software constant is set per
row; every software term comes from the defaults for the receiver (``rollyard.plan.inputs.GPU_SYNC``).
A row is in sample when it shares a source or a system with a constant the defaults use (the ``sample``
column says which); the count of rows within 2x is given for all rows and for the out-of-sample rows.
Nothing here is timed: the plan is arithmetic, so the figures are exact and tests pin them.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import rollyard.plan.inputs as plan_inputs
from rollyard.plan.inputs import load_plan
from rollyard.plan.planner import make_plan

# The examples next to the rollyard that is imported: with PYTHONPATH at another checkout's src (e.g. a git worktree
# of the commit before the v6 rules) every row is priced by that checkout's rules and files.
EXAMPLES = Path(plan_inputs.__file__).resolve().parents[3] / "examples"
V6 = hasattr(plan_inputs, "MOE_TRAINER_MFU")  # the rules of plan v6 are the ones imported
AIR = ("policy.params=109.3e9", "policy.active_params=12e9", "policy.weight_tensors=18327")
Q235 = ("policy.params=235.1e9", "policy.active_params=22e9", "policy.weight_tensors=36945")
KIMI = ("policy.params=1.029e12", "policy.active_params=32e9", "policy.bytes_per_param=1",
        "policy.weight_tensors=139583", "sync.source_bytes_per_param=2")
DSV3 = ("policy.params=689e9", "policy.active_params=37e9", "policy.weight_tensors=91991")
SKYRL = ("policy.params=14.8e9", "policy.active_params=14.8e9", "policy.weight_tensors=579", "rollout.tp=2",
         "sync.bucket_bytes=1e9", "rollout.backend=vllm")
TRL_SMALL = ("policy.params=0.75e9", "policy.active_params=0.6e9", "policy.weight_tensors=310", "trainer.dp=1",
             "network.sync_link=nvlink_h100", "network.gather_link=nvlink_h100", "rollout.mem_bandwidth=3.35e12")
# Why a row is in sample: the defaults' constants and their sources (inputs.GPU_SYNC, GPU_PAUSE_S).
SLIME = "in: slime system (load_weights 127 us is the slime blog's)"
MILES = "in: miles is slime's fork (load_weights 127 us)"
TRL = "in: TRL system (vLLM pause 0.14 s is TRL #5892's)"
NEMO = "in: NeMo-RL refit anchors (cross-node control 0.54 s is their 63.2 GB anchor's)"
NEMO_SYS = "in: NeMo-RL system (cross-node control 0.54 s is its refit anchor's)"
# Rows whose figure was read before the rule that prices it was written (2026-11-27): checked, not
# out of sample (docs/calibration.md "Fitted on, checked against").
SEEN = "seen: read before the direct_write / codec rules were written (2026-11-27)"
Q30_RESHARD = ("policy.params=30.5e9", "policy.active_params=3.3e9", "policy.weight_tensors=18867", "policy.layers=48",
               "trainer.dp=16", "trainer.gpus=16", "trainer.pp=2", "trainer.ep=8", "rollout.gpus=16", "rollout.tp=8",
               "cluster.gpus=32")
Q4_RESHARD = ("policy.params=4.0e9", "policy.active_params=4.0e9", "policy.weight_tensors=399", "policy.layers=36",
              "trainer.dp=8", "trainer.gpus=8", "trainer.pp=1", "trainer.ep=1", "rollout.gpus=8", "rollout.tp=8",
              "cluster.gpus=16")


@dataclass(frozen=True)
class Row:
    id: str
    what: str
    file: str
    overrides: tuple[str, ...]
    published_s: float
    sample: str  # "out", or "in: why"


ROWS = [
    Row("S1b", "NeMo-RL NCCL refit 247 GB, H100", "plan_nemo_refit_247.toml", (), 1.60, NEMO),
    Row("S1c", "NeMo-RL NCCL refit 470 GB", "plan_nemo_refit_470.toml", (), 2.52, NEMO),
    Row("S2", "NeMo-RL NCCL refit 1342 GB", "plan_nemo_refit_1342.toml", (), 3.365, NEMO),
    Row("S3a", "checkpoint-engine broadcast, Qwen3-235B, 8 x H800", "plan_ckpt_engine_qwen235b.toml", (), 6.22, "out"),
    Row("S3b", "checkpoint-engine broadcast, GLM-4.5-Air, 8 x H800", "plan_ckpt_engine_qwen235b.toml",
        (*AIR, "sync.bucket_bytes=3.24e9"), 3.47, "out"),
    Row("S3c", "checkpoint-engine broadcast, Kimi-K2 FP8, 16 x H20", "plan_kimi_k2_ckpt_engine.toml",
        ("sync.bucket_bytes=6.32e9",), 14.36, "out"),
    Row("S3d", "checkpoint-engine broadcast, Kimi-K2 FP8, 256 x H20", "plan_kimi_k2_ckpt_engine.toml", (), 16.04, "out"),
    Row("S3e", "checkpoint-engine broadcast, DeepSeek-V3.1 FP8, 16 x H20", "plan_kimi_k2_ckpt_engine.toml",
        (*DSV3, "sync.bucket_bytes=5.79e9"), 10.19, "out"),
    Row("S3f", "checkpoint-engine broadcast, DeepSeek-V3.1 FP8, 256 x H20", "plan_kimi_k2_ckpt_engine.toml", DSV3,
        11.33, "out"),
    Row("S4a", "miles NCCL broadcast, Qwen3-30B-A3B", "plan_miles_broadcast_qwen30b.toml", (), 2.670, MILES),
    Row("S4b", "miles NCCL broadcast, GLM-4.5-Air", "plan_miles_broadcast_qwen30b.toml", AIR, 5.001, MILES),
    Row("S4c", "miles NCCL broadcast, Qwen3-235B-A22B", "plan_miles_broadcast_qwen30b.toml", Q235, 10.754, MILES),
    Row("S4d", "miles NCCL broadcast, Kimi-K2 BF16 -> FP8", "plan_miles_broadcast_qwen30b.toml", KIMI, 53.279, MILES),
    Row("S4e", "miles P2P RDMA, Qwen3-30B-A3B", "plan_miles_p2p_qwen30b.toml", (), 2.160, MILES),
    Row("S4f", "miles P2P RDMA, GLM-4.5-Air (PP4)", "plan_miles_p2p_qwen30b.toml",
        (*AIR, "trainer.pp=4", "trainer.gpus=32", "rollout.gpus=32"), 2.637, MILES),
    Row("S4g", "miles P2P RDMA, Qwen3-235B-A22B (PP4, TP32)", "plan_miles_p2p_qwen30b.toml",
        (*Q235, "trainer.pp=4", "trainer.gpus=64", "rollout.gpus=64", "rollout.tp=32"), 3.162, MILES),
    Row("S4h", "miles P2P RDMA, Kimi-K2 BF16 -> FP8 (PP8, TP32)", "plan_miles_p2p_qwen30b.toml",
        (*KIMI, "trainer.pp=8", "trainer.gpus=256", "rollout.gpus=256", "rollout.tp=32"), 7.227, MILES),
    Row("S5", "NeMo-RL checkpoint-engine NIXL, DeepSeek-V3 -> vLLM TP32", "plan_nemo_nixl_deepseek_v3.toml", (),
        9.25, NEMO_SYS),
    Row("S6", "verl NCCL checkpoint engine, Qwen3-30B-A3B, no engine load", "plan_verl_ckpt_qwen30b.toml", (), 7.0,
        "out"),
    Row("S7a", "slime colocated CUDA IPC, Qwen3-30B-A3B (blog total)", "plan_slime_colocated_qwen30b.toml", (), 7.0,
        SLIME),
    Row("S7b", "slime colocated, measured loop, 8 x H200", "plan_slime_colocated_qwen30b.toml",
        ("rollout.mem_bandwidth=4.8e12",), 3.0, SLIME),
    Row("S7c", "vime (vLLM) colocated after packing, 8 x H200", "plan_slime_colocated_qwen30b.toml",
        ("rollout.backend=vllm", "rollout.mem_bandwidth=4.8e12"), 5.3, "out"),
    Row("S7d", "SkyRL colocated CUDA IPC into vLLM, 14B, TP2", "plan_slime_colocated_qwen30b.toml", SKYRL, 1.6, "out"),
    Row("S8a", "TRL + vLLM NCCL, Qwen3-0.6B, H100", "plan_trl_async_qwen3_32b.toml", TRL_SMALL, 0.18, TRL),
    Row("S8b", "TRL AsyncGRPO FSDP2 -> vLLM NCCL, Qwen3-32B, H200", "plan_trl_async_qwen3_32b.toml", (), 2.3, TRL),
    Row("R1", "NeMo-RL NCCL reshard (direct writes), DeepSeek-V3 PP16xEP16 -> TP32xDP8", "plan_nemo_reshard_dsv3.toml",
        (), 2.61, SEEN),
    Row("R2", "NeMo-RL NCCL reshard, Qwen3-30B-A3B EP8xPP2 -> TP8xDP2", "plan_nemo_reshard_dsv3.toml", Q30_RESHARD,
        0.87, SEEN),
    Row("R3", "NeMo-RL NCCL reshard, Qwen3-4B DP8 -> TP8", "plan_nemo_reshard_dsv3.toml", Q4_RESHARD, 0.275, SEEN),
    Row("P1", "NeMo-RL sparse refit over S3, 247.2 GB, 5% changed", "plan_nemo_sparse_247.toml", (), 25.790, SEEN),
    Row("P2", "NeMo-RL sparse refit over S3, 247.2 GB, 3% changed", "plan_nemo_sparse_247.toml",
        ("policy.delta_fraction=0.03",), 20.234, SEEN),
]


# New weight-sync figures, gathered 2026-11-27 after the v5 rules, not in the repository before;
# the rules were not changed after reading them. THUDM/slime PR #2146 (CalvinXKY, 2026-06-29): Qwen3-8B GRPO on one
# node of 8 x A100 80GB, non-colocated, 4 training GPUs (Megatron TP4) + 4 rollout GPUs (SGLang TP4),
# perf/update_weights_time steady-state mean over steps 2-49: NCCL broadcast 0.755 s (all-gather over the TP group,
# then rank 0 broadcasts whole tensors), P2P 0.484 s (each TP rank sends its local shard to the matching SGLang
# rank: no gather, 4 streams). Configuration only: Qwen3-8B 8.19e9 parameters, 36 layers x 11 tensors + 3 = 399;
# A100 SXM HBM2e 2.039 TB/s and NVLink 3 300 GB/s per direction (NVIDIA datasheet); slime's default
# --update-weight-buffer-size 512 MiB (not stated in the PR).
SLIME_2146 = "THUDM/slime PR #2146 (2026-06-29), Qwen3-8B P2P vs NCCL broadcast benchmark"
Q8_A100 = ("policy.params=8.19e9", "policy.active_params=8.19e9", "policy.weight_tensors=399", "trainer.dp=4",
           "rollout.gpus=4", "rollout.tp=4", "rollout.mem_bandwidth=2.039e12", "network.custom={nvlink_a100 = 300e9}",
           "network.sync_link=nvlink_a100", "network.gather_link=nvlink_a100", "cluster.gpus=8",
           "sync.bucket_bytes=536870912")


@dataclass(frozen=True)
class NewRow(Row):
    source: str = ""
    gathered: str = "2026-11-27"


NEW_ROWS = [
    NewRow("W1", "slime NCCL broadcast Megatron TP4 -> SGLang TP4, Qwen3-8B, 8 x A100 (one node)",
           "plan_miles_broadcast_qwen30b.toml", Q8_A100, 0.755,
           "new: gathered 2026-11-27, after the v5 rules; not in the repository before", SLIME_2146),
    NewRow("W2", "slime P2P shard send/recv TP4 -> SGLang TP4 (4 streams, no gather), Qwen3-8B, 8 x A100",
           "plan_miles_broadcast_qwen30b.toml", (*Q8_A100, "network.senders=4", "trainer.sharding=ddp"), 0.484,
           "new: gathered 2026-11-27, after the v5 rules; not in the repository before", SLIME_2146),
]


def plan_sync(row: Row):
    """One weight update as the plan prices it on its defaults (the sync breakdown: ``total``, ``mechanism``)."""
    return make_plan(load_plan(EXAMPLES / row.file, list(row.overrides))).sync_detail


def plan_seconds(row: Row) -> float:
    return plan_sync(row).total


def table(rows: list[Row] | None = None) -> list[dict]:
    out = []
    for r in ROWS if rows is None else rows:
        d = plan_sync(r)
        s = d.total
        out.append({**asdict(r), "plan_s": s, "ratio": s / r.published_s, "within_2x": 0.5 <= s / r.published_s <= 2,
                    "mechanism": d.mechanism})
    return out


# Async / one-step-off speed-ups over colocated at equal GPUs, at the published split: each file holds the
# published colocated phase times; the plan prices the split. Every verl row is in sample for the trainer's
# serial fraction (inputs.TRAINER_SERIAL_FRACTION: verl's fully-async trainer rows, the same table as 7-9).
# The mean response the plan prices is the file's ASSUMPTION, or less where the file's own measured phases
# cannot hold it at peak FLOPs (hardware.bounded_mean): the "mean" column.
SERIAL = "in: verl (the trainer's serial fraction is verl's fully-async update_actor rows)"
STATED = "seen: read after the v5 rules, before the file was written (2026-11-27); no phase measured"
# NeMo-RL's "1-step off" is async GRPO (max_trajectory_age_steps 1, in-flight weight updates): the async placement
# under the v6 rules; v5 read it as disaggregated (one step apart in lockstep).
ONE_OFF = "async" if V6 else "disaggregated"


def recipe(*overrides: str) -> tuple[str, ...]:
    """A NeMo-RL recipe's v6 terms (fields the v5 rules did not have): dropped when v5's rules are imported."""
    return overrides if V6 else ()


# The expert all-to-all and the engine's sleep (fields the rules before them did not have): dropped when those rules
# are not imported. The file states Qwen3-30B-A3B's top-8 and the engine's sleep; Qwen3-235B-A22B and DeepSeek-V3 route
# to 8 experts too, DeepSeek-V3 in 58 of its 61 layers.
A2A = hasattr(plan_inputs, "EP_NVLINK_BW")


def recipe_moe(*overrides: str) -> tuple[str, ...]:
    return overrides if A2A else ()


# The v6 terms each row's NeMo-RL v0.6.0 recipe states (docs/calibration.md "Plan v6"): the Qwen3-30B file holds
# its own; the others state layers, the training layout and recompute, and one optimizer step per batch
# (G-GBS = T-GBS = 512).
N2_RECIPE = recipe("policy.layers=94", "policy.hidden=4096", "trainer.tp=4", "trainer.pp=8", "trainer.ep=16",
                   "trainer.recompute=true", "trainer.optimizer_minibatches=1")
N3_RECIPE = (*recipe("policy.layers=61", "policy.hidden=7168", "trainer.tp=1", "trainer.pp=16", "trainer.ep=16",
                    "trainer.recompute=true", "trainer.optimizer_minibatches=1"), *recipe_moe("policy.moe_layers=58"))
N2 = ("policy.params=235.1e9", "policy.active_params=22e9", "policy.weight_tensors=36945", "rollout.prompts=32",
      "rollout.avg_tokens=5457", "tail.max_tokens=7936", "rollout.tp=8", "rollout.gpus=128", "trainer.dp=128",
      "trainer.gpus=128", "rollout.kv_bytes_per_token=193536", "cluster.gpus=256", *N2_RECIPE)
N3 = ("policy.params=671e9", "policy.active_params=37e9", "policy.weight_tensors=45395", "rollout.prompts=32",
      "rollout.avg_tokens=441", "tail.max_tokens=1280", "rollout.tp=32", "rollout.gpus=256", "trainer.dp=256",
      "trainer.gpus=256", "rollout.kv_bytes_per_token=70272", "cluster.gpus=512", *N3_RECIPE)


@dataclass(frozen=True)
class Speedup:
    id: str
    what: str
    file: str
    published_x: float  # published step-time speed-up over colocated at equal GPUs
    sample: str
    overrides: tuple[str, ...] = ()
    placement: str = "async"  # the split placement the published system ran (one step off: disaggregated)


SPEEDUPS = [
    Speedup("7", "verl fully-async 64:64 vs colocated, Qwen2.5-Math-7B, 128 x H20", "plan_verl_async_128.toml", 2.37,
            SERIAL),
    Speedup("8", "verl fully-async 32:32 vs colocated, 64 x H20", "plan_verl_async_64.toml", 1.93, SERIAL),
    Speedup("9", "verl fully-async 16:16 vs colocated, 32 x H20", "plan_verl_async_32.toml", 2.68, SERIAL),
    Speedup("A5", "verl one-step-off 4:12 vs colocated, 16 x H20", "plan_verl_one_step_off_16.toml", 1.44, SERIAL,
            placement="disaggregated"),
    # NeMo-RL v0.6, no phase breakdown published: every phase is stated (the plan's first finding says so).
    Speedup("N1", "NeMo-RL v0.6 1-step off vs colocated, Qwen3-30B-A3B, 32 x H100", "plan_nemo_offpolicy_qwen30b.toml",
            192 / 152, STATED, placement=ONE_OFF),
    Speedup("N2", "NeMo-RL v0.6 1-step off vs colocated, Qwen3-235B-A22B, 256 x H100",
            "plan_nemo_offpolicy_qwen30b.toml", 312 / 231, STATED, N2, ONE_OFF),
    Speedup("N3", "NeMo-RL v0.6 1-step off vs colocated, DeepSeek-V3, 512 x H100", "plan_nemo_offpolicy_qwen30b.toml",
            111 / 64.1, STATED, N3, ONE_OFF),
]


# ---- New figures: gathered 2026-11-27 after the v5 rules were committed (ddc8a01, 11:34 UTC),
# none of them in the repository before; the rules were not changed after reading them. Each row states the
# published configuration only; the hardware of the GB200 rows is NVIDIA's datasheet (HBM3e 8 TB/s, dense BF16
# 2.5 PFLOP/s, 186 GB per GPU). Where the published table does not give the 1-step-off split of the GPUs, the
# row says so (an ASSUMPTION, as in the N rows' file). Prompt length stays the file's ASSUMPTION (256 tokens):
# avg_tokens = the published on-policy mean sequence - 256.
GATHERED = "2026-11-27"
NEW = "new: gathered 2026-11-27, after the v5 rules; not in the repository before"
PERF_V06 = ("NVIDIA-NeMo/RL docs/about/performance-summary.md (mirror 7ea279ab, Aug 2026), NeMo RL v0.6, "
            "GB200 BF16 table")
PERF_V04 = "NVIDIA-NeMo/RL docs/about/performance-summary.md at 06beed91 (NeMo RL v0.4 table, DGX-H100 BF16)"
GB200 = ("rollout.mem_bandwidth=8e12", "trainer.peak_flops=2.5e15", "cluster.gpu_memory=186e9",
         # GB200 NVL72: 72 GPUs in one NVLink domain, so a TP16/TP32 replica's all-reduces stay on NVLink (v6's
         # cross-node decode term applies beyond the domain), and so does an EP16 expert all-to-all: DeepEP's SM100
         # EP8 NVLink 5 dispatch, 726 GB/s (deepseek-ai/DeepEP README at 0297fc80)
         *recipe("cluster.gpus_per_node=72"), *recipe_moe("network.ep_nvlink_bw=726e9"))
G1 = ("policy.params=671e9", "policy.active_params=37e9", "policy.weight_tensors=45395", "rollout.prompts=32",
      "rollout.avg_tokens=444", "tail.max_tokens=1280", "rollout.tp=16", "rollout.gpus=128", "trainer.dp=128",
      "trainer.gpus=128", "rollout.kv_bytes_per_token=70272", "cluster.gpus=256", *GB200,
      *recipe_moe("policy.moe_layers=58"),
      *recipe("policy.layers=61", "policy.hidden=7168", "trainer.tp=1", "trainer.pp=8", "trainer.ep=16",
              "trainer.recompute=true", "trainer.optimizer_minibatches=1"))
G2 = ("policy.params=235.1e9", "policy.active_params=22e9", "policy.weight_tensors=36945", "rollout.prompts=32",
      "rollout.avg_tokens=5437", "tail.max_tokens=7936", "rollout.tp=8", "rollout.gpus=64", "trainer.dp=64",
      "trainer.gpus=64", "rollout.kv_bytes_per_token=193536", "cluster.gpus=128", *GB200,
      *recipe("policy.layers=94", "policy.hidden=4096", "trainer.tp=4", "trainer.pp=4", "trainer.ep=16",
              "trainer.recompute=true", "trainer.optimizer_minibatches=1"))
V1 = ("policy.params=8.03e9", "policy.active_params=8.03e9", "policy.weight_tensors=291", "rollout.avg_tokens=804",
      "tail.max_tokens=3840", "rollout.tp=1", "rollout.gpus=8", "trainer.dp=8", "trainer.gpus=8",
      "rollout.kv_bytes_per_token=131072", "cluster.gpus=16",
      *recipe("policy.layers=32", "policy.hidden=4096", "trainer.tp=1", "trainer.pp=2", "trainer.ep=1",
              "trainer.recompute=true"))
V2 = ("rollout.avg_tokens=2898",)


@dataclass(frozen=True)
class NewSpeedup(Speedup):
    source: str = ""
    gathered: str = GATHERED
    note: str = ""
    published_colocated_s: float = 0.0  # the published on-policy step (s), set below from the note's figure


NEW_SPEEDUPS = [
    NewSpeedup("G1", "NeMo-RL v0.6 GB200, 1-step off (128:128, gen TP16) vs on-policy, DeepSeek-V3, 256 GPUs",
               "plan_nemo_offpolicy_qwen30b.toml", 98.7 / 61.7, NEW, G1, ONE_OFF, PERF_V06,
               note="published 98.7 s -> 61.7 s; training EP16 x PP8 = 128 GPUs", published_colocated_s=98.7),
    NewSpeedup("G2", "NeMo-RL v0.6 GB200, 1-step off (64:64, gen TP8) vs on-policy, Qwen3-235B-A22B, 128 GPUs",
               "plan_nemo_offpolicy_qwen30b.toml", 345 / 278, NEW, G2, ONE_OFF, PERF_V06,
               note="published 345 s -> 278 s; training TP4 x EP16 x PP4 on 64 GPUs", published_colocated_s=345),
    NewSpeedup("V1", "NeMo-RL v0.4 H100, 1-step off vs on-policy, Llama-3.1-8B, 16 GPUs (8:8 ASSUMED)",
               "plan_nemo_offpolicy_qwen30b.toml", 97.7 / 74.6, NEW, V1, ONE_OFF, PERF_V04,
               note="published 97.7 s -> 74.6 s; the split of the 16 GPUs is not published",
               published_colocated_s=97.7),
    NewSpeedup("V2", "NeMo-RL v0.4 H100, 1-step off (16:16, gen TP2) vs on-policy, Qwen3-30B-A3B, 32 GPUs",
               "plan_nemo_offpolicy_qwen30b.toml", 225 / 244, NEW, V2, ONE_OFF, PERF_V04,
               note="published 225 s -> 244 s: 1-step off was slower in v0.4", published_colocated_s=225),
]


@dataclass(frozen=True)
class Scaling:
    """A colocated (on-policy) step published at two GPU counts: how much doubling the GPUs bought."""

    id: str
    what: str
    file: str
    overrides: tuple[str, ...]
    small_gpus: int
    published_small_s: float
    published_full_s: float
    source: str
    sample: str = NEW


SCALINGS = [
    Scaling("C1", "NeMo-RL v0.6 H100 on-policy, DeepSeek-V3, 256 -> 512 GPUs", "plan_nemo_offpolicy_qwen30b.toml",
            N3, 256, 134, 111, "NVIDIA-NeMo/RL performance-summary.md, v0.6 H100 BF16 (the 256-GPU row is new)"),
    Scaling("C2", "NeMo-RL v0.6 H100 on-policy, Qwen3-235B-A22B (gen TP16), 128 -> 256 GPUs",
            "plan_nemo_offpolicy_qwen30b.toml", (*N2, "rollout.tp=16"), 128, 395, 312,
            "NVIDIA-NeMo/RL performance-summary.md, v0.6 H100 BF16 (the 128-GPU row is new)"),
    Scaling("C3", "NeMo-RL v0.6 GB200 on-policy, DeepSeek-V3 (gen TP32), 128 -> 256 GPUs",
            "plan_nemo_offpolicy_qwen30b.toml", (*G1, "rollout.tp=32"), 128, 108, 98.7, PERF_V06),
    Scaling("C4", "NeMo-RL v0.6 GB200 on-policy, Qwen3-235B-A22B, 64 -> 128 GPUs", "plan_nemo_offpolicy_qwen30b.toml",
            G2, 64, 286, 345, PERF_V06),
]


# ---- Hold-out figures of plan v6: NeMo-RL v0.5's performance table (NVIDIA-NeMo/RL docs/about/performance-summary.md
# at 9dbd9adc9, 2026-02-06, "Nemo RL v0.5", H100 BF16), read 2026-11-29 before the v6 rules were written and set
# aside as their check: no rule or default takes a figure from it, and the repository held none of it before. Each
# row states the published configuration from the v0.5.0 recipes (examples/configs/recipes/llm/performance/*.yaml at
# tag v0.5.0: batch, generation TP, training layout, recompute; the split of the 1-step-off runs from each recipe's
# generation resources); the prompt length stays the file's ASSUMPTION (256 tokens): mean response = the published
# G-Average Seq len - 256. On-policy rows price the colocated step on the published GPUs, 1-step-off rows the split
# placement's step at the recipe's split.
HOLDOUT_SOURCE = "NVIDIA-NeMo/RL docs/about/performance-summary.md at 9dbd9adc9 (NeMo RL v0.5, H100 BF16)"
HOLDOUT_READ = "2026-11-29"
L8 = ("policy.params=8.03e9", "policy.active_params=8.03e9", "policy.weight_tensors=291", "rollout.prompts=64",
      "rollout.samples=32", "tail.max_tokens=3840", "rollout.tp=1", "rollout.gpus=8", "trainer.dp=8", "trainer.gpus=8",
      "rollout.kv_bytes_per_token=131072", "cluster.gpus=16",
      *recipe("policy.layers=32", "policy.hidden=4096", "trainer.tp=1", "trainer.pp=1", "trainer.ep=1",
              "trainer.recompute=true"))
Q32 = ("policy.params=32.8e9", "policy.active_params=32.8e9", "policy.weight_tensors=707", "rollout.prompts=64",
       "rollout.samples=32", "tail.max_tokens=3840", "rollout.tp=4", "rollout.gpus=32", "trainer.dp=32",
       "trainer.gpus=32", "rollout.kv_bytes_per_token=262144",
       *recipe("policy.layers=64", "policy.hidden=5120", "trainer.tp=4", "trainer.pp=4", "trainer.ep=1"))
Q235_H = ("policy.params=235.1e9", "policy.active_params=22e9", "policy.weight_tensors=36945", "rollout.prompts=16",
          "rollout.samples=32", "tail.max_tokens=7936", "rollout.kv_bytes_per_token=193536",
          *recipe("policy.layers=94", "policy.hidden=4096", "trainer.pp=8", "trainer.ep=16", "trainer.recompute=true",
                  "trainer.optimizer_minibatches=1"))
L8_GB = (*L8, *GB200, "rollout.gpus=4", "trainer.dp=4", "trainer.gpus=4", "cluster.gpus=8")
Q32_GB = (*Q32, *GB200, "rollout.tp=1", "rollout.gpus=16", "trainer.dp=16", "trainer.gpus=16",
          *recipe("trainer.tp=2", "trainer.pp=1"))
Q30_GB = (*GB200, "rollout.tp=1", "rollout.gpus=16", "trainer.dp=16", "trainer.gpus=16",
          *recipe("trainer.pp=1", "trainer.ep=16"))
DS_H = ("policy.params=671e9", "policy.active_params=37e9", "policy.weight_tensors=45395", "rollout.prompts=32",
        "rollout.samples=16", "tail.max_tokens=1280", "rollout.tp=32", "rollout.gpus=256", "trainer.dp=256",
        "trainer.gpus=256", "rollout.kv_bytes_per_token=70272", "cluster.gpus=512",
        *recipe("policy.layers=61", "policy.hidden=7168", "trainer.tp=1", "trainer.pp=16", "trainer.ep=16",
                "trainer.recompute=true", "trainer.optimizer_minibatches=1"), *recipe_moe("policy.moe_layers=58"))


# Weight syncs gathered 2026-11-29 after the v6 rules were committed (364f4b0), none in the repository before:
# checkpoint-engine's "Update (P2P)" column (MoonshotAI/checkpoint-engine README at 59a3c4f: the weights sent from
# the owners' CPU memory to each new instance's GPUs over RDMA (mooncake), then the same IPC buffer and engine reload
# as its broadcast: every receiving GPU takes the whole bucket, vLLM's load_weights keeps its slice; so each row is
# its broadcast row's configuration (S3a-S3f) with the P2P column's bucket), and verl's NIXL checkpoint engine
# (volcengine/verl verl/checkpoint_engine/README.md at b178a3cd: the S6 configuration, all_gather + ring p2p).
CE_P2P = "MoonshotAI/checkpoint-engine README (59a3c4f), Update (P2P) column"
HOLDOUT_SYNC = [
    Row("K1", "checkpoint-engine P2P into vLLM, GLM-4.5-Air, 8 x H800 TP8", "plan_ckpt_engine_qwen235b.toml",
        (*AIR, "sync.bucket_bytes=3.24e9"), 4.12, CE_P2P),
    Row("K2", "checkpoint-engine P2P, Qwen3-235B-A22B, 8 x H800 TP8", "plan_ckpt_engine_qwen235b.toml",
        ("sync.bucket_bytes=2.88e9",), 7.10, CE_P2P),
    Row("K3", "checkpoint-engine P2P, DeepSeek-V3.1 FP8, 16 x H20 TP16", "plan_kimi_k2_ckpt_engine.toml",
        (*DSV3, "sync.bucket_bytes=5.81e9"), 11.80, CE_P2P),
    Row("K4", "checkpoint-engine P2P, Kimi-K2 FP8, 16 x H20 TP16", "plan_kimi_k2_ckpt_engine.toml",
        ("sync.bucket_bytes=6.35e9",), 17.49, CE_P2P),
    Row("K5", "checkpoint-engine P2P, DeepSeek-V3.1 FP8, 256 x H20 (16 GPUs updated)", "plan_kimi_k2_ckpt_engine.toml",
        DSV3, 11.81, CE_P2P),
    Row("K6", "checkpoint-engine P2P, Kimi-K2 FP8, 256 x H20 (16 GPUs updated)", "plan_kimi_k2_ckpt_engine.toml", (),
        16.75, CE_P2P),
    Row("K7", "verl NIXL checkpoint engine (all_gather + ring p2p), Qwen3-30B-A3B, FSDP 2 -> 30 receivers",
        "plan_verl_ckpt_qwen30b.toml", (), 7.0, "volcengine/verl verl/checkpoint_engine/README.md (b178a3cd), NIXL row"),
]


@dataclass(frozen=True)
class HoldoutStep:
    """A published step time (s) at a published placement and GPU count: steps/hour = 3600 / step."""

    id: str
    what: str
    overrides: tuple[str, ...]
    published_s: float
    one_off: bool  # the 1-step-off (split) run; else on-policy (colocated)
    file: str = "plan_nemo_offpolicy_qwen30b.toml"


HOLDOUT_STEPS = [
    HoldoutStep("H1", "Llama-3.1-8B on-policy, 16 H100 (train PP2)", (*L8, "rollout.avg_tokens=763"), 92.8, False),
    HoldoutStep("H2", "Llama-3.1-8B 1-step off, 16 H100 (8 train : 8 gen)", (*L8, "rollout.avg_tokens=867"), 64.8, True),
    HoldoutStep("H3", "Qwen3-32B on-policy, 32 H100 (train TP4 PP4, gen TP4)",
                (*Q32, "rollout.avg_tokens=2995", "cluster.gpus=32"), 376, False),
    HoldoutStep("H4", "Qwen3-32B 1-step off, 64 H100 (32 : 32)", (*Q32, "rollout.avg_tokens=2996", "cluster.gpus=64"),
                200, True),
    HoldoutStep("H5", "Qwen3-235B-A22B on-policy, 128 H100 (train TP2 CP2 EP16 PP8, gen TP16)",
                (*Q235_H, "rollout.avg_tokens=5444", "rollout.tp=16", "rollout.gpus=128", "trainer.dp=128",
                 "trainer.gpus=128", "cluster.gpus=128", *recipe("trainer.tp=2")), 431, False),
    HoldoutStep("H6", "Qwen3-235B-A22B 1-step off, 256 H100 (128 train TP4 EP16 PP8 : 128 gen TP8)",
                (*Q235_H, "rollout.avg_tokens=5451", "rollout.tp=8", "rollout.gpus=128", "trainer.dp=128",
                 "trainer.gpus=128", "cluster.gpus=256", *recipe("trainer.tp=4")), 203, True),
    HoldoutStep("H7", "DeepSeek-V3 1-step off, 512 H100 (256 train EP16 PP16 : 256 gen TP32)",
                (*DS_H, "rollout.avg_tokens=482"), 64.9, True),
    HoldoutStep("H8", "Qwen3-30B-A3B on-policy, 32 H100 (train EP8, gen TP2)", ("rollout.avg_tokens=2940",), 198, False),
    HoldoutStep("H9", "Qwen3-30B-A3B 1-step off, 32 H100 (16 train EP8 PP2 : 16 gen TP2)", ("rollout.avg_tokens=2945",),
                154, True),
    # The same table's GB200 rows (v0.5.0 recipes *-n4g*.yaml), added to the check after the rules were committed:
    # read with the H100 rows, used by no rule.
    HoldoutStep("B1", "GB200 Llama-3.1-8B on-policy, 8 GPUs", (*L8_GB, "rollout.avg_tokens=810"), 91.0, False),
    HoldoutStep("B2", "GB200 Llama-3.1-8B 1-step off, 8 GPUs (4 : 4)", (*L8_GB, "rollout.avg_tokens=851"), 71.1, True),
    HoldoutStep("B3", "GB200 Qwen3-32B on-policy, 16 GPUs (train TP2, gen TP1)",
                (*Q32_GB, "rollout.avg_tokens=2997", "cluster.gpus=16"), 381, False),
    HoldoutStep("B4", "GB200 Qwen3-32B 1-step off, 32 GPUs (16 : 16)", (*Q32_GB, "rollout.avg_tokens=3002",
                                                                       "cluster.gpus=32"), 210, True),
    HoldoutStep("B5", "GB200 Qwen3-30B-A3B on-policy, 16 GPUs (train EP16, gen TP1)",
                (*Q30_GB, "rollout.avg_tokens=2942", "cluster.gpus=16"), 232, False),
    HoldoutStep("B6", "GB200 Qwen3-30B-A3B 1-step off, 32 GPUs (16 : 16)", (*Q30_GB, "rollout.avg_tokens=2948",
                                                                           "cluster.gpus=32"), 136, True),
    HoldoutStep("B7", "GB200 Qwen3-235B-A22B on-policy, 64 GPUs (train TP2 CP2 EP16 PP4, gen TP8)",
                (*Q235_H, *GB200, "rollout.avg_tokens=5455", "rollout.tp=8", "rollout.gpus=64", "trainer.dp=64",
                 "trainer.gpus=64", "cluster.gpus=64", *recipe("trainer.tp=2", "trainer.pp=4")), 332, False),
    HoldoutStep("B8", "GB200 Qwen3-235B-A22B 1-step off, 128 GPUs (64 train TP4 EP16 PP4 : 64 gen TP8)",
                (*Q235_H, *GB200, "rollout.avg_tokens=5455", "rollout.tp=8", "rollout.gpus=64", "trainer.dp=64",
                 "trainer.gpus=64", "cluster.gpus=128", *recipe("trainer.tp=4", "trainer.pp=4")), 268, True),
    HoldoutStep("B9", "GB200 DeepSeek-V3 on-policy, 128 GPUs (train EP16 PP8, gen TP32)",
                (*DS_H, *GB200, "rollout.avg_tokens=740", "rollout.tp=32", "rollout.gpus=128", "trainer.dp=128",
                 "trainer.gpus=128", "cluster.gpus=128", *recipe("trainer.pp=8")), 128, False),
    HoldoutStep("B10", "GB200 DeepSeek-V3 1-step off, 256 GPUs (128 train EP16 PP8 : 128 gen TP16)",
                (*DS_H, *GB200, "rollout.avg_tokens=738", "rollout.tp=16", "rollout.gpus=128", "trainer.dp=128",
                 "trainer.gpus=128", "cluster.gpus=256", *recipe("trainer.pp=8")), 64.5, True),
]
# Step times gathered 2026-11-29 after the expert all-to-all and engine-sleep rules were committed (8ffbaf3): NeMo-RL
# v0.4's H100 BF16 table (NVIDIA-NeMo/RL docs/about/performance-summary.md at 06beed91, "Nemo RL v0.4"). The
# repository already cited that table for two speed-ups (V1, V2: Llama-3.1-8B and Qwen3-30B-A3B, left out here);
# none of the rows below was in it, and no rule or default takes a figure from them. The table states each row's
# generation TP and training [TP, CP, EP, PP], the same layouts as the v0.5 rows H3-H7; the rest (recompute, batch
# split, prompt length) is the v0.5 rows' (the v0.4.0 recipes were not read): mean response = G-Average Seq len - 256.
HOLDOUT_AFTER_SOURCE = "NVIDIA-NeMo/RL docs/about/performance-summary.md at 06beed91 (NeMo RL v0.4, H100 BF16)"
HOLDOUT_AFTER_READ = "2026-11-29"
HOLDOUT_AFTER = [
    HoldoutStep("D1", "v0.4 DeepSeek-V3 on-policy, 256 H100 (train EP16 PP16, gen TP32)",
                (*DS_H, "rollout.avg_tokens=489", "cluster.gpus=256"), 154, False),
    HoldoutStep("D2", "v0.4 DeepSeek-V3 1-step off, 512 H100 (256 : 256)", (*DS_H, "rollout.avg_tokens=488"), 77.9,
                True),
    HoldoutStep("D3", "v0.4 Qwen3-235B-A22B on-policy, 128 H100 (train TP2 CP2 EP16 PP8, gen TP16)",
                (*Q235_H, "rollout.avg_tokens=5415", "rollout.tp=16", "rollout.gpus=128", "trainer.dp=128",
                 "trainer.gpus=128", "cluster.gpus=128", *recipe("trainer.tp=2")), 506, False),
    HoldoutStep("D4", "v0.4 Qwen3-235B-A22B 1-step off, 256 H100 (128 train TP4 EP16 PP8 : 128 gen TP8)",
                (*Q235_H, "rollout.avg_tokens=5435", "rollout.tp=8", "rollout.gpus=128", "trainer.dp=128",
                 "trainer.gpus=128", "cluster.gpus=256", *recipe("trainer.tp=4")), 241, True),
    HoldoutStep("D5", "v0.4 Qwen3-32B on-policy, 32 H100 (train TP4 PP4, gen TP4)",
                (*Q32, "rollout.avg_tokens=2950", "cluster.gpus=32"), 393, False),
    HoldoutStep("D6", "v0.4 Qwen3-32B 1-step off, 64 H100 (32 : 32)", (*Q32, "rollout.avg_tokens=2951",
                                                                     "cluster.gpus=64"), 215, True),
]
# The steps set aside before the rules were written (H1-H9) and those added after (B1-B10).
REGISTERED = tuple(f"H{i}" for i in range(1, 10))
# Speed-ups at equal GPUs in the same table (1-step off over on-policy on the same GPU count): H1/H2 and H8/H9.
HOLDOUT_SPEEDUPS = [("X1", "Llama-3.1-8B, 16 H100", "H1", "H2"), ("X2", "Qwen3-30B-A3B, 32 H100", "H8", "H9"),
                    ("X3", "GB200 Llama-3.1-8B, 8 GPUs", "B1", "B2")]


def holdout_step_s(r: HoldoutStep) -> float:
    eq = make_plan(load_plan(EXAMPLES / r.file, list(r.overrides))).equal_hardware()
    return eq[ONE_OFF]["configured"]["step_s"] if r.one_off else eq["colocated"]["step_s"]


def holdout_tables() -> dict[str, list[dict]]:
    """The hold-out check: each published step against the plan's (steps/hour within 1.5x: 1/1.5 <= ratio <= 1.5),
    and each speed-up at equal GPUs (within 25%)."""
    steps = []
    for r in HOLDOUT_STEPS:
        s = holdout_step_s(r)
        steps.append({**asdict(r), "plan_s": s, "ratio": s / r.published_s,
                      "within_1_5x": 1 / 1.5 <= s / r.published_s <= 1.5})
    by = {r["id"]: r for r in steps}
    speedups = []
    for rid, what, on, off in HOLDOUT_SPEEDUPS:
        pub, plan = by[on]["published_s"] / by[off]["published_s"], by[on]["plan_s"] / by[off]["plan_s"]
        speedups.append({"id": rid, "what": what, "published_x": pub, "plan_x": plan, "ratio": plan / pub,
                         "within_25": 0.75 <= plan / pub <= 1.25})
    after = []
    for r in HOLDOUT_AFTER:
        s = holdout_step_s(r)
        after.append({**asdict(r), "plan_s": s, "ratio": s / r.published_s,
                      "within_1_5x": 1 / 1.5 <= s / r.published_s <= 1.5})
    rules = ("v6 + all-to-all + sleep" if A2A else "v6") if V6 else "v5"
    return {"rules": rules, "steps": steps, "speedups": speedups, "sync": table(HOLDOUT_SYNC), "steps_after": after}


def scaling_table() -> list[dict]:
    """Each row: the plan's colocated step at the small and the full GPU count, and its gain against the published."""
    out = []
    for r in SCALINGS:
        full = make_plan(load_plan(EXAMPLES / r.file, list(r.overrides))).equal_hardware()["colocated"]["step_s"]
        small = make_plan(load_plan(EXAMPLES / r.file, [*r.overrides, f"cluster.gpus={r.small_gpus}"]))
        small_s = small.equal_hardware()["colocated"]["step_s"]
        published_x = r.published_small_s / r.published_full_s
        out.append({**asdict(r), "plan_small_s": small_s, "plan_full_s": full, "plan_x": small_s / full,
                    "published_x": published_x, "ratio": (small_s / full) / published_x})
    return out


def new_speedup_table() -> list[dict]:
    return speedup_table(NEW_SPEEDUPS)


def speedup_table(rows: list[Speedup] | None = None) -> list[dict]:
    """Each row: the plan's speed-up at the published split (the file's pools) and at its best split."""
    out = []
    for r in SPEEDUPS if rows is None else rows:
        plan = make_plan(load_plan(EXAMPLES / r.file, list(r.overrides)))
        eq = plan.equal_hardware()
        placement = r.placement
        mine, best = eq[placement]["configured"], eq[placement]
        x = mine["vs_colocated"]
        out.append({**asdict(r), "placement": placement, "plan_x": x, "ratio": x / r.published_x,
                    "within_25": 0.75 <= x / r.published_x <= 1.25, "rollout_s": mine["rollout_s"],
                    "trainer_s": mine["trainer_s"], "colocated_s": eq["colocated"]["step_s"],
                    "mean_tokens": plan.inputs.rollout.avg_tokens,
                    "best_x": best["vs_colocated"], "best_split": (best["rollout_gpus"], best["trainer_gpus"]),
                    "stated_phases": any("rest on stated" in f for f in plan.findings[:1])})
    return out


def main(argv: list[str]) -> int:
    rows = table()
    speedups = speedup_table()
    new, scaling, new_sync = new_speedup_table(), scaling_table(), table(NEW_ROWS)
    if "--holdout" in argv:
        h = holdout_tables()
        if "--json" in argv:
            print(json.dumps(h, indent=1))
            return 0
        print(f"Hold-out ({HOLDOUT_SOURCE}, read {HOLDOUT_READ}), priced by the {h['rules']} rules:")
        for r in h["steps"]:
            print(f"{r['id']:4} {r['published_s']:7.1f}s {r['plan_s']:7.1f}s {r['ratio']:6.2f}  {r['what']}")
        for r in h["speedups"]:
            print(f"{r['id']:4} {r['published_x']:6.2f}x {r['plan_x']:6.2f}x {r['ratio']:6.2f}  {r['what']}")
        for r in h["sync"]:
            print(f"{r['id']:4} {r['published_s']:7.2f}s {r['plan_s']:7.2f}s {r['ratio']:6.2f}  {r['what']} ({r['mechanism']})")
        print(f"Step times read after the all-to-all and sleep rules ({HOLDOUT_AFTER_SOURCE}, read {HOLDOUT_AFTER_READ}):")
        for r in h["steps_after"]:
            print(f"{r['id']:4} {r['published_s']:7.1f}s {r['plan_s']:7.1f}s {r['ratio']:6.2f}  {r['what']}")
        print(f"steps/hour within 1.5x, read after those rules: {sum(r['within_1_5x'] for r in h['steps_after'])} of "
              f"{len(h['steps_after'])}")
        print(f"steps/hour within 1.5x: {sum(r['within_1_5x'] for r in h['steps'])} of {len(h['steps'])}; speed-ups "
              f"within 25%: {sum(r['within_25'] for r in h['speedups'])} of {len(h['speedups'])}; weight syncs within "
              f"2x: {sum(r['within_2x'] for r in h['sync'])} of {len(h['sync'])}")
        return 0
    if "--json" in argv:
        print(json.dumps({"sync": rows, "speedups": speedups, "new_sync": new_sync, "new_speedups": new,
                          "scaling": scaling}, indent=1))
        return 0
    print(f"{'row':5} {'published':>10} {'plan':>8} {'ratio':>6}  sample  configuration (receive path)")
    for r in rows:
        print(f"{r['id']:5} {r['published_s']:9.3f}s {r['plan_s']:7.3f}s {r['ratio']:6.2f}  "
              f"{r['sample'].split(':')[0]:6}  {r['what']} ({r['mechanism']})")
    out = [r for r in rows if r["sample"] == "out"]
    seen = [r for r in rows if r["sample"].startswith("seen")]
    print(f"within 2x on defaults: {sum(r['within_2x'] for r in rows)} of {len(rows)} rows; out of sample "
          f"{sum(r['within_2x'] for r in out)} of {len(out)}; seen before their rule {sum(r['within_2x'] for r in seen)} "
          f"of {len(seen)}")
    print()
    print(f"{'row':4} {'published':>9} {'plan':>6} {'ratio':>6} {'rollout':>8} {'trainer':>8} {'mean':>5}  best split  "
          f"configuration")
    for r in speedups:
        print(f"{r['id']:4} {r['published_x']:8.2f}x {r['plan_x']:5.2f}x {r['ratio']:6.2f} {r['rollout_s']:7.1f}s "
              f"{r['trainer_s']:7.1f}s {r['mean_tokens']:5.0f}  {r['best_x']:4.2f}x {r['best_split'][0]}:"
              f"{r['best_split'][1]:<4} {r['what']}")
    verl = [r for r in speedups if r["sample"] == SERIAL]
    stated = [r for r in speedups if r["stated_phases"]]
    print(f"speed-ups within 25% at the published split: verl rows (measured phases, in sample for the serial "
          f"fraction) {sum(r['within_25'] for r in verl)} of {len(verl)}; rows on stated phases (NeMo-RL) "
          f"{sum(r['within_25'] for r in stated)} of {len(stated)}")
    print()
    print(f"New figures, gathered {GATHERED} after the v5 rules (none in the repository before; rules unchanged):")
    for r in new_sync:
        print(f"{r['id']:5} {r['published_s']:9.3f}s {r['plan_s']:7.3f}s {r['ratio']:6.2f}  new     {r['what']} "
              f"({r['mechanism']})")
    print(f"new weight syncs within 2x on defaults: {sum(r['within_2x'] for r in new_sync)} of {len(new_sync)}")
    print(f"{'row':4} {'published':>9} {'plan':>6} {'ratio':>6} {'rollout':>8} {'trainer':>8} {'mean':>5} "
          f"{'colocated plan / published':>27}  configuration")
    for r in new:
        print(f"{r['id']:4} {r['published_x']:8.2f}x {r['plan_x']:5.2f}x {r['ratio']:6.2f} {r['rollout_s']:7.1f}s "
              f"{r['trainer_s']:7.1f}s {r['mean_tokens']:5.0f} {r['colocated_s']:10.1f} / {r['published_colocated_s']:5.1f} s "
              f"({r['colocated_s'] / r['published_colocated_s']:.2f})  {r['what']}")
    print(f"new speed-ups within 25% at the published split: {sum(r['within_25'] for r in new)} of {len(new)}")
    print(f"{'row':4} {'published':>9} {'plan':>6} {'ratio':>6} {'plan small/full s':>18}  colocated step, GPUs doubled")
    for r in scaling:
        print(f"{r['id']:4} {r['published_x']:8.2f}x {r['plan_x']:5.2f}x {r['ratio']:6.2f} "
              f"{r['plan_small_s']:8.1f} / {r['plan_full_s']:6.1f}  {r['what']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
