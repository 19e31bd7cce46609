"""Plain vs tail-batched rollout on the long-tailed ``countdown`` task (issue 9, seed 003).

    PYTHONPATH=src .venv/bin/python bench/tail.py                      # 40 steps per arm, chunks of 10
    PYTHONPATH=src .venv/bin/python bench/tail.py --steps 60 --chunk 10 --json bench/out/tail.json
    PYTHONPATH=src .venv/bin/python bench/tail.py --placement disaggregated --out bench/out/tail_dis   # Ray rollout pool
    PYTHONPATH=src .venv/bin/python bench/tail.py --placement async --out bench/out/tail_async         # max_staleness=1

Both arms start from the same warm-started model (examples/tail.toml, cached SFT), the same seed
and data order, and train the same number of samples per step (P prompts x n samples: a short
round trains its first P complete prompts, a long round P queued ones). They run *interleaved*:
``--chunk`` steps of plain, then of tail, then plain resumes from its checkpoint, and so on, so
drifting machine load hits both alike; each chunk's end is a held-out greedy eval (the accuracy
curve at equal trained samples).

Reported per arm: rollout seconds per step (tail: the streamed round, which also scores and
accumulates gradients for groups as they complete), end-to-end step seconds (every role, summed
over the run: the run's wall clock minus start-up and evals), the bubble (share of rollout slot-time
idle; plain: 1 - mean/max response length, exact since all of a round's samples hold a slot
at once), held-out accuracy per chunk, and the post-warm-start response-length distribution.
Beside it, ``rollyard plan``'s tail-batching what-if for the measured plain-arm length
distribution (``plan_whatif`` is the one call into plan/).

``--placement disaggregated|async`` runs both arms on the Ray rollout pool (``--workers`` actors;
async at ``max_staleness=1``). There rollout runs in the workers, beside training, so the time
measure is the step's wall clock (``time/step``, the first step of each chunk left out: it holds
the workers' start-up), reported as steps/hour; decode steps per round is the longest trained
completion of each step (the round's length when its samples all hold a slot at once), for both
arms; the bubble is not measured there (the cut samples' lengths stay in the workers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rollyard.cli import main  # noqa: E402
from rollyard.config import load_config  # noqa: E402
from rollyard.telemetry import rundir  # noqa: E402


def plan_whatif(response_lengths: list[int], cfg, rollout_s: float, steps: int) -> dict:
    """``rollyard plan``'s tail-batching what-if for these lengths (the plan counts overprovision as the extra share)."""
    from rollyard.plan.whatif import tail_whatif

    r = cfg.rollout
    return tail_whatif(prompts=r.prompts_per_step, samples=r.samples_per_prompt, overprovision=cfg.tail.overprovision - 1,
                       steps=steps, seed=cfg.seed, cap=r.max_new_tokens, rollout_s=rollout_s,
                       lengths=response_lengths, source="bench/tail.py plain arm").as_dict()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return float(xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))])


def run_chunk(arm: str, run: Path, upto: int, chunk: int, common: list[str]) -> float:
    if upto == chunk:
        argv = ["train", "--config", str(ROOT / "examples/tail.toml"), *common, f"rollout.scheduler={arm}",
                f"out_dir={run}", f"steps={upto}", f"checkpoint_every={chunk}"]
    else:
        argv = ["train", "--resume", str(run), f"steps={upto}"]
    if main(argv) != 0:
        raise SystemExit(f"{arm}: rollyard {' '.join(argv)} failed")
    return json.loads((run / rundir.SUMMARY).read_text())["eval_after"]


def trained_samples(run: Path, cfg) -> int:
    """Samples trained on so far: plain trains P x n per step; a tail round n per complete group."""
    r = cfg.rollout
    return sum(int(row.get("train/groups", r.prompts_per_step)) * r.samples_per_prompt
               for row in rundir.read_jsonl(run / rundir.METRICS))


def summarize_pool(arm: str, run: Path, cfg, curve: list[tuple[int, int, float]], chunk: int) -> dict:
    """The Ray placements' arm: wall-clock steps (the first of each chunk left out), longest trained completion."""
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    timed = [r[rundir.STEP_TIME] for r in rows if r["step"] % chunk]
    out = {
        "steps": len(rows), "trained_samples": trained_samples(run, cfg), "step_s": mean(timed),
        "steps_per_hour": 3600 * len(timed) / sum(timed), "end_to_end_s": sum(timed),
        "wait_samples_s": mean(r.get("wait/samples_s", 0.0) for r in rows),
        "tokens_per_step": mean(r["tokens/generated"] for r in rows),
        "decode_steps_per_round": mean(r["completions/max_length"] for r in rows),
        "curve": [{"step": s, "trained_samples": n, "accuracy": a} for s, n, a in curve],
        "final_accuracy": curve[-1][2], "max_staleness_seen": max(r[rundir.STALENESS_MAX] for r in rows),
        "stale_dropped": sum(r["staleness/dropped"] for r in rows),
    }
    if arm == "tail":
        out.update({"long_steps": sum(r["tail/long_round"] for r in rows), "long_share": rows[-1]["tail/long_share"],
                    "wasted_tokens_per_step": mean(r["tail/wasted_tokens"] for r in rows),
                    "deferred_per_step": mean(r["tail/deferred"] for r in rows),
                    "rerolled": sum(r["tail/rerolled"] for r in rows)})
    return out


