"""The one GRPO step (placement/step.py): one publish rule in every placement.

A skipped optimizer step (non-finite loss) makes no new weight version, so it must not move the
publish cadence: with ``sync.every=2`` and step 2 skipped, versions go 1, 2, 2, 3, 4 over five steps
and every placement publishes exactly versions 2 and 4 (by step count the old colocated rule
published after steps 1 and 3, i.e. versions 2 and 3, while the Ray placements published 2 and 4).
"""

from pathlib import Path

import pytest

from rollyard.cli import main
from rollyard.telemetry import rundir

HOOK = f"reward.hook={Path(__file__).parent / 'skip_reward.py'}:huge_at_step_2"
BASE = ["model.context=48", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false", "log.plots=false",
        "reward.num_workers=1", "eval_every=0", HOOK, "algo.normalize_std=false", "steps=5", "sync.every=2",
        "sync.mode=full", "sync.check_every=1"]
PLACEMENTS = {
    "colocated": [],
    "disaggregated": ["placement=disaggregated"],
    "async": ["placement=async", "max_staleness=1"],
}


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_skipped_step_publishes_the_same_versions_in_every_placement(tmp_path, placement):
    run = tmp_path / placement
    assert main(["train", *BASE, *PLACEMENTS[placement], f"out_dir={run}"]) == 0
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    assert [r["train/skipped"] for r in rows] == [0, 0, 1, 0, 0]
    assert [r["version"] for r in rows] == [1, 2, 2, 3, 4]
    spans = list(rundir.read_jsonl(run / rundir.SPANS))
    published = [(s["step"], s["version"]) for s in spans if s["role"] == "sync" and s["worker"] == "driver"]
    assert published == [(1, 2), (4, 4)]
    checked = [(s["step"], s["version"]) for s in spans if s["role"] == "sync_check"]
    assert checked == [(1, 2), (4, 4)]  # every publish checked: the rollout side holds the trainer's weights
    canaries = [(s["step"], s["version"]) for s in spans if s["role"] == "canary"]
    assert canaries == published  # the logprob canary after each publish is timed as its own role (time/canary)
    assert ["time/canary" in r for r in rows] == [False, True, False, False, True]
    assert [r["sync/checked"] for r in rows] == [0, 1, 0, 0, 1]
