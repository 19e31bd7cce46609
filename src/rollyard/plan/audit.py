"""Cross-checks of a run's own records, for `rollyard review`: the files must agree with each other
before they can be held against a plan.

Each check returns ``(result, evidence)`` with result PASS, FAIL or NOT CHECKED (and why). The
tolerances come from how the runtime writes the files (``telemetry/telemetry.py``), not from a run:

- ``time/<role>`` in metrics.jsonl is the sum of the same ``end - start`` differences written to
  spans.jsonl, summed in the same order, so it equals the driver's spans of that step to float
  rounding (``TIME_EPS``). Spans of other processes (rollout workers) reach the driver when they are
  shipped, possibly after the step's row was written: those may be missing from the row, never
  added. So ``driver spans - eps <= time/<role> <= all spans + eps``.
- ``time/step`` is the wall clock between two step ends: the step's driver spans lie inside it
  (lower bound: their union), and it lies between the last driver span of the step before and the
  first driver span of the step after (upper bound).
- ``tokens/generated`` is ``sum(len(completion))`` of the step's samples, the same list
  lengths.jsonl holds: equal, exactly.
- span ``version`` fields: a span cannot carry a weight version the trainer had not produced when
  the span ended (versions start at the run's first trained-at version and grow by at most one per
  train step), and a rollout span for step ``s`` starts on a version no older than its step's
  trained-at version minus the staleness bound (the admission rule, ``staleness.min_fresh_version``).
- colocated: rollout, reference, train and sync run one after another in one process on one device;
  two of them overlapping means the timeline (or the run) is not what the placement does.
"""

from __future__ import annotations

import json
import math
from itertools import combinations

from rollyard.telemetry import rundir
from rollyard.telemetry.telemetry import covered

PASS, FAIL, NOT_CHECKED = "PASS", "FAIL", "NOT CHECKED"
# Float rounding of epoch-second timestamps (~2.4e-7 s at 1.8e9 s) summed over a step's spans.
TIME_EPS = 1e-5
SERIAL_ROLES = ("rollout", "reference", "train", "sync")  # one device, one process: serial by design


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def serial_phases(spans: list[dict], placement: str) -> tuple[str, str]:
    """Colocated: the device-bound roles never overlap in time (any overlap beyond TIME_EPS fails)."""
    if placement != "colocated":
        return NOT_CHECKED, f"{placement}: the pools run concurrently by design (see the overlap item)"
    by_role: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        if s["role"] in SERIAL_ROLES:
            by_role.setdefault(s["role"], []).append((float(s["start"]), float(s["end"])))
    bad = []
    for a, b in combinations([r for r in SERIAL_ROLES if r in by_role], 2):
        sec = sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in by_role[a] for y0, y1 in by_role[b])
        if sec > TIME_EPS:
            bad.append(f"{a}/{b} overlap {sec:.3g} s")
    if bad:
        return FAIL, ("colocated roles share one device and run one after another, but " + "; ".join(bad)
                      + ": the spans do not describe a colocated run")
    return PASS, f"{', '.join(r for r in SERIAL_ROLES if r in by_role)} never overlap (tolerance {TIME_EPS:g} s)"


def _driver(s: dict) -> bool:
    return s.get("worker", "driver") == "driver"


