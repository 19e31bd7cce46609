"""The runbook's step 6 decision record: one page of markdown, built from a Plan.

Placement and why, the sync mode with the step-2 numbers, the staleness bound and where it is
enforced, the overlaps that must hold, the rate-matching plan, the collectives' fit on the fabric;
`review` appends a Verification section (pass or fail per item, with the evidence).
"""

from __future__ import annotations

from rollyard.plan import tools as plan_tools
from rollyard.plan.bytes import dtype_name, fmt_bytes, fmt_seconds, fmt_tokens, receiver, receiver_words
from rollyard.plan.planner import Plan


def decision_record(plan: Plan, verification: list[dict] | None = None, title_note: str = "") -> str:
    p, b, d = plan.inputs, plan.bytes, plan.decision
    pol, ro = p.policy, p.rollout
    link, tlink = p.network.sync_link, p.network.trainer_link
    tiers = p.tiers()
    sims = plan.sims
    L = [f"# Decision record: {p.name}{title_note}", ""]
    L.append(f"Workload: {pol.params:.3g} parameters ({dtype_name(pol.bytes_per_param)}, {pol.bytes_per_param:g} B), "
             f"{ro.prompts} prompts x {ro.samples} samples x {ro.avg_tokens:g} tokens ({fmt_tokens(b.rollout_tokens)} "
             f"tokens/step), DP {p.trainer.dp}, {p.sync.per_hour:.4g} syncs/h. Fabric: weight sync over {link} "
             f"({fmt_bytes(tiers[link])}/s), trainer collectives over {tlink} ({fmt_bytes(tiers[tlink])}/s).")
    L.append("")
    ph = plan.phases
    L.append(f"## Placement: {d.placement}")
    L.append("")
    if d.forced and d.placement != d.recommended:
        L.append(f"Set by the plan; the decision tree recommends **{d.recommended}**.")
    path = "; ".join(f"{s.question.split('.')[0]}: {s.answer}" for s in d.tree if s.answer != "n/a")
    L.append(f"Decision tree ({path}):")
    for s in d.tree:
        if s.answer != "n/a":
            L.append(f"- {s.question} **{s.answer}** - {s.evidence}")
    L.append("")
    L.append(f"Phases per step: rollout {ph.rollout:.1f} s, reward {ph.reward:.1f} s, reference {ph.reference:.1f} s, "
             + (f"teacher sampling {ph.teacher_sample:.1f} s, " if ph.teacher_sample else "")
             + (f"teacher forward {ph.teacher:.1f} s, " if ph.teacher else "")
             + f"train {ph.train:.1f} s, sync {plan.sync_seconds():.2f} s ({receiver(p)}). Simulated steps/hour: "
             + ", ".join(f"{k} {v.steps_per_hour:.1f} ({v.period_s:.1f} s/step)" for k, v in sims.items())
             + f". Cadence: {plan.cadence()}.")
    L.append("")
    eq = plan.equal_hardware()
    L.append(f"At equal hardware ({p.total_gpus()} GPUs, best split of each): "
             + ", ".join(f"{k} {v['step_s']:.1f} s/step ({v['vs_colocated']:.2f}x colocated"
                         + (f", {v['rollout_gpus']}:{v['trainer_gpus']}" if k != "colocated" else "") + ")"
                         for k, v in eq.items()) + ".")
    L.append("")
    L.append("## Findings")
    L.append("")
    if plan.findings:
        for f in plan.findings:
            L.append(f"- {f}")
    else:
        m = plan.memory
        L.append(f"- memory fits: trainer {fmt_bytes(m.trainer_total_per_gpu)}, rollout {fmt_bytes(m.rollout_per_gpu)} "
                 f"per GPU of {fmt_bytes(m.gpu_memory)}" if m else "- none")
    L.append("")
    L.append(f"## Sync mode: {'in-process (colocated)' if d.placement == 'colocated' else d.sync_mode}")
    L.append("")
    L.append(d.sync_why + ".")
    L.append("")
    L.append(f"| mode | per sync | per hour | on {link} ({receiver(p)}) |")
    L.append("|---|---|---|---|")
    for mode in ("full", "delta", "lora"):
        L.append(f"| {mode} | {fmt_bytes(b.sync(mode))} | {fmt_bytes(plan.per_hour[mode + '_sync'], 1)} | "
                 f"{fmt_seconds(plan.sync_times[mode][link])} |")
    L.append("")
    L.append(f"Receive path of every sync time here: {receiver_words(p)}.")
    L.append("")
    collective = "ring all-reduce" if p.trainer.sharding == "ddp" else "FSDP reduce-scatter + 2 all-gathers"
    L.append(f"Rollout payload {fmt_bytes(b.rollout_payload, 3)}/step; gradient {collective} "
             f"{fmt_bytes(b.gradient_per_rank)}/rank/step at DP={p.trainer.dp}.")
    L.append("")
    L.append(f"## Staleness bound: {d.staleness_bound} step{'s' if d.staleness_bound != 1 else ''}")
    L.append("")
    L.append(d.enforcement + ".")
    L.append("")
    L.append("## Overlaps that must hold")
    L.append("")
    if d.overlaps:
        for a, bb, why in d.overlaps:
            L.append(f"- {a} with {bb}: {why}")
    else:
        L.append("- none: the colocated step serializes rollout, scoring, training and the in-process sync by design")
    L.append("")
    L.append("## Rate matching")
    L.append("")
    L.append(plan.rate.text + ("." if d.placement != "colocated" else
                               " (applies if the pools are split; colocated time-shares one pool)."))
    t = plan.tail
    L.append(f"Tail batching (seed 003) on this length distribution: rollout {t.plain_rollout_s:.1f} s -> "
             f"{t.tail_rollout_s:.1f} s per step ({t.speedup:.2f}x; idle slots {t.plain_bubble:.0%} -> {t.tail_bubble:.0%}).")
    if plan.tools is not None and plan.tools.calls_per_sample:  # tool waits: the round's tail, what async hides
        L.append(plan_tools.note(plan.tools, {k: v.period_s for k, v in plan.sims.items()}, d.placement))
    L.append("")
    L.append("## Collectives and topology fit")
    L.append("")
    grad_s = b.gradient_per_rank / tiers[tlink]
    L.append(f"- trainer: gradient {collective} {fmt_bytes(b.gradient_per_rank)}/rank over {tlink}: "
             f"{fmt_seconds(grad_s)} per step; trainer ranks are gang-scheduled (all {p.trainer.dp} or none)")
    if d.placement == "colocated":
        how = ("CUDA-IPC handle inside the node" if p.rollout.device == "gpu"
               else "the trainer's tensors in the same process")
        L.append(f"- weights: {how}, no bytes between pools; the {p.rollout.backend} engine's reload of its "
                 f"shard costs {fmt_seconds(plan.sync_seconds())} per sync ({receiver(p)}; `rollyard plan` Sync "
                 "lines: its terms)")
    else:
        L.append(f"- weights: {d.sync_mode} sync {fmt_bytes(b.sync(d.sync_mode))} trainer -> rollout over {link}: "
                 f"{fmt_seconds(plan.sync_seconds())} per sync ({receiver(p)}); rollout replicas restart "
                 "individually")
    if verification is not None:
        L.append("")
        L.append("## Verification")
        L.append("")
        L.append("| item | result | evidence |")
        L.append("|---|---|---|")
        for v in verification:
            L.append(f"| {v['item']} | **{v['result']}** | {v['evidence']} |")
    return "\n".join(L) + "\n"
