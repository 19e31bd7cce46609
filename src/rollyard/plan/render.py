"""What `rollyard plan` prints: the runbook's lines, then one rich table per step of the review."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rollyard.plan import bytes as B
from rollyard.plan.inputs import FLOOR_MECHANISMS
from rollyard.plan.phases import term_parts
from rollyard.plan.planner import Plan
from rollyard.plan.simulate import timeline_text


def console() -> Console:
    """A console that does not wrap the runbook's lines or squeeze tables when piped."""
    c = Console(highlight=False, soft_wrap=False)
    if not c.is_terminal:
        c = Console(highlight=False, width=120)
    return c


def text(c: Console, line: str = "") -> None:
    c.print(line, markup=False, soft_wrap=True)


def print_plan(plan: Plan, c: Console) -> None:
    p, b, d = plan.inputs, plan.bytes, plan.decision
    text(c, f"rollyard plan: {p.name} ({d.placement}, {d.sync_mode} sync)")
    text(c)
    text(c, "Step 2 - bytes per step (runbook calculator):")
    for line in B.runbook_lines(p, b, plan.per_hour):
        text(c, line)
    text(c)

    t = Table(title="Step 1 - actors and edges of one step", title_justify="left")
    for col in ("edge", "from -> to", "payload", "trigger"):
        t.add_column(col)
    t.add_column("bytes/event", justify="right")
    t.add_column("bytes/hour", justify="right")
    t.add_column("note")
    for e in plan.edges:
        t.add_row(e.name, f"{e.source} -> {e.dest}", e.payload, e.trigger, B.fmt_bytes(e.bytes_per_event),
                  B.fmt_bytes(e.bytes_per_hour), e.note)
    c.print(t)

    t = Table(title=f"Step 2 - flows per step and per hour ({B.steps_per_hour_stated(p):g} steps/h, "
                    f"{p.sync.per_hour:g} syncs/h)", title_justify="left")
    for col in ("flow", "per step", "per hour", "vs full sync"):
        t.add_column(col, justify="left" if col == "flow" else "right")
    rows = (("full sync", b.full_sync, "full_sync"), ("delta sync", b.delta_sync, "delta_sync"),
            ("LoRA sync", b.lora_sync, "lora_sync"), ("rollout payload", b.rollout_payload, "rollout_payload"),
            ("gradient all-reduce (per rank)", b.gradient_per_rank, "gradient_per_rank"))
    for name, nbytes, key in rows:
        t.add_row(name, B.fmt_bytes(nbytes), B.fmt_bytes(plan.per_hour[key]), f"{nbytes / b.full_sync:.3g}x")
    c.print(t)

    tiers = p.tiers()
    t = Table(title="Step 5 - one transfer's time on each network tier", title_justify="left")
    t.add_column("flow")
    for name, bw in tiers.items():
        mark = " (sync)" if name == p.network.sync_link else " (trainer)" if name == p.network.trainer_link else ""
        t.add_column(f"{name}{mark}\n{B.fmt_bytes(bw)}/s", justify="right")
    for mode in ("full", "delta", "lora"):
        t.add_row(f"{mode} sync ({B.receiver(p)})", *(B.fmt_seconds(plan.sync_times[mode][n]) for n in tiers))
    t.add_row("gradient all-reduce", *(B.fmt_seconds(b.gradient_per_rank / bw) for bw in tiers.values()))
    c.print(t)

    ph = plan.phases
    t = Table(title="Phase times per step", title_justify="left")
    for col in ("phase", "seconds", "source"):
        t.add_column(col, justify="right" if col == "seconds" else "left")
    for role, secs in ph.seconds().items():
        if role == "teacher_sample" and not p.phases.teacher_sample_share:
            continue  # no seq_kd: the teacher only scores
        if role == "teacher" and not p.phases.teacher_params:
            continue  # no distillation: no teacher
        if role == "sync" and d.placement == "colocated":
            t.add_row(role, "0.00", "colocated: in-process handle (the engine reload is in the rollout's "
                                    f"turn: {B.fmt_seconds(plan.sync_seconds())}, receive path {B.receiver_words(p)})")
        else:
            t.add_row(role, f"{secs:.2f}", ph.source.get(role, ""))
        for term, s in ph.terms.items():  # every term of an estimated phase, with its rule
            of, words = term_parts(term)
            if of == role:
                t.add_row("", f"{s:.2f}", "  " + words)
    c.print(t)

    t = Table(title=f"Steps per hour by placement on the configured pools ({p.rollout.gpus} rollout, "
                    f"{p.trainer.gpus or p.trainer.dp} trainer GPUs; discrete-event simulation to steady state)",
              title_justify="left")
    for col in ("placement", "model", "s/step", "steps/h", "vs colocated", "max staleness", "horizon"):
        t.add_column(col, justify="left" if col in ("placement", "model") else "right")
    model = {"colocated": "R + W + F + T + reload", "disaggregated": "max(R, F + T) + sync", "async": "continuous, sync on a cadence"}
    base = plan.sims["colocated"].steps_per_hour
    for name, res in plan.sims.items():
        mark = " <- chosen" if name == d.placement else ""
        t.add_row(name + mark, model[name], f"{res.period_s:.1f}", f"{res.steps_per_hour:.1f}",
                  f"{res.steps_per_hour / base:.2f}x", str(res.max_staleness), f"{res.horizon_steps} steps")
    c.print(t)
    text(c, f"Cadence: {plan.cadence()}")
    t = Table(title=f"Equal hardware: every placement on the same {p.total_gpus()} GPUs, best split of each",
              title_justify="left")
    for col in ("placement", "rollout:trainer GPUs", "rollout s", "trainer s", escape(f"sync s\n[{B.receiver(p)}]"),
                "s/step", "steps/h", "vs colocated"):
        t.add_column(col, justify="left" if col == "placement" else "right")
    for name, v in plan.equal_hardware().items():
        split = "shared" if name == "colocated" else f"{v['rollout_gpus']}:{v['trainer_gpus']}"
        t.add_row(name + (" (best)" if name != "colocated" else ""), split, f"{v['rollout_s']:.1f}",
                  f"{v['trainer_s']:.1f}", f"{v['sync_s']:.2f}", f"{v['step_s']:.1f}", f"{v['steps_per_hour']:.2f}",
                  f"{v['vs_colocated']:.2f}x")
        m = v.get("configured")
        if m:
            t.add_row(name + " (configured)", f"{m['rollout_gpus']}:{m['trainer_gpus']}", f"{m['rollout_s']:.1f}",
                      f"{m['trainer_s']:.1f}", f"{m['sync_s']:.2f}", f"{m['step_s']:.1f}",
                      f"{m['steps_per_hour']:.2f}", f"{m['vs_colocated']:.2f}x")
    c.print(t)
    text(c, "  colocated: synchronous rounds (the step waits for its longest response) + trainer + engine reload; "
            "disaggregated: synchronous rounds, pools one step apart; async: continuous batching with partial "
            "rollout (bubble-free), pools decoupled by the staleness bound; sync s: receive path "
            f"{B.receiver_words(p)}")
    if plan.sync_detail:
        for line in sync_lines(plan):
            text(c, line)
    for line in memory_lines(plan):
        text(c, line)
    for f in plan.findings:
        text(c, f"Finding: {f}")
    text(c, "Timelines (digits: step index; r: reference forward; '.': idle):")
    for name, res in plan.sims.items():
        text(c, f" {name}: {res.period_s:.1f} s/step, {res.steps_per_hour:.1f} steps/h")
        for line in timeline_text(res):
            text(c, line)
    text(c)

    text(c, "Decision tree (lesson 19):")
    for s in d.tree:
        text(c, f"  {s.question} {s.answer} - {s.evidence}")
    text(c, f"  -> placement: {d.placement}" + (f" (forced by the plan; the tree says {d.recommended})"
                                                   if d.forced and d.placement != d.recommended else ""))
    text(c, f"  -> sync mode: {d.sync_mode}: {d.sync_why}")
    text(c, f"  -> staleness bound: {d.staleness_bound}")
    text(c, f"  -> rate matching: {plan.rate.text}")
    text(c)

    bw = plan.budget
    t = Table(title="Budget what-if (seed 002's allocator): "
                    + (", ".join(f"{a['name']} " + (f"{a['factor']:.3g}x" if a["factor"] else "off the critical path")
                                 for a in bw.applied) or "no optimizations"),
              title_justify="left")
    for col in ("role", "share", "seconds", "after", "optimizations"):
        t.add_column(col, justify="left" if col in ("role", "optimizations") else "right")
    for role in bw.before:
        names = ", ".join(a["name"] for a in bw.applied if a["role"] == role)
        label = escape(f"{role} [{B.receiver(p)}]") if role == "sync" else role
        t.add_row(label, f"{bw.shares[role]:.1%}", f"{bw.before[role]:.2f}", f"{bw.after[role]:.2f}", names)
    t.add_row("step", "100%", f"{bw.step_s:.2f}", f"{bw.new_step_s:.2f}", f"win {bw.win:.2f}x" if bw.win else "")
    c.print(t)

    if bw.placement_win is not None:
        text(c, f"  on the chosen placement's critical path ({bw.placement}): {bw.placement_step_s:.1f} s -> "
                f"{bw.placement_new_step_s:.1f} s per step, win {bw.placement_win:.2f}x")
    tw = plan.tail
    t = Table(title=f"Tail-batching what-if (seed 003), lengths: {tw.source}", title_justify="left")
    for col in ("strategy", "decode steps/round", "rollout s/step", "idle slots", "rounds"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    t.add_row("plain synchronous rounds", f"{tw.plain_round_tokens:.0f}", f"{tw.plain_rollout_s:.1f}",
              f"{tw.plain_bubble:.0%}", f"{p.tail.steps}")
    t.add_row(f"tail batching (+{p.tail.overprovision:.0%} prompts)", f"{tw.tail_round_tokens:.0f}",
              f"{tw.tail_rollout_s:.1f}", f"{tw.tail_bubble:.0%}", f"{tw.short_rounds} short + {tw.long_rounds} long")
    c.print(t)
    text(c, f"  lengths: mean {tw.mean_length:.0f}, p50 {tw.p50_length:.0f}, p99 {tw.p99_length:.0f}, "
            f"max {tw.max_length:.0f} tokens; tail batching predicts {tw.speedup:.2f}x faster rollout"
            + (f" (bounded by the bubble-free floor {tw.floor_rollout_s:.1f} s)" if tw.bounded else
               f"; bubble-free floor {tw.floor_rollout_s:.1f} s" if tw.floor_rollout_s is not None else "")
            + (f"; the {plan.placement} step {tw.step_speedup:.2f}x faster" if tw.step_speedup else ""))


def sync_lines(plan: Plan) -> list[str]:
    """One weight sync, every term (``mechanisms.sync_time``): what is paid once, each side's terms,
    and how the bucketing rule combines the sides."""
    p, s = plan.inputs, plan.sync_detail
    costs = B.sync_costs(p)
    f = B.fmt_seconds
    where = ("colocated: no wire, handles on the same GPUs" if plan.placement == "colocated"
             else f"{plan.decision.sync_mode} over {p.network.sync_link}")
    rule = (f"pipelined over {s.buckets} bucket(s) of {B.fmt_bytes(p.sync.bucket_bytes)}: slowest side + the "
            f"others' share of one bucket" if s.overlap else "not bucketed: the sides add")
    m = s.mechanism
    floor = "" if s.fixed_s else f" (none: {m} publishes no floor)" if B.receiver(p) not in FLOOR_MECHANISMS else ""
    send_each = (f"{f(costs.send_per_tensor_s)} each, CPU reshard per peer layout" if m == "rdma_pinned"
                 else f"{f(costs.send_per_tensor_s)} each")
    load_what = {"direct_write": f"misc tensors only ({B.misc_tensors(p)[1]})",
                 "rdma_pinned": "none: writes land in registered buffers"}.get(m, "every tensor loaded")
    return [
        f"Sync ({where}; backend {p.rollout.backend} on {p.rollout.device}; {s.tensors:,.0f} tensors; receive path "
        f"{m}: {s.words}): {f(s.total)} = once [fixed {f(s.fixed_s)}{floor} + pause/resume {f(s.pause_s)} + compare "
        f"{f(s.compare_s)}] + moving {f(s.moving_s)} ({rule}; + per-bucket handshakes + round trips)",
        f"  trainer {f(s.trainer_s)} = gather {f(s.gather_s)} + cast/copy {f(s.cast_s)} + per tensor "
        f"{f(s.send_tensor_s)} ({send_each}) + pinned-host staging {f(s.stage_s)} + encode {f(s.encode_s)} "
        f"({p.sync.codec})",
        f"  wire {f(s.wire_s)} ({'bulk shard to shard + misc broadcast whole' if m == 'direct_write' else 'bytes / streams'})",
        f"  engine {f(s.engine_s)} [{m}] = load per tensor {f(s.load_tensor_s)} ({f(costs.load_per_tensor_s)} each, "
        f"{load_what}" + (", whole model reloaded" if costs.reload_whole_model else "")
        + f") + {'reshard pass' if m == 'receiver_reshard' else 'copy'} {f(s.copy_s)} + decode {f(s.decode_s)}",
        f"  per bucket {f(s.bucket_s)} ({f(costs.per_bucket_s)} each, serial: every side waits); round trips "
        f"{f(s.round_trip_s)} ({f(p.sync.round_trip_s)} per payload)",
        f"  defaults: {costs.source}",
    ]


def memory_lines(plan) -> list[str]:
    """Memory per GPU of each pool, term by term, and whether it fits (before a run)."""
    m, p = plan.memory, plan.inputs
    if m is None:
        return []
    cap = m.gpu_memory

    def fits(x: float) -> str:
        return "fits" if x <= cap else "DOES NOT FIT"
    from rollyard.plan.planner import shape_given

    act = (f"{B.fmt_bytes(m.activations_per_gpu)} ({p.trainer.micro_batch_tokens} tokens per micro-batch; checkpointing "
           f"on {B.fmt_bytes(m.activations_ckpt_per_gpu)}, off {B.fmt_bytes(m.activations_full_per_gpu)})"
           if shape_given(p) else "not priced (give policy.layers, policy.hidden, policy.vocab)")
    return [f"Memory per GPU ({B.fmt_bytes(cap)} each): trainer model {B.fmt_bytes(m.trainer_model_per_gpu)} + optimizer "
            f"{B.fmt_bytes(m.trainer_optimizer_per_gpu)} + reference {B.fmt_bytes(m.reference_per_gpu)} + activations "
            f"{act} = {B.fmt_bytes(m.trainer_total_per_gpu)}: {fits(m.trainer_total_per_gpu)}"
            + ("" if shape_given(p) else " before activations"),
            f"  rollout weights {B.fmt_bytes(m.rollout_weights_per_gpu)} + KV cache {B.fmt_bytes(m.kv_per_gpu)} = "
            f"{B.fmt_bytes(m.rollout_per_gpu)}: {fits(m.rollout_per_gpu)}"]
