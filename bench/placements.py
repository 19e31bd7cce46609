"""colocated vs disaggregated vs async on the same work: steps/hour, ratios, accuracy, and the
planner's prediction from each run's measured phase times.

    .venv/bin/python bench/placements.py                          # the demo task, 30 steps each
    .venv/bin/python bench/placements.py --steps 40 --set rollout.max_concurrent=32
    .venv/bin/python bench/placements.py --only async --staleness 2
    .venv/bin/python bench/placements.py --steps 40 --rounds 3     # rotate the order 3 times, medians
    .venv/bin/python bench/placements.py --grid --steps 12         # Ray placements x sync mode x transport
    .venv/bin/python bench/placements.py --grid --config tail.toml --set rollout.scheduler=plain  # countdown
    .venv/bin/python bench/placements.py --actor-speed             # the rollout loop: Ray actor vs in-process

Same work: the demo config (examples/demo.toml: warm-started tiny preset, arithmetic, 32 x 8
samples per step), the same seed and the same number of optimizer steps, hence the same number of
trained samples, in each placement, one after the other in this process (Ray starts with the first
Ray placement). The trainer runs in this process with one intra-op thread; each rollout worker is
a Ray actor with one thread: on 2 cores, rollout and trainer each get one.

Steps/hour: 3600 / mean wall clock between optimizer steps (metrics ``time/step``), leaving out the
first ``--warmup`` steps (actor start-up, first-call overheads).

Prediction: plan/simulate.py's model of each placement, fed that run's own measured mean phase
times per step (rollout: rollout spans, on the workers for Ray; trainer lane: reward + algorithm
+ reference + train, which all run in the driver; sync: the driver's publish plus a worker's
apply). Error % = (measured - predicted) / predicted.

The physical limit of overlap: with rollout R and trainer T per step, colocated runs R + T and
the best two-pool placement max(R, T); their ratio (R + T) / max(R, T) is printed as "limit".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch  # noqa: E402

from rollyard import placement  # noqa: E402
from rollyard.config import load_config  # noqa: E402
from rollyard.plan.simulate import simulate  # noqa: E402
from rollyard.telemetry import rundir  # noqa: E402

PLACEMENTS = ("colocated", "disaggregated", "async")


def phases(run: Path, steps: range) -> dict[str, float]:
    """Mean seconds per step of each lane over ``steps``, from spans.jsonl."""
    tot: dict[str, float] = {}
    count: dict[str, int] = {}
    for s in rundir.read_jsonl(run / rundir.SPANS):
        if s["step"] not in steps:
            continue
        lane = s["role"] if s["role"] in ("rollout", "sync") else "trainer"
        if lane == "sync":
            lane = "sync_worker" if s["worker"] != "driver" else "sync_driver"
        tot[lane] = tot.get(lane, 0.0) + s["end"] - s["start"]
        count[lane] = count.get(lane, 0) + 1
    n = len(steps)
    return {"rollout": tot.get("rollout", 0.0) / n, "trainer": tot.get("trainer", 0.0) / n,
            "sync": tot.get("sync_driver", 0.0) / n + tot.get("sync_worker", 0.0) / max(count.get("sync_worker", 0), 1)}


def predicted_steps_per_hour(where: str, ph: dict[str, float], bound: int, sync_every: int) -> float:
    """The one wrapper over the planner: simulate ``where`` with these phase times."""
    sim = simulate(where, ph["rollout"], ph["trainer"], 0.0 if where == "colocated" else ph["sync"],
                   steps=12, staleness_bound=max(bound, 1) if where != "colocated" else 0, sync_every=sync_every)
    return sim.steps_per_hour


def sync_bytes_vs_plan(run: Path) -> tuple[float, float]:
    """Mean bytes per steady sync as the transport reported them (driver sync spans after the
    first) and the plan's prediction for the same syncs (``predicted_sync_bytes``: a delta's
    carried fraction with the index bytes of its encoding, LoRA's adapter / base ratio, the wire
    framing of the tensors it carries)."""
    from rollyard.plan.bytes import predicted_sync_bytes

    info = json.loads((run / rundir.RUN_INFO).read_text())
    P, bpp, mode = info["policy_params"], info["bytes_per_param"], info["sync_mode"]
    syncs = [s for s in rundir.read_jsonl(run / rundir.SPANS) if s["role"] == "sync" and s["worker"] == "driver"
             and "bytes" in s][1:]
    if not syncs:
        return 0.0, 0.0
    measured, predicted = 0.0, 0.0
    for s in syncs:
        measured += s["bytes"]
        f = s["values"] / P
        index = 4.0 if f < 1 / 32 else (1 / (8 * f) if bpp * (1 - f) > 1 / 8 else 0.0)
        predicted += predicted_sync_bytes(P, bpp, mode, delta_fraction=f, delta_index_bytes=index,
                                          lora_fraction=info["lora_fraction"] or 0.0,
                                          tensors=info.get("lora_tensors" if mode == "lora" else "weight_tensors") or 0)
    return measured / len(syncs), predicted / len(syncs)


def run_one(where: str, args, out: Path, sync: tuple[str, str] | None = None) -> dict:
    grid = [f"sync.mode={sync[0]}", f"sync.transport={sync[1]}"] if sync else []
    if sync and sync[0] == "lora":
        grid = [f"model.lora.r={args.lora_r}", f"sync.transport={sync[1]}"]
    run = out / (where if not sync else f"{where}-{sync[0]}-{sync[1]}")
    overrides = [f"steps={args.steps}", f"placement={where}", f"out_dir={run}", "progress=false",
                 f"sft.cache_dir={args.cache}", f"max_staleness={args.staleness}", *args.set, *grid]
    cfg = load_config(ROOT / "examples" / args.config, overrides)
    t0 = time.time()
    summary = placement.train(cfg, run)
    wall = time.time() - t0
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    timed = rows[args.warmup:]
    step_s = sum(r[rundir.STEP_TIME] for r in timed) / len(timed)
    ph = phases(run, range(args.warmup, args.steps))
    bound = int(json.loads((run / rundir.RUN_INFO).read_text())["staleness_bound"])
    pred = predicted_steps_per_hour(where, ph, bound, cfg.sync.every)
    wire, plan = sync_bytes_vs_plan(run) if where != "colocated" else (0.0, 0.0)
    per_step = {k: sum(r.get(k, 0.0) for r in timed) / len(timed)
                for k in ("tokens/generated", "rollout/engine_s", "rollout/engine_cpu_s", "rollout/ship_s",
                          "wait/samples_s")}
    return {"placement": where if not sync else f"{where} {sync[0]}/{sync[1]}", "steps": args.steps,
            "sync_bytes": wire, "sync_bytes_plan": plan,
            "samples": args.steps * cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
            "step_s": step_s, "steps_per_hour": 3600 / step_s, "predicted_steps_per_hour": pred,
            "error": (3600 / step_s - pred) / pred, "eval_before": summary["eval_before"],
            "eval_after": summary["eval_after"], "wall_s": wall, "phases": ph, "staleness_bound": bound,
            "max_staleness_seen": max(r[rundir.STALENESS_MAX] for r in rows),
            "dropped": sum(r.get("staleness/dropped", 0) for r in rows), "per_step": per_step}


def rollout_breakdown(results: list[dict]) -> str:
    """Where a step's rollout time goes, per placement: the rollout spans (R: the worker busy),
    inside them the engine's wall clock and its thread's CPU time (Ray placements: the worker's
    timers; the difference is time waiting for a core), the time the loop spent handing finished
    groups to the queue, the tokens generated, R and the engine's CPU per token, and how long the
    driver waited for samples. Colocated runs the engine in the driver: R is its wall clock, the
    CPU time is the process's over the rollout (``time.process_time``)."""
    lines = [f"\nrollout per step  {'R s':>7} {'engine s':>8} {'eng cpu s':>9} {'ship s':>7} {'tokens':>6} "
             f"{'R ms/tok':>8} {'cpu ms/tok':>10} {'driver wait s':>13}"]
    for r in results:
        ps, R = r["per_step"], r["phases"]["rollout"]
        n = max(ps["tokens/generated"], 1.0)
        colocated = r["placement"].startswith("colocated")
        engine, cpu = (R if colocated else ps["rollout/engine_s"]), ps["rollout/engine_cpu_s"]
        lines.append(f"{r['placement']:17} {R:7.4f} {engine:8.4f} {cpu:9.4f} {ps['rollout/ship_s']:7.4f} {n:6.0f} "
                     f"{R / n * 1e3:8.4f} {cpu / n * 1e3:10.4f} {ps['wait/samples_s']:13.4f}")
    return "\n".join(lines)


