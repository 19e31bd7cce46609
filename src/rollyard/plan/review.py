"""`rollyard review`: hold a measured run against its plan (the runbook's Verification).

- the run's shape (run.json) against the plan's: a plan of another workload does not describe it;
- per-phase step breakdown from spans.jsonl against the plan's budget, two-sided (a phase more
  than the tolerance over *or under* its budget is flagged);
- overlap audit: for each pair of roles, seconds of overlap in the timeline;
- staleness audit: the largest ``staleness/max`` against the bound (absent: not checked);
- traffic audit: the bytes the runtime measured where they crossed (traffic.jsonl: the weight
  transport's own count, the encoded samples) against the plan's independent prediction (the
  plan's formulas from run.json's sync mode and the measured token counts; never the runtime's);
- records: every step once in each step file, as many as summary.json says (``audit.records``);
- memory: each role's measured peak against the tensors the plan prices for it (``memory_item``).

Without ``--plan`` the plan is built from run.json (+ config.yaml, measured token counts), and
there is no phase budget: the budget item reads "not checked", which ``--check`` counts as a failure.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

import yaml

from rollyard.config import ConfigError
from rollyard.model.kv_budget import micro_batch_held
from rollyard.plan import audit
from rollyard.plan import bytes as B
from rollyard.plan.inputs import PLACEMENTS, PlanInputs, load_plan, optimizer_passes, validate_plan
from rollyard.plan.phases import term_parts
from rollyard.plan.planner import Plan, make_plan
from rollyard.telemetry import rundir
from rollyard.telemetry.rundir import RunDirError

PASS, FAIL, NOT_CHECKED = "PASS", "FAIL", "NOT CHECKED"
# Traffic: counts are exact; what a prediction cannot know is the prompt tokens of rounds handed out
# ahead of the last trained step (priced at the trained prompts' mean: one round in steps + 1 at a
# spread of prompt lengths well under 100% is under 20% of the edge for runs of 4 steps and more).
TRAFFIC_TOLERANCE = 0.2
NOISE_FLOOR = 0.01  # a phase is over budget only by more than 1% of the planned step as well (timer noise)


# ---- reading a run ----

@dataclass
class Run:
    path: Path
    info: dict[str, Any]
    config: dict[str, Any]
    spans: list[dict]
    metrics: list[dict]
    traffic: list[dict]
    lengths: dict[int, list[int]]
    prompt_lengths: dict[int, list[int]]
    length_records: list[dict] | None = None  # lengths.jsonl as written (None: no such file)
    summary: dict[str, Any] | None = None  # summary.json (None: the run did not finish)
    deadletters: int | None = None  # records in deadletter.jsonl (0 when the file is absent)


NUMERIC = {"start", "end", "bytes"}


def _records(run: Path, name: str, fields: tuple[str, ...], required: bool = True) -> list[dict]:
    """Every record of a JSONL file, each checked to hold ``fields`` (times and byte counts numeric)."""
    path = run / name
    if not path.exists():
        if required:
            raise RunDirError(f"{run} is not a complete rollyard run: {name} is missing")
        return []
    out = []
    for i, rec in enumerate(rundir.read_jsonl(path), 1):
        missing = [f for f in fields if not isinstance(rec, dict) or f not in rec]
        if missing:
            raise RunDirError(f"{path}: record {i} lacks {', '.join(missing)} (expected fields: "
                              f"{', '.join(fields)}); the file was not written by rollyard or is damaged")
        bad = [f for f in fields if f in NUMERIC and not isinstance(rec[f], (int, float))]
        if bad:
            raise RunDirError(f"{path}: record {i} has non-numeric {', '.join(f'{f}={rec[f]!r}' for f in bad)}; "
                              f"the file is damaged")
        out.append(rec)
    if required and not out:
        raise RunDirError(f"{path} holds no records: the run stopped before its first step")
    return out


def read_lengths(run_dir: str | Path, required: bool = True) -> dict[int, list[int]]:
    """step -> response lengths from lengths.jsonl."""
    run = Path(run_dir)
    if required:
        rundir.require(run, rundir.LENGTHS)
    recs = _records(run, rundir.LENGTHS, ("step", "response_lengths"), required=required)
    return {int(r["step"]): [int(n) for n in r["response_lengths"]] for r in recs}


def read_run(run_dir: str | Path, need_info: bool = True) -> Run:
    names = (rundir.SPANS, rundir.METRICS, rundir.TRAFFIC) + ((rundir.RUN_INFO,) if need_info else ())
    run = rundir.require(run_dir, *names)
    info: dict[str, Any] = {}
    if (run / rundir.RUN_INFO).exists():
        try:
            info = json.loads((run / rundir.RUN_INFO).read_text())
        except json.JSONDecodeError as e:
            raise RunDirError(f"{run / rundir.RUN_INFO}: not valid JSON ({e.msg}); the run's start was cut short") from None
        missing = [k for k in rundir.RUN_INFO_KEYS if k not in info] if need_info else []
        if missing:
            raise RunDirError(f"{run / rundir.RUN_INFO} lacks {', '.join(missing)}; pass --plan FILE to review "
                              f"against a plan file instead")
    config: dict[str, Any] = {}
    if (run / rundir.CONFIG).exists():
        try:
            config = yaml.safe_load((run / rundir.CONFIG).read_text()) or {}
        except yaml.YAMLError as e:
            raise RunDirError(f"{run / rundir.CONFIG} does not parse: {e}") from None
    recs = _records(run, rundir.LENGTHS, ("step", "response_lengths"), required=False)
    summary = None
    if (run / rundir.SUMMARY).exists():
        try:
            summary = json.loads((run / rundir.SUMMARY).read_text())
        except json.JSONDecodeError as e:
            raise RunDirError(f"{run / rundir.SUMMARY}: not valid JSON ({e.msg}); the run's finish was cut short "
                              f"or the file was edited") from None
        if not isinstance(summary, dict):
            raise RunDirError(f"{run / rundir.SUMMARY}: expected a JSON object, got {type(summary).__name__}")
    dead = run / rundir.DEADLETTER
    return Run(
        path=run, info=info, config=config if isinstance(config, dict) else {},
        spans=_records(run, rundir.SPANS, ("role", "step", "start", "end")),
        metrics=_records(run, rundir.METRICS, ("step",)),
        traffic=_records(run, rundir.TRAFFIC, ("step", "edge", "bytes")),
        lengths={int(r["step"]): [int(n) for n in r["response_lengths"]] for r in recs},
        prompt_lengths={int(r["step"]): [int(n) for n in r["prompt_lengths"]] for r in recs if "prompt_lengths" in r},
        length_records=recs if (run / rundir.LENGTHS).exists() else None, summary=summary,
        deadletters=sum(1 for _ in rundir.read_jsonl(dead)) if dead.exists() else 0,
    )


# ---- measurements ----

def phase_seconds(spans: list[dict]) -> dict[str, list[float]]:
    """role -> seconds per step (0 where a step has no span of that role), steps in order."""
    steps = sorted({int(s["step"]) for s in spans})
    per: dict[tuple[int, str], float] = {}
    for s in spans:
        key = (int(s["step"]), s["role"])
        per[key] = per.get(key, 0.0) + max(float(s["end"]) - float(s["start"]), 0.0)
    roles = [r for r in rundir.ROLES if any(s["role"] == r for s in spans)]
    roles += sorted({s["role"] for s in spans} - set(roles))
    return {r: [per.get((k, r), 0.0) for k in steps] for r in roles}


def steady(per_step: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each role's per-step seconds after the first step, which carries one-off start-up costs that no
    per-step budget prices: the rollout engine's start (a vLLM engine: 5-10 s here against ~0.1 s
    steps of a tiny model), first transfers, allocator and kernel warm-up. A one-step run keeps its
    only step. Budgets are set (``calibrate``) and held (``review``) on the same steady state."""
    return {r: (v[1:] if len(v) > 1 else v) for r, v in per_step.items()}


