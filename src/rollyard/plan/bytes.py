"""Runbook steps 1-2: every edge of one step and the bytes it moves (pure arithmetic).

The formulas are the runbook's ``rl_step_bytes.py`` exactly:

- full sync  = P * bytes_per_param
- delta sync = full * delta_fraction (+ P * delta_fraction * index bytes; the runbook uses 0)
- LoRA sync  = P * lora_fraction * bytes_per_param
- rollout payload = prompts * samples * avg_tokens * bytes_per_token (int32 id + fp32 logprob = 8)
- gradient wire per rank = 2 (k - 1) / k * P * bytes (ring all-reduce over k = DP ranks)

All byte counts are decimal (1 GB = 1e9 bytes), as in the runbook.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from rollyard.plan import mechanisms as M
from rollyard.plan import tools as plan_tools
from rollyard.plan.inputs import (
    CPU_INPROCESS_REFRESH_BW,
    CPU_SYNC,
    CROSS_NODE_FIXED_S,
    FLOOR_MECHANISMS,
    GPU_PAUSE_S,
    GPU_SYNC,
    MISC_TENSORS_PER_LAYER,
    MISC_TENSORS_PER_MODEL,
    NVLINK_CLASS_BW,
    PCIE5_X16_BW,
    ZSTD1_DECODE_BW,
    ZSTD1_ENCODE_BW,
    PlanInputs,
)
from rollyard.telemetry import rundir

GB = 1e9
IPC_HANDLE_BYTES = 64  # a colocated engine gets weights through a CUDA-IPC handle (runbook step 1)
PROMPT_TOKEN_BYTES = 4  # int32 token ids on the prompts edge
REWARD_BYTES = 4  # one fp32 reward per sample
LOGPROB_BYTES = 4  # fp32 reference logprob per completion token


def ring_allreduce_bytes(msg_bytes: float, k: int) -> float:
    """Per-rank wire traffic of a ring all-reduce over ``k`` ranks: 2 (k-1)/k * message (0 at k=1)."""
    if k < 1:
        raise ValueError(f"ring all-reduce needs k >= 1 ranks, got {k}")
    return 2.0 * (k - 1) / k * msg_bytes


@dataclass(frozen=True)
class StepBytes:
    """Bytes of each flow in one step (weight syncs: per sync)."""

    full_sync: float
    delta_sync: float
    lora_sync: float
    rollout_tokens: float
    rollout_payload: float
    gradient_per_rank: float
    prompts: float
    rewards: float
    ref_logprobs: float
    teacher_logprobs: float = 0.0

    def sync(self, mode: str) -> float:
        return {"full": self.full_sync, "delta": self.delta_sync, "lora": self.lora_sync}[mode]

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def step_bytes(p: PlanInputs) -> StepBytes:
    pol, ro = p.policy, p.rollout
    kw = {"delta_fraction": pol.delta_fraction, "delta_index_bytes": pol.delta_index_bytes,
          "lora_fraction": pol.lora_fraction}
    full = predicted_sync_bytes(pol.params, pol.bytes_per_param, "full", tensors=pol.weight_tensors, **kw)
    delta = predicted_sync_bytes(pol.params, pol.bytes_per_param, "delta", tensors=pol.weight_tensors, **kw)
    lora = predicted_sync_bytes(pol.params, pol.bytes_per_param, "lora", tensors=pol.lora_tensors, **kw)
    samples = ro.prompts * ro.samples
    tokens = samples * ro.avg_tokens
    grad_bpp = p.trainer.grad_bytes_per_param or pol.bytes_per_param
    if p.trainer.sharding == "fsdp":
        grad = M.fsdp_bytes_per_rank(pol.params * pol.bytes_per_param, pol.params * grad_bpp, p.trainer.dp)
    else:
        grad = ring_allreduce_bytes(pol.params * grad_bpp, p.trainer.dp)
    return StepBytes(
        full_sync=full, delta_sync=delta, lora_sync=lora,
        rollout_tokens=tokens, rollout_payload=tokens * ro.bytes_per_token,
        gradient_per_rank=grad,
        prompts=ro.prompts * ro.prompt_tokens * PROMPT_TOKEN_BYTES,
        rewards=samples * REWARD_BYTES,
        ref_logprobs=tokens * LOGPROB_BYTES if p.phases.use_reference else 0.0,
        teacher_logprobs=(tokens * (LOGPROB_BYTES + p.phases.teacher_top_k * (PROMPT_TOKEN_BYTES + LOGPROB_BYTES))
                          if p.phases.teacher_params > 0 else 0.0),
    )


def steps_per_hour_stated(p: PlanInputs) -> float:
    """The cadence the plan states: syncs per hour x steps per sync."""
    return p.sync.per_hour * p.sync.every_steps


def per_hour(p: PlanInputs, b: StepBytes) -> dict[str, float]:
    """Hourly wire bytes at the stated cadence (weights per sync, the rest per step)."""
    steps = steps_per_hour_stated(p)
    return {
        "full_sync": b.full_sync * p.sync.per_hour,
        "delta_sync": b.delta_sync * p.sync.per_hour,
        "lora_sync": b.lora_sync * p.sync.per_hour,
        "rollout_payload": b.rollout_payload * steps,
        "gradient_per_rank": b.gradient_per_rank * steps,
    }


@dataclass(frozen=True)
class SyncCosts:
    """The software terms and rates one sync pays, resolved: the plan's figure where it gives one, else
    the default of ``rollout.device`` and ``rollout.backend`` (``inputs.CPU_SYNC`` on a CPU; on a GPU
    ``inputs.GPU_SYNC`` by what the receiver does per tensor, ``receiver``, and the rates are the HBM
    bandwidth)."""

    pause_s: float
    fixed_s: float
    send_per_tensor_s: float
    load_per_tensor_s: float
    per_bucket_s: float
    cast_bw: float
    load_bw: float
    reload_whole_model: bool
    source: str  # where the defaults came from


def receiver(p: PlanInputs) -> str:
    """What the receiving engine does per tensor (``sync.receiver``; auto: vLLM and SGLang run
    load_weights, rollyard's native engine copies)."""
    if p.sync.receiver != "auto":
        return p.sync.receiver
    return "copy" if p.rollout.backend == "native" else "load_weights"


def receiver_words(p: PlanInputs) -> str:
    """The receive path in words, for every sync figure the plan prints: ``rule: what it does``."""
    rule = receiver(p)
    return f"{rule}: {M.RECEIVE_WORDS.get(rule, rule)}"


def sync_costs(p: PlanInputs) -> SyncCosts:
    s, ro = p.sync, p.rollout
    base = {"pause_s": 0.0, "send_per_tensor_s": 0.0, "load_per_tensor_s": 0.0, "per_bucket_s": 0.0,
            "cast_bw": ro.mem_bandwidth, "load_bw": ro.mem_bandwidth}
    if ro.device == "cpu":
        backend = "vllm" if ro.backend == "vllm" else "native"  # SGLang has no CPU measurement: the native engine's
        defaults = CPU_SYNC[backend]
        src = f"measured on a CPU for backend {backend} (inputs.CPU_SYNC)"
    else:
        rule = receiver(p)
        paused = rule in ("load_weights", "direct_write", "receiver_reshard", "copy")
        defaults = {**GPU_SYNC[rule], **({"pause_s": GPU_PAUSE_S[ro.backend]} if paused else {})}
        src = f"GPU: receiver {rule} (inputs.GPU_SYNC; pause of {ro.backend}), rates = rollout.mem_bandwidth"
        floor = has_floor(p, rule)
        if floor:
            defaults = {**defaults, "fixed_s": CROSS_NODE_FIXED_S}
        src += (f"; fixed {CROSS_NODE_FIXED_S:.2f} s (between nodes, {rule})" if floor else
                f"; fixed 0 ({'within a node' if within_node(p) else f'{rule} publishes no floor'})")
    base["fixed_s"] = 0.0
    pick = {k: getattr(s, k) if getattr(s, k) is not None else defaults.get(k, v) for k, v in base.items()}
    whole = s.reload_whole_model if s.reload_whole_model is not None else ro.backend == "vllm"
    return SyncCosts(**pick, reload_whole_model=whole, source=src)


def has_floor(p: PlanInputs, rule: str, tier: str | None = None) -> bool:
    """The cross-node control floor applies: a GPU sync between nodes whose mechanism has one
    (``inputs.FLOOR_MECHANISMS``: the anchor it comes from measured that mechanism)."""
    return p.rollout.device == "gpu" and rule in FLOOR_MECHANISMS and not within_node(p, tier)


def misc_tensors(p: PlanInputs) -> tuple[float, str]:
    """Tensors that ride load_weights under direct writes, and where the count comes from."""
    if p.sync.misc_tensors is not None:
        return float(p.sync.misc_tensors), "sync.misc_tensors"
    if p.policy.layers is not None:
        n = p.policy.layers * MISC_TENSORS_PER_LAYER + MISC_TENSORS_PER_MODEL
        return float(min(n, p.policy.weight_tensors)), f"policy.layers x {MISC_TENSORS_PER_LAYER} + {MISC_TENSORS_PER_MODEL}"
    return float(p.policy.weight_tensors), "every tensor (policy.layers not given)"


def rank_tensors(p: PlanInputs, tensors: float) -> float:
    """Tensors one trainer rank holds of an update's ``tensors`` (all its pipeline stages together): the dense ones
    (attention, norms, router, embeddings: ``misc_tensors``) and 1/trainer.ep of the expert ones (MoE)."""
    pol, ep = p.policy, p.trainer.ep
    if ep <= 1 or pol.active_params is None or pol.active_params >= pol.params:
        return tensors
    dense = min(misc_tensors(p)[0], tensors)
    return dense + (tensors - dense) / ep


def within_node(p: PlanInputs, tier: str | None = None) -> bool:
    """The sync stays inside a node: colocated, or over an NVLink-class link (``NVLINK_CLASS_BW``)."""
    return p.placement == "colocated" or p.tiers()[tier or p.network.sync_link] >= NVLINK_CLASS_BW


def sync_tensors(p: PlanInputs, mode: str) -> int:
    """Tensors one sync of ``mode`` carries: every weight (full; delta: every tensor that changed, at
    most all), or the adapter's (LoRA)."""
    return p.policy.lora_tensors if mode == "lora" else p.policy.weight_tensors


def sync_breakdown(p: PlanInputs, b: StepBytes, mode: str, tier: str | None = None) -> M.SyncTime:
    """One sync of ``mode`` over ``tier`` (default: the sync link), term by term (``mechanisms.sync_time``).

    Parallel sending streams: ``network.senders`` (default ``rollout.tp``: each GPU of the receiving
    replica takes its 1/tp share on its own NIC). Gather: the trainer's FSDP shards (``trainer.dp``
    under fsdp). A delta also costs its export/compare on the trainer at HBM bandwidth. An engine that
    reloads its whole model (``sync.reload_whole_model``) loads every tensor and byte of a full sync.
    """
    tiers = p.tiers()
    link = tiers[tier or p.network.sync_link]
    return _sync(p, b, mode, link, p.network.senders or p.rollout.tp)


def _sync(p: PlanInputs, b: StepBytes, mode: str, link_bw: float, links: int) -> M.SyncTime:
    c, pol = sync_costs(p), p.policy
    gpus_t = p.trainer.gpus or p.trainer.dp
    # the delta's compare is a memory pass on the trainer: the copy rate (rollout.mem_bandwidth on a GPU)
    compare = M.delta_compare_s(b.full_sync, gpus_t, c.cast_bw) if mode == "delta" else 0.0
    synced_params = {"full": pol.params, "delta": pol.params * pol.delta_fraction,
                     "lora": pol.params * pol.lora_fraction}[mode]
    rule = receiver(p) if p.rollout.device == "gpu" else "copy" if p.rollout.backend != "vllm" else "load_weights"
    # Control once per update: the plan's figure, else the GPU default where the mechanism has a floor and the
    # link priced crosses nodes (CROSS_NODE_FIXED_S; colocated prices an infinite link), none otherwise.
    crosses = not (p.placement == "colocated" or link_bw >= NVLINK_CLASS_BW)
    fixed = c.fixed_s if p.sync.fixed_s is not None or p.rollout.device == "cpu" else (
        CROSS_NODE_FIXED_S if rule in FLOOR_MECHANISMS and crosses else 0.0)
    nbytes, tensors = b.sync(mode), sync_tensors(p, mode)
    load_t = pol.weight_tensors if c.reload_whole_model else tensors
    load_b = b.full_sync if c.reload_whole_model else nbytes
    engine, sender = _mechanism_terms(p, rule, c, nbytes, tensors, load_t, load_b)
    wire = None
    if rule == "direct_write":  # the bulk shard to shard, the misc broadcast whole to every GPU
        bulk = M.bulk_fraction(pol.active_params is not None and pol.active_params < pol.params) * nbytes
        wire = M.direct_write_wire_s(bulk, nbytes - bulk, links, link_bw)
    # A compressed path's producers are the trainer ranks (NeMo-RL: every policy rank owns export chunks); each
    # receiving replica decodes every payload in one stream.
    producers = gpus_t
    codec = M.codec_terms(nbytes, producers, 1, ZSTD1_ENCODE_BW, ZSTD1_DECODE_BW) if p.sync.codec == "zstd1" else (0.0, 0.0)
    trips = M.round_trips_s(M.buckets_of(nbytes, p.sync.bucket_bytes), producers, p.sync.round_trip_s)
    return M.sync_time(
        nbytes, link_bw=link_bw, links=links, gather_bw=p.tiers()[p.network.gather_link], load_bw=c.load_bw,
        receivers=p.rollout.tp, fixed_s=fixed, pause_s=c.pause_s, compare_s=compare,
        tensors=tensors, per_bucket_s=c.per_bucket_s, bucket_bytes=p.sync.bucket_bytes,
        # direct writes send each rank's local shard: nothing is gathered into whole tensors first
        shards=p.trainer.dp if p.trainer.sharding == "fsdp" and rule != "direct_write" else 1, params=synced_params,
        source_bpp=p.sync.source_bytes_per_param or pol.bytes_per_param, dest_bpp=pol.bytes_per_param,
        cast_bw=c.cast_bw, overlap=p.sync.bucket_overlap, engine_terms=engine, sender_terms=sender, codec=codec,
        round_trip_s=trips, mechanism=rule, wire_s=wire)


def _mechanism_terms(p: PlanInputs, rule: str, c: SyncCosts, nbytes: float, tensors: float, load_tensors: float,
                     load_bytes: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """(engine per-tensor s, engine byte s), (sender per-tensor s per stream, sender staging s) of one update
    under the receive mechanism ``rule``, each from its own rule in ``mechanisms``."""
    tp, links = p.rollout.tp, p.network.senders or p.rollout.tp
    send = (tensors / links * c.send_per_tensor_s, 0.0)  # a stated per-tensor sender cost, split over the streams
    if rule == "rdma_pinned":
        # Each pipeline stage's sources reshard that stage's tensors; a source serves ceil(tp / sources) of the
        # engine's TP layouts (each its own CPU reshard), staging each layout's shard to pinned host memory.
        # Each trainer rank sends only the tensors it holds (rules of plan v6): its stage's dense tensors (whole or
        # a TP slice: one tensor each) and 1/ep of the stage's expert tensors; v5 charged one sender every tensor
        # of its stage.
        pp = p.trainer.pp
        sources = max(1, (p.trainer.gpus or p.trainer.dp) // pp)
        layouts = math.ceil(tp / min(sources, tp))
        host = p.sync.host_bw or PCIE5_X16_BW
        return (0.0, 0.0), M.pinned_rdma_terms(rank_tensors(p, tensors) / pp, nbytes / pp / tp, layouts,
                                               c.send_per_tensor_s, host)
    if rule == "direct_write":
        misc, _ = misc_tensors(p)
        pol = p.policy
        bulk = M.bulk_fraction(pol.active_params is not None and pol.active_params < pol.params) * load_bytes
        return M.direct_write_terms(min(misc, load_tensors), bulk, load_bytes - bulk, tp, c.load_per_tensor_s,
                                    c.load_bw), send
    if rule == "receiver_reshard":
        return M.receiver_reshard_terms(load_tensors, load_bytes, tp, c.load_per_tensor_s, c.load_bw), send
    return M.load_weights_terms(load_tensors, load_bytes, tp, c.load_per_tensor_s, c.load_bw), send


def sync_times(p: PlanInputs, b: StepBytes) -> dict[str, dict[str, float]]:
    """mode -> tier -> seconds of one sync over that tier (``sync_breakdown``'s total)."""
    return {mode: {t: sync_breakdown(p, b, mode, t).total for t in p.tiers()} for mode in ("full", "delta", "lora")}


def colocated_breakdown(p: PlanInputs, b: StepBytes | None = None) -> M.SyncTime:
    """Colocated sync, term by term: no wire (the engine gets the trainer's tensors through handles
    on the same GPUs), every other term of a full sync: gather, cast/copy into buffers, the software
    per tensor and bucket, the engine's load and copy of its 1/tp shard, pause/resume, the fixed cost.
    On a CPU with rollyard's native engine and no LoRA: the in-process refresh (:func:`inprocess_refresh`)."""
    if p.rollout.device == "cpu" and p.rollout.backend == "native" and not p.policy.lora:
        return inprocess_refresh(p)
    return _sync(p, b or step_bytes(p), "full", math.inf, p.rollout.tp)


def inprocess_refresh(p: PlanInputs) -> M.SyncTime:
    """A colocated CPU sync in mode ``inprocess`` (the native engine's default there): nothing is sent, paused or
    loaded; the engine reads the trainer's module and rebuilds its fused weight copies in one pass, reading the
    trainer's weights (``sync.source_bytes_per_param``, else ``policy.bytes_per_param``) and writing the copy
    (``policy.bytes_per_param``) at ``sync.cast_bw``, else ``inputs.CPU_INPROCESS_REFRESH_BW``."""
    pol = p.policy
    src = p.sync.source_bytes_per_param or pol.bytes_per_param
    cast = pol.params * (src + pol.bytes_per_param) / (p.sync.cast_bw or CPU_INPROCESS_REFRESH_BW)
    return M.SyncTime(fixed_s=p.sync.fixed_s or 0.0, pause_s=p.sync.pause_s or 0.0, compare_s=0.0, gather_s=0.0,
                      cast_s=cast, send_tensor_s=0.0, bucket_s=0.0, wire_s=0.0, load_tensor_s=0.0, copy_s=0.0,
                      buckets=0, tensors=pol.weight_tensors or 0.0, overlap=False, mechanism="copy")


def colocated_reload_seconds(p: PlanInputs) -> float:
    """One colocated sync's seconds (``colocated_breakdown``)."""
    return colocated_breakdown(p).total


# A typical tensor name in the wire header (rollout names: "model.layers.12.self_attn.q_proj.weight" is
# 39 characters, "model.layers.0.self_attn.k_proj.lora_A" 38).
NAME_CHARS = 40


def framing_bytes(mode: str, values: float, tensors: float, bytes_per_param: float,
                  name_chars: float = NAME_CHARS) -> float:
    """Bytes the wire form (sync/wire.py) adds to one sync's values, counted from the format: the
    16-byte prefix, the JSON header and one entry per tensor (``mechanisms.tensor_framing_bytes``).

    Full: ``tensors`` entries of the mean tensor (``values / tensors`` bytes, a square 2-D shape).
    Delta: every changed tensor has a value and an index entry (1-D). LoRA: ``tensors`` is 3 per
    adapted module: lora_A and lora_B (2-D) and an fp32 scaling scalar (4 bytes, padded to 8, which
    ``lora_fraction`` does not count). 0 tensors: no framing priced.
    """
    if tensors <= 0:
        return 0.0
    dtype = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}.get(bytes_per_param, "float32")
    base = M.WIRE_PREFIX_BYTES + M.WIRE_HEADER_BYTES
    if mode == "lora":
        modules = tensors / 3
        mean = values / max(2 * modules, 1)
        side = max(1, round(math.sqrt(mean / bytes_per_param)))
        ab = 2 * modules * M.tensor_framing_bytes(name_chars, dtype, (side, side), round(mean))
        scaling = modules * (M.tensor_framing_bytes(name_chars + 1, "float32", (), 4) + 4)
        return base + ab + scaling
    mean = values / tensors
    if mode == "delta":  # a values entry and an index entry, each 1-D, about half the bytes each
        half = round(mean / 2)
        return base + tensors * 2 * M.tensor_framing_bytes(name_chars, dtype, (half,), half)
    side = max(1, round(math.sqrt(mean / bytes_per_param)))
    return base + tensors * M.tensor_framing_bytes(name_chars, dtype, (side, side), round(mean))


def predicted_sync_bytes(params: float, bytes_per_param: float, mode: str, *, delta_fraction: float = 0.02,
                         delta_index_bytes: float = 0.0, lora_fraction: float = 0.005, tensors: float = 0,
                         name_chars: float = NAME_CHARS) -> float:
    """Stable entry point (bench/sync.py, review): bytes one sync of ``mode`` puts on the wire, predicted.

    Values: full = P x bytes; delta = P x fraction x (bytes + index bytes); lora = P x lora_fraction x
    bytes; inprocess = 0. Plus the wire framing of ``tensors`` tensors (``framing_bytes``; 0 tensors:
    values only). The object store's own serialization overhead (ray) is not counted.
    """
    if mode == "inprocess":
        return 0.0
    if mode == "full":
        values = params * bytes_per_param
    elif mode == "delta":
        values = params * delta_fraction * (bytes_per_param + delta_index_bytes)
    elif mode == "lora":
        values = params * lora_fraction * bytes_per_param
    else:
        raise ValueError(f"unknown sync mode {mode!r}; expected full, delta, lora or inprocess")
    return values + framing_bytes(mode, values, tensors, bytes_per_param, name_chars)


@dataclass(frozen=True)
class Edge:
    """One row of the runbook's actor/edge table."""

    name: str
    source: str
    dest: str
    payload: str
    trigger: str
    bytes_per_event: float  # per step, or per sync for the weights edge
    bytes_per_step: float  # averaged over steps
    bytes_per_hour: float
    note: str


def edges(p: PlanInputs, b: StepBytes, placement: str, sync_mode: str) -> list[Edge]:
    """The step's edges (names from rundir.EDGES) with bytes for this placement and sync mode."""
    steps_h = steps_per_hour_stated(p)
    ro = p.rollout
    if placement == "colocated":
        weights, wnote = 0.0, f"CUDA-IPC handle (~{IPC_HANDLE_BYTES} B), no weight bytes on the wire"
    else:
        weights = b.sync(sync_mode)
        wnote = f"{sync_mode} sync over {p.network.sync_link}"
    per_event = {
        "prompts": (b.prompts, f"{ro.prompts} prompts x {ro.prompt_tokens:g} tokens x 4 B"),
        "samples": (b.rollout_payload, f"{ro.prompts}x{ro.samples}x{ro.avg_tokens:g} tokens x {ro.bytes_per_token:g} B"),
        "rewards": (b.rewards, f"{ro.prompts * ro.samples} samples x 4 B"),
        "ref_logprobs": (b.ref_logprobs, "4 B per completion token" if p.phases.use_reference else "no reference model"),
        "teacher_logprobs": (b.teacher_logprobs, ("no teacher" if p.phases.teacher_params <= 0 else
                                                  f"4 B + top-{p.phases.teacher_top_k} x 8 B per completion token"
                                                  if p.phases.teacher_top_k else "4 B per completion token")),
        "weights": (weights, wnote),
        "gradients": (b.gradient_per_rank, f"per rank, ring over DP={p.trainer.dp}" if p.trainer.dp > 1 else "DP=1: no all-reduce"),
        "gather": (0.0, "unsharded trainer: nothing to gather (review prices fsdp runs from run.json)"),
        "tools": plan_tools.edge_bytes(p),
    }
    rows = []
    for name, (src, dst, payload, trigger) in rundir.EDGES.items():
        nbytes, note = per_event[name]
        per_step = nbytes / p.sync.every_steps if name == "weights" else nbytes
        rows.append(Edge(name, src, dst, payload, trigger, nbytes, per_step, per_step * steps_h, note))
    return rows


def training_state_bytes(p: PlanInputs) -> float:
    """Trainer memory for weights + grads + master + Adam (decision tree step 1), all ranks together."""
    return p.policy.params * p.cluster.train_bytes_per_param


# ---- formatting shared by the printed report and the decision record ----

_UNITS = ((1e15, "PB"), (1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def unit_of(nbytes: float) -> tuple[float, str]:
    """The largest decimal unit in which ``nbytes`` is at least 1."""
    for scale, name in _UNITS:
        if abs(nbytes) >= scale:
            return scale, name
    return 1.0, "B"


def fmt_bytes(nbytes: float, decimals: int = 2, unit: tuple[float, str] | None = None) -> str:
    """``28e9 -> '28.00 GB'``; with ``unit`` the value is written in that unit."""
    scale, name = unit or unit_of(nbytes)
    if name == "B" and unit is None:
        return f"{nbytes:.0f} B"
    return f"{nbytes / scale:.{decimals}f} {name}"


def fmt_tokens(n: float) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.0f}"


def fmt_seconds(s: float) -> str:
    if s == 0:
        return "0 s"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def dtype_name(bytes_per_param: float) -> str:
    return {1: "fp8", 2: "bf16", 4: "fp32"}.get(bytes_per_param, f"{bytes_per_param:g}-byte")


def fmt_fraction(x: float) -> str:
    """``0.02 -> '2%'``, ``0.005 -> '0.5%'`` (the runbook's labels)."""
    pct = x * 100
    return f"{pct:.0f}%" if abs(pct - round(pct)) < 1e-9 else f"{pct:.1f}%"


def runbook_lines(p: PlanInputs, b: StepBytes, hourly: dict[str, float]) -> list[str]:
    """The runbook calculator's printout, line for line, for these inputs.

    Per-step figures share the full sync's unit (so they compare at a glance, 0.56 GB next to
    28.00 GB); hourly figures each take their own unit (1.68 TB, 33.6 GB, 8.4 GB).
    """
    pol = p.policy
    u = unit_of(b.full_sync)
    return [
        (f"weight sync per step : full {dtype_name(pol.bytes_per_param)} {fmt_bytes(b.full_sync, 2, u)} | "
         f"delta ({fmt_fraction(pol.delta_fraction)}) {fmt_bytes(b.delta_sync, 2, u)} | "
         f"LoRA ({fmt_fraction(pol.lora_fraction)}) {fmt_bytes(b.lora_sync, 2, u)}"),
        (f"rollout payload      : {fmt_tokens(b.rollout_tokens)} tokens = "
         f"{fmt_bytes(b.rollout_payload, 3, u)} (ids + logprobs)"),
        (f"gradient all-reduce  : {fmt_bytes(b.gradient_per_rank, 2, u)}/rank/step at DP={p.trainer.dp} "
         + ("(ring)" if p.trainer.sharding == "ddp" else "(FSDP: reduce-scatter + 2 all-gathers)")),
        (f"per hour at {p.sync.per_hour:g} syncs: full {fmt_bytes(hourly['full_sync'], 2)} | "
         f"delta {fmt_bytes(hourly['delta_sync'], 1)} | LoRA {fmt_bytes(hourly['lora_sync'], 1)}"),
    ]
