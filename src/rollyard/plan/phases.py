"""Phase times of one step on the configured pools: given in the plan, or estimated (seed 002).

- rollout: a synchronous round on ``rollout.gpus`` from the decode model (``mechanisms``): the
  weight read is paid once per decode step for as many steps as the longest response, the KV
  read once per decoded token, against 2 x P_active FLOPs per token (the slower bound holds), plus the
  engine's work per step; a given ``phases.rollout_s`` is taken as measured (rescaled only
  when ``phases.gpus`` says it was measured on another GPU count: ``hardware.rollout_s``).
- train: 6 x P_active x tokens FLOPs (forward 2, backward 4) / (sustained FLOP/s x trainer GPUs); a
  given time measured on other GPUs scales by Amdahl's law (``trainer.serial_fraction``).
- reference: forward only, 2 x P_active x tokens on the trainer GPUs (a given one scales like train).
- teacher (on-policy distillation): the teacher's forward, 2 x P_teacher x tokens on the trainer GPUs
  (``hardware.teacher_terms``; a given ``phases.teacher_s`` scales like train); on a teacher pool in a split
  placement it is off the trainer's path (``planner._placed``), as the reference's pool is.
- teacher_sample (GKD's seq_kd): the teacher generating ``phases.teacher_sample_share`` of the sequences, the
  rollout's decode model with the teacher's weights on the trainer GPUs (``hardware.teacher_sample_terms``).
- sync: the chosen mode's sync time (``mechanisms.sync_time``) per step; colocated: the reload of
  the weights into the engine's buffers at HBM bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rollyard.plan import hardware as H
from rollyard.plan import mechanisms as M
from rollyard.plan.bytes import StepBytes, receiver_words
from rollyard.plan.inputs import PlanInputs


@dataclass(frozen=True)
class Phases:
    """Seconds per step of each role (rundir.ROLES) and where each figure came from."""

    rollout: float
    reward: float
    reference: float
    teacher_sample: float  # GKD's seq_kd: the teacher generating the off-policy share's completions (inline)
    teacher: float  # on-policy distillation: the teacher's forward scoring every sampled token
    algorithm: float
    train: float
    sync: float  # per step: one sync / every_steps (colocated: the engine reload)
    source: dict[str, str] = field(default_factory=dict, compare=False)
    # "phase: term" -> seconds: what each estimated phase holds, term by term (hardware.trainer_terms and the
    # rollout's per-step terms), so a reader sees which term dominates; a measured phase has none
    terms: dict[str, float] = field(default_factory=dict, compare=False)

    def seconds(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if k not in ("source", "terms")}


def term_parts(key: str) -> tuple[str, str]:
    """A ``Phases.terms`` key -> (the phase it belongs to, the term in words with its qualifier):
    ``"train (colocated only, ...): offload"`` -> ``("train", "(colocated only, ...) offload")``."""
    head, _, words = key.partition(": ")
    role, _, qualifier = head.partition(" ")
    return role, f"{qualifier} {words}" if qualifier else words


def bytes_per_decoded_token(p: PlanInputs) -> float:
    """Mean HBM bytes per decoded token at a full batch (kept for callers of the v1 API)."""
    ro = p.rollout
    if ro.bytes_per_decoded_token is not None:
        return ro.bytes_per_decoded_token
    weights = p.policy.params * p.policy.bytes_per_param / ro.concurrency
    return weights + ro.kv_bytes_per_token * (ro.prompt_tokens + ro.avg_tokens / 2)


trainer_gpus = H.trainer_gpus
train_tokens = H.train_tokens


def estimate(p: PlanInputs, b: StepBytes, sync_seconds: float, lengths: list[int] | None = None,
             sync_detail: M.SyncTime | None = None, placement: str | None = None) -> Phases:
    """Phase budget on the configured pools; ``sync_seconds`` is one sync (or the colocated reload), ``sync_detail``
    its terms (``mechanisms.SyncTime``; None: the sync phase lists none); ``placement`` "async" also lists the
    rollout the async placement prices (continuous, in-flight slots capped by the staleness bound)."""
    ph = p.phases
    gt = trainer_gpus(p)
    src: dict[str, str] = {}
    rollout = H.rollout_s(p, p.rollout.gpus, lengths=lengths)
    if ph.rollout_s is not None:
        o = H.measured_step_overhead(p, lengths)
        how = (f"the decode model with the {o * 1e3:.3g} ms per decode step the measured round takes beyond the "
               f"roofline" if o is not None else "the decode model's ratio")
        src["rollout"] = "given" + (f" on {ph.gpus} GPUs, scaled to {p.rollout.gpus} by {how}"
                                    if ph.gpus and ph.gpus != p.rollout.gpus else "")
    elif p.rollout.bytes_per_decoded_token is not None:
        src["rollout"] = (f"estimated: {b.rollout_tokens:.3g} tokens x {p.rollout.bytes_per_decoded_token:.3g} "
                          f"B/token / ({p.rollout.mem_bandwidth:.3g} B/s x {p.rollout.gpus} GPUs)")
    else:
        d = H.decode_on(p, p.rollout.gpus, lengths)
        tp_s = H.cross_node_tp_s(p)
        src["rollout"] = (f"estimated: synchronous round of {d.sequences:g} sequences per replica, longest "
                          f"{d.longest:.0f} tokens x {d.weight_step_s * 1e3:.3g} ms weight read per decode step "
                          f"+ KV {d.kv_s:.3g} s, against FLOPs {d.compute_s:.3g} s, + engine "
                          f"{(d.step_overhead_s - tp_s) * 1e3:.3g} ms per step"
                          + (f" + {tp_s * 1e3:.3g} ms of cross-node all-reduces per step" if tp_s else "")
                          + f" (bubble {H.M.bubble_fraction(d):.0%})")
    train = H.train_s(p, gt)
    measured_train = ph.train_s is not None or bool(ph.train_s_measured)
    t = p.trainer
    passes = "".join([" + recompute (2 x)" if t.recompute else "", f", x {t.epochs} epochs" if t.epochs > 1 else "",
                      f", x {H.bubble(p, gt):.3g} pipeline bubble (pp {t.pp})" if t.pp > 1 else "",
                      f" + expert all-to-all (EP{t.ep})" if H.expert_all_to_all_s(p, gt, train_tokens(p)) else ""])
    src["train"] = ("given" if ph.train_s is not None and not ph.gpus else
                    f"given on {ph.gpus} GPUs, to {gt} by Amdahl's law (serial fraction "
                    f"{p.trainer.serial_fraction:g})" if ph.train_s is not None else
                    "measured sizes (phases.train_s_measured)" if measured_train else
                    f"estimated: 6 x {H.active_params(p):.3g} x {train_tokens(p):.3g} tokens / "
                    f"({H.trainer_flops(p):.3g} FLOP/s = MFU {H.mfu(p):.3g} {'MoE' if H.is_moe(p) else 'dense'} x "
                    f"{gt} GPUs){passes}")
    reference = H.reference_s(p, gt)
    forwards = [w for w, on in (("reference", ph.use_reference), ("previous-policy", H.old_logprob_forward(p))) if on]
    src["reference"] = ("given" if ph.reference_s is not None and ph.use_reference else
                        "no policy or reference logprob forward" if not forwards else
                        f"estimated: {' + '.join(forwards)} forward, 2 x P_active x tokens each, on the trainer GPUs"
                        + (" + the reference swapped through host memory" if H.reference_swap_s(p, gt) else ""))
    teacher = H.teacher_s(p, gt)
    src["teacher"] = ("no teacher (phases.teacher_params = 0)" if ph.teacher_params <= 0 else
                      ("given" + (f" on {ph.gpus} GPUs, to {gt} by Amdahl's law" if ph.gpus and ph.gpus != gt else "")
                       if ph.teacher_s is not None else
                       f"estimated: 2 x {ph.teacher_params:.3g} x {train_tokens(p, skipping=False):.3g} tokens / "
                       f"({H.trainer_flops(p):.3g} FLOP/s x {gt} GPUs)")
                      + (", on its own pool (off the trainer's path in a split placement)"
                         if ph.teacher_placement == "pool" else ", inline on the trainer's critical path"))
    teacher_sample = H.teacher_sample_s(p, gt)
    src["teacher_sample"] = _teacher_sample_words(p, gt)
    terms = {k: v for k, v in H.trainer_terms(p, gt).items()
             if not (k.startswith("train:") and measured_train)
             and not (k.startswith("reference:") and ph.reference_s is not None)}
    terms.update(H.teacher_terms(p, gt))
    terms.update(H.teacher_sample_terms(p, gt))
    if ph.rollout_s is None:
        terms.update(H.rollout_terms(p, p.rollout.gpus, lengths))
        if placement == "async":  # the schedule the async placement prices instead of the round
            terms.update(H.rollout_terms(p, p.rollout.gpus, lengths, continuous=True))
            src["rollout"] += "; " + _async_words(p, lengths)
    if H.offload_s(p, gt):
        terms["train (colocated only, on top of these seconds): optimizer, gradients, weights offloaded and "
              "reloaded"] = H.offload_s(p, gt)
    if H.engine_sleep_s(p):
        terms["rollout (colocated only, on top of these seconds): engine weights offloaded to host memory and back "
              "(sleep level 1, wake)"] = H.engine_sleep_s(p)
    if sync_detail is not None:  # one update's terms, per step
        terms.update({f"sync: {k}": v / p.sync.every_steps for k, v in sync_detail.terms().items()})
    src["reward"] = src["algorithm"] = "given"
    src["sync"] = (f"one sync over {p.network.sync_link} (fixed + gather/wire/load), per {p.sync.every_steps} "
                   f"step(s); " + (f"{_slowest_side(sync_detail)}; " if sync_detail else "")
                   + f"receive path {receiver_words(p)}")
    return Phases(rollout=rollout, reward=ph.reward_s, reference=reference, teacher_sample=teacher_sample,
                  teacher=teacher, algorithm=ph.algorithm_s,
                  train=train, sync=sync_seconds / p.sync.every_steps, source=src,
                  terms={k: v for k, v in terms.items() if v > 0})


def _teacher_sample_words(p: PlanInputs, gt: int) -> str:
    """Where the teacher's sampling figure came from, in words (``hardware.teacher_decode_on``)."""
    ph = p.phases
    if ph.teacher_sample_share <= 0:
        return "the teacher samples nothing (phases.teacher_sample_share = 0)"
    if ph.teacher_sample_s is not None:
        return "given" + (f" on {ph.gpus} GPUs, to {gt} by Amdahl's law" if ph.gpus and ph.gpus != gt else "")
    d = H.teacher_decode_on(p, gt)
    return (f"estimated: the teacher ({ph.teacher_params:.3g} parameters) decodes {ph.teacher_sample_share:g} of the "
            f"{H.sequences(p)} sequences inline on the {gt} trainer GPUs, serial with the step: {d.sequences:g} "
            f"sequences per replica of tp {d.tp}, mean {d.mean_len:g} tokens, longest {d.longest:.0f} x "
            f"{d.weight_step_s * 1e3:.3g} ms weight read per decode step + KV {d.kv_s:.3g} s, against FLOPs "
            f"{d.compute_s:.3g} s, + engine {d.step_overhead_s * 1e3:.3g} ms per step")


def _slowest_side(t: M.SyncTime) -> str:
    """Which side of one update's bucket pipeline is the slowest, in words with each side's seconds."""
    sides = {"trainer": t.trainer_s, "wire": t.wire_s, "engine": t.engine_s}
    slow = max(sides, key=sides.get)
    return f"slowest side: {slow} ({', '.join(f'{k} {v:.3g} s' for k, v in sides.items())}, {t.buckets} buckets)"


def _async_words(p: PlanInputs, lengths: list[int] | None) -> str:
    """The async schedule in words: the slots a replica keeps busy and the decode steps of a batch."""
    d = H.decode_on(p, p.rollout.gpus, lengths)
    s = p.sync.staleness_bound
    slots = H.in_flight_bound(p, d)
    steps = max(d.sequences * d.mean_len / slots, H.M.round_steps(d) / (s + 1))
    return (f"async: min(concurrency {d.concurrency}, (staleness {s} + 1) x {d.sequences:g} sequences) = {slots} "
            f"slots per replica, {steps:.0f} decode steps per batch")
