"""A simulated two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): the driver (the
trainer) on the head node, the rollout workers on a second node that advertises the
``rollyard_rollout`` resource; weights move over both transports and every sync is checked.

It needs a Ray cluster of its own, so it runs in a subprocess (the suite's one Ray session stays
as it is) and joins the cluster the way a user does: ``RAY_ADDRESS``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
HOOK = str(Path(__file__).parent / "dense_reward.py") + ":digits"
SCRIPT = """
import os, sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"trainer_node": 1},
                                                        "include_dashboard": False})
cluster.add_node(num_cpus=2, resources={"rollyard_rollout": 2})
cluster.wait_for_nodes()
os.environ["RAY_ADDRESS"] = cluster.address
from rollyard.cli import main
codes = []
for transport in ("ray", "dist"):
    codes.append(main(["train", *sys.argv[2:], f"sync.transport={transport}", f"out_dir={sys.argv[1]}/{transport}"]))
import ray
ray.shutdown()
cluster.shutdown()
print("EXIT CODES", codes)
sys.exit(max(codes))
"""
RUN = ["model.context=48", "data.train_size=64", "data.eval_size=4", "rollout.prompts_per_step=2",
       "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false", "log.plots=false",
       "reward.num_workers=1", "eval_every=0", "steps=2", "placement=async", "rollout.workers=2",
       "sync.check_every=1", f"reward.hook={HOOK}"]


@pytest.mark.ray
@pytest.mark.slow
def test_trainer_and_rollout_on_two_nodes_over_both_transports(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", "COLUMNS": "300"}
    env.pop("RAY_ADDRESS", None)
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), *RUN], env=env, capture_output=True,
                         text=True, timeout=400, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    placed = [ln for ln in out.splitlines() if ln.startswith("rollout-") and " on node " in ln]
    assert len(placed) == 4 and all("another node than the driver" in ln for ln in placed), placed
    checks = [ln for ln in out.splitlines() if ln.startswith("sync check v")]
    assert len(checks) == 4 and all("2 worker(s) equal the trainer" in ln for ln in checks), checks
