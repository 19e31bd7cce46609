"""Whole-run totals for ``summary.json``, read from the record files rather than kept in memory.

A run resumed after a crash is several sessions; each keeps only its own steps in memory. The
record files hold every step exactly once (they are cut back to the checkpoint on resume), so
totals taken from them cover the whole run.
"""

from __future__ import annotations

from pathlib import Path
from statistics import mean

from rollyard.telemetry import rundir


def whole_run(run_dir: str | Path) -> dict:
    """Summary fields over every recorded step of the run (all sessions)."""
    run = Path(run_dir)
    rows = list(rundir.read_jsonl(run / rundir.METRICS)) if (run / rundir.METRICS).exists() else []
    deadletters = sum(1 for _ in rundir.read_jsonl(run / rundir.DEADLETTER)) if (run / rundir.DEADLETTER).exists() else 0

    def total(key: str) -> float:
        return sum(float(r.get(key, 0.0) or 0.0) for r in rows)

    roles = [r for r in rundir.ROLES if any(rundir.TIME_KEY.format(role=r) in row for row in rows)]
    return {
        "recorded_steps": len(rows),
        "step_seconds": total(rundir.STEP_TIME),
        "deadletters": deadletters,
        "reward_flags": {"timeouts": int(total("reward/timeouts")), "errors": int(total("reward/errors"))},
        "skipped_steps": int(total("train/skipped")),
        "alarms": {k: int(total(k)) for k in sorted({k for r in rows for k in r if k.startswith("alarm/")})},
        "role_seconds_per_step": {r: mean(float(row.get(rundir.TIME_KEY.format(role=r), 0.0)) for row in rows)
                                  for r in roles},
    }
