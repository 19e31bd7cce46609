"""Equal hardware: every placement priced on the same G accelerators (runbook step 6's rate matching).

Phase times are functions of the GPUs a pool gets:

- rollout on g GPUs: the decode model of ``mechanisms`` (synchronous round or bubble-free floor, each
  the roofline of HBM reads and FLOPs plus the engine's work per step) on the real per-replica batch. A
  measured ``phases.rollout_s`` (a synchronous round on ``phases.gpus``) sets the level: what it takes
  beyond the roofline is the engine's work per decode step (``measured_step_overhead``), paid by every
  decode step on any pool; a measurement faster than the roofline (the stated rates are too low) scales
  the model instead (measured x model(g) / model(measured GPUs));
- trainer on g GPUs: estimated from FLOPs (6 x P_active x tokens for fwd+bwd, 2 x P_active x tokens
  for a reference forward, at peak x MFU); a measured time scales to other pool sizes by Amdahl's law
  with ``trainer.serial_fraction`` (``mechanisms.amdahl_s``; 0 = time x GPUs constant);
- reward: CPU verifiers, independent of the GPU split (on the rollout side unless streamed);
- the distillation teacher's forward (``phases.teacher_params``): 2 x P_teacher x tokens FLOPs on the trainer's
  GPUs, its own phase (``teacher_terms``), serial with the trainer's step (the split table prices it there for
  either ``phases.teacher_placement``, as it does the reference);
- the teacher's sampling (GKD's seq_kd, ``phases.teacher_sample_share``): the decode model with the teacher's
  weights on the trainer's GPUs, serial with the trainer's step (``teacher_sample_terms``);
- algorithm (advantages, loss bookkeeping): a given time on the trainer side, independent of the split.

``split_table`` evaluates colocated on G, and disaggregated and async at every split of G into whole
engine replicas (on large pools, a grid refined around its best: ``search_splits``), and reports the
best split of each.
"""

from __future__ import annotations

import math
from dataclasses import replace

from rollyard.plan import mechanisms as M
from rollyard.plan.inputs import (
    CROSS_NODE_ALLREDUCE_S,
    DENSE_TRAINER_MFU,
    EP_NVLINK_BW,
    EP_RDMA_BW,
    MOE_TRAINER_MFU,
    PCIE5_X16_BW,
    STEP_OVERHEAD_S,
    PlanError,
    PlanInputs,
)


def active_params(p: PlanInputs) -> float:
    """Parameters that do FLOPs per token (MoE: active; dense: all)."""
    return p.policy.active_params or p.policy.params


def weight_bytes(p: PlanInputs) -> float:
    """Bytes of the rollout copy of the weights (all experts: every one is resident and synced)."""
    return p.policy.params * p.policy.bytes_per_param


def sequences(p: PlanInputs) -> int:
    return p.rollout.prompts * p.rollout.samples


def trainer_gpus(p: PlanInputs) -> int:
    return p.trainer.gpus or p.trainer.dp


def mean_bounds(p: PlanInputs) -> list[tuple[str, float]]:
    """The most generated tokens per response each measured phase allows, as (what, tokens): a phase
    measured at t s on g GPUs did at most t x g x peak FLOPs (``M.tokens_at_peak``), at the plan's own
    FLOPs per token (decode and reference forward 2 x P_active, train 6 x P_active: forward + backward
    without recompute, the fewest a train step does). The trainer's phases process every sequence's
    prompt and response, so their bound less ``rollout.prompt_tokens`` is the response's; the rollout
    round's counts generated tokens only (a prompt's prefill may be shared by its samples)."""
    ph, tr, ro = p.phases, p.trainer, p.rollout
    seqs, fpt = sequences(p), 2 * active_params(p)
    tg, rg = ph.gpus or trainer_gpus(p), ph.gpus or ro.gpus
    # Positions the trainer computes (train_tokens): the prompt per sample or once per group; a train step
    # computes the share of samples it does not skip (so its FLOPs per sequence are k x fpt x that share).
    prompt = ro.prompt_tokens * (ro.prompts / seqs if tr.prefix_shared else 1.0)
    kept = 1.0 - tr.zero_advantage_share
    measured = [("phases.rollout_s", ph.rollout_s, 1, rg, ro.peak_flops or tr.peak_flops, 0.0),
                ("phases.reference_s", ph.reference_s if ph.use_reference else None, 1, tg, tr.peak_flops, prompt),
                ("phases.train_s", ph.train_s, 3 * kept, tg, tr.peak_flops, prompt)]
    measured += [(f"phases.train_s_measured[{g}]", t, 3 * kept, g, tr.peak_flops, prompt)
                 for g, t in sorted(ph.train_s_measured.items())]
    return [(f"{what} = {t:g} s on {g} GPUs at {peak:.3g} FLOP/s", M.tokens_at_peak(t, g, peak, k * fpt) / seqs - prompt)
            for what, t, k, g, peak, prompt in measured if t]


