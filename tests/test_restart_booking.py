"""A replaced rollout worker's start-up is booked as ``restart/seconds`` in the step's row, not inside
the equality check's span, and the step-time alarm leaves that step alone."""

from __future__ import annotations

from pathlib import Path

import faults
import pytest

from rollyard.config import load_config
from rollyard.placement import disaggregated
from rollyard.telemetry import rundir
from rollyard.telemetry.alarms import Alarms

HOOK = f"reward.hook={Path(__file__).parent / 'dense_reward.py'}:digits"


def test_a_restart_step_is_not_judged_by_the_step_time_alarm():
    alarms = Alarms(min_history=3, log=lambda m: None)
    for i in range(4):
        alarms.check({"step": i, rundir.STEP_TIME: 1.0})
    assert alarms.check({"step": 4, rundir.STEP_TIME: 9.0, "restart/seconds": 8.0})["alarm/step_time"] == 0.0
    assert alarms.times == [1.0] * 4  # nor part of the baseline
    assert alarms.check({"step": 5, rundir.STEP_TIME: 9.0})["alarm/step_time"] == 1.0


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_a_restart_is_booked_as_restart_seconds_not_as_the_check(tmp_path):
    cfg = load_config(None, ["model.context=64", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
                             "rollout.samples_per_prompt=4", "rollout.max_new_tokens=24", "rollout.max_concurrent=2",
                             "sft.auto=false", "progress=false", "reward.num_workers=1", HOOK, "sync.check_every=1",
                             "steps=4", "log.plots=false", "placement=disaggregated", f"out_dir={tmp_path / 'r'}"])
    summary = disaggregated.train(cfg, cfg.out_dir, worker=faults.dying_worker("mid_sync", tmp_path / "died"))
    assert summary["rollout/restarts"] == 1
    rows = list(rundir.read_jsonl(Path(cfg.out_dir) / rundir.METRICS))
    restarted = [r for r in rows if r["rollout/restarts"]]
    assert len(restarted) == 1 and restarted[0]["restart/seconds"] > 0 and restarted[0]["alarm/step_time"] == 0.0
    assert sum("restart/seconds" in r for r in rows) == 1
    checks = [s["end"] - s["start"] for s in rundir.read_jsonl(Path(cfg.out_dir) / rundir.SPANS)
              if s["role"] == "sync_check"]
    assert checks and max(checks) < restarted[0]["restart/seconds"]  # the check span does not hold the restart
