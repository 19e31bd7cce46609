"""kill -9 of the driver of a Ray run leaves nothing it started running (placement/reaper.py)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
RUN = ["model.context=64", "data.train_size=64", "data.eval_size=4", "rollout.prompts_per_step=2",
       "rollout.samples_per_prompt=4", "rollout.max_new_tokens=40", "sft.auto=false", "progress=false", "log.plots=false",
       "reward.num_workers=1", "eval_every=0", "steps=500", "placement=async"]


@pytest.mark.ray
@pytest.mark.slow
def test_kill9_of_the_driver_leaves_no_process_behind(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    err = tmp_path / "driver.err"
    with err.open("w") as sink:
        driver = subprocess.Popen([sys.executable, "-m", "rollyard.cli", "train", *RUN, f"out_dir={tmp_path / 'r'}"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=sink)
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.exists() and metrics.stat().st_size) and time.time() < deadline:
        assert driver.poll() is None, f"the run ended before it could be killed: {err.read_text()[-3000:]}"
        time.sleep(0.5)
    started = {(p.pid, p.create_time()): p.name() for p in psutil.Process(driver.pid).children(recursive=True)}
    assert any("raylet" in n for n in started.values()), started  # a local Ray session is up
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()

    def left() -> dict:
        out = {}
        for (pid, born), name in started.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == born and p.status() != psutil.STATUS_ZOMBIE:
                    out[pid] = name
            except psutil.Error:
                pass
        return out

    deadline = time.time() + 30
    while left() and time.time() < deadline:
        time.sleep(0.5)
    assert not left(), f"left running after the driver was killed: {left()}"
