"""reference.placement: the reference model's time on the trainer's critical path, per option and placement.

    .venv/bin/python bench/reference.py                        # the demo work, 12 steps per case
    .venv/bin/python bench/reference.py --steps 20 --only disaggregated/pool colocated/inline

Same work in every case: the demo config (examples/demo.toml: warm-started tiny preset, arithmetic,
32 x 8 samples per step) with a LoRA policy (model.lora.r=8, so ``fused`` applies) and algo.kl_coef
(default 0.04), the same seed and steps. Per case, over the steps after ``--warmup``:

- ``ref wait s``: the step's ``reference`` span, the trainer waiting for reference logprobs -- the
  reference's time on the critical path (inline, fused: the forward itself; pool: the wait for
  results not in yet);
- ``pool s``: the reference actors' compute per step (role ``reference_pool``; off the path);
- ``ready``: the share of groups already scored when the trainer asked (pool);
- ``step s``: wall clock between optimizer steps; ``kl``: the logged k3 KL (a sanity check: the
  same order of magnitude in every case; the cases sample differently, so not equal).

The trainer runs in this process with one thread; rollout workers and reference actors are Ray
actors with one thread each. On a shared 2-core machine the actors compete with the trainer for
cores, so the pool's gain depends on spare cores: say so where these numbers are published.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch  # noqa: E402

from rollyard import placement  # noqa: E402
from rollyard.config import load_config  # noqa: E402
from rollyard.telemetry import rundir  # noqa: E402

CASES = ("colocated/inline", "colocated/fused", "disaggregated/inline", "disaggregated/pool", "async/inline",
         "async/pool")


def run_case(case: str, args, out: Path) -> dict:
    where, ref = case.split("/")
    run = out / case.replace("/", "-")
    shutil.rmtree(run, ignore_errors=True)  # each case a fresh run
    overrides = [f"steps={args.steps}", f"placement={where}", f"out_dir={run}", "progress=false",
                 "model.lora.r=8", f"algo.kl_coef={args.kl}", f"reference.placement={ref}",
                 f"reference.workers={args.ref_workers}", f"max_staleness={args.staleness}", "checkpoint_every=1000",
                 *args.set]
    cfg = load_config(ROOT / "examples" / "demo.toml", overrides)
    placement.train(cfg, run)
    rows = list(rundir.read_jsonl(run / rundir.METRICS))[args.warmup:]

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in rows) / len(rows)

    return {"case": case, "ref_wait_s": mean("time/reference"), "pool_s": mean("time/reference_pool"),
            "ready": mean("reference/ready_frac") if ref == "pool" else None, "step_s": mean(rundir.STEP_TIME),
            "train_s": mean("time/train"), "kl": mean("kl")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the means (actor start-up)")
    ap.add_argument("--kl", type=float, default=0.04)
    ap.add_argument("--staleness", type=int, default=1, help="async: max_staleness")
    ap.add_argument("--ref-workers", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=list(CASES), choices=CASES)
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "reference"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = [run_case(c, args, Path(args.out)) for c in args.only]
    print(f"\n{'case':22} {'ref wait s':>10} {'pool s':>7} {'ready':>6} {'train s':>8} {'step s':>7} {'kl':>9}")
    for r in results:
        ready = "-" if r["ready"] is None else f"{r['ready']:.2f}"
        print(f"{r['case']:22} {r['ref_wait_s']:10.4f} {r['pool_s']:7.4f} {ready:>6} {r['train_s']:8.4f} "
              f"{r['step_s']:7.3f} {r['kl']:9.2e}")


if __name__ == "__main__":
    main()