def bounded_mean(p: PlanInputs) -> tuple[PlanInputs, str | None]:
    """``p`` with ``rollout.avg_tokens`` no larger than the tightest of ``mean_bounds``, and the finding
    that says so (None when the stated mean fits every measured phase). A stated mean above a bound
    cannot have run in the measured time at the GPUs' peak, so the plan prices the bound: the longest
    mean the measurements allow. Raises PlanError when a bound leaves no room for one response token."""
    bounds = mean_bounds(p)
    if not bounds:
        return p, None
    what, cap = min(bounds, key=lambda b: b[1])
    ro = p.rollout
    if cap >= ro.avg_tokens:
        return p, None
    if cap < 1:
        raise PlanError(f"{what} leaves {cap:.3g} generated tokens per response for "
                        f"{sequences(p)} sequences of {ro.prompt_tokens:g} prompt tokens: no GPU runs above its peak; "
                        f"fix: check that phase time, phases.gpus, trainer.peak_flops and the batch "
                        f"(rollout.prompts, rollout.samples, rollout.prompt_tokens)")
    note = (f"rollout.avg_tokens = {ro.avg_tokens:g} is more than the measured phases allow: {what} "
            f"holds at most {cap:.0f} generated tokens per response ({sequences(p)} sequences of "
            f"{ro.prompt_tokens:g} prompt tokens at {2 * active_params(p):.3g} FLOP per token forward); the plan "
            f"prices {cap:.0f} (state a mean the measurements allow, or a run's lengths with --lengths-from)")
    return p.model_copy(update={"rollout": ro.model_copy(update={"avg_tokens": cap})}), note


def longest(p: PlanInputs, lengths: list[int] | None = None) -> float:
    """Expected longest response of one step (the synchronous barrier)."""
    return M.expected_longest(sequences(p), mean=p.rollout.avg_tokens, sigma=p.tail.sigma,
                              cap=p.tail.max_tokens, lengths=lengths)


def step_overhead(p: PlanInputs) -> float:
    """The engine's work per decode step: the plan's figure, else the backend's published one on a GPU
    (``inputs.STEP_OVERHEAD_S``), 0 on a CPU; plus a replica wider than a node's all-reduces
    (``cross_node_tp_s``)."""
    ro = p.rollout
    if ro.step_overhead_s is not None:
        return ro.step_overhead_s + cross_node_tp_s(p)
    return (STEP_OVERHEAD_S[ro.backend] if ro.device == "gpu" else 0.0) + cross_node_tp_s(p)


def cross_node_tp_s(p: PlanInputs) -> float:
    """What a decode step of a replica that spans nodes pays for its tensor parallelism across the node boundary:
    two all-reduces per layer (``mechanisms.cross_node_tp_step_s``); 0 within a node, on a CPU, or when
    ``policy.layers`` is not given."""
    ro, layers = p.rollout, p.policy.layers
    if ro.device != "gpu" or ro.tp <= p.cluster.gpus_per_node or not layers:
        return 0.0
    alpha = p.network.cross_node_allreduce_s
    return M.cross_node_tp_step_s(layers, CROSS_NODE_ALLREDUCE_S if alpha is None else alpha)


ASYNC_ROLLOUT = "rollout (async only, instead of the synchronous round)"


