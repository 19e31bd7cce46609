"""The lesson's decision tree (lesson 19) and the runbook's design choices, applied to the inputs.

1. Model fits on one node, low-effort prototype (or <= 7B)?        -> colocated
2. Training needs more than one node, rollout fits on a subset?   -> disaggregated
3. Scaling, and rollout dominates wall time (and lag is allowed)? -> async
4. Test-time inference only?                                      -> no trainer (not this tool)

Step 3 refines step 2, so the tree is read 1, 3, 2. Sync mode (runbook step 2): LoRA training
syncs the adapter; otherwise a full sync is kept while it costs at most SYNC_SHARE_LIMIT of the
step on the sync link, and delta beyond that.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from rollyard.plan.bytes import StepBytes, fmt_bytes, receiver, training_state_bytes
from rollyard.plan.inputs import PlanInputs
from rollyard.plan.phases import Phases, trainer_gpus

SMALL_MODEL_PARAMS = 7e9  # lesson 19: colocated is right for <= 7B, prototypes, single node
ROLLOUT_DOMINATES = 2 / 3  # rollout share of R + T above which the tree's step 3 applies
SYNC_SHARE_LIMIT = 0.05  # a sync above 5% of the step is worth shrinking (seed 002: sync is low single-digit %)


@dataclass
class TreeStep:
    question: str
    answer: str  # yes | no | n/a
    evidence: str


@dataclass
class Decision:
    placement: str
    recommended: str  # what the tree says (placement differs when the plan forces one)
    forced: bool
    tree: list[TreeStep]
    sync_mode: str
    sync_why: str
    staleness_bound: int
    enforcement: str
    overlaps: list[tuple[str, str, str]] = field(default_factory=list)  # (phase, phase, why it must overlap)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["overlaps"] = [{"a": a, "b": b, "why": w} for a, b, w in self.overlaps]
        return d


def decide_placement(p: PlanInputs, ph: Phases, equal: dict | None = None) -> tuple[str, list[TreeStep]]:
    """The tree, each answer from evidence: training-state memory against one node, the rollout
    side's share of the step (reward included unless streamed), and, when no branch says yes, the
    faster of colocated and disaggregated on the same G accelerators."""
    node = p.cluster.gpus_per_node * p.cluster.gpu_memory
    need = training_state_bytes(p)
    fits = need <= node
    small = p.policy.params <= SMALL_MODEL_PARAMS
    reward = 0.0 if p.phases.reward_streamed else ph.reward
    rollout_side = ph.rollout + reward
    rt = rollout_side + ph.train + ph.reference + ph.teacher + ph.teacher_sample
    share = rollout_side / rt if rt > 0 else 0.0
    steps = []
    q1 = fits and (p.cluster.prototype or small)
    steps.append(TreeStep(
        "1. Model fits on one node, low-effort prototype?", "yes" if q1 else "no",
        f"training state {p.cluster.train_bytes_per_param:g} B/param x {p.policy.params:.3g} = {fmt_bytes(need)} "
        f"{'fits' if fits else 'does not fit'} one node ({p.cluster.gpus_per_node} x {fmt_bytes(p.cluster.gpu_memory)} "
        f"= {fmt_bytes(node)}); {'a prototype' if p.cluster.prototype else 'not a prototype'}, "
        f"{'<=' if small else '>'} 7B"))
    q3 = (not q1) and share >= ROLLOUT_DOMINATES and p.sync.staleness_bound >= 1
    steps.append(TreeStep(
        "3. Scaling, and rollout dominates wall time?", "n/a" if q1 else ("yes" if q3 else "no"),
        f"rollout{' + reward' if reward else ''} is {share:.0%} of the step's work ({rollout_side:.1f} s of "
        f"{rt:.1f} s; threshold {ROLLOUT_DOMINATES:.0%}); staleness bound {p.sync.staleness_bound} "
        f"({'allows' if p.sync.staleness_bound >= 1 else 'forbids'} off-policy samples)"))
    multi_node = not fits
    q2 = not q1 and not q3 and multi_node
    steps.append(TreeStep(
        "2. Training needs more than one node, rollout fits on a subset?", "n/a" if (q1 or q3) else ("yes" if q2 else "no"),
        f"training state {fmt_bytes(need)} {'exceeds' if multi_node else 'fits in'} one node's {fmt_bytes(node)}; "
        f"trainer pool {trainer_gpus(p)} GPUs, rollout pool {p.rollout.gpus} GPUs"))
    steps.append(TreeStep("4. Test-time inference only?", "no", "a trainer is configured"))
    if q1:
        return "colocated", steps
    if q3:
        return "async", steps
    if q2 or not equal:
        return "disaggregated", steps
    # No branch says yes: price every placement the staleness bound allows on the same G
    # accelerators and take the fastest.
    allowed = ["colocated", "disaggregated"] + (["async"] if p.sync.staleness_bound >= 1 else [])
    priced = {k: equal[k]["best"] for k in allowed if equal.get(k, {}).get("best") is not None}
    pick = min(priced, key=lambda k: priced[k].step_s)
    steps.append(TreeStep("-> no branch applies: equal hardware decides", pick,
                          f"on {p.total_gpus()} GPUs: " + ", ".join(
                              f"{k} {v.step_s:.1f} s/step" + ("" if k == "colocated" else
                                                              f" at {v.rollout_gpus}:{v.trainer_gpus}")
                              for k, v in priced.items())))
    return pick, steps


def decide_sync(p: PlanInputs, b: StepBytes, ph: Phases, placement: str) -> tuple[str, str]:
    if placement == "colocated":
        mode, why = decide_sync(p, b, ph, "disaggregated")
        return mode, ("colocated: the rollout engine reads the trainer's weights through a CUDA-IPC handle, so no "
                      f"weight bytes cross the wire; were the pools split, the mode would be {mode}: {why}")
    from rollyard.plan.bytes import sync_breakdown

    step = max(ph.rollout + ph.reward, ph.reference + ph.teacher + ph.teacher_sample + ph.train) or 1.0
    full_s = sync_breakdown(p, b, "full").total
    delta_s = sync_breakdown(p, b, "delta").total
    if p.sync.mode != "auto":
        return p.sync.mode, f"set by the plan (sync.mode = {p.sync.mode})"
    if p.policy.lora:
        return "lora", (f"only the adapter trains: {fmt_bytes(b.lora_sync)} per sync, "
                        f"{b.full_sync / b.lora_sync:.0f}x less than full")
    if full_s <= SYNC_SHARE_LIMIT * step:
        return "full", (f"a full sync takes {full_s:.2f} s over {p.network.sync_link} ({receiver(p)}), "
                        f"{full_s / step:.1%} of a {step:.1f} s step (limit {SYNC_SHARE_LIMIT:.0%}): "
                        f"the simplest mode is cheap enough")
    if delta_s >= full_s:
        return "full", (f"a full sync takes {full_s:.2f} s over {p.network.sync_link} ({receiver(p)}), {full_s / step:.0%} of a "
                        f"{step:.1f} s step, but delta would take {delta_s:.2f} s (export/compare, fixed costs): "
                        f"shrinking the bytes does not shrink the time")
    return "delta", (f"a full sync would take {full_s:.2f} s over {p.network.sync_link} ({receiver(p)}), {full_s / step:.0%} of a "
                     f"{step:.1f} s step (limit {SYNC_SHARE_LIMIT:.0%}); delta moves {fmt_bytes(b.delta_sync)} "
                     f"({b.full_sync / b.delta_sync:.0f}x less) in {delta_s:.2f} s including its export/compare")


def staleness(p: PlanInputs, placement: str) -> tuple[int, str]:
    if placement == "colocated":
        bound = p.sync.every_steps - 1
        return bound, ("on-policy barrier: a step's rollout starts only after the previous step's in-process sync; "
                       "checked where samples are consumed (trainer version - sample version <= "
                       f"{bound}, logged as staleness/max)")
    bound = p.sync.staleness_bound if placement == "async" else min(p.sync.staleness_bound, max(1, p.sync.every_steps))
    return bound, (f"enforced where work is admitted: the rollout scheduler starts a prompt only while "
                   f"trainer version - engine version <= {bound}; checked where it is consumed: the trainer "
                   f"rejects a sample whose oldest token version is older, and logs staleness/max. Every "
                   f"token carries its gen_id; in-flight generations finish on their weights and the loss "
                   f"corrects the logprob gap with truncated importance sampling")


def overlaps(p: PlanInputs, placement: str) -> list[tuple[str, str, str]]:
    out = []
    # With bound 0 nothing may run ahead: each batch waits for the weights of the step before, so
    # the pools take turns by design (unless training streams, below).
    ahead = p.sync.staleness_bound >= 1
    if placement in ("disaggregated", "async") and ahead:
        out.append(("rollout", "train", "the two pools run concurrently: batch k+1 decodes while step k trains"))
    if placement == "async" and ahead:
        out.append(("rollout", "sync", "the weight transfer runs under the rollout tail; the engine swaps at a batch boundary"))
    if placement != "colocated" and p.phases.train_streamed and p.sync.staleness_bound == 0:
        out.append(("rollout", "train", f"on-policy streaming: the trainer accumulates mini-batch 1 of "
                                        f"{p.trainer.minibatches} while the rest decode"))
    if p.phases.reward_streamed:
        out.append(("rollout", "reward", "reward scoring is streamed while decode continues"))
    return out


def decide(p: PlanInputs, b: StepBytes, ph: Phases, equal: dict | None = None) -> Decision:
    recommended, tree = decide_placement(p, ph, equal)
    placement = recommended if p.placement == "auto" else p.placement
    mode, why = decide_sync(p, b, ph, placement)
    bound, enforcement = staleness(p, placement)
    return Decision(placement, recommended, p.placement != "auto", tree, mode, why, bound, enforcement,
                    overlaps(p, placement))


@dataclass
class RateMatch:
    rollout_gpu_s: float  # GPU-seconds of rollout work per step
    trainer_gpu_s: float
    current: tuple[int, int]  # (rollout GPUs, trainer GPUs)
    balanced: tuple[int, int]  # same total, split so both pools take the same time per step
    balanced_step_s: float
    text: str


def rate_match(p: PlanInputs, ph: Phases, equal: dict | None = None) -> RateMatch:
    """Split the same G GPUs between the pools so that neither waits (seed 000 step 6).

    With ``equal`` (hardware.split_table) the split is the async placement's best one, priced with
    each pool's phase times at its own size; without, the v1 rule (GPU-seconds in proportion).
    """
    gr, gt = p.rollout.gpus, trainer_gpus(p)
    cr = ph.rollout * gr
    ct = (ph.reference + ph.teacher + ph.teacher_sample + ph.train) * gt
    now = max(ph.rollout, ph.reference + ph.teacher + ph.teacher_sample + ph.train)
    slower = "rollout" if ph.rollout >= ph.reference + ph.teacher + ph.teacher_sample + ph.train else "trainer"
    best = (equal or {}).get("async", {}).get("best")
    if best is not None:
        br, bt, step = best.rollout_gpus, best.trainer_gpus, best.step_s
        total = br + bt
        how = (f"At equal hardware the async split that minimizes the step is {br}:{bt} (rollout:trainer): "
               f"rollout {best.rollout_s:.1f} s (bubble-free), trainer {best.trainer_s:.1f} s, sync {best.sync_s:.2f} s ({receiver(p)}) "
               f"-> ~{step:.1f} s per step")
    else:
        total = gr + gt
        br = min(max(round(total * cr / (cr + ct)), 1), total - 1) if (total > 1 and cr + ct) else max(total // 2, 1)
        bt = max(total - br, 1)
        step = max(cr / br, ct / bt)
        how = f"Split the same {total} GPUs {br}:{bt} (rollout:trainer) to balance at ~{step:.1f} s per step"
    text = (f"rollout pool produces a batch in {ph.rollout:.1f} s on {gr} GPUs ({cr:,.4g} GPU-s); the trainer "
            f"consumes one in {ph.reference + ph.teacher + ph.teacher_sample + ph.train:.1f} s on {gt} GPUs ({ct:,.4g} GPU-s): the {slower} pool "
            f"sets the pace ({now:.1f} s). {how}")
    return RateMatch(cr, ct, (gr, gt), (br, bt), step, text)
