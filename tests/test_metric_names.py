"""The accuracy column exists only where the reward is a correctness signal."""

from __future__ import annotations

from rollyard.config import load_config
from rollyard.placement.run import RunRecord
from rollyard.telemetry.report import step_line


def test_accuracy_only_for_a_correctness_signal():
    def correctness(*overrides: str) -> bool:
        return RunRecord(load_config(None, list(overrides)), None, None, None).correctness
    assert correctness()  # the built-in task's verifier
    assert not correctness("reward.hook=my_rewards:score")
    assert not correctness("reward.hooks=[a:b, c:d]")
    assert correctness("reward.hook=my_rewards:score", "reward.correctness=true")


def test_the_console_line_shows_accuracy_only_when_the_row_has_it():
    row = {"step": 0, "time/rollout": 0.4, "time/step": 0.5, "reward": 0.5}
    assert step_line(row).endswith("| mean reward 0.50")
    assert step_line({**row, "reward/accuracy": 0.25}).endswith("| mean reward 0.50, accuracy 25%")


def test_one_set_of_names_and_old_runs_read_under_them():
    from rollyard.telemetry.tracking import _numbers, current_names
    row = {"step": 3, "reward": 0.5, "rewards/f/mean": 0.2, "learning_rate": 1e-6, "time/rollout": 0.1}
    assert _numbers(row) == {k: v for k, v in row.items() if k != "step"}  # the trackers log the rows' own names
    old = {"step": 3, "reward/mean": 0.5, "reward/std": 0.1, "reward/f/mean": 0.2, "reward/f/acc": 1.0,
           "length/mean": 4.0, "train/lr": 1e-6, "train/loss": 0.3, "train/clip_frac": 0.0,
           "train/logprob_diff": 0.0, "reward/accuracy": 0.5, "reward/errors": 0}
    assert current_names(old) == {"step": 3, "reward": 0.5, "reward_std": 0.1, "rewards/f/mean": 0.2,
                                  "rewards/f/acc": 1.0, "completions/mean_length": 4.0, "learning_rate": 1e-6,
                                  "loss": 0.3, "clip_ratio/region_mean": 0.0, "train/logprob_diff": 0.0,
                                  "reward/accuracy": 0.5, "reward/errors": 0}
    assert current_names(current_names(old)) == current_names(old)
