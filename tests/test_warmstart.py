"""The warm start: cached under a key that holds only what changes it, and stopped within a step by
SIGTERM / SIGINT (a person should never need kill -9)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from rollyard.cli import main
from rollyard.config import load_config
from rollyard.sft import cache_key

SFT = ["model.context=48", "data.train_size=32", "data.eval_size=4", "rollout.prompts_per_step=2",
       "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "progress=false", "reward.num_workers=1",
       "log.plots=false", "sft.steps=2", "sft.eval_every=1", "sft.batch_size=4"]


def _key(*overrides: str) -> str:
    return cache_key(load_config(None, list(overrides)))


@pytest.mark.parametrize("override", ["rollout.max_new_tokens=5", "model.lora.r=4", "steps=7", "seed=3", "trainer.lr=1e-4",
                                      "reward.num_workers=1", "sft.auto=false", "sft.cache_dir=/elsewhere",
                                      "data.on_error=deadletter", "eval_every=5", "placement=async",
                                      "rollout.temperature=0.5", "algo.kl_coef=0.1", "checkpoint_every=3"])
def test_settings_that_do_not_change_the_warm_start_keep_its_key(override):
    assert _key(override) == _key()


@pytest.mark.parametrize("override", ["model.context=64", "model.seed=1", "model.name=small", "data.train_size=100",
                                      "data.eval_size=50", "data.seed=2", "data.task_options={max_operand: 20}",
                                      "sft.steps=10", "sft.lr=1e-3", "sft.target_accuracy=0.5", "sft.target_evals=3",
                                      "trainer.micro_batch_tokens=512"])
def test_settings_that_change_the_warm_start_change_its_key(override):
    assert _key(override) != _key()


def test_an_edited_dataset_file_is_a_new_warm_start(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    before = _key(f"data.path={data}")
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    assert _key(f"data.path={data}") != before


def test_rl_overrides_and_lora_reuse_the_cached_warm_start(tmp_path, capsys):
    cache = f"sft.cache_dir={tmp_path / 'cache'}"
    assert main(["train", *SFT, cache, "steps=1", f"out_dir={tmp_path / 'a'}"]) == 0
    assert "warm start: SFT on task demonstrations" in capsys.readouterr().out
    assert main(["train", *SFT, cache, "steps=1", "rollout.max_new_tokens=6", "model.lora.r=2", "seed=5",
                 f"out_dir={tmp_path / 'b'}"]) == 0
    assert "warm start: loading cached SFT model" in capsys.readouterr().out
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_a_run_that_finds_its_warm_start_written_meanwhile_keeps_that_copy(tmp_path, capsys, monkeypatch):
    # Two runs warm-starting one setup at once: the other run renames its copy into place while this one is still
    # writing its own. This run trains on, the cache holds exactly one complete copy, and no half-written one is left.
    import rollyard.sft as sft

    cache = tmp_path / "cache"
    real_export = sft.export

    def export_while_another_run_finishes(model, tokenizer, out):
        other = out.with_name(out.name.split(".tmp")[0])  # the final name: the other run got there first
        real_export(model, tokenizer, other)
        (other / "sft.json").write_text('{"other": true}')
        real_export(model, tokenizer, out)

    monkeypatch.setattr(sft, "export", export_while_another_run_finishes)
    assert main(["train", *SFT, f"sft.cache_dir={cache}", "steps=1", f"out_dir={tmp_path / 'a'}"]) == 0
    [entry] = list(cache.iterdir())
    assert ".tmp" not in entry.name and (entry / "sft.json").read_text() == '{"other": true}'
    monkeypatch.setattr(sft, "export", real_export)
    assert main(["train", *SFT, f"sft.cache_dir={cache}", "steps=1", f"out_dir={tmp_path / 'b'}"]) == 0
    assert "warm start: loading cached SFT model" in capsys.readouterr().out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_warm_start_stops_it_with_one_line(tmp_path, signum):
    cache = tmp_path / "cache"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "300"}
    args = [*SFT, "sft.steps=1000000", "sft.eval_every=1000000", f"sft.cache_dir={cache}", "steps=1",
            f"out_dir={tmp_path / 'run'}"]
    proc = subprocess.Popen([sys.executable, "-m", "rollyard.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:  # wait until the warm start has begun
        if line.startswith("warm start: SFT"):
            break
    time.sleep(1.0)  # into the SFT loop
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=60)  # a hang guard, not a timing assert: unfixed, this runs ~forever
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the warm start ignored the signal")
    assert proc.returncode == 128 + signum, err
    last = err.strip().splitlines()[-1]
    assert last == (f"rollyard train: stopped by {signal.Signals(signum).name}: the warm start was abandoned before RL "
                    f"began (nothing cached, no checkpoint); run the command again"), err
    assert "Traceback" not in err
    assert not any(p.is_dir() and ".tmp" not in p.name for p in cache.iterdir())  # nothing cached


def test_the_cpu_class_is_part_of_the_key(monkeypatch):
    """Another CPU class (or ROLLYARD_CPU_ISA narrowing this one) computes another warm start: not reused."""
    from rollyard.model import cpu

    monkeypatch.setattr(cpu, "reported", lambda: frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}))
    monkeypatch.delenv("ROLLYARD_CPU_ISA", raising=False)
    wide = _key()
    monkeypatch.setenv("ROLLYARD_CPU_ISA", "avx2")
    assert _key() != wide


@pytest.mark.parametrize("evals, stop", [(1, 1), (2, 4), (3, 3)])
def test_the_stop_needs_the_median_of_target_evals_at_the_target(tmp_path, monkeypatch, evals, stop):
    """The median of the last target_evals evals decides the stop: scripted evals 50%, 10%, 50%, 50% ... against a
    40% target stop it at the 1st eval (1: the plain rule), the 4th (2: the lower median, both at the target) or the
    3rd (3: the one low eval between two at the target does not restart the count, as "in a row" did)."""
    import json

    import rollyard.sft as sft

    script = iter([0.5, 0.1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    monkeypatch.setattr(sft, "greedy_accuracy", lambda *a, **k: next(script))
    cache = tmp_path / "cache"
    assert main(["train", *SFT, "sft.steps=8", "sft.target_accuracy=0.4", f"sft.target_evals={evals}",
                 f"sft.cache_dir={cache}", "steps=1", f"out_dir={tmp_path / 'run'}"]) == 0
    (done,) = list(cache.iterdir())
    assert json.loads((done / "sft.json").read_text())["sft_steps"] == stop


def test_one_eval_that_jumps_neither_stops_the_warm_start_nor_is_kept(tmp_path, monkeypatch):
    """Scripted evals 10%, 30%, 45%, 90% against a 40% target, median of 3: the jump to 90% at step 4 makes the
    median 45% (the stop), and the warm start keeps step 3's weights (the median eval's), not step 4's."""
    import json

    import rollyard.sft as sft
    from rollyard.model.loading import load_policy

    script, seen = iter([0.1, 0.3, 0.45, 0.9]), []

    def accuracy(model, *a, **k):
        seen.append({n: t.detach().clone() for n, t in model.state_dict().items()})
        return next(script)

    monkeypatch.setattr(sft, "greedy_accuracy", accuracy)
    cache = tmp_path / "cache"
    assert main(["train", *SFT, "sft.steps=8", "sft.target_accuracy=0.4", "sft.target_evals=3",
                 f"sft.cache_dir={cache}", "steps=1", f"out_dir={tmp_path / 'run'}"]) == 0
    (done,) = list(cache.iterdir())
    info = json.loads((done / "sft.json").read_text())
    assert (info["sft_steps"], info["sft_kept_step"], info["sft_accuracy"]) == (4, 3, 0.45)
    kept, _ = load_policy(str(done))
    at = kept.state_dict()
    assert all(torch.equal(at[n], t) for n, t in seen[2].items())  # step 3's weights
    assert not all(torch.equal(at[n], t) for n, t in seen[3].items())  # not the jump's