def summarize(arm: str, run: Path, cfg, curve: list[tuple[int, int, float]]) -> dict:
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    step_s = [sum(v for k, v in r.items() if k.startswith("time/") and k != rundir.STEP_TIME) for r in rows]
    if arm == "tail":
        bubbles = [r["tail/bubble"] for r in rows]
        steps = [r["tail/decode_steps"] for r in rows]
    else:  # every sample of a plain round holds a slot from its first step (P x n <= max_concurrent)
        bubbles = [1 - r["completions/mean_length"] / r["completions/max_length"] for r in rows]
        steps = [r["completions/max_length"] for r in rows]
    out = {
        "steps": len(rows), "trained_samples": trained_samples(run, cfg),
        "rollout_s_per_step": mean(r["time/rollout"] for r in rows),
        "step_s": mean(step_s), "end_to_end_s": sum(step_s), "bubble": mean(bubbles),
        "tokens_per_step": mean(r["tokens/generated"] for r in rows), "decode_steps_per_round": mean(steps),
        "curve": [{"step": s, "trained_samples": n, "accuracy": a} for s, n, a in curve],
        "final_accuracy": curve[-1][2],
    }
    if arm == "tail":
        out.update({"long_rounds": sum(r["tail/long_round"] for r in rows), "long_share": rows[-1]["tail/long_share"],
                    "wasted_tokens_per_step": mean(r["tail/wasted_tokens"] for r in rows),
                    "train_in_round_s": mean(r["tail/train_in_round_s"] for r in rows),
                    "train_after_round_s": mean(r["time/train"] for r in rows)})
    else:
        out["train_s"] = mean(r["time/train"] for r in rows)
    return out


