"""Work an engine drives beside decoding (``telemetry/side.py``'s ``SideWork``, issue 45): the engine names it and
the placements forward it without knowing what it is; the run record makes it metrics, a summary entry and spans."""

from __future__ import annotations

import json
import time

from rollyard import roles
from rollyard.cli import main
from rollyard.telemetry import rundir
from rollyard.telemetry.side import SideWork, latency_metrics

TINY = ["model.context=48", "data.train_size=64", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "sft.auto=false", "progress=false",
        "reward.num_workers=1", "log.plots=false"]


def test_workers_records_add_up_and_an_emptied_one_reports_zero_calls():
    a = SideWork("lookup", "kv", {"kv/calls": 2.0, "kv/hit_mean": 0.5}, [0.3, 0.1], [(1.0, 2.0)])
    b = SideWork("lookup", "kv", {"kv/calls": 1.0, "kv/misses": 4.0}, [0.2], [(5.0, 6.0)])
    both = a.emptied().plus(a).plus(b)
    assert both.counts == {"kv/calls": 3.0, "kv/misses": 4.0}  # a mean is one worker's: not summed
    assert sorted(both.seconds) == [0.1, 0.2, 0.3] and both.intervals == [(1.0, 2.0), (5.0, 6.0)]
    assert latency_metrics(both.seconds, "kv/latency_") == {"kv/latency_p50_s": 0.2, "kv/latency_p90_s": 0.3,
                                                          "kv/latency_p99_s": 0.3, "kv/latency_max_s": 0.3}
    assert latency_metrics([], "") == {"p50_s": 0.0, "p90_s": 0.0, "p99_s": 0.0, "max_s": 0.0}
    assert a.spans(7, "w0") == [{"role": "lookup", "step": 7, "worker": "w0", "start": 1.0, "end": 2.0}]


class _Lookups:
    """An engine that reports two lookups of its own beside each generate (no tools): the name, role and keys are
    its, not the placement's."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, requests, **kw):  # a round submits its requests once (rollout/rounds.py run_round)
        self.calls += 2
        return self.engine.submit(requests, **kw)

    def drain(self) -> SideWork:
        now, n, self.calls = time.time(), self.calls, 0
        return SideWork("lookup", "kv", {"kv/calls": float(n)}, [0.25] * (n // 2) + [0.5] * (n // 2),
                        [(now - 0.5, now)] if n else [])


def test_colocated_forwards_an_engines_side_work_it_does_not_know(tmp_path, monkeypatch):
    bare = roles.engine
    monkeypatch.setattr(roles, "engine", lambda *a, **k: _Lookups(bare(*a, **k)))
    out = tmp_path / "run"
    assert main(["train", *TINY, "steps=2", f"out_dir={out}"]) == 0
    rows = list(rundir.read_jsonl(out / rundir.METRICS))
    assert [r["kv/calls"] for r in rows] == [2.0, 2.0]
    assert all(r["kv/latency_p50_s"] == 0.25 and r["kv/latency_max_s"] == 0.5 for r in rows)
    assert all(r["time/lookup"] > 0 for r in rows)  # its intervals: a role of the timeline
    summary = json.loads((out / rundir.SUMMARY).read_text())
    assert summary["lookup_latency_s"] == {"p50_s": 0.25, "p90_s": 0.5, "p99_s": 0.5, "max_s": 0.5, "calls": 4}
    assert "tool_latency_s" not in summary and not any(k.startswith("tools/") for k in rows[0])
    spans = [s for s in rundir.read_jsonl(out / rundir.SPANS) if s["role"] == "lookup"]
    assert sorted(s["step"] for s in spans) == [0, 1] and {s["worker"] for s in spans} == {"kv"}
