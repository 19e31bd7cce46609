"""The run directory format: the one place that names its files and record fields.

A run writes these files and ``rollyard review`` reads them; both sides import the names from
here so the format cannot drift.

```
RUN_DIR/
  config.yaml        the resolved config (every default filled in)
  metrics.jsonl      one JSON object per step: {"step": int, "<group>/<name>": float, ...}
  spans.jsonl        one JSON object per span:  {"role", "step", "worker", "start", "end"}
                     (seconds, wall clock ``time.time()``), plus optional "version" fields
  traffic.jsonl      one JSON object per (step, edge): {"step", "edge", "bytes", "count"}
                     written every step for every edge in EDGES, zero bytes included
  trace.json         Chrome trace event format (loads in Perfetto), made from spans.jsonl
  lengths.jsonl      one JSON object per step: {"step", "response_lengths": [int, ...]}, plus optional
                     "prompt_lengths": [int, ...] (tokens per prompt; review prices the prompts edge from it)
  run.json           written at start: the facts `plan`/`review` need (RUN_INFO_KEYS)
  deadletter.jsonl   prompts and samples that were set aside, with their reason
  summary.json       written at the end: eval accuracy before/after, role shares, totals (whole run,
                     every session of it)
  reward_errors.json per failure kind ("timeout", "error: ValueError", ...): count and first texts
  run.lock           held (flock) by the process training in this directory
  summary.json       written at the end: eval accuracy before/after (null: no held-out set), role shares, totals
  eval.jsonl         one JSON object per held-out eval: {"step", "accuracy"} (step 0 = before RL)
  completions.jsonl  every log.completions_every steps, per sample: {"step", "id", "prompt", "completion",
                     "reward", "rewards" (per hook), "version", "finish_reason"}
  plots/*.png        written by `rollyard report` (and at the end of train)
  tensorboard/       TensorBoard event files (log.tensorboard)
  checkpoints/step_NNNNNN/   model, optimizer, RNG, step, weight version, dataset cursor
  model/             the final policy as a Hugging Face directory
```
"""

from __future__ import annotations

import fcntl
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SPANS = "spans.jsonl"
TRAFFIC = "traffic.jsonl"
TRACE = "trace.json"
DEADLETTER = "deadletter.jsonl"
SUMMARY = "summary.json"
LENGTHS = "lengths.jsonl"
RUN_INFO = "run.json"
REWARD_ERRORS = "reward_errors.json"
LOCK = "run.lock"
EVAL = "eval.jsonl"
COMPLETIONS = "completions.jsonl"
PLOTS = "plots"
CHECKPOINTS = "checkpoints"
MODEL = "model"

# The roles that get a span every step (seed 002: per-role wall-clock attribution), in the step's order; a run has
# the ones its settings use (reference: a KL term; teacher: a distillation objective; teacher_sample: GKD's seq_kd,
# the steps where the teacher samples completions).
ROLES = ("rollout", "reward", "reference", "teacher_sample", "teacher", "algorithm", "train", "sync")

# Every edge of the step's data path (runbook step 1): name -> (source, destination, payload,
# trigger). The traffic ledger has one row per edge per step; the planner predicts the same names.
EDGES: dict[str, tuple[str, str, str, str]] = {
    "prompts": ("dataset", "rollout", "prompt token ids (int32)", "per step"),
    "samples": ("rollout", "trainer", "token ids (int32) + logprobs (fp32) + versions (int32)", "per step"),
    "rewards": ("reward", "trainer", "one fp32 reward per sample", "per step"),
    "ref_logprobs": ("reference", "trainer", "fp32 logprob per completion token", "per step"),
    "teacher_logprobs": ("teacher", "trainer", "fp32 teacher logprob per completion token (distillation); gkd: + top-k int32 ids and fp32 logprobs", "per step"),
    "weights": ("trainer", "rollout", "weight update (full | delta | lora)", "per sync"),
    "gradients": ("trainer", "trainer", "ring all-reduce of gradients", "per optimizer step"),
    "gather": ("trainer", "trainer", "all-gather of sharded (fsdp) parameters before a sync", "per sync"),
    "tools": ("rollout", "tools", "tool calls out (name + JSON arguments) and outputs back (UTF-8)", "per tool call"),
}

# run.json: key -> meaning. Written once at start by the driver; `review` builds its default
# plan from these when no --plan is given.
RUN_INFO_KEYS = {
    "policy_params": "number of policy parameters",
    "bytes_per_param": "bytes per parameter in the synced (rollout) dtype",
    "placement": "colocated | disaggregated | async",
    "sync_mode": "inprocess | full | delta | lora",
    "dp": "trainer data-parallel width",
    "prompts_per_step": "prompts per step",
    "samples_per_prompt": "samples per prompt (GRPO group size)",
    "max_new_tokens": "response token cap",
    "staleness_bound": "largest allowed (trainer version - sample version); 0 = on-policy",
    "lora_fraction": "adapter parameters / base parameters (null when not LoRA)",
    "steps": "optimizer steps the run was configured for",
}