def step_seconds(run: Run) -> list[float]:
    """Wall-clock per step: metrics' time/step, else the extent of the step's spans."""
    vals = [float(m[rundir.STEP_TIME]) for m in run.metrics if isinstance(m.get(rundir.STEP_TIME), (int, float))]
    if vals:
        return vals
    ext: dict[int, list[float]] = {}
    for s in run.spans:
        e = ext.setdefault(int(s["step"]), [float(s["start"]), float(s["end"])])
        e[0], e[1] = min(e[0], float(s["start"])), max(e[1], float(s["end"]))
    return [b - a for a, b in ext.values()]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_audit(spans: list[dict], required: list[tuple[str, str, str]]) -> list[dict]:
    """Every pair of roles: seconds both were running, and whether the design needs them to overlap."""
    by_role: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        by_role.setdefault(s["role"], []).append((float(s["start"]), float(s["end"])))
    unions = {r: _union(v) for r, v in by_role.items()}
    busy = {r: sum(b - a for a, b in u) for r, u in unions.items()}
    need = {frozenset((a, b)): why for a, b, why in required}
    roles = [r for r in rundir.ROLES if r in unions] + sorted(set(unions) - set(rundir.ROLES))
    for a, b, _ in required:  # a designed pair is audited even if a role never ran
        for r in (a, b):
            if r not in roles:
                roles.append(r)
                unions[r], busy[r] = [], 0.0
    rows = []
    for a, b in combinations(roles, 2):
        sec = _intersection(unions[a], unions[b])
        shorter = min(busy[a], busy[b])
        overlapped = sec > 0 and sec >= 0.01 * shorter
        must = frozenset((a, b)) in need
        rows.append({"a": a, "b": b, "overlap_s": sec, "of_shorter": sec / shorter if shorter else 0.0,
                     "verdict": "overlapped" if overlapped else "serialized", "must_overlap": must,
                     "ok": overlapped or not must})
    return rows


def pipelined_steps(spans: list[dict], bound: int = 1) -> tuple[int, int, list[int]]:
    """Designed rollout/train overlap, judged step by step: step ``s`` is pipelined when the rollout
    of round ``s + 1`` started before step ``s``'s training ended (the rollout pool did not wait for
    the trainer). Seconds of overlap alone mislead on short runs: a round that decodes in less time
    than the driver spends scoring finishes before training starts although the pools ran
    concurrently. A step is judged only if the weights round ``s + 1`` needs (version
    ``s + 1 - bound``, the admission rule) had reached a rollout worker before step ``s``'s training
    ended: otherwise the round waited on the weight transfer, not on the trainer (a trainer step
    shorter than a sync's latency), which the sync budget prices. Nor is a step whose next round the
    driver handed out (``handed_out`` on the round's rollout spans, the driver's clock) before its
    training began, yet whose worker started only after training ended: the driver did not hold the
    round back, and the run cannot tell a worker process the machine did not schedule in time (a
    loaded machine against a training step of milliseconds) from a wait inside the worker. Returns
    (pipelined, judged, serialized steps)."""
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    began: dict[int, float] = {}  # step -> its training's first start
    handed: dict[int, float] = {}  # round -> when the driver handed it out
    applied: list[tuple[int, float]] = []  # (version, time a worker held it)
    for s in spans:
        k = int(s["step"])
        if s["role"] == "rollout":
            starts[k] = min(starts.get(k, math.inf), float(s["start"]))
            if s.get("handed_out") is not None:
                handed[k] = min(handed.get(k, math.inf), float(s["handed_out"]))
        elif s["role"] == "train":
            ends[k] = max(ends.get(k, -math.inf), float(s["end"]))
            began[k] = min(began.get(k, math.inf), float(s["start"]))
        elif s["role"] == "sync" and s.get("worker", "driver") != "driver" and isinstance(s.get("version"), int):
            applied.append((s["version"], float(s["end"])))
    first = min((int(s["version"]) for s in spans if s["role"] == "rollout" and isinstance(s.get("version"), int)),
                default=0)

    def ready(version: int) -> float:
        if version <= first:
            return -math.inf
        return min((t for v, t in applied if v >= version), default=math.inf)

    def worker_late(k: int) -> bool:
        return starts[k + 1] >= ends[k] and handed.get(k + 1, math.inf) < began[k]

    judged = [k for k in sorted(ends) if k + 1 in starts and ready(k + 1 - bound) < ends[k] and not worker_late(k)]
    serial = [k for k in judged if starts[k + 1] >= ends[k]]
    return len(judged) - len(serial), len(judged), serial


# ---- predictions ----

def run_backend(run: Run) -> str:
    """The rollout engine the run's weight syncs loaded into: config.yaml's ``rollout.backend`` (runs
    written before the vLLM backend existed have none: native)."""
    backend = (run.config.get("rollout") or {}).get("backend", "native")
    if backend not in ("native", "vllm"):
        raise RunDirError(f"{run.path / rundir.CONFIG}: rollout.backend = {backend!r}, expected native or vllm; "
                          f"the file is damaged or from a newer rollyard")
    return backend


