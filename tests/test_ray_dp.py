"""``trainer.dp > 1`` (and fsdp) in the Ray placements: the trainer ranks are processes the driver
(rank 0) starts; rank 0 publishes the weights to the rollout actors; the gradient all-reduce is
on the ledger's ``gradients`` edge, as measured at the sockets, and matches the plan's ring
formula; every sync is checked against the rollout workers."""

import json
from pathlib import Path

import pytest

from rollyard.cli import main
from rollyard.plan.bytes import ring_allreduce_bytes
from rollyard.telemetry import rundir

HOOK = f"reward.hook={Path(__file__).parent / 'dense_reward.py'}:digits"
RUN = ["model.context=48", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
       "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false", "log.plots=false",
       "reward.num_workers=1", "eval_every=0", HOOK, "steps=3", "sync.check_every=1", "trainer.dp=2"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("placement,sharding,transport", [("async", "none", "dist"),
                                                          ("disaggregated", "fsdp", "ray")])
def test_data_parallel_trainer_in_ray_placements(tmp_path, placement, sharding, transport):
    run = tmp_path / "r"
    assert main(["train", *RUN, f"placement={placement}", f"trainer.sharding={sharding}",
                 f"sync.transport={transport}", f"out_dir={run}"]) == 0
    info = json.loads((run / rundir.RUN_INFO).read_text())
    assert info["dp"] == 2 and info["placement"] == placement
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    assert [r["sync/checked"] for r in rows] == [1, 1, 1]
    checks = [s["checksum"] for s in rundir.read_jsonl(run / rundir.SPANS) if s["role"] == "sync_check"]
    assert len(set(checks)) == 3  # the weights rank 0 published changed every step, and the workers hold them
    grads = [t["bytes"] for t in rundir.read_jsonl(run / rundir.TRAFFIC) if t["edge"] == "gradients"]
    assert len(grads) == 3 and all(g > 0 for g in grads)
    if sharding == "none":  # every gradient all-reduced: the ring's 2 (k-1)/k x P x 4 bytes, plus framing
        ring = ring_allreduce_bytes(info["policy_params"] * 4, 2)
        assert all(abs(g / ring - 1) < 0.05 for g in grads), (grads, ring)