def rollout_terms(p: PlanInputs, gpus: int, lengths: list[int] | None = None,
                  continuous: bool = False) -> dict[str, float]:
    """The estimated rollout on ``gpus`` GPUs term by term (``M.Decode.round_terms``): the synchronous round, keys
    ``"rollout: ..."``, or with ``continuous`` the async schedule (``ASYNC_ROLLOUT``: slots capped by
    ``in_flight_bound``); the engine's work per decode step is split into its own and a replica wider than a node's
    all-reduces (``cross_node_tp_s``). They add up to ``rollout_s(p, gpus, continuous=...)`` when no round is
    measured."""
    head = ASYNC_ROLLOUT if continuous else "rollout"
    if p.rollout.bytes_per_decoded_token is not None:
        return {f"{head}: decoded tokens x rollout.bytes_per_decoded_token over HBM":
                _modelled_rollout(p, gpus, "round", lengths)}
    d, steps = _scheduled(p, decode_on(p, gpus, lengths), "continuous" if continuous else "round")
    out = {f"{head}: {k}": v for k, v in d.round_terms(steps).items()}
    tp = cross_node_tp_s(p) * steps
    out[f"{head}: engine work per decode step"] -= tp
    out[f"{head}: cross-node TP all-reduces (2 per layer per decode step)"] = tp
    return out


def decode_on(p: PlanInputs, gpus: int, lengths: list[int] | None = None) -> M.Decode:
    ro = p.rollout
    # Measured lengths may hold empty responses; a decode of zero mean tokens has nothing to price.
    mean = max(sum(lengths) / len(lengths), 1.0) if lengths else ro.avg_tokens
    return M.replica_decode(sequences_total=sequences(p), gpus=gpus, tp=ro.tp, mean_len=mean,
                            longest=longest(p, lengths), concurrency=ro.concurrency, weight_bytes=weight_bytes(p),
                            kv_bytes_per_token=ro.kv_bytes_per_token, prompt_tokens=ro.prompt_tokens,
                            mem_bw=ro.mem_bandwidth, flops_per_token=2 * active_params(p),
                            peak_flops=ro.peak_flops or p.trainer.peak_flops, step_overhead_s=step_overhead(p))


SCHEDULES = {"round": M.round_steps, "continuous": M.continuous_steps, "balanced": M.balanced_steps}


def _modelled_rollout(p: PlanInputs, gpus: int, schedule: str, lengths: list[int] | None,
                      overhead_s: float | None = None) -> float:
    """The decode model's seconds on ``gpus`` GPUs; ``overhead_s`` replaces ``rollout.step_overhead_s``."""
    ro = p.rollout
    if ro.bytes_per_decoded_token is not None:  # a stated per-token cost: no schedule to model
        return sequences(p) * ro.avg_tokens * ro.bytes_per_decoded_token / (ro.mem_bandwidth * gpus)
    d = decode_on(p, gpus, lengths)
    if overhead_s is not None:
        d = replace(d, step_overhead_s=overhead_s)
    d, steps = _scheduled(p, d, schedule)
    return d.round_s(steps)


def _scheduled(p: PlanInputs, d: M.Decode, schedule: str) -> tuple[M.Decode, float]:
    """A replica's decode under ``schedule`` and its decode steps: async ("continuous") keeps at most
    ``in_flight_bound`` slots busy and takes at least ``round steps / (staleness + 1)`` steps."""
    if schedule == "continuous":
        d = replace(d, concurrency=in_flight_bound(p, d))
        return d, max(M.continuous_steps(d), M.round_steps(d) / (p.sync.staleness_bound + 1))
    return d, SCHEDULES[schedule](d)


def in_flight_bound(p: PlanInputs, d: M.Decode) -> int:
    """Slots an async replica keeps busy: its KV slots, but no more than the sequences that exist. With a staleness
    bound s, generation runs at most s batches ahead of the trainer, so at most (s + 1) batches are in flight:
    ``min(concurrency, (s + 1) x the replica's sequences per batch)`` (NeMo-RL's max_trajectory_age_steps). By the
    same bound a batch is generated within s + 1 trainer steps, so its longest response's decode steps are spread
    over at most s + 1 step periods: an async round takes at least ``round steps / (s + 1)`` decode steps."""
    return max(1, min(d.concurrency, math.ceil((p.sync.staleness_bound + 1) * d.sequences)))


def measured_step_overhead(p: PlanInputs, lengths: list[int] | None = None) -> float | None:
    """The engine's work per decode step that a measured round implies: what ``phases.rollout_s`` takes
    beyond the decode roofline on its GPUs, over the round's decode steps. None when no round is given,
    when the model has no steps (a stated per-token cost), or when the measurement is faster than the
    roofline (then the stated rates are too low, and the model is scaled to the measurement instead)."""
    ro, given = p.rollout, p.phases.rollout_s
    if given is None or ro.bytes_per_decoded_token is not None:
        return None
    ref = p.phases.gpus or ro.gpus  # the given time is a synchronous round on these GPUs
    d = replace(decode_on(p, ref, lengths), step_overhead_s=0.0)
    roofline, steps = d.round_s(M.round_steps(d)), M.round_steps(d)
    return (given - roofline) / steps if given >= roofline and steps > 0 else None