def time_metrics(spans: list[dict], metrics: list[dict]) -> tuple[str, str]:
    """``time/<role>`` and ``time/step`` in metrics.jsonl against the spans (module docstring)."""
    drv: dict[tuple[int, str], float] = {}
    allr: dict[tuple[int, str], float] = {}
    win: dict[int, list[float]] = {}  # step -> [first driver start, last driver end]
    union: dict[int, list[tuple[float, float]]] = {}
    for s in spans:
        k, d = (int(s["step"]), s["role"]), float(s["end"]) - float(s["start"])
        allr[k] = allr.get(k, 0.0) + d
        if _driver(s):
            drv[k] = drv.get(k, 0.0) + d
            w = win.setdefault(k[0], [float(s["start"]), float(s["end"])])
            w[0], w[1] = min(w[0], float(s["start"])), max(w[1], float(s["end"]))
            union.setdefault(k[0], []).append((float(s["start"]), float(s["end"])))
    bad: list[str] = []
    checked = 0
    prefix, step_key = rundir.TIME_KEY.split("{")[0], rundir.STEP_TIME
    for row in metrics:
        step = int(row["step"])
        for key, val in row.items():
            if not key.startswith(prefix):
                continue
            v = _num(val)
            if v is None or not math.isfinite(v) or v < 0:
                bad.append(f"step {step} {key} = {val!r} (a duration must be a finite number >= 0)")
                continue
            checked += 1
            if key == step_key:
                lo = covered(union.get(step, []), -math.inf, math.inf)
                hi = (win[step + 1][0] - win[step - 1][1]) if step - 1 in win and step + 1 in win else math.inf
                if not (lo - TIME_EPS <= v <= hi + TIME_EPS):
                    bad.append(f"step {step} {key} = {v:.6g} s outside [{lo:.6g}, {hi:.6g}] s from the spans")
                continue
            role = key[len(prefix):]
            lo, hi = drv.get((step, role), 0.0), allr.get((step, role), 0.0)
            eps = TIME_EPS + 1e-9 * abs(v)
            if not (lo - eps <= v <= hi + eps):
                bad.append(f"step {step} {key} = {v:.6g} s vs spans {lo:.6g} s (driver) .. {hi:.6g} s (all)")
    if bad:
        return FAIL, f"{len(bad)} time figure(s) disagree with spans.jsonl: " + "; ".join(bad[:4])
    if not checked:
        return NOT_CHECKED, f"no time/* figures in {rundir.METRICS}"
    return PASS, f"{checked} time/* figures agree with the spans (tolerance {TIME_EPS:g} s)"


def tokens(metrics: list[dict], lengths: dict[int, list[int]], samples_bytes: float,
           bytes_per_token: float, tol: float) -> tuple[str, str]:
    """``tokens/generated`` against lengths.jsonl (equal) and the samples edge's bytes (within ``tol``)."""
    rows = {int(m["step"]): _num(m.get("tokens/generated")) for m in metrics if "tokens/generated" in m}
    if not rows:
        return NOT_CHECKED, f"no tokens/generated in {rundir.METRICS}"
    bad = [f"step {k} tokens/generated {v!r} vs {sum(lengths[k])} in {rundir.LENGTHS}"
           for k, v in sorted(rows.items()) if k in lengths and v != sum(lengths[k])]
    total = sum(v for v in rows.values() if v is not None)
    if samples_bytes > 0 and total > 0:
        per = samples_bytes / total
        if abs(per / bytes_per_token - 1) > tol:
            bad.append(f"samples edge {samples_bytes:.0f} B / {total:.0f} tokens = {per:.3g} B per token vs "
                       f"{bytes_per_token:g} B encoded (tolerance {tol:.0%})")
    if bad:
        return FAIL, "token counts disagree: " + "; ".join(bad[:4])
    return PASS, (f"{len(rows)} steps: tokens/generated = {rundir.LENGTHS} and {bytes_per_token:g} B per token on "
                  f"the samples edge")


def versions(spans: list[dict], metrics: list[dict], bound: int) -> tuple[str, str]:
    """Span ``version`` fields against the trainer's versions (module docstring)."""
    rows = sorted(metrics, key=lambda m: int(m["step"]))
    trained_at: dict[int, int] = {}
    prev = None
    for m in rows:
        v = _num(m.get("version"))
        if v is None:
            continue
        step = int(m["step"])
        if prev is not None:
            trained_at[step] = int(prev)
        elif step == 0:
            trained_at[step] = 0
        prev = v
    have = [s for s in spans if _num(s.get("version")) is not None]
    if not have or not trained_at:
        return NOT_CHECKED, "no span carries a weight version, or metrics.jsonl has no version"
    v0 = trained_at[min(trained_at)]
    first = min(trained_at)
    train_ends = sorted(float(s["end"]) for s in spans if s["role"] == "train" and _driver(s) and int(s["step"]) >= first)
    last_step, last_v = int(rows[-1]["step"]), int(prev)
    bad = []
    for s in have:
        v, end = int(s["version"]), float(s["end"])
        made = v0 + sum(t <= end + TIME_EPS for t in train_ends)  # versions the trainer had produced
        if v > made:
            bad.append(f"{s['role']} span of step {s['step']} ({s.get('worker', 'driver')}) carries version {v}, "
                       f"but only {made} existed when it ended")
        if s["role"] == "rollout":
            step = int(s["step"])
            ta = trained_at.get(step, last_v + (step - last_step - 1) if step > last_step else None)
            if ta is not None and v < ta - bound:
                bad.append(f"rollout span of step {step} on version {v}, older than trained-at {ta} minus bound {bound}")
    if bad:
        return FAIL, f"{len(bad)} span version(s) impossible: " + "; ".join(bad[:3])
    return PASS, f"{len(have)} span versions consistent with the trainer's versions and bound {bound}"


