"""Alarms worth reading: one line per episode (hysteresis), and no step-time verdict on the steps
whose wall time holds a held-out eval or a checkpoint write."""

from __future__ import annotations

import json

import torch

from rollyard.cli import main
from rollyard.telemetry import rundir
from rollyard.telemetry.alarms import Alarms, first_canary_max


def _steps(alarms: Alarms, times: list[float], start: int = 0, **extra) -> list[float]:
    return [alarms.check({"step": start + i, rundir.STEP_TIME: t, **extra})["alarm/step_time"]
            for i, t in enumerate(times)]


def test_a_load_spike_is_one_alarm_then_it_re_arms_after_recovery():
    seen: list[str] = []
    alarms = Alarms(min_history=5, log=seen.append)
    assert _steps(alarms, [1.0] * 10) == [0.0] * 10
    assert _steps(alarms, [3.0, 2.8, 3.5, 2.9, 3.1], start=10) == [1.0] * 5  # the row says it holds
    assert [m for m in seen if m.startswith("ALARM")] == [seen[0]] and "step 10" in seen[0]  # printed once
    assert _steps(alarms, [1.15], start=15) == [1.0]  # under 1.2x but not back under 1.1x: still slow
    assert _steps(alarms, [1.0, 1.0], start=16) == [0.0, 0.0]
    assert len(seen) == 2 and seen[1].startswith("alarm cleared at step 16")
    assert _steps(alarms, [1.5], start=18) == [1.0]  # re-armed: the next episode fires again
    assert len([m for m in seen if m.startswith("ALARM")]) == 2
    assert _steps(alarms, [1.0], start=19) == [0.0] and len(seen) == 3  # a one-step blip: no "cleared" line
    assert alarms.times == [1.0] * 13  # the slow steps never joined the baseline


def test_eval_and_checkpoint_steps_are_not_in_the_step_time_baseline():
    seen: list[str] = []
    alarms = Alarms(min_history=3, log=seen.append)
    _steps(alarms, [1.0] * 4)
    assert _steps(alarms, [5.0, 5.0], start=4, **{"eval/seconds": 4.0}) == [0.0, 0.0]
    assert _steps(alarms, [5.0] * 20, start=6, **{"checkpoint/seconds": 4.0}) == [0.0] * 20
    assert seen == [] and alarms.times == [1.0] * 4
    assert _steps(alarms, [1.3], start=26) == [1.0]  # the baseline is still 1.0 s


def test_reward_hacking_is_one_alarm_per_episode():
    seen: list[str] = []
    alarms = Alarms(log=seen.append)
    values = []
    for step in range(16):
        row = {"step": step, "reward": 0.1 * step}
        if step % 4 == 3:
            row["eval/accuracy"] = 0.3 if step < 12 else 0.9
        values.append(alarms.check(row).get("alarm/reward_hacking"))
    assert [values[s] for s in (3, 7, 11, 15)] == [0.0, 1.0, 1.0, 0.0]
    assert len([m for m in seen if m.startswith("ALARM")]) == 1
    assert seen[-1].startswith("alarm cleared at step 15")


def test_a_first_canary_past_the_copy_dtypes_rounding_is_an_alarm():
    # A copy that never matched the trainer (another sampling support, a wrong weight mapping) reads a large gap
    # from the first sync on; with the first gap as the floor it would never alarm.
    seen: list[str] = []
    alarms = Alarms(canary_first_max=first_canary_max(torch.float32), log=seen.append)
    values = [alarms.check({"step": s, "canary/logprob_gap": g})["alarm/logprob_canary"]
              for s, g in enumerate([0.3, 0.25, 2e-6])]
    assert values == [1.0, 1.0, 0.0]
    assert seen[0].startswith("ALARM step 0: logprob canary: at the first sync") and "rollout.top_p" in seen[0]
    assert seen[1].startswith("alarm cleared at step 2") and len(seen) == 2
    # a bf16 copy's own rounding (measured up to 2.1e-2) is a floor, not an alarm
    bf16 = Alarms(canary_first_max=first_canary_max(torch.bfloat16), log=seen.append)
    assert [bf16.check({"step": s, "canary/logprob_gap": g})["alarm/logprob_canary"] for s, g in
            enumerate([2e-2, 3e-2, 0.5])] == [0.0, 0.0, 1.0]


def test_a_resumed_run_keeps_the_alarm_state_without_printing_again():
    rows = [{"step": i, rundir.STEP_TIME: 1.0} for i in range(8)] + [{"step": 8, rundir.STEP_TIME: 4.0}]
    seen: list[str] = []
    alarms = Alarms(log=seen.append)
    alarms.seed(rows)
    assert seen == [] and alarms.slow
    assert _steps(alarms, [4.0], start=9) == [1.0] and seen == []


def test_a_run_marks_its_eval_and_checkpoint_steps(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "model.context=48", "data.train_size=32", "data.eval_size=4", "rollout.prompts_per_step=2",
                 "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "sft.auto=false", "progress=false",
                 "reward.num_workers=1", "log.plots=false", "steps=5", "eval_every=2", "checkpoint_every=3",
                 f"out_dir={run}"]) == 0
    rows = [json.loads(line) for line in (run / rundir.METRICS).read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/seconds" in r] == [1, 3]  # the evals after steps 1 and 3
    assert [r["step"] for r in rows if "checkpoint/seconds" in r] == [3]  # checkpoint 3, written after row 2
