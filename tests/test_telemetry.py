"""Spans, ledger and trace: every edge every step, per-role seconds, a loadable Chrome trace."""

import json
import time

import pytest

from rollyard.telemetry import rundir
from rollyard.telemetry import telemetry as telemetry_module
from rollyard.telemetry.report import role_shares
from rollyard.telemetry.telemetry import Telemetry, covered


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


def test_covered_is_the_union_of_the_spans_inside_the_window():
    assert covered([], 0.0, 5.0) == 0.0
    assert covered([(1.0, 2.0), (4.0, 6.0)], 0.0, 5.0) == 2.0  # disjoint, one clipped at the window's end
    assert covered([(0.0, 3.0), (1.0, 2.0), (2.5, 4.0)], 1.0, 5.0) == 3.0  # nested and overlapping, clipped at start
    assert covered([(-2.0, -1.0), (6.0, 7.0)], 0.0, 5.0) == 0.0  # outside the window


def test_a_step_s_time_in_no_span_is_its_outside_roles(tmp_path, monkeypatch):
    """On a fake clock: spans 10-11 and 10.5-12 (overlapping), nothing 12-13, one opened at 13 still open at the
    window's end 14: 1 s of the 4 s step in no span. The next window, 14-15, is all inside the open span."""
    now = [10.0]
    monkeypatch.setattr(telemetry_module, "time", type("Clock", (), {"time": staticmethod(lambda: now[0])}))
    tel = Telemetry(tmp_path)
    a, b = tel.span("rollout", 0), tel.span("reward", 0)
    a.__enter__()
    now[0] = 10.5
    b.__enter__()
    now[0] = 11.0
    a.__exit__(None, None, None)
    now[0] = 12.0
    b.__exit__(None, None, None)
    now[0] = 13.0
    with tel.span("train", 0):
        now[0] = 14.0
        row = tel.end_step(0, {}, window=(10.0, 14.0))
        assert row[rundir.OUTSIDE_ROLES] == pytest.approx(1.0) and tel.outside[0] == (4.0, pytest.approx(1.0))
        now[0] = 15.0
        assert tel.end_step(1, {}, window=(14.0, 15.0))[rundir.OUTSIDE_ROLES] == 0.0
    assert rundir.OUTSIDE_ROLES not in tel.end_step(2, {})  # no window: not measured
    tel.close()