def plan_from_run(run: Run) -> PlanInputs:
    """The plan a run implies: run.json facts, measured token counts and measured phase means."""
    info = run.info
    lengths = [n for v in run.lengths.values() for n in v]
    avg = sum(lengths) / len(lengths) if lengths else float(info["max_new_tokens"])
    prompts = [n for v in run.prompt_lengths.values() for n in v]
    secs = {r: sum(v) / len(v) for r, v in steady(phase_seconds(run.spans)).items() if v}
    kl = float((run.config.get("algo") or {}).get("kl_coef") or 0.0)
    use_ref = kl > 0 or "reference" in secs
    mode = info.get("sync_mode")
    step_s = steady({"step": step_seconds(run)})["step"]
    step = sum(step_s) / max(len(step_s), 1)
    data = {
        "name": f"run {run.path.name}",
        "placement": info["placement"] if info.get("placement") in PLACEMENTS else "auto",
        "policy": {"params": info["policy_params"], "bytes_per_param": info["bytes_per_param"],
                   "lora": mode == "lora", **({"lora_fraction": info["lora_fraction"]} if info.get("lora_fraction") else {}),
                   # tensors a sync carries (the per-tensor terms of the sync's price; runs before them lack them)
                   **{k: info[k] for k in ("weight_tensors", "lora_tensors") if isinstance(info.get(k), int)}},
        "trainer": {"dp": info["dp"]},
        "rollout": {"backend": run_backend(run), **({"device": info["device"]} if info.get("device") in ("cpu", "gpu") else {}),
                    "gpus": info["dp"], "prompts": info["prompts_per_step"],
                    "samples": info["samples_per_prompt"],
                    "avg_tokens": max(avg, 1e-9), "prompt_tokens": sum(prompts) / len(prompts) if prompts else 0},
        "sync": {"staleness_bound": info["staleness_bound"],
                 "mode": mode if mode in ("full", "delta", "lora") else "auto",
                 "per_hour": 3600.0 / step if step > 0 else 60},
        # A role with no measurable time is left to the plan's estimate (times must be > 0).
        "phases": {"rollout_s": secs.get("rollout") or None, "reward_s": secs.get("reward", 0.0),
                   "reference_s": secs.get("reference", 0.0), "train_s": secs.get("train") or None,
                   "algorithm_s": secs.get("algorithm", 0.0), "use_reference": use_ref,
                   "reference_placement": (run.config.get("reference") or {}).get("placement", "inline"),
                   **_teacher_phases(run, secs)},
        "tail": {"max_tokens": int(info["max_new_tokens"]), "steps": 16},
    }
    data = _with_shape(run, data)
    try:
        return validate_plan(data)
    except ConfigError as e:  # a run.json value out of bounds: say which file
        raise RunDirError(f"{run.path / rundir.RUN_INFO}: cannot build a plan from it: {e}") from None


def model_shape(run: Run) -> dict[str, float]:
    """The exported model's shape (RUN_DIR/model/config.json, Hugging Face names): layers, hidden,
    vocab and KV bytes per token in the run's dtype; {} when the file is absent or lacks them."""
    path = run.path / rundir.MODEL / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    try:
        layers, hidden, vocab = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["vocab_size"])
        heads = int(cfg.get("num_attention_heads") or 1)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError):
        return {}
    nbytes = float(run.info.get("bytes_per_param") or 2)
    return {"layers": layers, "hidden": hidden, "vocab": vocab, "kv_bytes_per_token": layers * kv_heads * head_dim * 2 * nbytes}


def _with_shape(run: Run, data: dict) -> dict:
    """A run-implied plan with the run's model shape and micro-batch (its memory prediction)."""
    shape = model_shape(run)
    if shape:
        data["policy"].update({k: shape[k] for k in ("layers", "hidden", "vocab")})
        data["rollout"]["kv_bytes_per_token"] = shape["kv_bytes_per_token"]
    tr = run.config.get("trainer") or {}
    if isinstance(tr.get("micro_batch_tokens"), int) and tr["micro_batch_tokens"] >= 1:
        # a micro-batch holds at most a step's batch: the largest the run computed (train/packed_tokens)
        held = max((int(m["train/packed_tokens"]) for m in run.metrics
                    if isinstance(m.get("train/packed_tokens"), (int, float))), default=0)
        data["trainer"]["micro_batch_tokens"] = micro_batch_held(tr["micro_batch_tokens"], held)  # the start-up check's rule
    if isinstance(tr.get("logprob_chunk"), int) and tr["logprob_chunk"] >= 1:
        data["trainer"]["logits_tokens"] = tr["logprob_chunk"]
    # trainer.activation_checkpointing keeps each layer's input only (the plan's checkpointing); the logit chunks
    # are recomputed either way
    data["trainer"]["activation_checkpointing"] = tr.get("activation_checkpointing") in (True, "auto")
    # What the trainer computed (trainer.useful_work; a run before it computed every position): each group's
    # prompt once, and the samples it skipped (the run's mean train/skipped_frac).
    data["trainer"]["prefix_shared"] = tr.get("useful_work") is True
    # How many times the run trained on each generation batch (trainer.epochs x trainer.mini_batches; one each for a
    # run before them): an estimated train phase pays each epoch, and more than one optimizer step per batch makes
    # the trainer compute the old policy's logprobs (inputs.optimizer_passes)
    data["trainer"]["epochs"], data["trainer"]["optimizer_minibatches"] = optimizer_passes(tr)
    skipped = [float(m["train/skipped_frac"]) for m in run.metrics if isinstance(m.get("train/skipped_frac"), (int, float))]
    data["trainer"]["zero_advantage_share"] = min(sum(skipped) / len(skipped), 0.99) if skipped else 0.0
    if run.info.get("sharding") == "fsdp":
        data["trainer"]["sharding"] = "fsdp"
    return data


# Memory: a measured peak per role against the plan's prediction. A run measures each
# role's peak resident set (telemetry/memory.py: host RSS of the process while the role's span was open);
# the plan prices the tensors a role holds (weights, optimizer state, activations, KV cache). A process
# holds at least its tensors, so on a CPU (tensors in host memory) the measured peak must reach the
# prediction, within a tolerance; what it holds beyond them (interpreter, libraries, allocator) has no
# price, so there is no upper bound. On a GPU the tensors are in device memory, which RSS does not see.
MEMORY_TOLERANCE = 0.5
MEMORY_KEY = "memory_peak_gb"  # summary.json: {role: GB}; metrics.jsonl: memory/<role>_peak_gb per step
GPU_MEMORY_KEY = "memory_gpu_peak_gb"  # on CUDA: PyTorch's device memory; memory/<role>_gpu_peak_gb per step
TRAINER_ROLES = ("train", "trainer", "reference", "teacher", "teacher_sample", "algorithm")


