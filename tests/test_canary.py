"""The logprob canary: after every sync the rollout copy and the trainer score a fixed probe at the same
version. A healthy fp32 copy reads a gap of 0 in every placement; a copy that stops taking weights (it
claims each version, keeps the old weights) trips ``alarm/logprob_canary``; the lag is its own metric."""

from __future__ import annotations

from pathlib import Path

import faults
import pytest

from rollyard.config import load_config
from rollyard.placement import disaggregated
from rollyard.placement import step as grpo
from rollyard.placement.colocated import LocalRollout
from rollyard.placement.run import start
from rollyard.sync.factory import resolve
from rollyard.telemetry import rundir

HOOK = f"reward.hook={Path(__file__).parent / 'dense_reward.py'}:digits"
RUN = ["model.context=64", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
       "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8", "sft.auto=false", "progress=false",
       "reward.num_workers=1", HOOK, "steps=5", "log.plots=false", "trainer.lr=5e-3",
       "sync.check_every=0"]  # the checksum would stop the stale runs first: the canary is what is tested


class StaleRollout(LocalRollout):
    """The colocated side with its own copy, which stops taking weights at version 3 (it claims them)."""

    def publish(self, step: int, version: int) -> int:
        if version < 3:
            return super().publish(step, version)
        self.session.publish(self.r.model, version, {})  # the trainer publishes; the copy loads nothing
        self.engine.version = version
        return 0


def _rows(run) -> list[dict]:
    return list(rundir.read_jsonl(Path(run.run_dir) / rundir.METRICS))


@pytest.mark.parametrize("stale", [False, True])
def test_colocated_canary(tmp_path, capsys, stale):
    cfg = load_config(None, [*RUN, "sync.mode=full", f"out_dir={tmp_path / 'r'}"])
    run, r, extra = start(cfg, cfg.out_dir, False)
    side = (StaleRollout if stale else LocalRollout)(run, r, resolve(cfg, "cpu"), extra)
    grpo.train(run, r, side)
    rows = _rows(run)
    gaps = [row["canary/logprob_gap"] for row in rows]
    assert [row["canary/lag"] for row in rows] == [0.0] * 5
    if not stale:
        assert gaps == [0.0] * 5 and not any(row["alarm/logprob_canary"] for row in rows)
        return
    assert gaps[:2] == [0.0, 0.0] and min(gaps[2:]) > 1e-4, gaps  # versions 3-5 were never loaded
    assert [row["alarm/logprob_canary"] for row in rows] == [0.0, 0.0, 1.0, 1.0, 1.0]
    out = capsys.readouterr().out
    assert sum(line.startswith("ALARM step 2: logprob canary") for line in out.splitlines()) == 1


def test_inprocess_mode_has_no_canary(tmp_path):
    cfg = load_config(None, [*RUN, "steps=2", f"out_dir={tmp_path / 'r'}"])
    run, r, extra = start(cfg, cfg.out_dir, False)
    grpo.train(run, r, LocalRollout(run, r, resolve(cfg, "cpu"), extra))
    assert not any(k.startswith("canary/") for row in _rows(run) for k in row)  # the engine reads the trainer's module


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_a_ray_worker_that_stops_taking_weights_trips_the_canary(tmp_path, capsys):
    cfg = load_config(None, [*RUN, "placement=disaggregated", f"out_dir={tmp_path / 'r'}"])
    disaggregated.train(cfg, cfg.out_dir, worker=faults.stale_worker(from_version=3))
    rows = list(rundir.read_jsonl(Path(cfg.out_dir) / rundir.METRICS))
    # the workers answer without holding the step up: a row carries the latest sync answered by then
    seen = {row["canary/version"]: row for row in rows if "canary/version" in row}
    assert any(v < 3 for v in seen) and any(v >= 3 for v in seen), sorted(seen)
    for v, row in seen.items():
        assert row["canary/lag"] == 0.0  # it claims each version: no lag to blame
        if v < 3:  # equal versions, weights taken: no gap at all
            assert row["canary/logprob_gap"] == 0.0 and row["alarm/logprob_canary"] == 0.0, (v, row)
        else:  # a copy left behind
            assert row["canary/logprob_gap"] > 1e-4 and row["alarm/logprob_canary"] == 1.0, (v, row)
    assert sum(line.startswith("ALARM") and "logprob canary" in line for line in capsys.readouterr().out.splitlines()) == 1
