"""A rollout actor killed (SIGKILL) while decoding, mid-sync or between syncs, with weights that
really change, is replaced: it starts from the *current* published weights (checksum-verified
against that version, and every later sync checked again with ``sync.check_every=1``), its
in-flight prompts are requeued once, and the run finishes with every prompt trained at most once.
Workers that keep dying stop the run with one line (exit 1)."""

import json
from pathlib import Path

import faults
import pytest

from rollyard.config import load_config
from rollyard.placement import RolloutCrashLoop, async_, disaggregated
from rollyard.telemetry import rundir

HOOK = f"reward.hook={Path(__file__).parent / 'dense_reward.py'}:digits"
RUN = ["model.context=64", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
       "rollout.samples_per_prompt=4", "rollout.max_new_tokens=24", "rollout.max_concurrent=2", "sft.auto=false",
       "progress=false", "reward.num_workers=1", "eval_every=0", HOOK, "sync.check_every=1", "steps=5",
       "checkpoint_every=5"]

ray_test = pytest.mark.usefixtures("ray_session")


def _accounted(run: Path, steps: int, per_step: int) -> dict:
    """Nothing lost, nothing trained twice: the train spans' request ids against the final ledger."""
    ckpt = max((run / rundir.CHECKPOINTS).iterdir())
    led = json.loads((ckpt / "state.json").read_text())["cursor"]["ledger"]
    trained_spans = [s["requests"] for s in rundir.read_jsonl(run / rundir.SPANS)
                     if s["role"] == "train" and "requests" in s]
    ids = [i for ids in trained_spans for i in ids]
    assert len(ids) == len(set(ids)) == steps * per_step, "a prompt was trained twice or a step trained short"
    trained, dead, live = set(led["trained"]), set(led["dead"]), {r["id"] for r in led["live"]}
    assert set(ids) == trained and not (trained & dead) and not (trained & live) and not (dead & live)
    return led


@pytest.mark.ray
@pytest.mark.slow
@ray_test
@pytest.mark.parametrize("placement,moment,transport", [
    ("async", "decoding", "ray"),
    ("async", "mid_sync", "dist"),
    ("disaggregated", "mid_sync", "ray"),
    ("disaggregated", "between_syncs", "dist"),
])
def test_killed_actor_is_replaced_with_the_current_weights(tmp_path, capsys, placement, moment, transport):
    marker = tmp_path / "died.json"
    cfg = load_config(None, [*RUN, f"placement={placement}", f"sync.transport={transport}", "max_staleness=1",
                             f"out_dir={tmp_path / 'r'}"])
    driver = async_ if placement == "async" else disaggregated
    summary = driver.train(cfg, cfg.out_dir, worker=faults.dying_worker(moment, marker))
    run = Path(cfg.out_dir)
    died = json.loads(marker.read_text())
    assert died["version"] >= 1 and summary["rollout/restarts"] == 1 and summary["steps"] == 5
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "rollout worker rollout-0 died" in ln)
    restarted_at = int(line.split("restarted at weights v")[1].split()[0])
    assert restarted_at >= 2, line  # the current version, not the start-up one
    if (moment, transport) == ("mid_sync", "dist"):  # the trainer was mid-broadcast: the group is rebuilt
        assert "rebuilding the sync group" in out
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    assert sum(r["rollout/restarts"] for r in rows) == 1 and all(r["sync/checked"] == 1 for r in rows)
    checks = [s for s in rundir.read_jsonl(run / rundir.SPANS) if s["role"] == "sync_check"]
    assert len({c["checksum"] for c in checks}) == len(checks) == 5  # weights moved at every sync, all checked
    led = _accounted(run, 5, 2)
    if moment == "decoding":
        assert died["active"] > 0
        assert led["requeues"] >= 1  # its in-flight prompts were handed out again


@pytest.mark.ray
@pytest.mark.slow
@ray_test
def test_workers_that_keep_dying_stop_the_run_with_one_line(tmp_path, capsys):
    cfg = load_config(None, [*RUN, "placement=async", f"out_dir={tmp_path / 'r'}"])
    with pytest.raises(RolloutCrashLoop, match=r"died 4 times within .* \(limit 3\)") as e:
        async_.train(cfg, cfg.out_dir, worker=faults.dying_worker("always", tmp_path / "m", from_version=0))
    assert "\n" not in str(e.value)  # the CLI prints it as one line and exits 1
    assert capsys.readouterr().out.count("rollout worker rollout-0 died") == 3
