"""The weight check is on by default (the first sync, then every ``sync.check_every``), and a rollout
copy whose weights go bad after a sync stops the run with one line naming it, in every placement."""

from __future__ import annotations

from pathlib import Path

import faults
import pytest

from rollyard import roles
from rollyard.checkpoint import resume_hint
from rollyard.config import load_config
from rollyard.placement import async_, disaggregated
from rollyard.placement import step as grpo
from rollyard.placement.colocated import LocalRollout
from rollyard.placement.run import start
from rollyard.sync.check import WeightsDiffer
from rollyard.sync.factory import resolve

HOOK = f"reward.hook={Path(__file__).parent / 'dense_reward.py'}:digits"
RUN = ["model.context=64", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
       "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "sft.auto=false", "progress=false",
       "reward.num_workers=1", HOOK, "steps=4", "log.plots=false"]


def test_the_check_runs_at_the_first_sync_then_every_n():
    cfg = load_config(None, [])
    assert cfg.sync.check_every > 0  # on by default
    plan = resolve(load_config(None, ["sync.mode=full"]), "cpu")
    from rollyard.sync.session import SyncSession
    session = SyncSession(plan, roles.policy(load_config(None, ["model.context=32"]), "cpu")[0], check_every=3)
    due = []
    for _ in range(7):
        session.syncs += 1
        due.append(session.check_due())
    assert due == [True, False, True, False, False, True, False]  # syncs 1, 3, 6


class CorruptingRollout(LocalRollout):
    """The colocated rollout side (its own copy: sync.mode=full) whose engine weights go bad after sync 1."""

    def publish(self, step: int, version: int) -> int:
        nbytes = super().publish(step, version)
        if version == 1:
            import torch
            with torch.no_grad():
                next(self.engine.model.parameters()).add_(1e-3)
        return nbytes


def test_colocated_copy_corrupted_after_a_sync_stops_the_run(tmp_path):
    cfg = load_config(None, [*RUN, "sync.mode=full", f"out_dir={tmp_path / 'r'}"])
    run, r, extra = start(cfg, cfg.out_dir, False)
    try:
        with pytest.raises(WeightsDiffer) as e:
            grpo.train(run, r, CorruptingRollout(run, r, resolve(cfg, "cpu"), extra))
    finally:
        r.rewards.close()
    assert "at version 1" in str(e.value) and "\n" not in str(e.value)  # the CLI prints it as one line, exit 1
    # ... adding where to go on from (cli.cmd_train): stopped in step 0, before any checkpoint
    assert resume_hint(cfg.out_dir) == (f"no checkpoint was written yet (the run restarts): resume with "
                                        f"rollyard train --resume {cfg.out_dir}")


ray_test = pytest.mark.usefixtures("ray_session")


@pytest.mark.ray
@pytest.mark.slow
@ray_test
@pytest.mark.parametrize("placement, fault", [("async", "corrupting"), ("disaggregated", "stale")])
def test_ray_worker_corrupted_after_a_sync_stops_the_run(tmp_path, placement, fault):
    """corrupting: the weights go bad after the sync; stale: the worker claims the version, keeps the old weights."""
    # steps=12: the worker's answer to the first check travels back through the sample queue; the run stops when it
    # lands, so the extra steps cost nothing, and a loaded machine (two test workers) cannot end a 4-step run first
    cfg = load_config(None, [*RUN, f"placement={placement}", "max_staleness=1", f"out_dir={tmp_path / 'r'}", "steps=12"])
    driver = async_ if placement == "async" else disaggregated
    worker = faults.corrupting_worker(from_version=1) if fault == "corrupting" else faults.stale_worker(from_version=1)
    with pytest.raises(WeightsDiffer) as e:  # the default cadence checks the first sync: the one that went bad
        driver.train(cfg, cfg.out_dir, worker=worker)
    assert "rollout worker rollout-0 holds v1" in str(e.value) and "\n" not in str(e.value)