# run.json: placement facts beyond RUN_INFO_KEYS (not required by review; older runs lack them).
RUN_INFO_EXTRA = {
    "sync_transport": "inprocess | ray (how weights reach the rollout side)",
    "sync_every": "optimizer steps between weight publishes",
    "weight_tensors": "tensors a full sync carries (each adds a wire header entry)",
    "lora_tensors": "tensors a LoRA sync carries: lora_A, lora_B, scaling per adapted module (null when not LoRA)",
    "rollout_workers": "rollout worker processes (0 when colocated)",
    "inflight": "what in-flight sequences do when weights arrive: finish | abort | continue",
    "kernels": "numerics-relevant kernel/GEMM choices (rollyard.model.kernels.choices; by shape and CPU features)",
    "teacher_params": "the distillation teacher's parameters (absent or null: no teacher; algo.objective=rl)",
    "teacher": "the teacher as loaded: teacher.model and the hash of its weights (absent: no teacher)",
    "tools": "the run's tools (import paths) or environment class: rollouts and the held-out eval are multi-turn with them (null: single-turn)",
}

# run.json keys a reader must not require (runs written before them lack them).
RUN_INFO_OPTIONAL_KEYS = {
    "precision": "fp32 | bf16: the trainer's matmul precision (trainer.precision, auto resolved)",
    "precision_reason": "why: the setting, or auto's rule on this device (an explicit bf16 on a CPU without native bf16 says it is emulated)",
    "sharding": "none | fsdp (trainer parameters sharded over the dp ranks); absent = none",
    "dp_backend": "gloo | nccl: the trainer ranks' collectives (null at dp=1)",
    "device": "cpu | gpu: where the trainer and the rollout engines ran (review prices the sync's software terms for it)",
    "backend": "native | vllm: the rollout engine (rollout.backend)",
    "accuracy_signal": "what scores the held-out eval (evaluate.accuracy_signal); null: no correctness signal, no held-out accuracy",
}

# Metric keys that review and the progress display rely on.
TIME_KEY = "time/{role}"          # seconds spent in the role this step
STEP_TIME = "time/step"           # wall-clock seconds of the whole step
OUTSIDE_ROLES = "timeline/outside_roles"  # seconds of the step's wall time in no span of the driver's (bookkeeping, the
# metrics row, a checkpoint's snapshot): time/step less the union of the driver's spans over the step
STALENESS_MAX = "staleness/max"   # largest (trainer version - sample version) in the batch
# Also per step: staleness/hist (sample counts per lag 0, 1, ...), staleness/mean, staleness/dropped
# (groups dropped at consumption and requeued), staleness/mixed_samples (samples spanning an update).


def strict_json(obj: Any, indent: int | None = 1) -> str:
    """``obj`` as standard JSON: NaN and infinities (which ``json.dumps`` writes as bare ``NaN``, not
    JSON) become null, so any JSON reader accepts the file."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    return json.dumps(clean(obj), indent=indent, allow_nan=False)


class RunDirError(ValueError):
    """A run directory is missing, truncated or not a rollyard run."""


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yield records; a line that does not parse is an error naming file and line."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise RunDirError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); the file is truncated or was "
                    f"written by something else. Re-run the step or remove the broken line."
                ) from None


def require(run_dir: str | Path, *names: str) -> Path:
    """Check ``run_dir`` exists and holds ``names``; return it as a Path."""
    run = Path(run_dir)
    if not run.is_dir():
        raise RunDirError(f"run directory {run} does not exist; pass the directory `rollyard train` wrote")
    missing = [n for n in names if not (run / n).exists()]
    if missing:
        raise RunDirError(
            f"{run} is not a complete rollyard run: missing {', '.join(missing)} "
            f"(expected files: {', '.join(names)}); the run may have crashed before its first step"
        )
    return run


# Files of per-step records ("step" field). On resume each is cut back to the checkpoint's step
# before the resumed session appends, so no step is recorded twice.
STEP_RECORDS = (METRICS, SPANS, TRAFFIC, LENGTHS, DEADLETTER, COMPLETIONS, EVAL)
# eval.jsonl's "step" counts the optimizer steps done before the eval (0: before RL), so an eval
# at the checkpoint's own step happened before the checkpoint and is kept.
_UP_TO_STEP = (EVAL,)


def truncate_records(run_dir: str | Path, step: int) -> dict[str, int]:
    """Keep only records of steps ``< step`` (eval: ``<= step``) in every STEP_RECORDS file; return lines
    dropped per file.

    A torn line (a crash mid-write) is dropped wherever it is. Records without a step (start-up
    dead letters) are dropped too: the resumed start writes them again. Each file is rewritten
    atomically (tmp + rename), so a crash here leaves either the old or the new file.
    """
    dropped: dict[str, int] = {}
    for name in STEP_RECORDS:
        path = Path(run_dir) / name
        if not path.exists():
            continue
        keep, lost = [], 0
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    lost += bool(line.strip())
                    continue
                last = step if name in _UP_TO_STEP else step - 1
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= last:
                    keep.append(json.dumps(rec) + "\n")
                else:
                    lost += 1
        if lost:
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text("".join(keep))
            os.replace(tmp, path)
            dropped[name] = lost
    return dropped


_HELD: dict[str, int] = {}  # resolved run dir -> fd of its lock file, for the locks this process holds


def lock(run_dir: str | Path) -> None:
    """Take an exclusive ``flock`` on ``RUN_DIR/run.lock`` for this process (re-entrant within it).

    The kernel drops the lock when the holder dies (kill -9 included), so a stale lock file never
    blocks a resume; a second live process on the same directory gets a RunDirError.
    """
    key = str(Path(run_dir).resolve())
    if key in _HELD:
        return
    fd = os.open(Path(run_dir) / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RunDirError(f"run directory {run_dir} is in use by another rollyard process (pid {holder}); "
                          f"wait for it to finish or stop it, or choose another out_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _HELD[key] = fd


def unlock(run_dir: str | Path) -> None:
    fd = _HELD.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        os.close(fd)