# ---- every record counted ----
#
# How the runtime writes the files (telemetry/telemetry.py, placement/run.py, telemetry/sessions.py):
# at the end of optimizer step s the driver writes exactly one metrics.jsonl row, one traffic.jsonl
# row per ledger edge (zeros included) and one lengths.jsonl row for step s, and the step's driver
# spans (train among them); a resumed run cuts every file back to its checkpoint first, so a finished
# run holds steps 0 .. N-1 once each, where N is summary.json's ``steps`` (the optimizer steps done).
# Rollout-worker spans may carry the step of a round handed out ahead (s >= N); driver spans may not.
# A metrics row's ``bytes/<edge>`` is the same pending total its traffic row writes, and summary.json's
# figures are read back from the files at finish (recorded_steps = rows, the last row's version, the
# prompt ledger's trained prompts = the step rows' prompts, dead letters = deadletter.jsonl's lines).

def _counts(steps) -> dict[int, int]:
    out: dict[int, int] = {}
    for s in steps:
        out[s] = out.get(s, 0) + 1
    return out


def _per_step(name: str, counts: dict[int, int], expected: range | None, what: str = "record") -> list[str]:
    """'FILE: step s missing | recorded k times | beyond ...' for each step whose count is not one."""
    bad = [f"{name}: step {s} has {n} {what}s (expected 1)" for s, n in sorted(counts.items()) if n > 1]
    if expected is not None:
        bad += [f"{name}: step {s} missing" for s in expected if s not in counts]
        bad += [f"{name}: step {s} beyond the run's {len(expected)} steps (summary.json steps = {len(expected)})"
                for s in sorted(counts) if s not in expected]
    else:  # no summary.json: the steps must still run 0 .. last without a gap
        last = max(counts, default=-1)
        bad += [f"{name}: step {s} missing (steps 0..{last} recorded around it)" for s in range(last + 1) if s not in counts]
    return bad