def rollout_s(p: PlanInputs, gpus: int, *, continuous: bool = False, balanced: bool = False,
              lengths: list[int] | None = None) -> float:
    """Rollout seconds per step on ``gpus`` GPUs: a synchronous round (default), the bubble-free
    floor of continuous batching with partial rollout (``continuous``), or a round of mean-length
    responses (``balanced``). A measured round sets the engine's work per step (``measured_step_overhead``)."""
    schedule = "continuous" if continuous else "balanced" if balanced else "round"
    if p.phases.rollout_s is None:
        return _modelled_rollout(p, gpus, schedule, lengths)
    overhead = measured_step_overhead(p, lengths)
    if overhead is not None:
        return _modelled_rollout(p, gpus, schedule, lengths, overhead)
    model = _modelled_rollout(p, gpus, schedule, lengths)
    ref = p.phases.gpus or p.rollout.gpus
    den = _modelled_rollout(p, ref, "round", lengths)
    return p.phases.rollout_s * model / den if den > 0 else p.phases.rollout_s


def train_tokens(p: PlanInputs, skipping: bool = True) -> float:
    """Positions the trainer computes per step: every sample's response, and each prompt once per group
    (``trainer.prefix_shared``) or once per sample; ``skipping``: less the samples it leaves out
    (``trainer.zero_advantage_share``; a reference forward scores every sample, an old-logprob forward the kept ones)."""
    t, ro = p.trainer, p.rollout
    prompts = ro.prompts if t.prefix_shared else sequences(p)
    kept = 1.0 - t.zero_advantage_share if skipping else 1.0
    return kept * (prompts * ro.prompt_tokens + sequences(p) * ro.avg_tokens)


def is_moe(p: PlanInputs) -> bool:
    """A mixture of experts: fewer parameters active per token than held."""
    return p.policy.active_params is not None and p.policy.active_params < p.policy.params


def mfu(p: PlanInputs) -> float:
    """The trainer's model FLOPs utilization: ``trainer.mfu``, else by architecture (``inputs.DENSE_TRAINER_MFU``,
    ``inputs.MOE_TRAINER_MFU``)."""
    t = p.trainer.mfu
    return t if t is not None else MOE_TRAINER_MFU if is_moe(p) else DENSE_TRAINER_MFU


def trainer_flops(p: PlanInputs) -> float:
    """Sustained training FLOP/s per GPU: the stated ``trainer.flops_per_gpu``, else peak x MFU."""
    t = p.trainer
    return t.flops_per_gpu if t.flops_per_gpu is not None else t.peak_flops * mfu(p)


def old_logprob_forward(p: PlanInputs) -> bool:
    """The trainer runs a previous-policy logprob forward: ``trainer.old_logprob_forward``, else when a generation
    batch takes more than one optimizer step (epochs x optimizer mini-batches > 1)."""
    t = p.trainer
    return t.old_logprob_forward if t.old_logprob_forward is not None else t.epochs * t.optimizer_minibatches > 1


