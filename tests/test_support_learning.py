"""A run at top_p=0.9 learns as one at top_p=1.0 does (issue 47, item 3), end to end on the native backend.

The set-up of tests/test_vllm.py's reward-rise test (its numbers and margin): a 30-step SFT warm start on
arithmetic (sft.auto, cached), then 20 colocated GRPO steps over the same 16 prompts, so the sampled reward
moves with the policy. With the rollout and the trainer on the same top-p support (algo/support.py) the
samples' logprob gap stays at float rounding and the mean reward of the last five steps beats the first
five's by more than MARGIN at top_p=0.9 as at 1.0. Slow (two runs, ~2-4 min on 2 quiet cores).
"""

from __future__ import annotations

import pytest

from rollyard.cli import main
from rollyard.telemetry import rundir

STEPS, WINDOW, MARGIN = 20, 5, 0.1
RUN = ["model.name=tiny64", "model.context=48", "data.task=arithmetic", "data.train_size=16", "data.eval_size=8",
       "rollout.prompts_per_step=16", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=8", "trainer.lr=1e-3",
       "sft.auto=true", "sft.steps=30", "eval_every=0", f"steps={STEPS}", "progress=false", "log.plots=false",
       "reward.num_workers=1"]


@pytest.mark.slow
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_top_p_run_learns_the_task_as_a_full_one_does(tmp_path, top_p):
    assert main(["train", *RUN, f"rollout.top_p={top_p}", f"out_dir={tmp_path / 'run'}"]) == 0
    rows = list(rundir.read_jsonl(tmp_path / "run" / rundir.METRICS))
    assert len(rows) == STEPS
    assert max(r["train/logprob_diff_max"] for r in rows) < 1e-4  # same support: float rounding, not log(mass)
    reward = [r["reward"] for r in rows]
    first, last = sum(reward[:WINDOW]) / WINDOW, sum(reward[-WINDOW:]) / WINDOW
    assert last > first + MARGIN, (top_p, reward)
