"""Held-out accuracy with a calculator tool vs without, same model and budget (issue 37 item 4).

Both arms are the built-in task ``data.task=calculator`` (``"47*38="`` -> ``"1786"``, two-digit products,
~10% of the 8,100 problems held out) on the ``tiny`` preset (~0.5M parameters, character tokenizer), with
the same warm start budget (``sft.steps`` x ``sft.batch_size`` demonstrations, ``sft.target_accuracy=1``
so neither arm stops early) and the same GRPO budget (``steps`` x ``prompts_per_step`` x ``samples_per_prompt``):

- ``tools``: the task's default (``task_options.tools=1``): demonstrations call ``calc(expr)`` and copy its
  output; rollouts and the held-out eval are multi-turn with the tool in isolated workers;
- ``no-tools``: ``task_options.tools=0``: demonstrations answer directly; single-turn.

Each arm is one ``rollyard.train`` run (its own warm start, cached in ``--cache``); the table reads the
run's summary.json (held-out greedy accuracy after the warm start and after RL, on the same
``data.eval_size`` problems) and metrics.jsonl. Not a test: it prints a table.

    .venv/bin/python bench/tools.py                                   # defaults below (~20 min per arm, loaded 2 cores)
    .venv/bin/python bench/tools.py --sft-steps 40 --rl-steps 2 --eval 20   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import time


def arm(tools: bool, args) -> dict:
    import rollyard

    name = "tools" if tools else "no-tools"
    cfg = {"out_dir": f"{args.out}/{name}-{int(time.time())}", "steps": args.rl_steps, "seed": args.seed,
           "progress": False, "checkpoint_every": 1000, "log": {"plots": False},
           "model": {"name": "tiny", "context": 192},
           "data": {"task": "calculator", "task_options": {"tools": int(tools)}, "eval_size": args.eval},
           "sft": {"steps": args.sft_steps, "batch_size": args.sft_batch, "eval_every": min(100, args.sft_steps),
                   "target_accuracy": 1.0, "cache_dir": args.cache},
           "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 128, "temperature": 1.0},
           "trainer": {"lr": args.lr}, "reward": {"num_workers": 1}, "tools": {"num_workers": 2}}
    t0 = time.time()
    run = rollyard.train(cfg)
    m = run.metrics
    return {"arm": name, "sft": run.summary["eval_before"], "rl": run.summary["eval_after"],
            "r0": sum(r["reward"] for r in m[:3]) / len(m[:3]), "r1": sum(r["reward"] for r in m[-3:]) / len(m[-3:]),
            "calls": sum(r.get("tools/calls", 0) for r in m), "samples": 32 * len(m),
            "tokens": sum(r["tokens/generated"] for r in m) / len(m), "seconds": time.time() - t0,
            "dir": str(run.run_dir)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sft-steps", type=int, default=800)
    ap.add_argument("--sft-batch", type=int, default=32)
    ap.add_argument("--rl-steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4, help="GRPO learning rate (trainer.lr)")
    ap.add_argument("--eval", type=int, default=50, help="held-out problems (data.eval_size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench-tools")
    ap.add_argument("--cache", default=".cache/warmstart")
    ap.add_argument("--arms", nargs="+", choices=["tools", "no-tools"], default=["tools", "no-tools"])
    args = ap.parse_args(argv)
    rows = [arm(a == "tools", args) for a in args.arms]
    print(f"\nheld-out greedy accuracy, data.task=calculator, {args.eval} problems, tiny preset: {args.sft_steps} SFT "
          f"steps x {args.sft_batch}, then {args.rl_steps} GRPO steps of 8 prompts x 4 (seed {args.seed})")
    print(f"{'arm':9s} {'after SFT':>9s} {'after RL':>9s} {'reward first3':>13s} {'reward last3':>12s} "
          f"{'tool calls/sample':>17s} {'tokens/step':>11s} {'wall s':>7s}  run")
    for r in rows:
        print(f"{r['arm']:9s} {r['sft']:9.1%} {r['rl']:9.1%} {r['r0']:13.3f} {r['r1']:12.3f} "
              f"{r['calls'] / r['samples']:17.2f} {r['tokens']:11.0f} {r['seconds']:7.0f}  {r['dir']}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
