"""Accuracy only from a correctness signal: a reward that is high for any text shows no accuracy, a
length hack is held against a real verifier (eval.reward) and trips the reward-hacking alarm, and a
held-out regression alarms only past the eval's binomial noise."""

from __future__ import annotations

import json

from rollyard.cli import main
from rollyard.config import load_config
from rollyard.evaluate import accuracy_signal
from rollyard.telemetry import rundir
from rollyard.telemetry.alarms import Alarms

TINY = ["model.context=48", "data.train_size=64", "data.eval_size=32", "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "sft.auto=false", "progress=false", "reward.num_workers=1", "log.plots=false"]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_which_signal_scores_the_held_out_eval():
    def signal(*overrides: str):
        return accuracy_signal(load_config(None, list(overrides)))
    assert signal() == "the arithmetic task's verifier"
    assert signal("reward.hook=m:f") is None  # a custom reward alone is not a correctness check
    assert signal("reward.hooks=[a:b, c:d]") is None
    assert signal("reward.hook=m:f", "reward.correctness=true") == "the training reward m:f (reward.correctness=true)"
    assert signal("reward.hook=m:f", "eval.reward=v:ok") == "eval.reward=v:ok"


def test_a_random_model_with_a_custom_hook_shows_no_accuracy(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "steps=2", "eval_every=1", "reward.hook=hacking_rewards:anything",
                 f"out_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "no held-out accuracy: reward.hook=hacking_rewards:anything is not declared a correctness signal" in out
    assert "eval.reward=module:function" in out and "%" not in out.split("accuracy", 1)[1].split("\n", 1)[0]
    rows = _rows(run / rundir.METRICS)
    assert [r["reward"] for r in rows] == [0.9, 0.9]  # the hook scores everything 0.9 ...
    assert not any(k in r for r in rows for k in ("eval/accuracy", "reward/accuracy"))  # ... no accuracy
    assert "after step 0: held-out" not in out
    summary = json.loads((run / rundir.SUMMARY).read_text())
    assert summary["eval_before"] is None and summary["eval_after"] is None
    assert not (run / rundir.EVAL).exists()
    assert json.loads((run / rundir.RUN_INFO).read_text())["accuracy_signal"] is None


def test_a_length_hack_trips_the_reward_hacking_alarm_against_a_real_verifier(tmp_path, capsys):
    """The training reward pays for digits (16: 1.0), so the policy pads; the held-out eval scores with the
    arithmetic verifier (eval.reward), which a random model never passes: reward up, correctness flat."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "steps=9", "eval_every=4", "trainer.lr=5e-3", "reward.hook=hacking_rewards:longer",
                 "eval.reward=rollyard.reward.verifiers:arithmetic", f"out_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "(32 prompts, scored by eval.reward=rollyard.reward.verifiers:arithmetic)" in out
    assert "eval_every=0" not in out  # evals during the run: the alarms are armed
    rows = _rows(run / rundir.METRICS)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 4, 8] and all(r["eval/prompts"] == 32 for r in evals)
    assert rows[8]["reward"] > rows[0]["reward"] + 0.1, [r["reward"] for r in rows]  # the hack pays ...
    assert [r["eval/accuracy"] for r in evals] == [0.0, 0.0, 0.0]  # ... correctness does not move
    assert rows[8]["alarm/reward_hacking"] == 1.0
    # Printed once, at the first eval that sees it (step 4 when the hack is learned fast, as on a GPU; else 8).
    first = next(r["step"] for r in evals if r["alarm/reward_hacking"] == 1.0)
    assert first in (4, 8) and f"ALARM step {first}: train reward rose by" in out
    assert not any("reward/accuracy" in r for r in rows)  # the training reward is no correctness signal
    assert json.loads((run / rundir.RUN_INFO).read_text())["accuracy_signal"] == \
        "eval.reward=rollyard.reward.verifiers:arithmetic"


def test_held_out_regression_alarms_past_the_noise_of_two_evals():
    """100 held-out prompts, best 50%: a fall to 40% is 1.4 standard errors (noise), to 30% is 3.0."""
    def run(accuracies, n=100):
        seen: list[str] = []
        alarms = Alarms(log=seen.append)
        fired = [alarms.check({"step": i, "reward": 0.5, "eval/accuracy": a, "eval/prompts": n})
                 .get("alarm/held_out_regression") for i, a in enumerate(accuracies)]
        return fired, seen

    assert run([0.5, 0.4])[0] == [0.0, 0.0]
    fired, seen = run([0.3, 0.5, 0.3, 0.32, 0.48])
    assert fired == [0.0, 0.0, 1.0, 1.0, 0.0]  # measured from the best eval (0.5), not the first
    assert [m.split(":")[0] for m in seen] == ["ALARM step 2", "alarm cleared at step 4"]
    assert "fell to 30.0% from the run's best 50.0%" in seen[0] and "over 100 prompts" in seen[0]
    assert run([1.0, 0.99])[0] == [0.0, 0.0]  # one prompt of 100 from perfect: noise, not a regression
    assert run([1.0, 0.97])[0] == [0.0, 0.0]  # 3 points: 1.8 standard errors
    assert run([1.0, 0.95])[0] == [0.0, 1.0]  # 5 points: 2.3
    assert run([0.5, 0.3], n=10)[0] == [0.0, 0.0]  # 10 prompts: 20 points is within noise
    assert "alarm/held_out_regression" not in Alarms().check({"step": 0, "eval/accuracy": 0.5})  # no n: not checked


def test_a_run_whose_alarms_cannot_fire_says_so(tmp_path, capsys):
    assert main(["train", *TINY, "steps=2", f"out_dir={tmp_path / 'r'}"]) == 0  # eval_every=0: before and after only
    assert ("held-out eval only before and after RL (eval_every=0): the reward-hacking and held-out regression alarms"
            in capsys.readouterr().out)