def measured_memory(run: Run, gpu: bool = False) -> dict[str, float]:
    """role -> peak GB over the run: summary.json's memory_peak_gb (``gpu``: memory_gpu_peak_gb), else the
    largest ``memory/<role>_peak_gb`` (``_gpu_peak_gb``) in metrics.jsonl; {} when the run measured none."""
    got = (run.summary or {}).get(GPU_MEMORY_KEY if gpu else MEMORY_KEY)
    if isinstance(got, dict):
        return {str(k): float(v) for k, v in got.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out: dict[str, float] = {}
    suffix = "_gpu_peak_gb" if gpu else "_peak_gb"
    for m in run.metrics:
        for k, v in m.items():
            if (k.startswith("memory/") and k.endswith(suffix) and (gpu or not k.endswith("_gpu_peak_gb"))
                    and isinstance(v, (int, float))):
                role = k[len("memory/"):-len(suffix)]
                out[role] = max(out.get(role, 0.0), float(v))
    return out


def memory_item(run: Run, plan: Plan) -> dict | None:
    """'Memory per role holds what the plan prices': each trainer or rollout role's measured peak against
    the bytes its pool holds per the plan (trainer roles: model + optimizer + reference + activations;
    rollout: weights + KV cache; colocated: both pools in one process, so their sum). A peak below the
    prediction by more than the tolerance FAILs (the plan prices tensors the process never held). On a CPU
    the peak is the resident set; on a GPU PyTorch's allocated device memory (telemetry/memory.py), and
    where a GPU run has only host RSS (a Ray actor's, an older run): NOT CHECKED. None when nothing was measured."""
    on_gpu = run.info.get("device") not in (None, "cpu")
    measured = measured_memory(run, gpu=on_gpu) if on_gpu else measured_memory(run)
    if on_gpu and not measured and measured_memory(run):
        return {"item": "Memory per role holds what the plan prices", "result": NOT_CHECKED,
                "evidence": "the run measured host memory (RSS) only; the plan prices the tensors in GPU memory"}
    if not measured or plan.memory is None:
        return None
    pools = plan.memory.roles()
    colocated = (run.info.get("placement") or plan.placement) == "colocated"
    what = "GB of GPU memory" if on_gpu else "GB"
    rows, bad, other = [], [], []
    for role, gb in sorted(measured.items()):
        pool = "trainer" if role in TRAINER_ROLES else ("rollout" if role.startswith("rollout") else None)
        if pool is None:
            other.append(f"{role} {gb:.3g} {what}")
            continue
        pred = (pools["trainer"] + pools["rollout"] if colocated else pools[pool]) / 1e9
        rows.append(f"{role} {gb:.3g} {what} measured vs {pred:.3g} GB of tensors planned"
                    + (f" (+{gb - pred:.3g} GB the process holds beyond them)" if gb >= pred else ""))
        if gb < pred / (1 + MEMORY_TOLERANCE):
            bad.append(rows[-1])
    item = "Memory per role holds what the plan prices"
    tail = f"; not priced: {', '.join(other)}" if other else ""
    if not rows:
        return {"item": item, "result": NOT_CHECKED, "evidence": "no trainer or rollout peak measured" + tail}
    if bad:
        return {"item": item, "result": FAIL, "evidence": f"a peak below the plan's tensors by more than "
                f"{1 + MEMORY_TOLERANCE:g}x, so the plan does not describe this run: " + "; ".join(bad) + tail}
    return {"item": item, "result": PASS, "evidence": "; ".join(rows) + tail}


def rounds_ahead(info: dict[str, Any]) -> int:
    """Rounds of prompts a split placement hands out beyond the last trained step: the rollout pool
    fills rounds up to ``step + 1`` (disaggregated) or ``step + bound + 1`` (async) at every step
    (placement/disaggregated.py, async_.py), so the prompts edge counts those prompts although no
    step trains on them. Colocated takes exactly one round per step."""
    if not info.get("rollout_workers") or info.get("placement") not in ("disaggregated", "async"):
        return 0
    return 1 if info["placement"] == "disaggregated" else int(info.get("staleness_bound") or 0) + 1


def run_structure(info: dict[str, Any], predicted: dict[str, tuple[float | None, str]], plan: Plan,
                  steps: int) -> dict[str, tuple[float | None, str]]:
    """What a plan file's per-step edges leave out of a whole run, from run.json: the rounds of prompts
    a split pool hands out ahead (``rounds_ahead``) and the full sync a run opens with."""
    out = {}
    ahead = rounds_ahead(info)
    per = plan.bytes.prompts
    if ahead and predicted.get("prompts", (None,))[0] is not None:
        out["prompts"] = (predicted["prompts"][0] + ahead * per,
                          predicted["prompts"][1] + f" + {ahead} round(s) handed out ahead")
    w = predicted.get("weights", (None, ""))
    if w[0] and info and info.get("initial_full_sync", True) and info.get("sync_transport") != "inprocess":
        out["weights"] = (w[0] + plan.bytes.full_sync, w[1] + f" + one full sync at start ({B.fmt_bytes(plan.bytes.full_sync)})")
    return out


def _teacher_phases(run: Run, secs: dict[str, float]) -> dict:
    """A distillation run's teacher (run.json ``teacher_params``): its size, measured forward and placement."""
    n = run.info.get("teacher_params")
    if not isinstance(n, (int, float)) or isinstance(n, bool) or n <= 0:
        return {}
    algo = run.config.get("algo") or {}
    return {"teacher_params": float(n), "teacher_s": secs.get("teacher", 0.0),
            "teacher_top_k": int(algo.get("gkd_top_k") or 0) if algo.get("objective") == "gkd" else 0,
            "teacher_placement": (run.config.get("teacher") or {}).get("placement", "inline"),
            **_teacher_sampling(run, secs)}


def _teacher_sampling(run: Run, secs: dict[str, float]) -> dict:
    """GKD's seq_kd (``algo.gkd_seq_kd`` under ``algo.objective=gkd``): the teacher generates the off-policy share's
    completions, ``1 - algo.gkd_lmbda`` of the prompts (``phases.teacher_sample_share``); its measured seconds per
    step (the ``teacher_sample`` spans, 0 in a step that drew no prompt off-policy) and, where the spans have
    them, its mean tokens per completion (their ``tokens`` over ``sequences``). {} without seq_kd."""
    algo = run.config.get("algo") or {}
    if algo.get("objective") != "gkd" or algo.get("gkd_seq_kd") is not True:
        return {}
    share = 1.0 - float(algo.get("gkd_lmbda", 1.0))
    if not 0.0 < share <= 1.0:
        return {}
    spans = [s for s in run.spans if s["role"] == "teacher_sample"]
    seqs = sum(s["sequences"] for s in spans if isinstance(s.get("sequences"), int))
    toks = sum(s["tokens"] for s in spans if isinstance(s.get("tokens"), int))
    return {"teacher_sample_share": share, "teacher_sample_s": secs.get("teacher_sample", 0.0),
            **({"teacher_sample_tokens": toks / seqs} if seqs > 0 and toks > 0 else {})}


def _teacher_tokens(run: Run, gen: int) -> tuple[float, str]:
    """The completion tokens the teacher scored: the generated ones, but under GKD with ``algo.gkd_lmbda`` < 1 the
    trained ones (``train/tokens``: some groups train on the dataset's reference completion instead)."""
    algo = run.config.get("algo") or {}
    if algo.get("objective") == "gkd" and float(algo.get("gkd_lmbda", 1.0)) < 1.0:
        trained = [r["train/tokens"] for r in run.metrics if isinstance(r.get("train/tokens"), (int, float))]
        if trained:
            return float(sum(trained)), "trained tokens (train/tokens; reference completions replace some groups')"
    return float(gen), "generated tokens"


def predict_from_run(run: Run, plan: Plan, steps: int) -> dict[str, tuple[float | None, str]]:
    """edge -> (predicted total bytes over the run, how), from run.json and measured token counts."""
    info = run.info
    gen = sum(sum(v) for v in run.lengths.values())
    n_samples = sum(len(v) for v in run.lengths.values())
    have_lengths = bool(run.lengths)
    inprocess = info.get("sync_mode") == "inprocess" or (info.get("sync_mode") is None and plan.placement == "colocated")
    out: dict[str, tuple[float | None, str]] = {}
    if run.prompt_lengths:
        tok = [n for v in run.prompt_lengths.values() for n in v]
        ahead = rounds_ahead(info)
        extra = ahead * int(info.get("prompts_per_step") or 0) * (sum(tok) / len(tok))
        out["prompts"] = (4.0 * (sum(tok) + extra), "4 B x prompt tokens" + (
            f" + {ahead} round(s) handed out ahead of the last trained step (x mean prompt tokens)" if ahead else ""))
    else:
        out["prompts"] = (None, "not priced: lengths.jsonl has no prompt_lengths")
    if have_lengths:
        bpt = plan.inputs.rollout.bytes_per_token  # the plan's stated encoding: int32 id + fp32 logprob
        out["samples"] = (bpt * gen, f"{bpt:g} B x {gen} generated tokens (encoded ids + logprobs)")
        out["rewards"] = (4.0 * n_samples, f"4 B x {n_samples} samples")
        out["ref_logprobs"] = ((4.0 * gen, "4 B x generated tokens") if plan.inputs.phases.use_reference
                               else (0.0, "no reference model"))
        k = plan.inputs.phases.teacher_top_k  # GKD: an int32 id + fp32 log-prob per top-k token besides
        scored, what = _teacher_tokens(run, gen)
        out["teacher_logprobs"] = (((4.0 + 8.0 * k) * scored, f"(4 + 8 x {k}) B x {what}" if k
                                    else f"4 B x {what}") if plan.inputs.phases.teacher_params > 0
                                   else (0.0, "no teacher"))
    else:
        for e in ("samples", "rewards", "ref_logprobs", "teacher_logprobs"):
            out[e] = (None, "not priced: no lengths.jsonl")
    mode = info.get("sync_mode")
    every = int(info.get("sync_every") or 1)
    syncs = steps // every if every > 0 else steps
    if inprocess or mode == "inprocess":
        out["weights"] = (0.0, "in-process sync: no bytes")
    elif info.get("sync_transport") == "inprocess":
        out["weights"] = (0.0, f"{mode} sync over the in-process transport: a local copy, no bytes on a wire")
    elif mode == "delta" and not isinstance(info.get("delta_fraction"), (int, float)):
        out["weights"] = (None, "not priced: a delta's size needs run.json delta_fraction")
    elif mode in ("full", "delta", "lora"):
        nbytes = B.predicted_sync_bytes(float(info["policy_params"]), float(info["bytes_per_param"]), mode,
                                        delta_fraction=float(info.get("delta_fraction") or 0.0),
                                        delta_index_bytes=float(info.get("delta_index_bytes", 8)),
                                        lora_fraction=float(info.get("lora_fraction") or 0.0),
                                        tensors=float(info.get("lora_tensors" if mode == "lora" else "weight_tensors") or 0))
        # The rollout engine starts equal to the trainer (DESIGN: equality check at start-up), so a
        # run opens with one full sync unless run.json says it does not.
        first = (B.predicted_sync_bytes(float(info["policy_params"]), float(info["bytes_per_param"]), "full",
                                        tensors=float(info.get("weight_tensors") or 0))
                 if info.get("initial_full_sync", True) else 0.0)
        out["weights"] = (first + nbytes * syncs,
                          f"{mode} sync: {B.fmt_bytes(nbytes)} x {syncs} syncs (values + indices)"
                          + (f" + one full sync at start ({B.fmt_bytes(first)})" if first else ""))
    else:
        out["weights"] = (None, f"not priced: run.json sync_mode {mode!r}")
    dp = int(info.get("dp", 1))
    out["gradients"] = (plan.bytes.gradient_per_rank * steps,
                        "dp=1: no all-reduce" if dp <= 1 else f"ring all-reduce over dp={dp}")
    out["gather"] = (0.0, "unsharded: nothing to gather")
    out["tools"] = ((None, "not priced: what a run's tools move is what its model sends them (tools/bytes); "
                     "`rollyard plan` prices it from tools.bytes_per_call") if info.get("tools") else (0.0, "no tools"))
    if info.get("sharding") == "fsdp" and dp > 1:
        # FSDP = all-gather (k-1)/k + reduce-scatter (k-1)/k: the ring formula. gloo has no reduce-scatter
        # of its own and runs an all-reduce (2(k-1)/k), so over gloo a step costs 3(k-1)/k x message.
        # Priced here from the run's parameters, not from the plan's gradient_per_rank: the plan prices a
        # ZeRO-3 step (two all-gathers), while rollyard's FSDP gathers once per step.
        gloo = info.get("dp_backend") == "gloo"
        pol, share = plan.inputs.policy, (dp - 1) / dp
        grad_msg = pol.params * (plan.inputs.trainer.grad_bytes_per_param or pol.bytes_per_param)
        gather = share * pol.params * pol.bytes_per_param
        out["gradients"] = ((gather + share * grad_msg * (2 if gloo else 1)) * steps,
                            f"fsdp over dp={dp}: all-gather + reduce-scatter" + (" (an all-reduce on gloo)" if gloo else ""))
        out["gather"] = (gather * steps, f"all-gather of the parameters per sync, (k-1)/k x P, dp={dp}")
    return out


def traffic_audit(run: Run, predicted: dict[str, tuple[float | None, str]], tol: float) -> tuple[list[dict], int]:
    steps = len({int(r["step"]) for r in run.traffic})
    measured: dict[str, float] = {}
    for r in run.traffic:
        measured[r["edge"]] = measured.get(r["edge"], 0.0) + float(r["bytes"])
    rows = []
    for edge in list(rundir.EDGES) + sorted(set(measured) - set(rundir.EDGES)):
        m = measured.get(edge, 0.0)
        pred, how = predicted.get(edge, (0.0, "not an edge of the plan"))
        if pred is None:
            status = "unpriced"
        elif pred == 0:
            status = "ok" if m == 0 else "unexplained"
        elif m == 0:
            status = "missing"
        else:
            dev = m / pred - 1
            status = "ok" if abs(dev) <= tol else ("over" if dev > 0 else "under")
        rows.append({"edge": edge, "measured": m, "predicted": pred, "basis": how, "status": status,
                     "measured_per_step": m / steps if steps else 0.0,
                     "predicted_per_step": pred / steps if (pred is not None and steps) else None})
    return rows, steps


def shape_differences(info: dict[str, Any], p: PlanInputs, rel: float = 0.01, backend: str | None = None,
                      useful_work: bool | None = None) -> list[str]:
    """What run.json (and config.yaml's ``rollout.backend``) say that the plan does not: 'field: run X
    vs plan Y' per difference. The backend is shape: a sync priced for one engine's load does not
    budget the other's; so is config.yaml's ``trainer.useful_work`` against ``trainer.prefix_shared``
    (the positions a train step computes)."""
    pairs = (("policy_params", p.policy.params, "policy.params"), ("bytes_per_param", p.policy.bytes_per_param,
             "policy.bytes_per_param"), ("prompts_per_step", p.rollout.prompts, "rollout.prompts"),
             ("samples_per_prompt", p.rollout.samples, "rollout.samples"), ("dp", p.trainer.dp, "trainer.dp"))
    out = []
    for key, planned, field in pairs:
        got = info.get(key)
        if isinstance(got, (int, float)) and abs(got - planned) > rel * max(abs(planned), 1e-12):
            out.append(f"{key}: run {got:g} vs plan {field} = {planned:g}")
    if p.placement != "auto" and info.get("placement") not in (None, p.placement):
        out.append(f"placement: run {info['placement']} vs plan {p.placement}")
    if backend is not None and backend != p.rollout.backend:
        out.append(f"rollout.backend: run {backend} vs plan rollout.backend = {p.rollout.backend}")
    if useful_work is not None and useful_work != p.trainer.prefix_shared and p.rollout.prompt_tokens > 0:
        out.append(f"trainer.useful_work: run {str(useful_work).lower()} vs plan trainer.prefix_shared = "
                   f"{str(p.trainer.prefix_shared).lower()}")
    return out


# ---- the review ----

BUDGET_ITEM = "Measured step breakdown matches the budget"
CALIBRATE_FIX = ("fix: price a budget on this machine with `rollyard plan --calibrate-from BASELINE_RUN --out DIR` "
                 "and review with --plan DIR/plan.yaml")


def blocks(v: dict) -> bool:
    """An item that holds `review --check`: a failure, or the budget left unchecked."""
    return v["result"] == FAIL or (v["result"] == NOT_CHECKED and v["item"] == BUDGET_ITEM)

@dataclass
class Review:
    run: Run
    plan: Plan
    plan_source: str
    tolerance: float
    phases: list[dict]
    step_mean_s: float
    has_budget: bool
    overlaps: list[dict]
    staleness: dict
    traffic: list[dict]
    steps: int
    verification: list[dict]

    @property
    def verdict(self) -> str:
        """FAIL if an item failed; NOT CHECKED if an item that a gate needs could not be checked (the
        budget: a gate without one passes anything); else PASS. Items a run cannot show (too short,
        a pool that idles by design) say NOT CHECKED and why, and do not hold the gate."""
        if any(v["result"] == FAIL for v in self.verification):
            return FAIL
        return NOT_CHECKED if any(blocks(v) for v in self.verification) else PASS

    def as_dict(self) -> dict:
        return {"run": str(self.run.path), "plan_source": self.plan_source, "tolerance": self.tolerance,
                "phases": self.phases, "step_mean_s": self.step_mean_s, "has_budget": self.has_budget,
                "overlaps": self.overlaps, "staleness": self.staleness, "traffic": self.traffic,
                "steps": self.steps, "verification": self.verification, "verdict": self.verdict,
                "plan": self.plan.as_dict()}


def review(run_dir: str | Path, plan_file: str | Path | None = None, tolerance: float | None = None,
           overrides: list[str] = ()) -> Review:
    run = read_run(run_dir, need_info=plan_file is None)
    if plan_file is not None:
        inputs = load_plan(plan_file, list(overrides))
        source = str(plan_file)
    else:
        inputs = plan_from_run(run)
        source = f"{run.path / rundir.RUN_INFO} (no budget: pass --plan FILE for one)"
    lengths = [n for v in run.lengths.values() for n in v] or None
    plan = make_plan(inputs, lengths, f"{run.path.name}/{rundir.LENGTHS}" if lengths else None)
    tol = inputs.budget.tolerance if tolerance is None else tolerance

    # Phase breakdown against the budget.
    per = phase_seconds(run.spans)
    held = steady(per)  # the first (start-up) step is reported, not budgeted
    means = {r: sum(v) / len(v) for r, v in held.items()}
    total = sum(means.values()) or 1.0
    budget = plan.step_budget() if plan_file is not None else {}
    floor = NOISE_FLOOR * sum(budget.values())
    phases = []
    for role, mean in means.items():
        b = budget.get(role) if budget else None
        over = b is not None and mean > b * (1 + tol) + floor  # b = 0: any measurable time is over
        # Two-sided: a phase far under its budget means the plan does not describe this run either.
        under = b is not None and mean < b * (1 - tol) - floor
        # the budget's own terms (an estimated phase's rules, plan.phases.terms), so a flag says which term missed
        terms = {term_parts(k)[1]: v for k, v in plan.phases.terms.items() if term_parts(k)[0] == role} if budget else {}
        phases.append({"role": role, "measured_s": mean, "max_s": max(held[role]), "first_s": per[role][0],
                       "share": mean / total,
                       "budget_s": b, "over_by": (mean / b - 1) if b else None, "flag": over or under,
                       "direction": "over" if over else "under" if under else "", "terms": terms})
    steps_s = steady({"step": step_seconds(run)})["step"]
    startup = (f"; the first step ({sum(v[0] for v in per.values()):.3g} s of spans, start-up included) is not "
               f"budgeted" if any(len(v) > 1 for v in per.values()) else "")

    overlaps = overlap_audit(run.spans, plan.decision.overlaps)
    # The bound the run was configured with (run.json) is what its samples must respect; a plan file's
    # own decision applies only when the review is held against that plan.
    run_bound = run.info.get("staleness_bound") if run.info else None
    bound = plan.decision.staleness_bound if plan_file is not None or run_bound is None else int(run_bound)
    vals = [float(m[rundir.STALENESS_MAX]) for m in run.metrics if isinstance(m.get(rundir.STALENESS_MAX), (int, float))]
    stale = {"bound": bound, "max": max(vals) if vals else None, "steps": len(vals),
             "ok": bool(vals) and max(vals) <= bound, "measured": bool(vals)}

    n_steps = len({int(r["step"]) for r in run.traffic})
    if plan_file is not None:
        predicted = {e.name: (e.bytes_per_step * n_steps, f"plan: {B.fmt_bytes(e.bytes_per_step)}/step")
                     for e in plan.edges}
        predicted.update(run_structure(run.info, predicted, plan, n_steps))
        if run.info.get("placement") == "colocated" and run.info.get("sync_transport") not in (None, "inprocess"):
            # The plan prices a colocated sync as a CUDA-IPC handle (no bytes); this run sent its updates
            # through a transport, so its bytes are priced from run.json as without a plan.
            predicted["weights"] = predict_from_run(run, plan, n_steps)["weights"]
    else:
        predicted = predict_from_run(run, plan, n_steps)
    # Bytes carry no timer noise: a budget tolerance loosened for a noisy machine does not loosen them.
    traffic, n_steps = traffic_audit(run, predicted, min(tol, TRAFFIC_TOLERANCE))

    ver = []
    if budget:
        flagged = [p for p in phases if p["flag"]]
        ver.append({"item": "Measured step breakdown matches the budget", "result": FAIL if flagged else PASS,
                    "evidence": ("; ".join(f"{p['role']} {p['measured_s']:.3g} s vs {p['budget_s']:.3g} s "
                                           f"({p['over_by']:+.0%}, {p['direction']} budget"
                                           + "".join(f"; planned {t} {v:.3g} s" for t, v in p["terms"].items())
                                           + ")" if p["budget_s"] else
                                           f"{p['role']} {p['measured_s']:.3g} s vs no budget (0 s planned)"
                                           for p in flagged) if flagged else
                                 f"every phase within {tol:.0%} of its budget (step {sum(budget.values()):.3g} s planned, "
                                 f"{sum(steps_s) / len(steps_s):.3g} s measured)") + startup})
    else:
        ver.append({"item": BUDGET_ITEM, "result": NOT_CHECKED,
                    "evidence": f"no budget ({CALIBRATE_FIX}); measured shares: "
                                + ", ".join(f"{p['role']} {p['share']:.0%}" for p in phases)})
    ver.append(overlap_item(run, plan, overlaps, per))
    ver.append({"item": "The staleness bound holds under load",
                "result": (PASS if stale["ok"] else FAIL) if vals else NOT_CHECKED,
                "evidence": (f"max staleness {stale['max']:g} over {stale['steps']} steps, bound {bound}"
                             if vals else f"no {rundir.STALENESS_MAX} in {rundir.METRICS}: the bound is not measured")})
    off = [t for t in traffic if t["status"] not in ("ok", "unpriced")]
    unpriced = [t["edge"] for t in traffic if t["status"] == "unpriced"]
    ver.append({"item": "No unexplained traffic", "result": FAIL if off else (NOT_CHECKED if unpriced else PASS),
                "evidence": ("; ".join(f"{t['edge']} {t['status']}: {B.fmt_bytes(t['measured'])} measured vs "
                                       f"{B.fmt_bytes(t['predicted'] or 0)} predicted" for t in off) if off else
                             f"{len(traffic) - len(unpriced)} edges within {min(tol, TRAFFIC_TOLERANCE):.0%} of prediction")
                            + (f" ({', '.join(unpriced)} not priced)" if unpriced else "")})
    placement = run.info.get("placement") or plan.placement
    if placement == "colocated":
        result, evidence = audit.serial_phases(run.spans, placement)
        ver.append({"item": "Serial phases stay serial", "result": result, "evidence": evidence})
    checks = [audit.time_metrics(run.spans, run.metrics),
              audit.tokens(run.metrics, run.lengths, sum(t["measured"] for t in traffic if t["edge"] == "samples"),
                           plan.inputs.rollout.bytes_per_token, tol),
              audit.versions(run.spans, run.metrics, int(bound)),
              audit.records(metrics=run.metrics, traffic=run.traffic, spans=run.spans, lengths=run.length_records,
                            summary=run.summary, info=run.info, deadletters=run.deadletters)]
    res = [r for r, _ in checks]
    ver.append({"item": "The run's records agree with each other",
                "result": FAIL if FAIL in res else (PASS if PASS in res else NOT_CHECKED),
                "evidence": "; ".join(f"{name}: {r} ({e})" for name, (r, e)
                                      in zip(("time", "tokens", "versions", "records"), checks))})
    mem = memory_item(run, plan)
    if mem is not None:
        ver.append(mem)
    if plan_file is not None:
        diffs = shape_differences(run.info, inputs, backend=run_backend(run) if run.config else None,
                                  useful_work=(run.config.get("trainer") or {}).get("useful_work") if run.config else None)
        ver.insert(0, {"item": "The plan describes this run's shape", "result": FAIL if diffs else
                       (PASS if run.info else NOT_CHECKED),
                       "evidence": ("the plan does not describe this run, so its budget and traffic do not apply: "
                                    + "; ".join(diffs)) if diffs else
                       ("parameters, dtype, batch shape, placement and rollout backend agree with the run" if run.info else
                        f"no {rundir.RUN_INFO}: the run's shape is unknown")})
    return Review(run, plan, source, tol, phases, sum(steps_s) / len(steps_s) if steps_s else 0.0, bool(budget),
                  overlaps, stale, traffic, n_steps, ver)


def overlap_item(run: Run, plan: Plan, overlaps: list[dict], per: dict[str, list[float]]) -> dict:
    """'Designed overlaps actually overlap': rollout/train judged step by step (``pipelined_steps``;
    a majority of judged steps must be pipelined: one step held up by a scheduling hiccup is not the
    design failing, most steps held up is, so a run with one judged step is not checked unless it pipelined); other designed pairs by seconds of overlap, NOT CHECKED
    when the run cannot show them (the rollout side idles by design when it is faster than the
    trainer, so the sync has nothing to hide under). Which side paces is read from the steady state:
    the first step carries one-off start-up costs (engine warm-up, first transfers) and is left out,
    and fewer than two steady steps cannot say."""
    steady = {r: v[1:] for r, v in per.items()}
    means = {r: sum(v) / len(v) for r, v in steady.items() if v}
    item = "Designed overlaps actually overlap"
    req = [o for o in overlaps if o["must_overlap"]]
    if not req:
        return {"item": item, "result": PASS,
                "evidence": f"{plan.placement}: no overlap designed; {sum(o['verdict'] == 'serialized' for o in overlaps)} "
                            f"of {len(overlaps)} role pairs serialized"}
    results, notes = [], []
    for o in req:
        pair = f"{o['a']}/{o['b']}"
        if {o["a"], o["b"]} == {"rollout", "train"}:
            ok, judged, serial = pipelined_steps(run.spans, max(1, int(run.info.get("staleness_bound") or 1)))
            if not judged:
                results.append(NOT_CHECKED)
                notes.append(f"{pair}: not checked: no step whose next round's rollout and own training were both "
                             f"recorded with the round's weights delivered before training ended (the run is too "
                             f"short, or each training step was shorter than a weight transfer), other than steps "
                             f"whose next round was handed out before training began and started late on its "
                             f"worker (machine scheduling or a wait in the worker: the run cannot tell which)")
            elif judged < 2 and not ok:
                results.append(NOT_CHECKED)
                notes.append(f"{pair}: not checked: the one judged step (step {serial[0]}) was serialized, and one "
                             f"step cannot tell a scheduling hiccup from the design failing; a run with more steps "
                             f"can (a majority of judged steps must be pipelined)")
            elif 2 * ok >= judged:
                results.append(PASS)
                notes.append(f"{pair}: {ok} of {judged} steps pipelined (next round decoding before training ended), "
                             f"overlap {o['overlap_s']:.3g} s")
            else:
                results.append(FAIL)
                notes.append(f"{pair} serialized: in steps {serial} the next round's rollout started only after "
                             f"training ended ({ok} of {judged} pipelined; overlap {o['overlap_s']:.3g} s)")
        elif o["ok"]:
            results.append(PASS)
            notes.append(f"{pair} overlapped {o['overlap_s']:.3g} s")
        elif o["a"] == "rollout" and len(steady.get("train", [])) < 2:
            results.append(NOT_CHECKED)
            notes.append(f"{pair}: not checked: fewer than two steps after the first (start-up) step; the run is "
                         f"too short to say which side paces")
        elif o["a"] == "rollout" and means.get("rollout", 0.0) < means.get("train", 0.0):
            results.append(NOT_CHECKED)
            notes.append(f"{pair}: not checked: after the first step the rollout side ({means.get('rollout', 0.0):.3g} "
                         f"s/step) is faster than the trainer ({means.get('train', 0.0):.3g} s/step), so it idles by "
                         f"design and there was no rollout for the transfer to hide under")
        else:
            results.append(FAIL)
            notes.append(f"{pair} serialized (overlap {o['overlap_s']:.3g} s)")
    result = FAIL if FAIL in results else (PASS if PASS in results else NOT_CHECKED)
    return {"item": item, "result": result, "evidence": "; ".join(notes)}


def print_review(rv: Review, c) -> None:
    from rich.table import Table

    from rollyard.plan.render import text

    text(c, f"rollyard review: {rv.run.path} ({rv.steps} steps) against {rv.plan_source}")
    t = Table(title=f"Per-phase step breakdown (mean per step after the first; tolerance {rv.tolerance:.0%})",
              title_justify="left")
    for col in ("phase", "measured s", "max s", "first step s", "share", "budget s", "vs budget", "flag"):
        t.add_column(col, justify="left" if col in ("phase", "flag") else "right")
    for p in rv.phases:
        t.add_row(p["role"], f"{p['measured_s']:.4g}", f"{p['max_s']:.4g}", f"{p['first_s']:.4g}", f"{p['share']:.1%}",
                  "-" if p["budget_s"] is None else f"{p['budget_s']:.4g}",
                  "-" if p["over_by"] is None else f"{p['over_by']:+.0%}", p["direction"].upper() if p["flag"] else "")
    t.add_row("step (wall)", f"{rv.step_mean_s:.4g}", "", "", "", "", "", "")
    c.print(t)
    if not rv.has_budget:
        text(c, "  no budget: the plan was built from run.json; pass --plan FILE to hold phases to a budget")

    t = Table(title="Overlap audit (seconds both phases were running)", title_justify="left")
    for col in ("pair", "overlap s", "of shorter", "timeline", "design", "ok"):
        t.add_column(col, justify="right" if col in ("overlap s", "of shorter") else "left")
    for o in rv.overlaps:
        t.add_row(f"{o['a']} / {o['b']}", f"{o['overlap_s']:.4g}", f"{o['of_shorter']:.0%}", o["verdict"],
                  "must overlap" if o["must_overlap"] else "-", "yes" if o["ok"] else "NO")
    c.print(t)

    s = rv.staleness
    text(c, f"Staleness audit: largest weight-version lag {s['max'] if s['max'] is not None else 'not measured'} "
            f"over {s['steps']} steps, bound {s['bound']}: {'holds' if s['ok'] else 'VIOLATED or unmeasured'}")

    t = Table(title="Traffic audit (bytes per step, measured vs predicted)", title_justify="left")
    for col in ("edge", "measured/step", "predicted/step", "status", "basis"):
        t.add_column(col, justify="right" if "step" in col else "left")
    for r in rv.traffic:
        t.add_row(r["edge"], B.fmt_bytes(r["measured_per_step"]),
                  "-" if r["predicted_per_step"] is None else B.fmt_bytes(r["predicted_per_step"]),
                  r["status"], r["basis"])
    c.print(t)

    t = Table(title=f"Verification: {rv.verdict}", title_justify="left")
    for col in ("item", "result", "evidence"):
        t.add_column(col)
    for v in rv.verification:
        t.add_row(v["item"], v["result"], v["evidence"])
    c.print(t)