def actor_speed(reps: int = 15, prompts: int = 32, new_tokens: int = 8) -> int:
    """The rollout actor's own loop (``RolloutWorker.poll``: admit, ``engine.step()``, ship finished
    groups) on ``prompts`` x 8 samples x ``new_tokens`` tokens (the demo's round by default), in this
    process and in a Ray actor (its output through the placements' Ray queue), one intra-op thread
    each, the two sides alternated (and which goes first too) ``reps`` times.

    Per token, three times for each side: *engine* (the worker's own timer around ``engine.step()``:
    the per-token speed of the engine where it runs), *engine cpu* (that thread's CPU time over the
    same calls: the least load-sensitive) and *round* (submit to the last group back through the
    queue: what the driver sees). Min and median of each; min / min is the ratio least
    sensitive to other load on the machine. Both sides print what sets the engine's speed
    (``rollout_actor.runtime``) from the thread that runs the loop."""
    import ray
    from ray.util.queue import Queue

    from rollyard import roles
    from rollyard.placement import cluster
    from rollyard.placement.rollout_actor import RolloutWorker, runtime
    from rollyard.sync.full import FullPublisher
    from rollyard.types import Request

    cfg = load_config(None, ["model.context=64", f"rollout.max_new_tokens={new_tokens}", "rollout.max_concurrent=256"])
    model, tok, _ = roles.policy(cfg, "cpu")
    update = FullPublisher(torch.float32).publish(model, 0)

    def work(k: int) -> list:
        return [(Request(f"p{k}-{i}", tok(f"{i}+{i}=")["input_ids"], n=8, max_new_tokens=new_tokens), 0)
                for i in range(prompts)]

    class Out(list):
        def put(self, item):
            self.append(item)

    out = Out()
    settings = roles.settings(cfg)  # resolved once here, handed to both workers (as the pool does)
    local = RolloutWorker(cfg.model_dump(mode="json"), "local", 0, update, out, 1, "finish", settings)
    load0 = os.getloadavg()[0]
    cluster.connect()
    queue = Queue(maxsize=64, actor_options={"num_cpus": 0})
    actor = ray.remote(num_cpus=1, max_concurrency=8)(RolloutWorker).remote(
        cfg.model_dump(mode="json"), "actor", 0, update, queue, 1, "finish", settings)
    ray.get(actor.info.remote())
    loop = actor.run.remote()

    def take(k: int, submit, get) -> tuple[float, float, float, float]:
        t0, got, engine, cpu, n, ship = time.perf_counter(), 0, 0.0, 0.0, 0, 0.0
        submit(work(k))
        while got < prompts:
            for item in get():
                st = item["stats"]
                got, engine, cpu, n = got + len(item["groups"]), engine + st["engine_s"], cpu + st["engine_cpu_s"], n + st["tokens"]
                ship += st["ship_s"]
        return engine / n, cpu / n, (time.perf_counter() - t0) / n, ship

    def local_items() -> list:
        local.poll()
        items = list(out)
        out.clear()
        return items

    def in_process(k: int):
        return take(k, local.submit, local_items)

    def in_actor(k: int):
        return take(k, actor.submit.remote, lambda: [queue.get()])

    local.runtime = runtime(local.engine)
    sides = {"in-process": in_process, "ray actor": in_actor}
    times: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in sides}
    for k in range(reps + 1):  # round 0 warms both up and is left out
        for name in (list(sides) if k % 2 else list(sides)[::-1]):
            t = sides[name](k)
            if k:
                times[name].append(t)
    info = ray.get(actor.info.remote())
    actor.stop.remote()
    ray.get(loop)
    print(f"{reps} alternated rounds of {prompts} prompts x 8 samples x {new_tokens} tokens; "
          f"load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
    for name, rt in (("in-process", local.runtime), ("ray actor", info["runtime"])):
        print(f"  {name:10} loop thread: {json.dumps(rt)}")
    stats = {}
    for name, v in times.items():
        for i, what in enumerate(("engine", "engine cpu", "round")):
            xs = sorted(t[i] for t in v)
            stats[name, what] = (xs[0], xs[len(xs) // 2])
    print(f"{'ms per token':14} {'in-process min':>14} {'median':>8} {'ray actor min':>14} {'median':>8} "
          f"{'ratio of mins':>13} {'of medians':>10}")
    for what in ("engine", "engine cpu", "round"):
        (a, am), (b, bm) = stats["in-process", what], stats["ray actor", what]
        print(f"{what:14} {a * 1e3:14.4f} {am * 1e3:8.4f} {b * 1e3:14.4f} {bm * 1e3:8.4f} {b / a:12.2f}x {bm / am:9.2f}x")
    ship = sorted(t[3] for t in times["ray actor"])[reps // 2]
    print(f"handing items to the queue in the actor's loop: median {ship * 1e3:.2f} ms per round")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per placement")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of steps/hour")
    p.add_argument("--staleness", type=int, default=1, help="max_staleness of the async run")
    p.add_argument("--set", action="append", default=[], help="extra config override KEY=VALUE (all runs)")
    p.add_argument("--only", choices=PLACEMENTS, action="append", help="run only these placements")
    p.add_argument("--cache", default=str(ROOT / ".cache" / "warmstart"), help="sft.cache_dir (warm start cache)")
    p.add_argument("--out", default=None, help="where the runs go (default: a fresh dir under bench/out)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--config", default="demo.toml", help="example config under examples/ (tail.toml: countdown)")
    p.add_argument("--grid", action="store_true", help="the Ray placements once per sync mode x transport "
                   "(full, delta, lora x ray, dist) after one colocated run; bytes per sync vs the plan")
    p.add_argument("--lora-r", type=int, default=16, help="adapter rank of the lora runs in --grid")
    p.add_argument("--actor-speed", action="store_true", help="only: the rollout actor's loop in a Ray actor "
                   "vs the same loop in this process, tokens per second (one thread each)")
    p.add_argument("--rounds", type=int, default=1, help="run the set R times, rotating the order (drifting "
                   "load hits every placement alike); the table shows each placement's median round")
    args = p.parse_args()
    from rollyard.config import env_error

    if why := env_error():  # a bad ROLLYARD_* setting: one line, exit 2
        p.exit(2, f"{p.prog}: error: {why}\n")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps ({args.steps}) must be larger than --warmup ({args.warmup})")
    torch.set_num_threads(1)
    out = Path(args.out or ROOT / "bench" / "out" / f"placements-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.actor_speed:
        return actor_speed()
    order = list(args.only or PLACEMENTS)
    if args.grid:
        order = [(w, (m, t)) if w != "colocated" else (w, None) for w in order
                 for m, t in ([(None, None)] if w == "colocated" else
                              [(m, t) for m in ("full", "delta", "lora") for t in ("ray", "dist")])]
    else:
        order = [(w, None) for w in order]
    runs: dict[tuple, list[dict]] = {w: [] for w in order}
    for k in range(args.rounds):
        for where, sync in order[k % len(order):] + order[:k % len(order)]:
            runs[(where, sync)].append(run_one(where, args, out / f"round{k}" if args.rounds > 1 else out, sync))
    results = [sorted(rs, key=lambda r: r["steps_per_hour"])[len(rs) // 2] for rs in runs.values()]
    if args.rounds > 1:
        for rs in runs.values():
            per = ", ".join(f"{r['steps_per_hour']:.0f}" for r in rs)
            print(f"{rs[0]['placement']}: steps/h per round {per}")
    base = next((r for r in results if r["placement"] == "colocated"), None)
    if args.grid:
        print(f"\n{'placement mode/transport':32} {'bytes/sync':>11} {'plan':>11} {'ratio':>6}")
        for r in results:
            if r["sync_bytes_plan"]:
                print(f"{r['placement']:32} {r['sync_bytes']:11.0f} {r['sync_bytes_plan']:11.0f} "
                      f"{r['sync_bytes'] / r['sync_bytes_plan']:6.3f}")
    print(f"\nsame work: {args.steps} steps x {results[0]['samples'] // args.steps} samples, seed 0, "
          f"overrides {args.set or 'none'}; steps/hour over steps {args.warmup}..{args.steps - 1}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'placement':24} {'s/step':>7} {'steps/h':>8} {'vs colo':>8} {'planner':>8} {'error':>7} "
          f"{'acc before':>10} {'acc after':>9} {'R s':>6} {'T s':>6} {'sync s':>7} {'limit':>6} {'lag':>4}")
    for r in results:
        ph = r["phases"]
        ratio = f"{r['steps_per_hour'] / base['steps_per_hour']:.2f}x" if base else "-"
        limit = (ph["rollout"] + ph["trainer"]) / max(ph["rollout"], ph["trainer"], 1e-9)
        print(f"{r['placement']:24} {r['step_s']:7.3f} {r['steps_per_hour']:8.0f} {ratio:>8} "
              f"{r['predicted_steps_per_hour']:8.0f} {r['error']:+7.1%} {r['eval_before']:10.1%} {r['eval_after']:9.1%} "
              f"{ph['rollout']:6.3f} {ph['trainer']:6.3f} {ph['sync']:7.3f} {limit:5.2f}x "
              f"{r['max_staleness_seen']:>4}")
    print(rollout_breakdown(results))
    print(f"runs: {out}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
