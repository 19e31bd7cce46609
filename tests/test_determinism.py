"""One config and seed, two runs, bit-identical metrics and weights on this machine, loaded or not:
kernel and GEMM choices that change numerics are made by shape and CPU features (recorded in
run.json), never by a start-up timing. Each run is its own process (nothing cached in between), the
second one next to a process that keeps a core busy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rollyard.telemetry import rundir

ARGS = ["model.name=tiny", "model.context=64", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "sft.auto=false", "progress=false",
        "reward.num_workers=1", "log.plots=false", "steps=3", "seed=7"]
# measured durations and what follows from them (the step-time alarm), the only values allowed to differ
TIMED = ("time/", "tokens/per_s", "eval/seconds", "checkpoint/seconds", "alarm/step_time", "rollout/engine_cpu_s",
         "checkpoint/write_seconds",  # the background checkpoint write's own seconds
         "train/lm_head_s", "train/optimizer_s",  # seconds inside the train step (trainer/head.py's clock, AdamW)
         "timeline/",  # timeline/outside_roles: the step's wall seconds in no span
         "memory/")  # memory/*: measured peak RSS (the allocator and thread timing move it)


def _run(out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLYARD_")}  # the defaults (auto)
    env["OMP_NUM_THREADS"] = "1"  # as the suite; OpenMP threads spinning against the busy core cost minutes
    subprocess.run([sys.executable, "-m", "rollyard.cli", "train", *ARGS, f"out_dir={out}"], env=env, check=True,
                   capture_output=True, timeout=600)


def _numbers(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / rundir.METRICS).read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMED)} for r in rows]


def test_two_runs_with_one_seed_are_bit_identical(tmp_path):
    _run(tmp_path / "a")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        _run(tmp_path / "b")
    finally:
        busy.kill()
        busy.wait()
    a, b = _numbers(tmp_path / "a"), _numbers(tmp_path / "b")
    assert len(a) == 3 and a == b  # == on floats parsed from the same JSON text: bit-identical
    assert (tmp_path / "a" / rundir.EVAL).read_text() == (tmp_path / "b" / rundir.EVAL).read_text()
    weights = [p / rundir.MODEL / "model.safetensors" for p in (tmp_path / "a", tmp_path / "b")]
    assert weights[0].read_bytes() == weights[1].read_bytes()
    kernels = [json.loads((p / rundir.RUN_INFO).read_text())["kernels"] for p in (tmp_path / "a", tmp_path / "b")]
    assert kernels[0] == kernels[1] and "onednn_linear" in kernels[0]  # the choices are recorded, and the same
