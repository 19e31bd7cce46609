"""colocated vs disaggregated vs async on the same work: steps/hour, ratios, accuracy, and the
planner's prediction from each run's measured phase times.

    .venv/bin/python bench/placements.py                          # the demo task, 30 steps each
    .venv/bin/python bench/placements.py --steps 40 --set rollout.max_concurrent=32
    .venv/bin/python bench/placements.py --only async --staleness 2
    .venv/bin/python bench/placements.py --steps 40 --rounds 3     # rotate the order 3 times, medians

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


def run_one(where: str, args, out: Path) -> dict:
    run = out / where
    overrides = [f"steps={args.steps}", f"placement={where}", f"out_dir={run}", "progress=false",
                 f"sft.cache_dir={args.cache}", f"max_staleness={args.staleness}", *args.set]
    cfg = load_config(ROOT / "examples" / "demo.toml", overrides)
    t0 = time.time()
    summary = placement.train(cfg, run)
    wall = time.time() - t0
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    timed = rows[args.warmup:]
    step_s = sum(r[rundir.STEP_TIME] for r in timed) / len(timed)
    ph = phases(run, range(args.warmup, args.steps))
    bound = int(json.loads((run / rundir.RUN_INFO).read_text())["staleness_bound"])
    pred = predicted_steps_per_hour(where, ph, bound, cfg.sync.every)
    return {"placement": where, "steps": args.steps,
            "samples": args.steps * cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
            "step_s": step_s, "steps_per_hour": 3600 / step_s, "predicted_steps_per_hour": pred,
            "error": (3600 / step_s - pred) / pred, "eval_before": summary["eval_before"],
            "eval_after": summary["eval_after"], "wall_s": wall, "phases": ph, "staleness_bound": bound,
            "max_staleness_seen": max(r[rundir.STALENESS_MAX] for r in rows),
            "dropped": sum(r.get("staleness/dropped", 0) for r in rows)}


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
    order = list(args.only or PLACEMENTS)
    runs: dict[str, list[dict]] = {w: [] for w in order}
    for k in range(args.rounds):
        for where in order[k % len(order):] + order[:k % len(order)]:
            runs[where].append(run_one(where, args, out / f"round{k}" if args.rounds > 1 else out))
    results = [sorted(rs, key=lambda r: r["steps_per_hour"])[len(rs) // 2] for rs in runs.values()]
    if args.rounds > 1:
        for where, rs in runs.items():
            per = ", ".join(f"{r['steps_per_hour']:.0f}" for r in rs)
            print(f"{where}: steps/h per round {per}")
    base = next((r for r in results if r["placement"] == "colocated"), None)
    print(f"\nsame work: {args.steps} steps x {results[0]['samples'] // args.steps} samples, seed 0, "
          f"overrides {args.set or 'none'}; steps/hour over steps {args.warmup}..{args.steps - 1}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'placement':14} {'s/step':>7} {'steps/h':>8} {'vs colo':>8} {'planner':>8} {'error':>7} "
          f"{'acc before':>10} {'acc after':>9} {'R s':>6} {'T s':>6} {'sync s':>7} {'limit':>6} {'lag':>4}")
    for r in results:
        ph = r["phases"]
        ratio = f"{r['steps_per_hour'] / base['steps_per_hour']:.2f}x" if base else "-"
        limit = (ph["rollout"] + ph["trainer"]) / max(ph["rollout"], ph["trainer"], 1e-9)
        print(f"{r['placement']:14} {r['step_s']:7.3f} {r['steps_per_hour']:8.0f} {ratio:>8} "
              f"{r['predicted_steps_per_hour']:8.0f} {r['error']:+7.1%} {r['eval_before']:10.1%} {r['eval_after']:9.1%} "
              f"{ph['rollout']:6.3f} {ph['trainer']:6.3f} {ph['sync']:7.3f} {limit:5.2f}x "
              f"{r['max_staleness_seen']:>4}")
    print(f"runs: {out}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
