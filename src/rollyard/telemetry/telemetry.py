"""Spans, the traffic ledger and step metrics, written as the run goes (format: rundir.py).

``Telemetry`` is the only writer of a run's measurement files. Records are appended and flushed
per step, so a crash loses at most the step in progress, and a resumed run appends to the same
files (review then sees one continuous history).
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rollyard.telemetry import rundir
from rollyard.telemetry.alarms import Alarms
from rollyard.telemetry.memory import PeakMemory

OWN_SPANS_KEPT = 4096  # this process's closed spans kept for timeline/outside_roles (end_step drops those it passed)


class Telemetry:
    """``span(role, step)``, ``traffic(step, edge, nbytes)``, ``metrics(step, values)``."""

    def __init__(self, run_dir: str | Path, worker: str = "driver", tracking=None, alarms: Alarms | None = None):
        self.run_dir = Path(run_dir)
        self.tracking = tracking  # telemetry.tracking.Tracking (TensorBoard / W&B) or None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.worker = worker
        self.alarms = alarms or Alarms()
        if (self.run_dir / rundir.METRICS).exists():  # a resumed run: the alarms keep their baseline
            self.alarms.seed(rundir.read_jsonl(self.run_dir / rundir.METRICS))
        self._noted: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._spans = open(self.run_dir / rundir.SPANS, "a")
        self._metrics = open(self.run_dir / rundir.METRICS, "a")
        self._traffic_file = open(self.run_dir / rundir.TRAFFIC, "a")
        self._lengths = open(self.run_dir / rundir.LENGTHS, "a")
        self._pending: dict[int, dict[str, list[int]]] = {}
        self.step_seconds: dict[int, dict[str, float]] = {}
        # this process's own spans as (start, end), and the start of each still open: a step's wall time in none of
        # them is its timeline/outside_roles (end_step)
        self._own: list[tuple[float, float]] = []
        self._open: dict[int, float] = {}
        self.outside: dict[int, tuple[float, float]] = {}  # step -> (its wall seconds, those in no span of this process)
        self.memory = PeakMemory(worker)  # memory/<role>_peak_gb: this process's peak while each role's span is open

    @contextmanager
    def span(self, role: str, step: int, worker: str | None = None, **fields: Any) -> Iterator[dict]:
        """Time a role's work in ``step``; extra ``fields`` (and keys set on the yielded dict) are recorded."""
        extra: dict[str, Any] = dict(fields)
        self.memory.enter(role)
        start = time.time()
        key = id(extra)
        if worker is None:
            with self._lock:
                self._open[key] = start
        try:
            yield extra
        finally:
            end = time.time()
            self.memory.exit(role)
            rec = {"role": role, "step": step, "worker": worker or self.worker, "start": start, "end": end, **extra}
            with self._lock:
                if self._open.pop(key, None) is not None:
                    self._own.append((start, end))
                    if len(self._own) > OWN_SPANS_KEPT:  # a process whose steps end elsewhere (no window) keeps few
                        del self._own[:OWN_SPANS_KEPT // 2]
                self._spans.write(json.dumps(rec) + "\n")
                per = self.step_seconds.setdefault(step, {})
                per[role] = per.get(role, 0.0) + (end - start)

    def record(self, span: dict[str, Any], offset: float = 0.0) -> None:
        """A span another process recorded (``role``, ``step``, ``worker``, ``start``, ``end``, ...);
        ``offset``: that process's clock minus this one's, subtracted to align the timelines."""
        rec = {**span, "start": span["start"] - offset, "end": span["end"] - offset}
        with self._lock:
            self._spans.write(json.dumps(rec) + "\n")
            per = self.step_seconds.setdefault(int(rec["step"]), {})
            per[rec["role"]] = per.get(rec["role"], 0.0) + (rec["end"] - rec["start"])

    def traffic(self, step: int, edge: str, nbytes: int, count: int = 1) -> None:
        """Count ``nbytes`` moved on ``edge`` (a name in rundir.EDGES) during ``step``."""
        if edge not in rundir.EDGES:
            raise ValueError(f"traffic edge {edge!r} is not in the ledger's edges {sorted(rundir.EDGES)}")
        with self._lock:
            row = self._pending.setdefault(step, {}).setdefault(edge, [0, 0])
            row[0] += int(nbytes)
            row[1] += int(count)

    def lengths(self, step: int, response_lengths: list[int], prompt_lengths: list[int]) -> None:
        """Per-sample response lengths and per-request prompt lengths (plan's tail-batching and
        prompt-traffic inputs)."""
        self._lengths.write(json.dumps({"step": step, "response_lengths": list(response_lengths),
                                        "prompt_lengths": list(prompt_lengths)}) + "\n")

    def note(self, step: int, values: dict[str, Any]) -> None:
        """Add ``values`` to ``step``'s metrics row (written by ``end_step``)."""
        with self._lock:
            self._noted.setdefault(step, {}).update(values)

    def end_step(self, step: int, values: dict[str, Any], window: tuple[float, float] | None = None) -> dict[str, Any]:
        """Write the step's ledger (every edge, zeros included) and metrics, with the alarms' values;
        return the metrics row. ``window``: the step's wall-clock ``(start, end)``, whose time in none of this
        process's spans is the row's ``timeline/outside_roles``."""
        with self._lock:
            values = {**self._noted.pop(step, {}), **values}
            if window is not None:
                spans = self._own + [(t, window[1]) for t in self._open.values()]
                values[rundir.OUTSIDE_ROLES] = max(0.0, (window[1] - window[0]) - covered(spans, *window))
                self.outside[step] = (window[1] - window[0], values[rundir.OUTSIDE_ROLES])
                self._own = [s for s in self._own if s[1] > window[1]]
            pending = self._pending.pop(step, {})
            for edge in rundir.EDGES:
                nbytes, count = pending.get(edge, [0, 0])
                self._traffic_file.write(json.dumps({"step": step, "edge": edge, "bytes": nbytes, "count": count}) + "\n")
            for edge, (nbytes, _count) in pending.items():
                values[f"bytes/{edge}"] = nbytes
            row = {"step": step}
            for role, secs in self.step_seconds.get(step, {}).items():
                row[rundir.TIME_KEY.format(role=role)] = secs
            row.update(self.memory.step_metrics())
            row.update(values)
            row.update(self.alarms.check(row))
            self._metrics.write(json.dumps(row, default=float) + "\n")
            for f in (self._spans, self._metrics, self._traffic_file, self._lengths):
                f.flush()
        if self.tracking is not None:
            self.tracking.log(step, row)
        return row

    def completions(self, step: int, records: list[dict[str, Any]]) -> None:
        """Append sampled completions (``telemetry.tracking.completion_records``) to completions.jsonl."""
        with open(self.run_dir / rundir.COMPLETIONS, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        if self.tracking is not None:
            self.tracking.completions(step, records)

    def evaluation(self, step: int, accuracy: float) -> None:
        """Record a held-out greedy accuracy measured after ``step`` optimizer steps (eval.jsonl)."""
        with open(self.run_dir / rundir.EVAL, "a") as f:
            f.write(json.dumps({"step": step, "accuracy": accuracy}) + "\n")
        if self.tracking is not None:
            self.tracking.log(step, {"eval/accuracy": accuracy})

    def close(self) -> None:
        for f in (self._spans, self._metrics, self._traffic_file, self._lengths):
            f.close()
        if self.tracking is not None:
            self.tracking.close()
        export_trace(self.run_dir)


def covered(spans: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of ``[t0, t1]`` inside at least one of ``spans`` (``(start, end)`` pairs, overlapping or not)."""
    total, reached = 0.0, t0
    for a, b in sorted(spans):
        a, b = max(a, reached), min(b, t1)
        if b > a:
            total += b - a
            reached = b
    return total


def export_trace(run_dir: str | Path) -> Path:
    """spans.jsonl -> trace.json (Chrome trace event format; opens in Perfetto / chrome://tracing).

    One process (track group) per worker -- the driver and each rollout worker -- one thread
    (track) per role, complete ("X") events in microseconds
    relative to the first span; span fields go into ``args``.
    """
    run = Path(run_dir)
    spans = list(rundir.read_jsonl(run / rundir.SPANS)) if (run / rundir.SPANS).exists() else []
    t0 = min((s["start"] for s in spans), default=0.0)
    workers = sorted({s["worker"] for s in spans})
    roles = sorted({s["role"] for s in spans}, key=lambda r: (rundir.ROLES + (r,)).index(r))
    events: list[dict] = []
    for pid, w in enumerate(workers):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": w}})
        for tid, r in enumerate(roles):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": r}})
    for s in spans:
        args = {k: v for k, v in s.items() if k not in ("role", "worker", "start", "end")}
        events.append({
            "name": f"{s['role']} {s['step']}", "cat": s["role"], "ph": "X",
            "ts": (s["start"] - t0) * 1e6, "dur": max(s["end"] - s["start"], 0.0) * 1e6,
            "pid": workers.index(s["worker"]), "tid": roles.index(s["role"]), "args": args,
        })
    out = run / rundir.TRACE
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    os.replace(tmp, out)
    return out
