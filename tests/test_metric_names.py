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
    row = {"step": 0, "time/rollout": 0.4, "time/step": 0.5, "reward/mean": 0.5}
    assert step_line(row).endswith("| mean reward 0.50")
    assert step_line({**row, "reward/accuracy": 0.25}).endswith("| mean reward 0.50, accuracy 25%")
