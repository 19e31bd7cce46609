"""The logprob canary: after every sync the rollout side scores a fixed probe through what it samples with
(the fast path's fused copies, or vLLM's own forward) and the trainer scores it with its forward, at the
same version. A healthy fp32 copy reads the kernels' rounding (measured <= 3e-6, bench/canary.py; the tests
allow KERNELS); a copy that stops taking weights (it claims each version, keeps the old weights) trips
``alarm/logprob_canary`` with a gap > 1e-4 (one step at lr 5e-3 moves the probe's logprobs by more); the lag
is its own metric. In mode inprocess the engine reads the trainer's module, and the canary checks the fast
path's fused copies of it (a refresh that did not take)."""

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
KERNELS = 1e-5  # fp32 kernels' rounding, nats (fast path or vLLM vs the trainer's HF forward: <= 3e-6 measured)


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


@pytest.mark.parametrize("mode,stale", [("full", False), ("full", True), ("lora", False)])
def test_colocated_canary(tmp_path, capsys, mode, stale):
    lora = ["model.lora.r=4"] if mode == "lora" else []  # the copy holds the merged adapter
    cfg = load_config(None, [*RUN, *lora, f"sync.mode={mode}", f"out_dir={tmp_path / 'r'}"])
    run, r, extra = start(cfg, cfg.out_dir, False)
    side = (StaleRollout if stale else LocalRollout)(run, r, resolve(cfg, "cpu"), extra)
    grpo.train(run, r, side)
    rows = _rows(run)
    gaps = [row["canary/logprob_gap"] for row in rows]
    assert [row["canary/lag"] for row in rows] == [0.0] * 5
    if not stale:
        assert max(gaps) < KERNELS and not any(row["alarm/logprob_canary"] for row in rows), gaps
        return
    assert max(gaps[:2]) < KERNELS and min(gaps[2:]) > 1e-4, gaps  # versions 3-5 were never loaded
    assert [row["alarm/logprob_canary"] for row in rows] == [0.0, 0.0, 1.0, 1.0, 1.0]
    out = capsys.readouterr().out
    assert sum(line.startswith("ALARM step 2: logprob canary") for line in out.splitlines()) == 1


def test_canary_every_n_syncs_still_catches_a_copy_that_stopped_taking_weights(tmp_path, capsys):
    """``sync.canary_every=2``: the canary at the first sync, then every second (steps 0, 1, 3 of five, one sync a
    step), each its own span; a copy stale from version 3 shows at the first canary after it (step 3). At 0: none."""
    cfg = load_config(None, [*RUN, "sync.mode=full", "sync.canary_every=2", f"out_dir={tmp_path / 'r'}"])
    run, r, extra = start(cfg, cfg.out_dir, False)
    grpo.train(run, r, StaleRollout(run, r, resolve(cfg, "cpu"), extra))
    rows = _rows(run)
    assert ["canary/logprob_gap" in row for row in rows] == [True, True, False, True, False]
    assert rows[1]["canary/logprob_gap"] < KERNELS < 1e-4 < rows[3]["canary/logprob_gap"]
    assert rows[3]["alarm/logprob_canary"] == 1.0
    spans = list(rundir.read_jsonl(Path(run.run_dir) / rundir.SPANS))
    assert [s["step"] for s in spans if s["role"] == "canary"] == [0, 1, 3]
    assert sum(line.startswith("ALARM step 3: logprob canary") for line in capsys.readouterr().out.splitlines()) == 1
    cfg = load_config(None, [*RUN, "sync.mode=full", "sync.canary_every=0", f"out_dir={tmp_path / 'off'}"])
    run, r, extra = start(cfg, cfg.out_dir, False)
    grpo.train(run, r, StaleRollout(run, r, resolve(cfg, "cpu"), extra))
    assert not any(k.startswith("canary/") for row in _rows(run) for k in row)
    assert not any(s["role"] == "canary" for s in rundir.read_jsonl(Path(run.run_dir) / rundir.SPANS))
    assert "logprob canary: off (sync.canary_every=0)" in capsys.readouterr().out


class StaleFusedRollout(LocalRollout):
    """Mode inprocess: the engine reads the trainer's module, but from version 3 its fast path decodes with
    the fused weight copies of version 2 (a refresh that did not take; the engine claims each version)."""

    def publish(self, step: int, version: int) -> int:
        nbytes = super().publish(step, version)
        fwd = self.engine.backend.fwd
        if version == 2:
            self.kept = fwd.layers  # refresh builds a new list of new fused tensors: these stay v2's
        elif version > 2:
            fwd.layers = self.kept
        return nbytes


