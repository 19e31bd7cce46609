"""The logprob canary's gap at equal versions, and the cost of the weight check, native vs vLLM.

    .venv/bin/python bench/canary.py                    # both parts, both backends
    .venv/bin/python bench/canary.py --part cost        # the per-check cost only
    .venv/bin/python bench/canary.py --part gaps --steps 20 --backends native
    .venv/bin/python bench/canary.py --part gaps --cases vllm/full/fp32,native/full/bf16

``gaps``: one warm-started colocated GRPO run per case (preset ``tiny64``, the one both backends run: vLLM's
CPU attention needs head_dim 64; arithmetic, 30 SFT steps, ``trainer.lr=1e-3``, ``sync.check_every=1``),
backend x sync mode x rollout dtype. Per case: ``canary/logprob_gap`` over the run's syncs (first, median,
max: the alarm's floor is the first, its limit 10 x floor + 1e-4, ``telemetry/alarms.py``), the alarms that
fired (a healthy run: 0), the samples' ``train/logprob_diff_max`` beside it (sampling vs trainer logprobs
of the same tokens, the same kernels' gap seen through real samples), the mean ``sync_check`` span and the
mean step.

``cost``: the equality check alone, timed on an idle engine: ``compare_weights`` (the trainer's expected
weights vs the engine's, sha256 over both, ``sync/check.py``) repeated ``--repeat`` times, best and
median, for the native engine (its module) and the vLLM engine (the weights read inside the vLLM
worker: one ``collective_rpc`` that clones every parameter and splits the fused projections), on
``tiny64`` and on ``small`` (the preset of docs/weight-sync.md's native figure) with 4 heads of 64 instead of 8 of
32 (vLLM's CPU attention; the same 16.6 MB); and the canary (trainer forward + the engine's answer) on
the same engines.

A shared 2-core machine: absolute seconds are indicative; the vLLM / native ratio is the point.
Not named ``vllm*.py``: run as a script, a file of that name would shadow the vllm package.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rollyard.model.loading import load_policy
from rollyard.sync import canary
from rollyard.sync.check import compare_weights
from rollyard.telemetry import rundir

RUN = ["model.name=tiny64", "data.task=arithmetic", "sft.auto=true", "sft.steps=30", "data.train_size=16",
       "data.eval_size=8", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=8",
       "rollout.max_new_tokens=8", "trainer.lr=1e-3", "sync.check_every=1", "eval_every=0", "progress=false",
       "log.plots=false", "reward.num_workers=1"]
CASES = [  # (backend, sync.mode, rollout.dtype)
    ("native", "inprocess", "fp32"), ("native", "full", "fp32"), ("native", "full", "bf16"),
    ("vllm", "inprocess", "fp32"), ("vllm", "full", "fp32"), ("vllm", "full", "bf16"),
]


def gaps(cases: list[tuple[str, str, str]], steps: int, out: Path) -> list[dict]:
    from rollyard.cli import main

    rows = []
    for backend, mode, dtype in cases:
        run = out / f"{backend}-{mode}-{dtype}"
        code = main(["train", *RUN, f"steps={steps}", f"rollout.backend={backend}", f"sync.mode={mode}",
                     f"rollout.dtype={dtype}", f"out_dir={run}"])
        if code != 0:
            rows.append({"case": f"{backend}/{mode}/{dtype}", "exit": code})
            continue
        m = list(rundir.read_jsonl(run / rundir.METRICS))
        g = [r["canary/logprob_gap"] for r in m if "canary/logprob_gap" in r]
        checks = [s["end"] - s["start"] for s in rundir.read_jsonl(run / rundir.SPANS) if s["role"] == "sync_check"]
        rows.append({"case": f"{backend}/{mode}/{dtype}", "canaries": len(g),
                     "gap_first": g[0] if g else None, "gap_median": statistics.median(g) if g else None,
                     "gap_max": max(g) if g else None, "alarms": sum(r.get("alarm/logprob_canary", 0) for r in m),
                     "logprob_diff_max": max(r["train/logprob_diff_max"] for r in m),
                     "checks": len(checks), "check_s": statistics.mean(checks) if checks else None,
                     "step_s": statistics.mean(r[rundir.STEP_TIME] for r in m)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ``small`` with 4 heads of 64 (vLLM's CPU attention) instead of 8 of 32: the same parameters (16.6 MB fp32)
SIZES = {"tiny64": {}, "small-hd64": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64)}


def _timed(repeat: int, fn, *args) -> tuple[float, float]:
    """(best, median) seconds of ``fn(*args)`` over ``repeat`` calls."""
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t)
    return min(ts), statistics.median(ts)


def cost_case(preset: str, backend: str, repeat: int) -> dict:
    """One engine over a copy of ``preset``: the equality check and the canary, timed."""
    from rollyard.rollout.engine import RolloutEngine

    model, tok = load_policy(preset.removesuffix("-hd64"), max_position_embeddings=64)
    if SIZES[preset]:  # the preset's shape with other heads: a fresh random init of it
        from transformers import AutoModelForCausalLM

        conf = copy.deepcopy(model.config)
        for k, v in SIZES[preset].items():
            setattr(conf, k, v)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    copy_ = copy.deepcopy(model).eval().requires_grad_(False)
    if backend == "vllm":
        from rollyard.rollout.vllm import VllmEngine
        engine = VllmEngine(copy_, eos_token_id=tok.eos_token_id, max_concurrent=8, max_cache_tokens=2048)
    else:
        engine = RolloutEngine(copy_, eos_token_id=tok.eos_token_id, max_concurrent=8, max_cache_tokens=2048)
    try:
        expected = {n: p.detach() for n, p in model.named_parameters()}
        check = _timed(repeat, compare_weights, expected, engine.model, 0)
        probe = canary.probe(model.config.vocab_size, 64)
        canary.answer(engine, probe)  # the first vLLM prompt-logprobs request warms its path up
        trainer = _timed(repeat, canary.score, model, probe)
        answer = _timed(repeat, canary.answer, engine, probe)
        gap = max(abs(a - b) for a, b in zip(canary.answer(engine, probe), canary.score(model, probe)))
    finally:
        if backend == "vllm":
            engine.close()
    return {"preset": preset, "backend": backend,
            "weights_mb": round(sum(t.numel() * t.element_size() for t in expected.values()) / 1e6, 2),
            "check_best_s": check[0], "check_median_s": check[1], "canary_trainer_s": trainer[1],
            "canary_engine_s": answer[1], "canary_gap": gap}


def cost(backends: list[str], repeat: int) -> list[dict]:
    rows = []
    for preset in SIZES:
        for backend in [b for b in ("native", "vllm") if b in backends]:
            rows.append(cost_case(preset, backend, repeat))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["gaps", "cost", "both"], default="both")
    p.add_argument("--backends", default="native,vllm", help="comma-separated: native, vllm")
    p.add_argument("--cases", help="comma-separated backend/mode/dtype (gaps; default: every case of --backends)")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps per case (gaps)")
    p.add_argument("--repeat", type=int, default=20, help="timed repetitions (cost)")
    p.add_argument("--json", type=Path, help="write the rows here")
    a = p.parse_args(argv)
    backends = a.backends.split(",")
    torch.manual_seed(0)
    out = {}
    if a.part in ("cost", "both"):
        out["cost"] = cost(backends, a.repeat)
    if a.part in ("gaps", "both"):
        with tempfile.TemporaryDirectory(prefix="canary-bench-") as d:
            cases = [tuple(c.split("/")) for c in a.cases.split(",")] if a.cases else \
                [c for c in CASES if c[0] in backends]
            out["gaps"] = gaps(cases, a.steps, Path(d))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
