"""Trainer step time at dp=1 vs dp=2 (and fsdp), side by side, and the gradient collectives' share.

    PYTHONPATH=src .venv/bin/python bench/dp.py                        # tiny + small, demo shape
    PYTHONPATH=src .venv/bin/python bench/dp.py --presets small --steps 8 --json bench/out/dp.json

Every side trains the same preset (fp32, CPU) on the same batches: ``--prompts`` x ``--samples``
completions per step (default the demo's 32 x 8), prompts of 6-12 and completions of 1-``--len``
tokens (random ids, random advantages and rollout logprobs, fixed seed), micro-batches of 1024
tokens. A step is one ``trainer.step(samples)`` call: rank 0's wall clock, which includes handing
rank 1 its share (pickled, over the gloo group), the forward/backward of rank 0's share, the
collectives and the optimizer step. ``--warmup`` steps run first and are left out; the table shows
the median and min of the timed steps. One process holds one process group at a time, so the
dp=2 and fsdp sides run one after the other, each alternating step by step with the dp=1 side
(dp=1 step i, then dp=2 step i), so a drifting load on the shared machine hits both alike.

Columns: ``step s`` (median / min); ``vs dp=1`` = dp=1 median / this median (>1: faster);
``cpu s`` = CPU seconds rank 0's process used in the step (``time.process_time``): the work
a rank does, independent of how much CPU the machine's other load leaves it; dp=1 cpu s / dp=2
cpu s is the speedup an otherwise idle machine with a core per rank would allow;
``scatter s`` = rank 0's seconds handing the other ranks their shares (pickled samples);
``wait s`` = rank 0's seconds at a barrier before the all-reduce, waiting for the slower rank
(imbalance and the machine's other load); ``collective s`` = rank 0's seconds in the flat gradient
all-reduce after that barrier (fsdp: its
all-gather and reduce-scatter run inside backward and are not separable, so only the all-reduce of
the replicated rest is shown), ``share`` = collective s / step s; ``wire MB/rank`` = bytes rank 0's
process wrote to its sockets during backward + all-reduce (``/proc/self/io`` wchar), against
``ring MB`` = 2 (k-1)/k x the fp32 gradient message (the runbook's formula).

The physical limit for the all-reduce is loopback memcpy bandwidth (several GB/s): the measured
GB/s column says how far the gloo all-reduce is from it. With 2 cores, the compute of two ranks
can at best halve; with a tiny model and little work per step the fixed costs (pickling the
shares, the collectives' latency, Python per micro-batch) dominate.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

from rollyard import roles
from rollyard.config import load_config
from rollyard.model.loading import PRESETS
from rollyard.trainer.dp import DataParallelTrainer
from rollyard.types import Sample


def batch(seed: int, n: int, max_len: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(4, 80, (int(torch.randint(6, 13, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(4, 80, (int(torch.randint(1, max_len + 1, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(id=f"s{i}", request_id=f"r{i // 8}", prompt_ids=p, completion_ids=c,
                          logprobs=(-torch.rand(len(c), generator=g)).tolist(), versions=[0] * len(c),
                          finish_reason="stop", advantage=float(torch.randn(1, generator=g))))
    return out


def run(preset: str, args) -> list[dict]:
    sides = {"dp=2": ["trainer.dp=2"], "dp=2 fsdp": ["trainer.dp=2", "trainer.sharding=fsdp"]}
    base = [f"model.name={preset}", "model.context=64", "trainer.micro_batch_tokens=1024"]
    times: dict[str, list[float]] = {"dp=1": []}
    wires: dict[str, list[dict]] = {"dp=1": []}
    model, _, _ = roles.policy(load_config(None, base), "cpu")
    params = sum(p.numel() for p in model.parameters())
    single = roles.Trainer(copy.deepcopy(model), **roles.trainer_kwargs(load_config(None, base)))
    # One process group per process: the dp sides run one after the other, each interleaved with dp=1.
    for name in [s for s in sides if s in args.sides]:
        handle = DataParallelTrainer(load_config(None, base + sides[name]), copy.deepcopy(model), "cpu")
        times[name], wires[name] = [], []
        try:
            for i in range(args.warmup + args.steps):
                samples = batch(i, args.prompts * args.samples, args.len)
                for side, t in (("dp=1", single), (name, handle)):
                    t0, c0 = time.perf_counter(), time.process_time()
                    t.step(copy.deepcopy(samples))
                    if i >= args.warmup:
                        times[side].append(time.perf_counter() - t0)
                        wires[side].append({**getattr(t, "wire", {}), "cpu_s": time.process_time() - c0})
        finally:
            handle.close()
    rows = []
    ring = 2 * (2 - 1) / 2 * 4 * params
    base_med = statistics.median(times["dp=1"]) if times["dp=1"] else float("nan")
    for name, ts in times.items():
        if not ts:
            continue
        med = statistics.median(ts)
        w = wires[name]
        coll = statistics.median([x.get("allreduce_s", 0.0) for x in w]) if w else 0.0
        wait = statistics.median([x.get("wait_s", 0.0) for x in w]) if w else 0.0
        scatter = statistics.median([x.get("scatter_s", 0.0) for x in w]) if w else 0.0
        cpu = statistics.median([x["cpu_s"] for x in w]) if w else 0.0
        wire = statistics.median([x.get("gradient_bytes", 0.0) for x in w]) if w else 0.0
        rows.append({"preset": preset, "params": params, "side": name, "step_median_s": med, "step_min_s": min(ts),
                     "speedup_vs_dp1": base_med / med, "collective_s": coll, "collective_share": coll / med, "wait_s": wait, "scatter_s": scatter, "rank0_cpu_s": cpu,
                     "wire_bytes_per_rank": wire, "ring_bytes": ring if name != "dp=1" else 0.0,
                     "allreduce_GBps": (wire / coll / 1e9) if (coll and name == "dp=2") else None})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=sorted(PRESETS))
    ap.add_argument("--sides", nargs="+", default=["dp=2", "dp=2 fsdp"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--len", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    from rollyard.config import env_error

    if why := env_error():  # a bad ROLLYARD_* setting: one line, exit 2
        ap.exit(2, f"{ap.prog}: error: {why}\n")
    torch.set_num_threads(1)
    print(f"cpus {len(os.sched_getaffinity(0))}, load avg {os.getloadavg()[0]:.2f}; {args.prompts}x{args.samples} "
          f"completions of 1-{args.len} tokens per step, {args.steps} timed steps after {args.warmup} warm-up")
    rows = []
    for preset in args.presets:
        rows += run(preset, args)
    print(f"{'preset':6} {'side':10} {'step s med/min':>15} {'vs dp=1':>8} {'collective s':>13} {'share':>6} "
          f"{'wire MB/rank':>13} {'ring MB':>8} {'GB/s':>6} {'wait s':>7} {'scatter s':>9} {'cpu s':>6}")
    for r in rows:
        gbps = f"{r['allreduce_GBps']:.2f}" if r["allreduce_GBps"] else "-"
        print(f"{r['preset']:6} {r['side']:10} {r['step_median_s']:7.3f}/{r['step_min_s']:.3f} {r['speedup_vs_dp1']:8.2f} "
              f"{r['collective_s']:13.4f} {r['collective_share']:6.1%} {r['wire_bytes_per_rank'] / 1e6:13.3f} "
              f"{r['ring_bytes'] / 1e6:8.3f} {gbps:>6} {r['wait_s']:7.3f} {r['scatter_s']:9.3f} {r['rank0_cpu_s']:6.3f}")
    print(f"load avg after {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