def bubble(p: PlanInputs, gpus: int) -> float:
    """The pipeline bubble factor of a pass on ``gpus`` trainer GPUs (``mechanisms.pipeline_bubble``): data-parallel
    ranks ``gpus / (tp x pp)`` share each optimizer step's sequences in micro-batches of
    ``trainer.micro_batch_sequences``; 1 without pipeline stages."""
    t = p.trainer
    if t.pp <= 1:
        return 1.0
    ranks = max(1, gpus // (t.tp * t.pp))
    per_step = sequences(p) / t.optimizer_minibatches
    return M.pipeline_bubble(max(1, math.ceil(per_step / (ranks * t.micro_batch_sequences))), t.pp)


def trainer_terms(p: PlanInputs, gpus: int) -> dict[str, float]:
    """The estimated trainer seconds per step on ``gpus`` GPUs, term by term (each a rule with its source in
    docs/calibration.md); the train phase is the sum of the ``train:`` terms, the reference phase of the
    ``reference:`` terms. A measured phase replaces its terms (``train_s``, ``reference_s``)."""
    t, per = p.trainer, active_params(p) / (trainer_flops(p) * gpus)
    fb = 6 * per * train_tokens(p)
    rc = 2 * per * train_tokens(p) if t.recompute else 0.0
    extra = (t.epochs - 1) * (fb + rc)
    # dispatch + combine per MoE layer in each forward, the same pair in the backward, and again in a recompute
    a2a = t.epochs * (4 + (2 if t.recompute else 0)) * expert_all_to_all_s(p, gpus, train_tokens(p))
    bub = bubble(p, gpus) - 1
    out = {"train: forward + backward (6 x P_active x tokens)": fb, "train: activation recompute (2 x P_active x tokens)": rc,
           "train: extra epochs": extra,
           "train: expert all-to-all (dispatch + combine per MoE layer, forward, backward, recompute)": a2a,
           "train: pipeline bubble": bub * (fb + rc + extra + a2a)}
    # The reference scores every sample; the previous policy only the samples the updates compute (rollyard's
    # trainer/optimize.old_logprobs forwards the samples that move the weights; 0 skipped: every sample, as NeMo-RL)
    ref = 2 * per * train_tokens(p, skipping=False) if p.phases.use_reference else 0.0
    old = 2 * per * train_tokens(p) if old_logprob_forward(p) else 0.0
    ref_a2a = sum(2 * expert_all_to_all_s(p, gpus, train_tokens(p, skipping=k)) for k, on in ((False, ref), (True, old))
                  if on)
    out.update({"reference: reference forward (2 x P_active x tokens)": ref,
                "reference: previous-policy logprob forward": old,
                "reference: expert all-to-all of the logprob forwards (dispatch + combine per MoE layer)": ref_a2a,
                "reference: pipeline bubble": bub * (ref + old + ref_a2a),
                "reference: weights swapped through host memory": reference_swap_s(p, gpus)})
    return out


def expert_all_to_all_s(p: PlanInputs, gpus: int, tokens: float) -> float:
    """One dispatch (or combine) of every MoE layer over a pass of ``tokens`` tokens on ``gpus`` trainer GPUs
    (``mechanisms.expert_all_to_all_s``): a GPU holds the layers of its pipeline stage and the tokens of its
    data-parallel rank split over tp (sequence parallel), ``tokens x pp / gpus``; its expert group is ``trainer.ep``
    neighbouring ranks (Megatron's expert parallelism folded over the data- and tensor-parallel ranks), as many of
    them in its node as fit. 0 for a dense model, without expert parallelism, or when ``policy.experts_per_token``,
    ``hidden`` or ``layers`` is not given."""
    pol, t = p.policy, p.trainer
    layers = pol.moe_layers or pol.layers
    if not (is_moe(p) and pol.experts_per_token and pol.hidden and layers) or t.ep <= 1:
        return 0.0
    local = min(t.ep, p.cluster.gpus_per_node)
    nw = p.network
    return M.expert_all_to_all_s(tokens * t.pp / gpus, pol.hidden, pol.experts_per_token, layers / t.pp, t.ep, local,
                                 nw.ep_nvlink_bw or EP_NVLINK_BW, nw.ep_rdma_bw or EP_RDMA_BW)


TEACHER = "teacher"


def teacher_terms(p: PlanInputs, gpus: int) -> dict[str, float]:
    """The distillation teacher's forward per step on ``gpus`` trainer GPUs, term by term (its own phase,
    ``teacher``): 2 x ``phases.teacher_params`` x tokens FLOPs over every sample (the teacher scores each sampled
    token, skipped or not) at the trainer's sustained FLOP/s; {} without a teacher or when a measured
    ``phases.teacher_s`` replaces the estimate."""
    ph = p.phases
    if ph.teacher_params <= 0 or ph.teacher_s is not None:
        return {}
    return {f"{TEACHER}: forward (2 x P_teacher x tokens)":
            2 * ph.teacher_params * train_tokens(p, skipping=False) / (trainer_flops(p) * gpus)}


def teacher_s(p: PlanInputs, gpus: int) -> float:
    """The distillation teacher's forward over every sample on ``gpus`` trainer GPUs (the ``teacher`` phase; where
    it runs, inline or on its pool, is the placement's: ``planner._placed``): a given ``phases.teacher_s``
    (Amdahl's law from ``phases.gpus``), else the sum of ``teacher_terms``; 0 without a teacher."""
    ph = p.phases
    if ph.teacher_s is not None:
        return M.amdahl_s(ph.teacher_s, ph.gpus or trainer_gpus(p), gpus, p.trainer.serial_fraction)
    return sum(teacher_terms(p, gpus).values())


TEACHER_SAMPLE = "teacher_sample"


def teacher_decode_on(p: PlanInputs, gpus: int) -> M.Decode | None:
    """What one replica of the teacher decodes per step (GKD's seq_kd: ``phases.teacher_sample_share``), on ``gpus``
    trainer GPUs: the rollout's decode model (``M.replica_decode``) with the teacher's weights. The share's sequences
    (``share x prompts x samples``) over replicas of ``trainer.tp`` GPUs (the trainer's tensor-parallel group), each
    holding the whole teacher at ``policy.bytes_per_param``; a completion of ``phases.teacher_sample_tokens``
    (else ``rollout.avg_tokens``) mean, its longest from the tail's lognormal (``tail.sigma``, cut at
    ``tail.max_tokens``); the policy's KV bytes per token (same tokenizer, the plan has no teacher layout); the
    rollout's slots (``rollout.concurrency``: the sampler runs with ``rollout.max_concurrent``) and decode rates
    (``rollout.mem_bandwidth``, ``rollout.peak_flops``); the engine's work per step: rollyard's native engine's
    (``rollout.step_overhead_s`` when the rollout is native, else ``STEP_OVERHEAD_S["native"]`` on a GPU, 0 on a
    CPU). None when the teacher samples nothing."""
    ph, ro = p.phases, p.rollout
    n = ph.teacher_sample_share * sequences(p)
    if n <= 0 or ph.teacher_params <= 0:
        return None
    mean = ph.teacher_sample_tokens or ro.avg_tokens
    longest_t = M.expected_longest(math.ceil(n), mean=mean, sigma=p.tail.sigma, cap=p.tail.max_tokens)
    overhead = (ro.step_overhead_s if ro.backend == "native" and ro.step_overhead_s is not None else
                STEP_OVERHEAD_S["native"] if ro.device == "gpu" else 0.0)
    tp = min(p.trainer.tp, gpus)
    return M.replica_decode(sequences_total=n, gpus=gpus, tp=tp, mean_len=mean, longest=longest_t,
                            concurrency=ro.concurrency, weight_bytes=ph.teacher_params * p.policy.bytes_per_param,
                            kv_bytes_per_token=ro.kv_bytes_per_token, prompt_tokens=ro.prompt_tokens,
                            mem_bw=ro.mem_bandwidth, flops_per_token=2 * ph.teacher_params,
                            peak_flops=ro.peak_flops or p.trainer.peak_flops, step_overhead_s=overhead)


def teacher_sample_terms(p: PlanInputs, gpus: int) -> dict[str, float]:
    """The teacher's decoding per step on ``gpus`` trainer GPUs, term by term (``teacher_decode_on``, a synchronous
    round: ``M.Decode.round_terms``), keys ``"teacher_sample: the teacher's ..."``; {} when it samples nothing or a
    measured ``phases.teacher_sample_s`` replaces the estimate."""
    d = teacher_decode_on(p, gpus)
    if d is None or p.phases.teacher_sample_s is not None:
        return {}
    return {f"{TEACHER_SAMPLE}: the teacher's {k}": v for k, v in d.round_terms(M.round_steps(d)).items()}


def teacher_sample_s(p: PlanInputs, gpus: int) -> float:
    """The teacher's sampling per step on ``gpus`` trainer GPUs (inline: serial with the step, before its scoring):
    a given ``phases.teacher_sample_s`` (Amdahl's law from ``phases.gpus``), else the sum of
    ``teacher_sample_terms``; 0 when the teacher samples nothing."""
    ph = p.phases
    if ph.teacher_sample_share <= 0:
        return 0.0
    if ph.teacher_sample_s is not None:
        return M.amdahl_s(ph.teacher_sample_s, ph.gpus or trainer_gpus(p), gpus, p.trainer.serial_fraction)
    return sum(teacher_sample_terms(p, gpus).values())


def model_shard_params(p: PlanInputs, gpus: int) -> float:
    """Parameters one trainer GPU holds: Megatron's layout when trainer.tp, pp or ep is set (each stage's dense
    weights over tp, its experts over ep (dense FFNs over tp); the FFN/expert share ``mechanisms.bulk_fraction``),
    else all of them (ddp) or 1/gpus (fsdp)."""
    t, n = p.trainer, p.policy.params
    if t.tp * t.pp * t.ep > 1:
        b = M.bulk_fraction(is_moe(p))
        return n / t.pp * ((1 - b) / t.tp + b / (t.ep if is_moe(p) else t.tp))
    return n / gpus if t.sharding == "fsdp" else n


def host_bw(p: PlanInputs) -> float:
    return p.cluster.host_bw or PCIE5_X16_BW


def reference_swap_s(p: PlanInputs, gpus: int) -> float:
    """The reference swapped through host memory for its forward: three copies of a GPU's model shard (policy out,
    reference in, policy back) over the host link; 0 without ``trainer.reference_swap`` or a reference."""
    if not (p.trainer.reference_swap and p.phases.use_reference):
        return 0.0
    return M.host_copies_s(3 * model_shard_params(p, gpus) * p.policy.bytes_per_param, host_bw(p))


def offload_s(p: PlanInputs, gpus: int) -> float:
    """Colocated offload around generation (``trainer.offload``): a GPU's weights and gradients (its model shard)
    and its share of the optimizer state (the rest of ``cluster.train_bytes_per_param``, sharded over every GPU)
    copied to host memory and back each step; 0 when not set."""
    if not p.trainer.offload:
        return 0.0
    bpp = p.policy.bytes_per_param
    grad = p.trainer.grad_bytes_per_param or bpp
    optimizer = max(p.cluster.train_bytes_per_param - bpp - grad, 0.0) * p.policy.params / gpus
    return M.host_copies_s(2 * (model_shard_params(p, gpus) * (bpp + grad) + optimizer), host_bw(p))


def engine_sleep_s(p: PlanInputs) -> float:
    """Colocated, an engine that sleeps while the trainer runs (``rollout.sleep_offload``: vLLM sleep level 1) copies
    its weight shard (all weights over ``rollout.tp``) to host memory and back each step over the host link; 0 when
    not set."""
    if not p.rollout.sleep_offload:
        return 0.0
    return M.host_copies_s(2 * weight_bytes(p) / p.rollout.tp, host_bw(p))


def _flop_seconds(p: PlanInputs, flops_per_token_param: float, given: float | None, gpus: int,
                  skipping: bool = True) -> float:
    if given is not None:  # measured on phases.gpus: Amdahl's law to this pool
        return M.amdahl_s(given, p.phases.gpus or trainer_gpus(p), gpus, p.trainer.serial_fraction)
    return flops_per_token_param * active_params(p) * train_tokens(p, skipping) / (trainer_flops(p) * gpus)


def train_s(p: PlanInputs, gpus: int) -> float:
    """Forward + backward + optimizer on ``gpus`` GPUs (6 x P_active x tokens FLOPs).

    Measured times at several pool sizes (``phases.train_s_measured`` and the given ``train_s``)
    win over scaling: between two measured sizes the time is interpolated linearly, beyond them it
    scales from the nearest end by Amdahl's law (``trainer.serial_fraction``).
    """
    points = dict(p.phases.train_s_measured)
    if p.phases.train_s is not None:
        points.setdefault(p.phases.gpus or trainer_gpus(p), p.phases.train_s)
    if not points:
        return sum(v for k, v in trainer_terms(p, gpus).items() if k.startswith("train:"))
    if len(points) < 2 and gpus not in points:
        return _flop_seconds(p, 6, p.phases.train_s, gpus)
    gs = sorted(points)
    s = p.trainer.serial_fraction
    if gpus <= gs[0]:
        return M.amdahl_s(points[gs[0]], gs[0], gpus, s)
    if gpus >= gs[-1]:
        return M.amdahl_s(points[gs[-1]], gs[-1], gpus, s)
    hi = next(g for g in gs if g >= gpus)
    lo = max(g for g in gs if g <= gpus)
    if hi == lo:
        return points[lo]
    return points[lo] + (points[hi] - points[lo]) * (gpus - lo) / (hi - lo)


def reference_s(p: PlanInputs, gpus: int) -> float:
    """The logprob forwards before training on ``gpus`` GPUs: the reference's (when used) and the previous
    policy's (``old_logprob_forward``), 2 x P_active x tokens FLOPs each, their pipeline bubble and a reference
    swapped through host memory (``trainer_terms``); a given ``phases.reference_s`` is taken as measured."""
    if p.phases.reference_s is not None:
        return _flop_seconds(p, 2, p.phases.reference_s, gpus, skipping=False) if p.phases.use_reference else 0.0
    return sum(v for k, v in trainer_terms(p, gpus).items() if k.startswith("reference:"))


def reward_on_rollout_side(p: PlanInputs) -> float:
    """Reward seconds the rollout side waits for: 0 when scoring streams under decode."""
    return 0.0 if p.phases.reward_streamed else p.phases.reward_s


def split_table(p: PlanInputs, sync_per_step_s: float, reload_s: float,
                lengths: list[int] | None = None) -> dict[str, dict]:
    """placement -> {"best": PoolSplit, "all": [PoolSplit...]} on G = p.total_gpus() accelerators."""
    G = p.total_gpus()
    reward = reward_on_rollout_side(p)
    stream = p.trainer.minibatches if p.phases.train_streamed else 0
    algo = p.phases.algorithm_s  # advantages / loss bookkeeping: on the trainer side, as in the simulator
    ro = rollout_s(p, G, lengths=lengths) + reward
    tr = reference_s(p, G) + teacher_s(p, G) + teacher_sample_s(p, G) + train_s(p, G) + algo
    tr_colo = tr + offload_s(p, G)  # colocated: the trainer's state leaves the GPUs for generation and comes back
    ro_colo = ro + engine_sleep_s(p)  # and the engine's weights leave them for training
    colo = M.PoolSplit("colocated", G, G, ro_colo, tr_colo, reload_s, M.colocated_step_s(ro_colo, 0.0, tr_colo, reload_s))
    out = {"colocated": {"best": colo, "all": [colo]}}
    tp = p.rollout.tp
    for placement in ("disaggregated", "async"):

        def price(replicas: int, placement=placement) -> M.PoolSplit:
            gr, gt = replicas * tp, G - replicas * tp
            if placement == "async":
                ro = rollout_s(p, gr, continuous=True, lengths=lengths) + reward
                tr = ((0.0 if p.phases.async_rollout_logprobs else reference_s(p, gt)) + teacher_s(p, gt)
                      + teacher_sample_s(p, gt) + train_s(p, gt) + algo)
                step = M.async_step_s(ro, tr, sync_per_step_s, p.sync.staleness_bound, stream)
            else:
                ro = rollout_s(p, gr, lengths=lengths) + reward
                tr = reference_s(p, gt) + teacher_s(p, gt) + teacher_sample_s(p, gt) + train_s(p, gt) + algo
                step = M.disaggregated_step_s(ro, tr, sync_per_step_s, p.sync.staleness_bound, stream)
            return M.PoolSplit(placement, gr, gt, ro, tr, sync_per_step_s, step)

        rows = search_splits(price, (G - 1) // tp, p.rollout.gpus // tp)
        best = min(rows, key=lambda r: r.step_s) if rows else None
        out[placement] = {"best": best, "all": rows}
    return out


def search_splits(price, replicas: int, configured: int) -> list[M.PoolSplit]:
    """The splits priced for a pool of up to ``replicas`` rollout replicas (the trainer keeps the rest):
    every one when there are at most ``M.SPLIT_POINTS``, else an even grid refined around its best
    split, pass after pass, until the neighbours of the best are adjacent (exact when the step time
    falls then rises with the rollout pool's size, as max(rollout, trainer) does), plus the
    configured split. At most ~``SPLIT_POINTS`` x log(replicas) / log(SPLIT_POINTS / 2) prices."""
    if replicas < 1:
        return []
    rows: dict[int, M.PoolSplit] = {}
    lo, hi = 1, replicas
    while True:
        ks = M.grid(lo, hi)
        for k in ks:
            if k not in rows:
                rows[k] = price(k)
        i = min(range(len(ks)), key=lambda j: rows[ks[j]].step_s)
        if len(ks) == hi - lo + 1:
            break
        lo, hi = ks[max(i - 1, 0)], ks[min(i + 1, len(ks) - 1)]
    if 1 <= configured <= replicas and configured not in rows:
        rows[configured] = price(configured)
    return [rows[k] for k in sorted(rows)]
