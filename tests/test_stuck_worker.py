"""A rollout actor whose loop stops making progress while the trainer waits for it.

The driver looks at each worker's loop after a silence (``RolloutWorker.state``: where its thread is, what it
holds, its process's CPU use) and says it; a loop blocked for ``STUCK_S`` with its process idle stops the run with
one line naming where it is, instead of waiting out the silence bound (an hour). A loop that computes as long (a
long prefill, a core busy) is not stuck: the run goes on."""

import json
from pathlib import Path

import faults
import pytest

from rollyard import waits
from rollyard.config import load_config
from rollyard.placement import async_, pool

HOOK = f"reward.hook={Path(__file__).parent / 'dense_reward.py'}:digits"
RUN = ["model.context=64", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
       "rollout.samples_per_prompt=4", "rollout.max_new_tokens=24", "rollout.max_concurrent=2", "sft.auto=false",
       "progress=false", "reward.num_workers=1", "eval_every=0", HOOK, "sync.check_every=1", "steps=6",
       "placement=async", "max_staleness=1"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
def test_a_blocked_worker_loop_stops_the_run_in_one_line_and_a_long_computation_does_not(tmp_path, capsys,
                                                                                         monkeypatch):
    monkeypatch.setattr(pool, "LOOK_EVERY_S", 1.0)
    monkeypatch.setattr(pool, "STUCK_S", 3.0)
    marker = tmp_path / "stalled.json"
    cfg = load_config(None, [*RUN, f"out_dir={tmp_path / 'r'}"])
    with pytest.raises(waits.NoAnswer) as e:
        async_.train(cfg, cfg.out_dir, worker=faults.stalling_worker(marker, spin_s=3 * pool.STUCK_S))
    stalled = json.loads(marker.read_text())
    # The computation (three times the bound, at version 1) was looked at and let go on: the run synced again
    assert stalled["spun"]["version"] == 1 and stalled["blocked"]["version"] >= 2 and stalled["blocked"]["active"] > 0
    err = capsys.readouterr().err
    looks = [ln for ln in err.splitlines() if ln.startswith("rollyard: rollout worker rollout-0: at v")]
    spinning = [ln for ln in looks if ln.startswith("rollyard: rollout worker rollout-0: at v1,") and "_step (faults.py:" in ln]
    assert spinning and any(not ln.endswith(" 0% of a core since the last look") for ln in spinning), looks
    # The block: one line, naming where the loop is, what it held
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rollout worker rollout-0: its loop made no progress for "), msg
    assert "blocked in blocked (faults.py:" in msg and "_step (faults.py:" in msg, msg
    assert any(f"at v{stalled['blocked']['version']}, {stalled['blocked']['active']} sample(s) decoding" in ln
               for ln in looks), looks