def main_bench() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--chunk", type=int, default=10)
    ap.add_argument("--out", default="bench/out/tail")
    ap.add_argument("--cache", default=".cache/warmstart", help="sft.cache_dir (warm start shared by both arms)")
    ap.add_argument("--set", action="append", default=[], help="extra config override KEY=VALUE (both arms)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--placement", choices=("colocated", "disaggregated", "async"), default="colocated")
    ap.add_argument("--workers", type=int, default=1, help="rollout.workers (Ray placements)")
    a = ap.parse_args()
    from rollyard.config import env_error

    if why := env_error():  # a bad ROLLYARD_* setting: one line, exit 2
        ap.exit(2, f"{ap.prog}: error: {why}\n")
    common = ["progress=false", f"sft.cache_dir={a.cache}", *a.set]
    if a.placement != "colocated":
        common = [f"placement={a.placement}", f"rollout.workers={a.workers}",
                  *(["max_staleness=1"] if a.placement == "async" else []), *common]
    cfg = load_config(ROOT / "examples/tail.toml", common)
    out = Path(a.out)
    runs = {arm: out / arm for arm in ("plain", "tail")}
    for run in runs.values():
        if run.exists():
            raise SystemExit(f"{run} exists; pass another --out")
    curves: dict[str, list] = {"plain": [], "tail": []}
    for upto in range(a.chunk, a.steps + 1, a.chunk):
        for arm in ("plain", "tail") if (upto // a.chunk) % 2 else ("tail", "plain"):  # alternate who goes first
            acc = run_chunk(arm, runs[arm], upto, a.chunk, common)
            curves[arm].append((upto, trained_samples(runs[arm], cfg), acc))
    before = json.loads((runs["plain"] / rundir.SUMMARY).read_text())["eval_before"]
    if a.placement != "colocated":
        return report_pool(a, cfg, runs, curves, before)
    res = {arm: summarize(arm, runs[arm], cfg, curves[arm]) for arm in runs}
    first = [x for r in list(rundir.read_jsonl(runs["plain"] / rundir.LENGTHS))[: a.chunk] for x in r["response_lengths"]]
    dist = {"p50": pct(first, 0.5), "p90": pct(first, 0.9), "p99": pct(first, 0.99), "max": max(first)}
    dist["p99/p50"] = dist["p99"] / dist["p50"]
    res["lengths_after_warm_start"] = dist
    res["eval_before"] = before
    res["speedup_end_to_end"] = res["plain"]["end_to_end_s"] / res["tail"]["end_to_end_s"]
    res["speedup_rollout"] = res["plain"]["rollout_s_per_step"] / res["tail"]["rollout_s_per_step"]
    res["speedup_decode_steps"] = res["plain"]["decode_steps_per_round"] / res["tail"]["decode_steps_per_round"]
    res["plan_whatif"] = plan_whatif(first, cfg, res["plain"]["rollout_s_per_step"], a.steps)
    res["load"] = os.getloadavg()
    print(f"\nlong-tailed countdown, {a.steps} steps per arm, {cfg.rollout.prompts_per_step}x{cfg.rollout.samples_per_prompt}"
          f", interleaved in chunks of {a.chunk}; load average {res['load'][0]:.1f}")
    print(f"response lengths after warm start: p50 {dist['p50']:.0f}, p90 {dist['p90']:.0f}, p99 {dist['p99']:.0f}, "
          f"max {dist['max']}, p99/p50 {dist['p99/p50']:.1f}; held-out accuracy before RL {before:.1%}")
    print(f"{'':6} {'rollout s/step':>14} {'step s':>7} {'end-to-end s':>12} {'bubble':>7} {'samples':>8}  accuracy curve")
    for arm in ("plain", "tail"):
        r = res[arm]
        curve = " ".join(f"{c['accuracy']:.1%}@{c['trained_samples']}" for c in r["curve"])
        print(f"{arm:6} {r['rollout_s_per_step']:14.2f} {r['step_s']:7.2f} {r['end_to_end_s']:12.1f} {r['bubble']:7.1%} "
              f"{r['trained_samples']:8d}  {curve}")
    w = res["plan_whatif"]
    print(f"measured speedup: end to end {res['speedup_end_to_end']:.2f}x, rollout {res['speedup_rollout']:.2f}x; "
          f"decode steps per round {res['plain']['decode_steps_per_round']:.1f} -> {res['tail']['decode_steps_per_round']:.1f} "
          f"({res['speedup_decode_steps']:.2f}x, the memory-bound GPU measure); plan what-if (decode steps, same lengths): "
          f"{w['speedup']:.2f}x, bubble {w['plain_bubble']:.1%} -> {w['tail_bubble']:.1%}")
    t = res["tail"]
    print(f"tail: {t['long_rounds']:.0f} long rounds, {t['long_share']:.1%} of trained samples from long rounds, "
          f"{t['wasted_tokens_per_step']:.0f} dropped tokens/step, {t['train_in_round_s']:.2f}s/step of training "
          f"overlapped with rollout + {t['train_after_round_s']:.2f}s after the round (plain train {res['plain']['train_s']:.2f}s)")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


def report_pool(a, cfg, runs: dict, curves: dict, before: float) -> int:
    res = {arm: summarize_pool(arm, runs[arm], cfg, curves[arm], a.chunk) for arm in runs}
    res.update({"placement": a.placement, "workers": a.workers, "eval_before": before, "load": os.getloadavg(),
                "speedup_steps_per_hour": res["tail"]["steps_per_hour"] / res["plain"]["steps_per_hour"],
                "speedup_decode_steps": res["plain"]["decode_steps_per_round"] / res["tail"]["decode_steps_per_round"]})
    print(f"\nlong-tailed countdown, placement={a.placement} ({a.workers} rollout worker(s)), {a.steps} steps per arm, "
          f"{cfg.rollout.prompts_per_step}x{cfg.rollout.samples_per_prompt}, interleaved in chunks of {a.chunk}; "
          f"load average {res['load'][0]:.1f}; held-out accuracy before RL {before:.1%}")
    print(f"{'':6} {'step s':>7} {'steps/hour':>10} {'wait s':>7} {'decode steps':>12} {'max lag':>7} {'samples':>8}  accuracy curve")
    for arm in ("plain", "tail"):
        r = res[arm]
        curve = " ".join(f"{c['accuracy']:.1%}@{c['trained_samples']}" for c in r["curve"])
        print(f"{arm:6} {r['step_s']:7.2f} {r['steps_per_hour']:10.0f} {r['wait_samples_s']:7.2f} "
              f"{r['decode_steps_per_round']:12.1f} {r['max_staleness_seen']:7d} {r['trained_samples']:8d}  {curve}")
    t = res["tail"]
    print(f"measured: steps/hour {res['speedup_steps_per_hour']:.2f}x, decode steps per round "
          f"{res['speedup_decode_steps']:.2f}x fewer; tail: {t['long_share']:.1%} of trained groups from long rounds, "
          f"{t['deferred_per_step']:.2f} prompts deferred/step, {t['wasted_tokens_per_step']:.0f} dropped tokens/step, "
          f"{t['stale_dropped']} stale groups dropped ({t['rerolled']:.0f} of deferred prompts, re-rolled)")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main_bench())
