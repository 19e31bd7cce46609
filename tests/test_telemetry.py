"""Spans, ledger and trace: every edge every step, per-role seconds, a loadable Chrome trace."""

import json
import time

import pytest

from rollyard.telemetry import rundir
from rollyard.telemetry.report import role_shares
from rollyard.telemetry.telemetry import Telemetry


def test_ledger_spans_metrics_and_trace(tmp_path):
    tel = Telemetry(tmp_path)
    for step in range(2):
        with tel.span("rollout", step, version=step):
            time.sleep(0.02)
        with tel.span("train", step):
            time.sleep(0.01)
        tel.traffic(step, "samples", 800)
        tel.traffic(step, "samples", 200)
        row = tel.end_step(step, {"reward": 0.5})
        assert row[rundir.TIME_KEY.format(role="rollout")] >= 0.02
        assert row["bytes/samples"] == 1000
    tel.close()
    ledger = list(rundir.read_jsonl(tmp_path / rundir.TRAFFIC))
    assert len(ledger) == 2 * len(rundir.EDGES)  # zero rows included
    assert {r["edge"] for r in ledger} == set(rundir.EDGES)
    assert [r["bytes"] for r in ledger if r["edge"] == "weights"] == [0, 0]
    assert [r["bytes"] for r in ledger if r["edge"] == "samples"] == [1000, 1000]
    spans = list(rundir.read_jsonl(tmp_path / rundir.SPANS))
    assert [s["role"] for s in spans] == ["rollout", "train"] * 2
    assert all(s["end"] >= s["start"] for s in spans)
    trace = json.loads((tmp_path / rundir.TRACE).read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 4 and all(e["dur"] > 0 for e in xs)
    assert xs[0]["args"]["version"] == 0


def test_unknown_edge_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="not in the ledger"):
        Telemetry(tmp_path).traffic(0, "nowhere", 1)


def test_role_shares_sum_to_one():
    shares = role_shares({0: {"rollout": 3.0, "train": 1.0}, 1: {"rollout": 1.0, "train": 1.0}})
    d = {r: (s, f) for r, s, f in shares}
    assert d["rollout"] == (2.0, pytest.approx(2 / 3))
    assert sum(f for _, _, f in shares) == pytest.approx(1.0)


def test_truncated_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(rundir.RunDirError, match=r"m.jsonl:2"):
        list(rundir.read_jsonl(p))