def records(*, metrics: list[dict], traffic: list[dict], spans: list[dict], lengths: list[dict] | None,
            summary: dict | None, info: dict, deadletters: int | None) -> tuple[str, str]:
    """Every step's records in metrics.jsonl, traffic.jsonl, spans.jsonl and lengths.jsonl (the prompt
    ledger's per-step rows) against each other and against summary.json and run.json (see above): a
    missing, doubled or extra record in any one of them is a FAIL naming the file and the step.
    ``lengths`` None: the run has no lengths.jsonl (older runs); ``summary`` None: the run did not
    finish (then its last steps cannot be counted, and the result says so)."""
    steps = summary.get("steps") if summary else None
    n = steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0 else None
    expected = range(n) if n is not None else None
    bad: list[str] = []
    if summary is not None and n is None:
        bad.append(f"summary.json steps = {steps!r}: expected a whole number of optimizer steps")
    bad += _per_step(rundir.METRICS, _counts(int(m["step"]) for m in metrics), expected, "row")
    edges = sorted({r["edge"] for r in traffic})
    per_edge = _counts((int(r["step"]), r["edge"]) for r in traffic)
    t_steps = sorted({s for s, _ in per_edge})
    bad += _per_step(rundir.TRAFFIC, dict.fromkeys(t_steps, 1), expected)
    for s in t_steps:
        for e in edges:
            k = per_edge.get((s, e), 0)
            if k != 1:
                bad.append(f"{rundir.TRAFFIC}: step {s} has {k} records of edge {e} (expected 1: one row per edge per step)")
    if lengths is not None:
        bad += _per_step(rundir.LENGTHS, _counts(int(r["step"]) for r in lengths), expected, "row")
    train = _counts(int(s["step"]) for s in spans if s["role"] == "train" and _driver(s))
    bad += [f"{rundir.SPANS}: step {s} has no driver train span" for s in (expected or range(max(train, default=-1) + 1))
            if s not in train]
    last = n if n is not None else max(train, default=-1) + 1
    bad += sorted({f"{rundir.SPANS}: step {int(s['step'])} has a driver {s['role']} span beyond the run's {last} steps"
                   for s in spans if _driver(s) and int(s["step"]) >= last})
    seen: dict[str, list] = {}  # a span's every field -> [span, times recorded]
    for s in spans:
        seen.setdefault(json.dumps(s, sort_keys=True, default=str), [s, 0])[1] += 1
    bad += [f"{rundir.SPANS}: step {s['step']} {s['role']} span ({s.get('worker', 'driver')}) recorded {c} times "
            f"(identical records)" for s, c in seen.values() if c > 1]
    # Per step, the metrics row's bytes/<edge> is the traffic row's byte count (an edge with no record that
    # step has no key: 0). Rows without any bytes/ key (runs written before them) are not compared.
    tb = {(int(r["step"]), r["edge"]): float(r["bytes"]) for r in traffic}
    for m in metrics:
        s = int(m["step"])
        if not any(k.startswith("bytes/") for k in m):
            continue
        for e in edges:
            got, want = _num(m.get(f"bytes/{e}", 0)), tb.get((s, e))
            if want is not None and got is not None and abs(got - want) > 0.5 and per_edge.get((s, e)) == 1:
                bad.append(f"step {s}: {rundir.METRICS} bytes/{e} = {got:.0f} vs {rundir.TRAFFIC} {want:.0f}")
    if summary is not None:
        bad += _summary(summary, metrics, lengths, info, deadletters)
    if bad:
        return FAIL, f"{len(bad)} record(s) missing, doubled or in disagreement: " + "; ".join(bad[:6]) + (
            f"; ... {len(bad) - 6} more" if len(bad) > 6 else "")
    files = f"{rundir.METRICS}, {rundir.TRAFFIC}, {rundir.SPANS}" + (f", {rundir.LENGTHS}" if lengths is not None else "")
    if n is None:
        return NOT_CHECKED, (f"no {rundir.SUMMARY}: the run did not finish, so steps cut from the end of every file "
                             f"cannot be told apart from a run that stopped; {files} agree on steps "
                             f"0..{max(train, default=-1)}")
    return PASS, f"{n} steps recorded once each in {files}, as {rundir.SUMMARY} and {rundir.RUN_INFO} say"


def _summary(summary: dict, metrics: list[dict], lengths: list[dict] | None, info: dict,
             deadletters: int | None) -> list[str]:
    """summary.json's whole-run figures against the step records and run.json."""
    bad = []
    rec = summary.get("recorded_steps")
    if isinstance(rec, int) and rec != len(metrics):
        bad.append(f"{rundir.SUMMARY} recorded_steps = {rec} vs {len(metrics)} rows in {rundir.METRICS}")
    last = max(metrics, key=lambda m: int(m["step"]), default=None)
    if last is not None and _num(summary.get("version")) is not None and _num(last.get("version")) is not None \
            and _num(summary["version"]) != _num(last["version"]):
        bad.append(f"{rundir.SUMMARY} version = {summary['version']} vs {last['version']} in the last row of "
                   f"{rundir.METRICS} (step {last['step']})")
    trained = (summary.get("prompts") or {}).get("trained") if isinstance(summary.get("prompts"), dict) else None
    if isinstance(trained, int) and lengths is not None:
        got = sum(len(r.get("prompt_lengths") or []) for r in lengths)
        if all("prompt_lengths" in r for r in lengths) and got != trained:
            bad.append(f"{rundir.SUMMARY} prompts.trained = {trained} (the prompt ledger) vs {got} prompts in "
                       f"{rundir.LENGTHS}")
    dl = summary.get("deadletters")
    if isinstance(dl, int) and deadletters is not None and dl != deadletters:
        bad.append(f"{rundir.SUMMARY} deadletters = {dl} vs {deadletters} records in {rundir.DEADLETTER}")
    configured, steps = info.get("steps"), summary.get("steps")
    if isinstance(configured, int) and isinstance(steps, int) and steps > configured:
        bad.append(f"{rundir.SUMMARY} steps = {steps} beyond {rundir.RUN_INFO} steps = {configured} (configured)")
    if info.get("placement") and summary.get("placement") and info["placement"] != summary["placement"]:
        bad.append(f"{rundir.SUMMARY} placement {summary['placement']} vs {rundir.RUN_INFO} {info['placement']}")
    return bad