def test_inprocess_canary_checks_the_fast_paths_fused_copies(tmp_path, capsys):
    cfg = load_config(None, [*RUN, f"out_dir={tmp_path / 'r'}"])
    run, r, extra = start(cfg, cfg.out_dir, False)
    side = StaleFusedRollout(run, r, resolve(cfg, "cpu"), extra)
    assert side.session.mode == "inprocess"  # the colocated default on CPU
    assert type(side.engine.backend).__name__ == "NativeBackend"
    grpo.train(run, r, side)
    rows = _rows(run)
    gaps = [row["canary/logprob_gap"] for row in rows]
    assert [row["canary/lag"] for row in rows] == [0.0] * 5  # one module: no version can lag
    assert max(gaps[:2]) < KERNELS and min(gaps[2:]) > 1e-4, gaps  # the fast path's kernels, then stale fused copies
    assert [row["alarm/logprob_canary"] for row in rows] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert sum(line.startswith("ALARM step 2: logprob canary") for line in capsys.readouterr().out.splitlines()) == 1


def test_a_bf16_rollout_over_the_shared_fp32_module_reads_bf16_rounding_and_raises_no_alarm(tmp_path, capsys):
    """rollout.precision=bf16 with the trainer's fp32 module shared (sync.mode=inprocess): the fast path's fused
    copies are bf16, so the canary reads bf16 rounding (far above the fp32 kernels'), within the first-sync
    ceiling of a bf16 rollout, not the fp32 copy's: no alarm, and run.json says what ran."""
    import json

    cfg = load_config(None, [*RUN, "rollout.precision=bf16", "trainer.lr=1e-4", f"out_dir={tmp_path / 'r'}"])
    run, r, extra = start(cfg, cfg.out_dir, False)
    side = LocalRollout(run, r, resolve(cfg, "cpu"), extra)
    assert side.session.mode == "inprocess" and side.engine.backend.fwd.mm_dtype.is_floating_point
    assert str(side.engine.backend.fwd.mm_dtype) == "torch.bfloat16"
    grpo.train(run, r, side)
    rows = _rows(run)
    gaps = [row["canary/logprob_gap"] for row in rows]
    assert min(gaps) > 20 * KERNELS and max(gaps) < 0.5 and max(gaps) > 1e-3, gaps  # (1e-3: an fp32 copy's ceiling)
    assert not any(row["alarm/logprob_canary"] for row in rows), gaps
    assert "ALARM" not in capsys.readouterr().out
    info = json.loads((Path(run.run_dir) / rundir.RUN_INFO).read_text())
    assert info["rollout_precision"] == "bf16" and "rollout.precision=bf16" in info["rollout_precision_reason"]


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
        if v < 3:  # equal versions, weights taken: the kernels' rounding only
            assert row["canary/logprob_gap"] < KERNELS and row["alarm/logprob_canary"] == 0.0, (v, row)
        else:  # a copy left behind
            assert row["canary/logprob_gap"] > 1e-4 and row["alarm/logprob_canary"] == 1.0, (v, row)
    assert sum(line.startswith("ALARM") and "logprob canary" in line for line in capsys.readouterr().out.splitlines()) == 1


@pytest.mark.slow
def test_a_vllm_engine_that_stops_taking_weights_trips_the_canary(tmp_path, capsys):
    """rollout.backend=vllm: the copy lives inside vLLM and vLLM's own forward scores the probe (prompt logprobs).
    Mode inprocess: the engine's mirror is the trainer's module, vLLM's copy is reloaded from it at each sync;
    equal versions read the kernels' rounding, a vLLM copy no longer reloaded from v3 on trips the alarm.
    (Mode full with a healthy copy: tests/test_vllm.py's warm run; the Ray actors: its Ray placements test.)"""
    pytest.importorskip("vllm")
    cfg = load_config(None, [*RUN, "model.name=tiny64", "rollout.backend=vllm", "sync.mode=inprocess",
                             "sync.check_every=10", f"out_dir={tmp_path / 'r'}"])  # one check: the first sync
    run, r, extra = start(cfg, cfg.out_dir, False)
    side = StaleRollout(run, r, resolve(cfg, "cpu"), extra)
    try:
        assert callable(getattr(side.engine, "score", None))  # vLLM's forward, not a module of rollyard's
        grpo.train(run, r, side)
    finally:
        side.engine.close()
    rows = _rows(run)
    gaps = [row["canary/logprob_gap"] for row in rows]
    assert [row["canary/lag"] for row in rows] == [0.0] * 5
    assert max(gaps[:2]) < KERNELS and min(gaps[2:]) > 1e-4, gaps  # versions 3-5 never reached vLLM
    # mode inprocess, yet vLLM holds a copy: the equality check reads it (first sync, still healthy)
    assert [row["sync/checked"] for row in rows] == [1, 0, 0, 0, 0]
    assert [row["alarm/logprob_canary"] for row in rows] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert sum(line.startswith("ALARM step 2: logprob canary") for line in capsys.readouterr().out.splitlines()) == 1
