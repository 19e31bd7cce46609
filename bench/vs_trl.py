"""rollyard's colocated loop vs TRL's GRPOTrainer: same model, shape, reward, threads; steps/s and tokens/s.

    .venv/bin/python bench/vs_trl.py                 # 1 warm-up + 5 timed steps on each side
    .venv/bin/python bench/vs_trl.py --steps 10 --threads 2

What is compared (both sides, one after the other, never concurrently):
  * model: rollyard's "tiny" preset (Llama architecture, character tokenizer), built once with a
    fixed seed and exported to a temporary directory; both sides load it from there with
    AutoModelForCausalLM / AutoTokenizer.
  * shape: 4 prompts x 8 samples = 32 completions per optimizer step, 64 new tokens each,
    temperature 1.0, top-p 1, no KL / reference model (beta = kl_coef = 0), one optimizer step per
    batch (TRL: per_device_train_batch_size=32, gradient_accumulation_steps=1,
    num_generations=8, num_iterations=1; CPU, no vLLM, logging/eval/saving off).
  * optimizer: AdamW at lr 2e-3, betas (0.9, 0.999), constant schedule, grad-norm clip 1.0, on both sides
    (``LR``, ``ADAM_BETA2``: passed to both, not left to each side's defaults).
  * precision: bf16 (TRL's GRPOConfig default, bf16=True) and fp32, one after the other
    (``--precisions``).
  * length: every completion is exactly 64 tokens on both sides. The exported tokenizer's EOS is a
    token id outside the model's vocabulary, so no sampler can stop early (no logits processor
    or engine flag needed, identical on both sides); the bench counts the tokens each side
    actually generated and reports tokens/s on those counts. ``--allow-eos`` keeps the model's
    real EOS instead (lengths then vary; tokens/s still uses the real counts).
  * reward: ``digits`` in bench/_trl_side.py (fraction of digit characters), the same function:
    rollyard imports it as the hook ``bench/_trl_side.py:digits``, TRL gets it wrapped as a
    reward function.
  * threads: torch.set_num_threads(T) in each process and OMP_NUM_THREADS=MKL_NUM_THREADS=T in
    the environment of both (``--threads``, default 2).
  * timing: the wall clock from the end of one optimizer step to the end of the next (everything
    in between: data, generation, reward, loss, backward, optimizer, weight sync, bookkeeping).
    The first ``--warmup`` steps are run and left out; the next ``--steps`` are timed.
    "generate" is the time inside generation alone (TRL: its transformers ``generate`` call;
    rollyard: the rollout span).

TRL runs in its own virtual environment, bench/.venv-trl, created on first use (torch==2.13.0
first, the local CPU wheel, then trl + datasets with a transformers 5 release) and reused after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TRL_SIDE = BENCH / "_trl_side.py"
REWARD_HOOK = f"{TRL_SIDE}:digits"
DEFAULT_VENV = BENCH / ".venv-trl"
TORCH_SPEC = "torch==2.13.0"
TRL_SPECS = ["trl>=1.16,<2", "transformers>=5,<6", "datasets"]
# The optimizer both sides run, passed to both: rollyard's defaults are lr 1e-6 and beta2 0.99 (for real models), TRL's
# AdamW beta2 0.999; a rollyard side left at its defaults trained 2000x slower than TRL's and read as "rollyard LOWER"
# in the learning check (2026-11-29).
LR, ADAM_BETA2 = 2e-3, 0.999


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------ TRL's venv
def _pip(py: Path, specs: list[str]) -> None:
    """``pip install specs`` into the venv of ``py``, echoing pip's progress lines."""
    cmd = [str(py), "-m", "pip", "install", "--progress-bar", "off", "--disable-pip-version-check", *specs]
    log(f"[setup] pip install {' '.join(specs)}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-30:]
        if line.startswith(("Collecting", "Installing", "Successfully", "ERROR")):
            log(f"[setup]   {line[:160]}")
    if proc.wait() != 0:
        raise SystemExit(f"[setup] pip install {' '.join(specs)} failed (exit {proc.returncode}):\n" + "\n".join(tail))


def ensure_trl_venv(venv: Path, specs: list[str]) -> Path:
    """Create (once) and return the Python of the venv TRL runs in; a stamp file marks it done."""
    py = venv / "bin" / "python"
    stamp = venv / ".vs-trl-installed"
    wanted = "\n".join([TORCH_SPEC, *specs])
    if py.exists() and stamp.exists() and stamp.read_text() == wanted:
        return py
    t0 = time.time()
    if not py.exists():
        log(f"[setup] creating {venv} (once; reused by later runs)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # torch first: installed after anything that depends on it, pip would fetch a multi-GB CUDA build.
    try:
        _pip(py, [TORCH_SPEC])
    except SystemExit as e:
        log(f"{e}\n[setup] falling back to plain 'torch'")
        _pip(py, ["torch"])
    _pip(py, specs)
    stamp.write_text(wanted)
    log(f"[setup] {venv} ready in {time.time() - t0:.0f}s")
    return py


# ------------------------------------------------------------------------------- shared inputs
def warm_start(model, tok, seed: int, steps: int = 60) -> None:
    """SFT ``model`` in place to answer ``"a+b="`` with 4-56 random digits/letters, then EOS.

    The ``varlen`` case starts from here: sampled completions then end at EOS at different lengths
    (on both sides alike), and the reward (digit fraction, ~0.45 after the warm start) has room
    to rise, so the reward curves show learning.
    """
    import string

    from rollyard.trainer.trainer import Trainer

    rng = random.Random(seed)
    alphabet = string.digits + "abcdefghij +"

    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    trainer = Trainer(model, lr=3e-3, micro_batch_tokens=4096)
    for _ in range(steps):
        pairs = [(enc(f"{rng.randint(0, 9)}+{rng.randint(0, 9)}="),
                  enc("".join(rng.choice(alphabet) for _ in range(rng.randint(4, 56)))) + [tok.eos_token_id])
                 for _ in range(32)]
        trainer.sft_step(pairs)


def build_inputs(work: Path, preset: str, case: str, n_prompts: int, seed: int, allow_eos: bool) -> tuple[Path, Path]:
    """Export the preset's model + tokenizer (warm-started for ``varlen``) and write the prompt file."""
    from rollyard.model.loading import build_preset, char_tokenizer, export

    tok = char_tokenizer()
    model = build_preset(preset, tok, seed=seed, max_position_embeddings=256)
    if case == "varlen":
        warm_start(model, tok, seed)
    elif not allow_eos:
        # EOS becomes an id the model cannot produce (its logits cover ids 0..vocab-1 only).
        tok.add_special_tokens({"eos_token": "<never>"})
        assert tok.eos_token_id >= model.config.vocab_size
        model.config.eos_token_id = None
        model.generation_config.eos_token_id = None
    model_dir = export(model, tok, work / f"model-{preset}-{case}")
    rng = random.Random(seed)
    prompts = work / "prompts.jsonl"
    with prompts.open("w") as f:
        for i in range(n_prompts):  # 4 characters each: "3+7="
            f.write(json.dumps({"id": f"p{i}", "prompt": f"{rng.randint(0, 9)}+{rng.randint(0, 9)}="}) + "\n")
    return model_dir, prompts


# -------------------------------------------------------------------------------------- sides
def run_trl(py: Path, model_dir: Path, prompts: Path, work: Path, a) -> dict:
    out = work / "trl.json"
    cmd = [str(py), str(TRL_SIDE), "--model", str(model_dir), "--prompts", str(prompts),
           "--steps", str(a.warmup + a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads),
           "--seed", str(a.seed), "--lr", str(LR), "--out", str(out), *(["--bf16"] if a.precision == "bf16" else [])]
    log(f"[trl] running {a.warmup} + {a.steps} steps with {py}")
    rc = subprocess.run(cmd, env=thread_env(a.threads), cwd=work).returncode
    if rc != 0:
        raise SystemExit(f"[trl] side failed (exit {rc}); command: {' '.join(cmd)}")
    res = json.loads(out.read_text())
    w = res["warmup"]
    return {"versions": res["versions"], "threads": res["threads"],
            "step_seconds": res["step_seconds"][w:], "generate_seconds": res["generate_seconds"][w:],
            "generated_tokens": res["generated_tokens"][w:], "rewards": res["reward_means"],
            "lengths": [t / res["completions_per_step"] for t in res["generated_tokens"]]}


def run_rollyard(model_dir: Path, prompts: Path, work: Path, a) -> dict:
    import torch
    import transformers

    import rollyard
    from rollyard.config import load_config
    from rollyard.placement.colocated import train

    torch.set_num_threads(a.threads)
    steps = a.warmup + a.steps
    run_dir = work / "rollyard-run"
    overrides = [
        f"out_dir={run_dir}", f"steps={steps}", f"seed={a.seed}", "progress=false",
        f"checkpoint_every={steps}", "eval_every=0",
        f"model.name={model_dir}", "sft.auto=false",
        "data.task=null", f"data.path={prompts}",
        f"reward.hook={REWARD_HOOK}",
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=64",
        "rollout.temperature=1.0", "rollout.top_p=1.0",
        "algo.kl_coef=0.0", "trainer.device=cpu", f"trainer.lr={LR}", f"trainer.adam_beta2={ADAM_BETA2}",
        # bf16: the trainer's matmuls under autocast (fp32 weights and Adam state, as TRL's bf16=True)
        # and a bf16 rollout copy of the weights (TRL generates under the same autocast).
        *(["trainer.precision=bf16", "rollout.dtype=bf16"] if a.precision == "bf16" else ["trainer.precision=fp32"]),
        # One micro-batch per step, as TRL's per_device_train_batch_size=32 (32 x 68 tokens padded).
        "trainer.micro_batch_tokens=4096",
        *a.set,
    ]
    cfg = load_config(None, overrides)
    log(f"[rollyard] rollyard {getattr(rollyard, '__version__', '?')}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {torch.get_num_threads()} threads; {a.warmup} + {a.steps} steps")
    train(cfg, run_dir)

    # Step ends from the span log (the last span of a step is its weight sync).
    ends: dict[int, float] = {}
    for line in (run_dir / "spans.jsonl").read_text().splitlines():
        rec = json.loads(line)
        ends[rec["step"]] = max(ends.get(rec["step"], 0.0), rec["end"])
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    timed = range(a.warmup, steps)
    if sorted(ends) != list(range(steps)) or sorted(rows) != list(range(steps)):
        raise SystemExit(f"[rollyard] expected steps 0..{steps - 1} in {run_dir}, got spans for {sorted(ends)} "
                         f"and metrics for {sorted(rows)}")
    from engine import matmul_flops  # bench/engine.py: the matmul peak both benches report against

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    matmul_params = params - model.get_input_embeddings().weight.numel()  # the input embedding is a lookup
    train_s = sum(rows[s]["time/train"] for s in timed)
    positions = sum(rows[s]["train/packed_tokens"] for s in timed)
    generated = sum(rows[s]["tokens/generated"] for s in timed)
    peak = matmul_flops(dtype=torch.bfloat16 if a.precision == "bf16" else torch.float32)
    return {"versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "threads": torch.get_num_threads(),
            "trainer_flops": [6 * params * positions / train_s], "matmul_flops": [peak],
            # The least time any implementation could take for this step's work at the matmul peak:
            # 2 x matmul params per generated token, 6 x per trained position (forward + backward).
            "floor_seconds": [matmul_params * (2 * generated + 6 * positions) / peak / len(timed)],
            "step_seconds": [ends[s] - ends[s - 1] for s in timed],
            "generate_seconds": [rows[s].get("time/rollout", float("nan")) for s in timed],
            "generated_tokens": [int(rows[s]["tokens/generated"]) for s in timed],
            "rewards": [rows[s]["reward"] for s in range(steps)],
            "lengths": [rows[s]["completions/mean_length"] for s in range(steps)],
            "role_seconds": {k.removeprefix("time/"): statistics.mean(rows[s][k] for s in timed)
                             for k in rows[a.warmup] if k.startswith("time/") and k != "time/step"}}


def merge(sides: dict, name: str, res: dict) -> None:
    if name not in sides:
        sides[name] = {**res, "reward_rounds": [res["rewards"]], "length_rounds": [res["lengths"]]}
        return
    for key in ("step_seconds", "generate_seconds", "generated_tokens"):
        sides[name][key] += res[key]
    sides[name]["reward_rounds"].append(res["rewards"])
    sides[name]["length_rounds"].append(res["lengths"])
    for key in ("trainer_flops", "matmul_flops", "floor_seconds"):
        if key in res:
            sides[name][key] += res[key]
    if "role_seconds" in res:  # mean over rounds, weighted by steps
        n_old = len(sides[name]["step_seconds"]) - len(res["step_seconds"])
        n_new = len(res["step_seconds"])
        sides[name]["role_seconds"] = {k: (v * n_old + res["role_seconds"].get(k, 0.0) * n_new) / (n_old + n_new)
                                       for k, v in sides[name]["role_seconds"].items()}


def thread_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    return env


# -------------------------------------------------------------------------------------- report
def summarize(side: dict) -> dict:
    secs, gen, toks = side["step_seconds"], side["generate_seconds"], side["generated_tokens"]
    total = sum(secs)
    return {"steps_per_s": len(secs) / total, "tokens_per_s": sum(toks) / total,
            "s_per_step": statistics.mean(secs), "s_per_step_median": statistics.median(secs),
            "s_per_step_min": min(secs), "generate_s_per_step": statistics.mean(gen),
            "generate_tokens_per_s": sum(toks) / sum(gen), "tokens_per_step": statistics.mean(toks)}


ROWS = [  # key, label, format, which way is better
    ("steps_per_s", "steps/s", "{:.3f}", "higher"),
    ("tokens_per_s", "generated tokens/s", "{:.0f}", "higher"),
    ("s_per_step", "s/step (mean)", "{:.3f}", "lower"),
    ("s_per_step_median", "s/step (median)", "{:.3f}", "lower"),
    ("s_per_step_min", "s/step (min)", "{:.3f}", "lower"),
    ("generate_s_per_step", "generate s/step", "{:.3f}", "lower"),
    ("generate_tokens_per_s", "generate-only tokens/s", "{:.0f}", "higher"),
    ("tokens_per_step", "generated tokens/step", "{:.0f}", "equal"),
]


def table(trl: dict, ry: dict) -> str:
    lines = [f"{'':24}{'TRL':>12}{'rollyard':>12}{'rollyard/TRL':>14}   better", "-" * 70]
    for key, label, fmt, better in ROWS:
        t, r = trl[key], ry[key]
        lines.append(f"{label:24}{fmt.format(t):>12}{fmt.format(r):>12}{r / t:>13.2f}x   {better}")
    return "\n".join(lines)


def round_ratios(rounds: list[dict]) -> list[float]:
    """rollyard / TRL steps/s of each round that ran both sides."""
    out = []
    for r in rounds:
        if "trl" in r and "rollyard" in r:
            out.append(summarize(r["rollyard"])["steps_per_s"] / summarize(r["trl"])["steps_per_s"])
    return out


def reward_curve(side: dict, key: str = "reward_rounds") -> list[float]:
    """Mean reward (or completion length) per step (warm-up steps included), averaged over rounds."""
    rounds = side[key]
    return [statistics.mean(r[i] for r in rounds) for i in range(min(map(len, rounds)))]


def learning_check(sides: dict) -> str:
    """Both reward curves and their gap; "equal" when the last half's means are within 2 std errors."""
    lines = []
    tails = {}
    for name in ("trl", "rollyard"):
        curve = reward_curve(sides[name])
        lines.append(f"reward/step {name:8}: " + " ".join(f"{x:.3f}" for x in curve))
        lines.append(f"length/step {name:8}: " + " ".join(f"{x:5.1f}" for x in reward_curve(sides[name], "length_rounds")))
        tails[name] = [x for r in sides[name]["reward_rounds"] for x in r[len(r) // 2:]]
    gap = statistics.mean(tails["rollyard"]) - statistics.mean(tails["trl"])
    se = math.sqrt(sum(statistics.pvariance(t) / len(t) for t in tails.values()))
    verdict = "equal within noise" if abs(gap) <= 2 * se + 1e-9 else ("rollyard higher" if gap > 0 else "rollyard LOWER")
    lines.append(f"learning check: last-half mean reward rollyard - TRL = {gap:+.3f} (2 s.e. {2 * se:.3f}): {verdict}; "
                 f"first step TRL {reward_curve(sides['trl'])[0]:.3f} / rollyard {reward_curve(sides['rollyard'])[0]:.3f}")
    return "\n".join(lines)


def report(label: str, sides: dict, rounds: list[dict], load: list[float], a) -> dict:
    summary = {name: summarize(side) for name, side in sides.items()}
    print()
    log(f"== {label}: 4 prompts x 8 samples = 32 completions/step, up to 64 new tokens, T=1.0, no KL, {a.precision}, "
        f"1 optimizer step/batch; {a.warmup} warm-up + {a.steps} timed steps per side and round, {a.rounds} round(s), "
        f"sides run one after the other; torch threads {a.threads} (set_num_threads + OMP/MKL_NUM_THREADS) on both sides")
    log(f"machine: {os.cpu_count()} CPUs, 1-min load average {' -> '.join(f'{x:.1f}' for x in load)} "
        f"(before, and after each side){'  WARNING: other work was running; numbers are noisy' if max(load) > a.threads + 1 else ''}")
    v = {**sides.get("rollyard", {}).get("versions", {}), **sides.get("trl", {}).get("versions", {})}
    log("versions: " + ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "trl") if k in v))
    for name, side in sides.items():
        log(f"{name} per-step seconds: " + " ".join(f"{x:.2f}" for x in side["step_seconds"]))
    if "rollyard" in sides:
        roles = sides["rollyard"]["role_seconds"]
        log("rollyard seconds/step by role: " + ", ".join(f"{k} {x:.3f}" for k, x in roles.items()))
        fl, peak = sides["rollyard"]["trainer_flops"], sides["rollyard"]["matmul_flops"]
        log("rollyard trainer efficiency (6 x params x positions trained / train seconds, per round): "
            + ", ".join(f"{f / 1e9:.1f} GFLOP/s = {f / p:.0%} of {p / 1e9:.1f}" for f, p in zip(fl, peak))
            + f" GFLOP/s measured matmul peak (1024^3 {a.precision}, same threads, right after the run)")
        if "trl" in sides:
            floor = statistics.mean(sides["rollyard"]["floor_seconds"])
            log(f"matmul floor of the step's work (matmul params x (2 x generated tokens + 6 x trained positions) at the "
                f"measured peak): {floor:.3f} s; rollyard's mean step is {summary['rollyard']['s_per_step'] / floor:.2f}x it; "
                f"the most any implementation could run vs TRL's mean step is {summary['trl']['s_per_step'] / floor:.2f}x")
    out = {"label": label, "sides": sides, "summary": summary}
    if len(summary) == 2:
        print()
        log(table(summary["trl"], summary["rollyard"]))
        ratios = round_ratios(rounds)
        out["round_ratios"] = ratios
        log(f"\n{label}: rollyard runs {summary['rollyard']['steps_per_s'] / summary['trl']['steps_per_s']:.2f}x "
            f"TRL's steps/s over all rounds; per round min {min(ratios):.2f}x / median {statistics.median(ratios):.2f}x"
            f" / max {max(ratios):.2f}x ({len(ratios)} rounds)")
        log(learning_check(sides))
    else:
        for name, x in summary.items():
            log(f"{name}: " + ", ".join(f"{lab} {fmt.format(x[key])}" for key, lab, fmt, _ in ROWS))
    return out


def run_pair(preset: str, case: str, py, a) -> dict:
    """All rounds of one (preset, case): inputs built once, sides alternating who goes first."""
    work = Path(tempfile.mkdtemp(prefix="vs-trl-"))
    try:
        model_dir, prompts = build_inputs(work, preset, case, n_prompts=64, seed=a.seed, allow_eos=a.allow_eos)
        sides: dict[str, dict] = {}
        rounds: list[dict] = []
        load = [os.getloadavg()[0]]
        for r in range(a.rounds):  # alternate the sides so drifting load on the machine hits both alike
            order = ["trl", "rollyard"] if r % 2 == 0 else ["rollyard", "trl"]
            rounds.append({})
            for name in order:
                if a.only and name != a.only:
                    continue
                rd = work / f"round{r}"
                rd.mkdir(exist_ok=True)
                res = (run_trl(py, model_dir, prompts, rd, a) if name == "trl"
                       else run_rollyard(model_dir, prompts, rd, a))
                rounds[-1][name] = {k: (list(x) if isinstance(x, list) else x) for k, x in res.items()}
                merge(sides, name, res)
                load.append(os.getloadavg()[0])
    finally:
        if a.keep:
            log(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    length = "EOS at varying lengths (warm-started)" if case == "varlen" else (
        "real EOS" if a.allow_eos else "EOS unreachable: every completion is 64 tokens")
    return report(f"{preset} / {case} / {a.precision} ({length})", sides, rounds, load, a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--steps", type=int, default=5, help="timed optimizer steps per side (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed leading steps per side (default 1)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for both sides (default 2)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the pair this many times, alternating which side goes first (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--presets", nargs="+", choices=["tiny", "small"], default=["tiny"],
                    help="model presets to run (default tiny)")
    ap.add_argument("--cases", nargs="+", choices=["uniform", "varlen"], default=["uniform"],
                    help="uniform: every completion 64 tokens (EOS unreachable); varlen: a warm-started model whose "
                         "completions end at EOS at different lengths (default uniform)")
    ap.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["bf16", "fp32"],
                    help="bf16: both sides in bf16 mixed precision (TRL: bf16=True, what GRPOConfig defaults to; "
                         "rollyard: trainer.precision=bf16 + rollout.dtype=bf16); fp32: both sides in fp32 "
                         "(default: both, bf16 first). Matmuls in bf16 run ~2-4x faster than fp32 on CPUs with "
                         "AVX512-BF16/AMX")
    ap.add_argument("--allow-eos", action="store_true", help="uniform case: keep the model's EOS (completions may end early)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra rollyard config override (repeatable), e.g. --set trainer.micro_batch_tokens=1024")
    ap.add_argument("--only", choices=["trl", "rollyard"], help="run one side only (no table)")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"TRL's virtual environment (default {DEFAULT_VENV.relative_to(ROOT)})")
    ap.add_argument("--trl-python", type=Path,
                    help="run TRL's side with this interpreter instead (trl + datasets already importable; no venv is made)")
    ap.add_argument("--trl-spec", nargs="+", default=TRL_SPECS, help=f"what to pip install there after torch (default: {' '.join(TRL_SPECS)})")
    ap.add_argument("--json", type=Path, help="also write the raw per-step numbers and the summary here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (model, prompts, run dirs)")
    a = ap.parse_args(argv)
    from rollyard.config import env_error

    if why := env_error():  # a bad ROLLYARD_* setting: one line, exit 2
        ap.exit(2, f"{ap.prog}: error: {why}\n")
    if a.steps < 1 or a.warmup < 1 or a.rounds < 1:
        ap.error("--steps, --warmup and --rounds must be >= 1 (the warm-up step is what the first timed step is measured from)")

    for k, v in thread_env(a.threads).items():  # before torch is imported here
        os.environ[k] = v
    py = None
    if a.only != "rollyard":
        py = a.trl_python or ensure_trl_venv(a.venv, a.trl_spec)

    results = []
    for precision in a.precisions:
        a.precision = precision
        results += [run_pair(preset, case, py, a) for preset in a.presets for case in a.cases]
    if len(results) > 1 and all("round_ratios" in r for r in results):
        print()
        log("summary (rollyard / TRL steps/s per round: min / median / max):")
        for r in results:
            x = r["round_ratios"]
            log(f"  {r['label']:60} {min(x):.2f}x / {statistics.median(x):.2f}x / {max(x):.2f}x")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": {k: str(x) for k, x in vars(a).items()}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
