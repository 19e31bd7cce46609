"""The demo's learning over RL seeds, on this CPU class: held-out greedy accuracy before -> after RL.

Runs ``examples/demo.toml`` (the warm start once, shared by every seed, cached per CPU class), then RL with
each seed, and prints one row per seed and the spread. ``--isa avx2`` runs it as an AVX2 machine would choose
(``ROLLYARD_CPU_ISA``: on an AVX-512 machine the other class, with kernels built for x86-64-v3), so one
machine measures both classes. The README's demo figures come from this script:

    .venv/bin/python bench/demo_seeds.py                 # seeds 0 1 2, this CPU's class
    .venv/bin/python bench/demo_seeds.py --isa avx2      # as an AVX2-only CPU would
    .venv/bin/python bench/demo_seeds.py --seeds 0 1 2 3 4 --json out.json

Target, for every seed on each class: >= 75% held-out accuracy after RL, and >= +25 points over the warm start.
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

ROOT = Path(__file__).resolve().parents[1]


def run_seed(seed: int, out: Path, cache: Path, env: dict, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "rollyard.cli", "train", "--config", str(ROOT / "examples/demo.toml"),
           f"seed={seed}", f"out_dir={out}", f"sft.cache_dir={cache}", "progress=false", "log.plots=false", *extra]
    shutil.rmtree(out, ignore_errors=True)  # this script's own run of the seed: a rerun replaces it (the warm start stays)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: rollyard train exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"seed": seed, "before": summary["eval_before"], "after": summary["eval_after"],
            "seconds": time.time() - t0, "rl_seconds": summary["seconds"], "cpu_class": cpu_class(proc.stdout)}


def cpu_class(stdout: str) -> str:
    """The class in "device cpu (CPU class avx2 (narrowed by ROLLYARD_CPU_ISA=avx2))", up to its own closing
    parenthesis (the narrowed name has one of its own; the console may wrap the line)."""
    text = " ".join(stdout.split())
    start = text.find("(CPU class ")
    if start < 0:
        return "?"
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("(CPU class "):i]
    return text[start + len("(CPU class "):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--isa", choices=["native", "avx512", "avx2", "generic"], default=None,
                    help="ROLLYARD_CPU_ISA for the runs (default: as set, else native)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "demo-seeds")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run (e.g. steps=100)")
    a = ap.parse_args(argv)
    env = dict(os.environ)
    if a.isa:
        env["ROLLYARD_CPU_ISA"] = a.isa
    tag = env.get("ROLLYARD_CPU_ISA", "native")
    cache = a.out / "warmstart"  # keyed by the CPU class inside: two classes never share a warm start
    rows = []
    for seed in a.seeds:
        row = run_seed(seed, a.out / f"{tag}-seed{seed}", cache, env, a.overrides)
        rows.append(row)
        print(f"seed {seed}: {row['before']:.1%} -> {row['after']:.1%} ({100 * (row['after'] - row['before']):+.1f} "
              f"points, {row['seconds']:.0f} s in all, RL {row['rl_seconds']:.0f} s, CPU class {row['cpu_class']})", flush=True)
    gains = [100 * (r["after"] - r["before"]) for r in rows]
    afters = [100 * r["after"] for r in rows]
    print(f"CPU class {rows[0]['cpu_class']}: gain {min(gains):+.1f} .. {max(gains):+.1f} points over seeds "
          f"{a.seeds} (after RL {min(afters):.1f}-{max(afters):.1f}%, mean {statistics.mean(afters):.1f}%); "
          f"target >= 75% and >= +25 each: {'met' if min(gains) >= 25 and min(afters) >= 75 else 'NOT met'}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
