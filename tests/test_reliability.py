"""Fault injection: nothing lost or doubled across crashes, resumes and faults; every failure loud.

Faults come from tests/faults.py (named injection points). Runs are real: the CLI in a subprocess
killed with SIGKILL / SIGTERM / SIGINT by its own reward hook, checkpoints damaged on disk, reward
workers killed from outside.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import faults
import pytest
import torch

from rollyard import checkpoint
from rollyard.cli import main
from rollyard.reward.dispatcher import RewardDispatcher
from rollyard.telemetry import rundir
from rollyard.telemetry.alarms import Alarms
from rollyard.trainer.numerics import NumericalError
from rollyard.types import Sample

SRC = str(Path(__file__).resolve().parents[1] / "src")
# 4 eval calls at start, then 4 reward calls per step (2 prompts x 2 samples), one worker: the Nth
# reward call of the run is step (N - 5) // 4.
TINY = ["model.context=48", "data.train_size=32", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false", "log.plots=false",
        "reward.num_workers=1"]
STEPS = 6


def _call_in_step(step: int) -> int:
    return 4 + 4 * step + 2  # the 2nd of the step's 4 reward calls


def _train(run: Path, *extra: str, hook: str = "kill_trainer", fault_at: int | None = None,
           resume: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "COLUMNS": "500"}
    env.pop("ROLLYARD_FAULT_DIR", None)
    if fault_at is not None:
        env.update(ROLLYARD_FAULT_DIR=str(run.parent), ROLLYARD_FAULT_AT=str(fault_at))
        (run.parent / "calls").unlink(missing_ok=True)
    args = (["--resume", str(run), *extra] if resume else
            [*TINY, f"steps={STEPS}", "checkpoint_every=2", f"reward.hook={faults.HOOKS}:{hook}", f"out_dir={run}",
             "reward.correctness=true", *extra])  # the hooks score as the arithmetic verifier: the held-out eval runs
    return subprocess.run([sys.executable, "-m", "rollyard.cli", "train", *args], env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def _rows(run: Path, name: str = rundir.METRICS) -> list[dict]:
    return list(rundir.read_jsonl(run / name))


def _assert_each_step_once(run: Path, steps: int) -> None:
    """metrics, lengths: one row per step; spans: one per role per step; traffic: one per edge per step."""
    assert [r["step"] for r in _rows(run)] == list(range(steps))
    assert [r["step"] for r in _rows(run, rundir.LENGTHS)] == list(range(steps))
    spans = Counter((s["role"], s["step"]) for s in _rows(run, rundir.SPANS))
    assert set(spans.values()) == {1} and {st for _, st in spans} == set(range(steps))
    traffic = Counter((t["edge"], t["step"]) for t in _rows(run, rundir.TRAFFIC))
    assert set(traffic.values()) == {1} and len(traffic) == steps * len(rundir.EDGES)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run every interrupted one is held against."""
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = _train(run)
    assert proc.returncode == 0, proc.stderr
    return run


def _same_losses(a: Path, b: Path) -> None:
    for ra, rb in zip(_rows(a), _rows(b), strict=True):
        assert ra["reward"] == rb["reward"], ra["step"]
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-6), ra["step"]


# ------------------------------------------------------------------------ the main process killed
def test_kill9_then_resume_doubles_nothing_and_matches_uninterrupted(straight, tmp_path):
    run = tmp_path / "run"
    killed = _train(run, fault_at=_call_in_step(5))  # steps 0-4 recorded, latest checkpoint at step 4
    assert killed.returncode == -signal.SIGKILL
    assert "Traceback" not in killed.stderr
    assert [r["step"] for r in _rows(run)] == [0, 1, 2, 3, 4]
    resumed = _train(run, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "removed records of steps after the checkpoint" in resumed.stdout
    _assert_each_step_once(run, STEPS)
    _same_losses(straight, run)  # step 4, the first after the resume, included
    assert all("alarm/step_time" in r and r["train/skipped"] == 0.0 for r in _rows(run))
    summary = json.loads((run / rundir.SUMMARY).read_text())
    assert summary["recorded_steps"] == STEPS and summary["steps"] == STEPS


def test_sigterm_finishes_the_step_checkpoints_and_exits_143(straight, tmp_path):
    run = tmp_path / "run"
    stopped = _train(run, "checkpoint_every=10", hook="term_trainer", fault_at=_call_in_step(2))
    assert stopped.returncode == 143, stopped.stderr
    last = stopped.stderr.strip().splitlines()[-1]
    assert "stopped by SIGTERM" in last and "checkpoint written at step 3" in last and "Traceback" not in stopped.stderr
    assert checkpoint.latest(run).name == "step_000003"
    assert [r["step"] for r in _rows(run)] == [0, 1, 2]
    resumed = _train(run, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    _assert_each_step_once(run, STEPS)
    _same_losses(straight, run)


def test_second_signal_abandons_the_step_at_once(capsys):
    from rollyard import signals

    with signals.graceful():
        os.kill(os.getpid(), signal.SIGTERM)  # first: only a request, the step goes on
        assert signals.stop_requested()
        with pytest.raises(signals.Stopped) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)  # second: out of the step now
        assert stopped.value.abandoned and stopped.value.exit_code == 143
        assert "latest checkpoint is intact" in str(stopped.value)
    assert not signals.stop_requested() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert "send it again to stop at once" in capsys.readouterr().err


def test_sigint_checkpoints_and_exits_130(tmp_path):
    run = tmp_path / "run"
    stopped = _train(run, "checkpoint_every=10", hook="int_trainer", fault_at=_call_in_step(1))
    assert stopped.returncode == 130, stopped.stderr
    assert "stopped by SIGINT" in stopped.stderr and "Traceback" not in stopped.stderr
    assert checkpoint.latest(run).name == "step_000002"


# ----------------------------------------------------------------------------- run directory
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    (run / rundir.SUMMARY).unlink()  # as if it died during the final eval: resumable
    faults.truncate(run / rundir.CHECKPOINTS / "step_000006" / checkpoint.MODEL)
    resumed = _train(run, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "step_000006 is not usable" in resumed.stdout and "bytes" in resumed.stdout
    assert "resuming" in resumed.stdout and "step 4" in resumed.stdout
    _assert_each_step_once(run, STEPS)
    _same_losses(straight, run)


@pytest.mark.parametrize("name", [checkpoint.MODEL, checkpoint.OPTIM, checkpoint.STATE, checkpoint.RNG])
def test_checkpoint_damage_is_detected(straight, tmp_path, name):
    ckpt = tmp_path / "step_000006"
    shutil.copytree(straight / rundir.CHECKPOINTS / "step_000006", ckpt)
    assert checkpoint.verify(ckpt) is None
    faults.corrupt(ckpt / name, offset=min(200, (ckpt / name).stat().st_size // 2))
    assert name in checkpoint.verify(ckpt)
    (ckpt / checkpoint.MANIFEST).unlink()
    assert "missing" in checkpoint.verify(ckpt)


def test_no_valid_checkpoint_is_one_line_exit_2(straight, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    (run / rundir.SUMMARY).unlink()
    for ck in (run / rundir.CHECKPOINTS).iterdir():
        faults.truncate(ck / checkpoint.OPTIM)
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no valid checkpoint" in err[0]


def test_failed_resume_keeps_config_and_finished_run_is_left_alone(straight, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    config = (run / rundir.CONFIG).read_bytes()
    assert main(["train", "--resume", str(run), "steps=8", "model.name=small"]) == 2  # model does not match
    assert "does not match the model" in capsys.readouterr().err
    assert (run / rundir.CONFIG).read_bytes() == config
    before = {f: (run / f).read_bytes() for f in (rundir.SUMMARY, rundir.METRICS, rundir.SPANS, rundir.CONFIG)}
    assert main(["train", "--resume", str(run)]) == 0
    assert "is finished" in capsys.readouterr().err
    assert {f: (run / f).read_bytes() for f in before} == before
    assert filecmp.dircmp(run / rundir.CHECKPOINTS, straight / rundir.CHECKPOINTS).diff_files == []


def test_second_process_on_a_run_directory_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode()); print('locked', flush=True); "
        "time.sleep(120)"), str(run / rundir.LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["train", *TINY, "steps=1", f"out_dir={run}"]) == 2
        assert f"in use by another rollyard process (pid {holder.pid})" in capsys.readouterr().err
        assert not (run / rundir.METRICS).exists()
    finally:
        holder.kill()
        holder.wait()


def test_truncate_records_repairs_a_torn_line(tmp_path):
    rows = [json.dumps({"step": s, "x": s}) for s in range(6)]
    (tmp_path / rundir.METRICS).write_text("\n".join(rows) + '\n{"step": 6, "x"')
    (tmp_path / rundir.DEADLETTER).write_text('{"step": null, "source": "f:1"}\n{"step": 1, "source": "a@1"}\n')
    (tmp_path / rundir.EVAL).write_text("".join(json.dumps({"step": s, "accuracy": 0.5}) + "\n" for s in (0, 2, 4, 6)))
    dropped = rundir.truncate_records(tmp_path, 4)
    assert [r["step"] for r in _rows(tmp_path)] == [0, 1, 2, 3]
    assert [r["step"] for r in _rows(tmp_path, rundir.EVAL)] == [0, 2, 4]  # the eval at step 4 ran before checkpoint 4
    assert [r["source"] for r in _rows(tmp_path, rundir.DEADLETTER)] == ["a@1"]  # start-up letters are rewritten
    assert dropped == {rundir.METRICS: 3, rundir.DEADLETTER: 1, rundir.EVAL: 1}


# ------------------------------------------------------------------------------ reward faults
def _samples(n_prompts: int = 4, n: int = 2) -> list[Sample]:
    return [Sample(id=f"p{p}-{k}", request_id=f"p{p}", prompt_ids=[1], completion_ids=[p + 1] * (k + 1),
                   logprobs=[0.0] * (k + 1), versions=[0] * (k + 1), finish_reason="stop",
                   meta={"prompt": f"{p}+0=", "answer": str(p)})
            for p in range(n_prompts) for k in range(n)]


def _dispatcher(hook: str, **kw) -> RewardDispatcher:
    return RewardDispatcher(f"{faults.HOOKS}:{hook}", decode=lambda ids: "".join(map(str, ids)), **kw)


def test_reward_worker_killed_mid_call_loses_no_sample():
    others = set(faults.reward_worker_pids())  # workers of dispatchers other tests left to the GC
    with _dispatcher("slow", num_workers=2, timeout_s=30) as d:
        batch = _samples()
        for s in batch:
            d.submit(s)
        faults.kill_reward_worker(spare=others)
        done = list(d.results())
        assert sorted(s.id for s in done) == sorted(s.id for s in batch)  # every sample came back, once
        assert d.stats["worker_restarts"] >= 1
        flags = [s.reward_flag for s in done if s.reward_flag]
        assert all("worker died (killed by SIGKILL)" in f for f in flags)
        again = d.score(_samples())  # the pool is whole again
        assert all(s.reward_flag is None for s in again)


def test_hook_that_hangs_costs_one_timeout_per_batch_not_one_per_sample(capsys):
    with _dispatcher("hangs", num_workers=2, timeout_s=0.5) as d:
        out = d.score(_samples(n_prompts=4, n=4))
        assert [s.reward_flag for s in out] == ["timeout"] * 16
        assert d.stats["worker_restarts"] == 2  # only the two first calls ran (and timed out), in parallel
    assert "flagged timeout without running" in capsys.readouterr().err


@pytest.mark.parametrize("hook", ["overflow_f32", "huge"])
def test_rewards_must_be_finite_in_float32(hook):
    with _dispatcher(hook, num_workers=1) as d:
        out = d.score(_samples(2, 2))
    bad = [s for s in out if s.reward_flag]
    assert bad and all("not finite in float32" in s.reward_flag and s.reward == 0.0 for s in bad)


def test_hook_isolation_memory_cpu_and_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with _dispatcher("allocate_gb", num_workers=1, memory_mb=256) as d:
        assert "MemoryError" in d.score(_samples(1, 1))[0].reward_flag
    with _dispatcher("spin", num_workers=1, timeout_s=60, cpu_s=1) as d:
        assert "killed by SIGXCPU" in d.score(_samples(1, 1))[0].reward_flag
    with _dispatcher("writes_cwd", num_workers=1) as d:
        workdir = Path(d._workdir)
        assert d.score(_samples(1, 1))[0].reward == 1.0
    assert not (tmp_path / "scratch.txt").exists() and not workdir.exists()


@pytest.mark.parametrize(("hook", "kind"), [("always_raise", "error: RuntimeError"), ("returns_none", "error: TypeError")])
def test_a_hook_failing_every_call_is_loud_recorded_and_not_trained_on(tmp_path, capsys, hook, kind):
    run = tmp_path / "run"
    assert main(["train", *TINY, "steps=2", f"reward.hook={faults.HOOKS}:{hook}", f"out_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "4/4 reward calls failed" in out and "ALARM step 0" in out
    errors = json.loads((run / rundir.REWARD_ERRORS).read_text())
    assert list(errors) == [kind] and len(errors[kind]) == 3 and errors[kind][0]["step"] == 0
    rows = _rows(run)
    assert [r["reward/errors"] for r in rows] == [4, 4] and [r["alarm/reward_failures"] for r in rows] == [1.0, 1.0]
    assert [r["train/tokens"] for r in rows] == [0.0, 0.0]  # reward.on_failure=skip: nothing trained on
    assert json.loads((run / rundir.SUMMARY).read_text())["reward_flags"]["errors"] == 8


def test_on_failure_zero_trains_on_failed_samples(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *TINY, "steps=1", f"reward.hook={faults.HOOKS}:always_raise", "reward.on_failure=zero",
                 f"out_dir={run}"]) == 0
    assert _rows(run)[0]["train/tokens"] > 0


def test_hook_that_exits_on_import_is_a_start_up_error(tmp_path, capsys):
    hook = tmp_path / "exits.py"
    hook.write_text("raise SystemExit(3)\n\ndef score(c, p, m):\n    return 1.0\n")
    assert main(["train", *TINY, "steps=1", f"reward.hook={hook}:score", f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SystemExit" in err[0]


# ------------------------------------------------------------------------------- numerics
def test_non_finite_loss_skips_loudly_then_stops(capsys):
    from rollyard.model.loading import build_preset, char_tokenizer
    from rollyard.trainer.trainer import Trainer

    model = build_preset("tiny", char_tokenizer(), max_position_embeddings=32)
    trainer = Trainer(model, max_skipped_steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    batch = _samples(2, 2)
    for s in batch:
        s.advantage = float("nan")
    metrics = trainer.step(batch)
    assert metrics["skipped"] == 1.0 and metrics["skipped_steps"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert "optimizer step skipped" in capsys.readouterr().err
    for s in batch:
        s.advantage = 1.0
    assert trainer.step(batch)["skipped"] == 0.0  # a good step resets the run of skips
    for s in batch:
        s.advantage = float("nan")
    trainer.step(batch)
    with pytest.raises(NumericalError, match="2 consecutive"):
        trainer.step(batch)


def test_nan_loss_in_a_run_skips_steps_keeps_the_version_then_stops(tmp_path, capsys):
    model = faults.nan_in_training(tmp_path / "nan_model")
    run = tmp_path / "run"
    # trainer.useful_work=false: every sample is computed. With it on, a step whose groups all have equal rewards
    # (this random model's, mostly) computes no forward at all, so its NaN logits never reach the loss.
    assert main(["train", *TINY, "steps=4", f"model.name={model}", "trainer.max_skipped_steps=2",
                 "trainer.useful_work=false", f"out_dir={run}"]) == 1
    err = capsys.readouterr().err
    assert err.count("optimizer step skipped") == 2
    assert err.strip().splitlines()[-1].startswith("rollyard train: error: 2 consecutive optimizer steps")
    [row] = _rows(run)  # step 1 raised before its row was written
    assert row["train/skipped"] == 1.0 and row["train/skipped_steps"] == 1.0 and row["version"] == 0


# ------------------------------------------------------------------------------- bad input
def _bert_dir(path: Path) -> Path:
    from transformers import BertConfig, BertForMaskedLM
    BertForMaskedLM(BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32)).save_pretrained(path)
    return path


def _bad_inputs(tmp: Path) -> dict[str, list[str]]:
    a_file = tmp / "a_file"
    a_file.write_text("x")
    broken = tmp / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    latin = tmp / "latin.yaml"
    latin.write_bytes(b"steps: 3 # caf\xe9\n")
    config_dir = tmp / "conf.yaml"
    config_dir.mkdir()
    dead = tmp / "dead.jsonl"
    dead.write_text('{"question": "1+1="}\n{"question": "2+2="}\n')
    out = [f"out_dir={tmp / 'run'}"]
    return {
        "model directory missing": [f"model.name={tmp / 'no_such_model'}", *out],
        "model is a file": [f"model.name={a_file}", *out],
        "broken config.json": [f"model.name={broken}", *out],
        "not a causal LM": [f"model.name={_bert_dir(tmp / 'bert')}", *out],
        "unknown device": ["trainer.device=tpu", *out],
        "unavailable device": ["trainer.device=cuda:7", *out],
        "out_dir a file": [f"out_dir={a_file}"],
        "out_dir read-only": ["out_dir=/sys/rollyard-run"],
        "--config a directory": ["--config", str(config_dir), *out],
        "--config not UTF-8": ["--config", str(latin), *out],
        "invalid task option value": ["data.task_options={max_operand: abc}", *out],
        "unwritable sft.cache_dir": ["sft.auto=true", f"sft.cache_dir={a_file}/cache", *out],
        "every prompt dead-lettered": [f"data.path={dead}", "data.on_error=deadletter",
                                       "reward.hook=rollyard.reward.verifiers:exact_match", *out],
    }


def test_every_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    cases = _bad_inputs(tmp_path)
    capsys.readouterr()
    for name, args in cases.items():
        base = [a for a in TINY if not any(a.startswith(k.split("=")[0] + "=") for k in args)]
        flags = args[:2] if args[0] == "--config" else []
        assert main(["train", *flags, *base, "steps=1", *args[len(flags):]]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("rollyard train: error:") and "Traceback" not in err[0], (name, err)
    assert not (tmp_path / "run" / rundir.CONFIG).exists()  # no failed start wrote a config


def test_dataset_without_demos_warm_starts_from_its_answers(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    args = [a for a in TINY if a != "sft.auto=false"]
    assert main(["train", *args, "steps=1", f"data.path={data}", "reward.hook=rollyard.reward.verifiers:exact_match", "sft.steps=2", "sft.eval_every=1",
                 f"sft.cache_dir={tmp_path / 'cache'}", f"out_dir={tmp_path / 'run'}"]) == 0
    assert "warm start: SFT on task demonstrations" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / rundir.SUMMARY).read_text())["sft_steps"] == 2


# ---------------------------------------------------------------------------------- alarms
def test_step_time_alarm_fires_20_percent_above_the_trailing_median():
    seen: list[str] = []
    alarms = Alarms(min_history=3, log=seen.append)
    assert [alarms.check({"step": i, rundir.STEP_TIME: 1.0})["alarm/step_time"] for i in range(4)] == [0.0] * 4
    assert alarms.check({"step": 4, rundir.STEP_TIME: 1.19})["alarm/step_time"] == 0.0
    assert alarms.check({"step": 5, rundir.STEP_TIME: 1.3})["alarm/step_time"] == 1.0
    assert "30% above the median" in seen[-1]


def test_reward_hacking_alarm_when_reward_rises_and_held_out_does_not():
    def run(accuracies):
        alarms, fired = Alarms(log=lambda m: None), []
        for step in range(8):
            row = {"step": step, "reward": 0.1 * step}
            if step % 4 == 3:
                row["eval/accuracy"] = accuracies[step // 4]
            fired.append(alarms.check(row).get("alarm/reward_hacking"))
        return fired

    assert run([0.30, 0.30])[7] == 1.0  # reward up 0.4, held-out flat
    assert run([0.30, 0.25])[7] == 1.0  # ... or falling
    assert run([0.30, 0.45])[7] == 0.0  # both up: learning
    assert run([0.30, 0.30])[3] == 0.0  # nothing to compare the first eval with


@pytest.mark.parametrize(("hook", "flag"), [("always_raise", "reward/errors"), ("hangs", "reward/timeouts")])
def test_tail_scheduler_counts_failed_verifier_calls_as_the_plain_one(tmp_path, hook, flag):
    """Every sample of the step failed (raised, or ran past the timeout): both schedulers count each one."""
    rows = {}
    for sched in ("plain", "tail"):
        run = tmp_path / sched
        assert main(["train", *TINY, "steps=1", f"reward.hook={faults.HOOKS}:{hook}", "reward.timeout_s=0.5",
                     f"rollout.scheduler={sched}", f"out_dir={run}"]) == 0
        rows[sched] = _rows(run)[0]
        summary = json.loads((run / rundir.SUMMARY).read_text())
        assert summary["reward_flags"][flag.split("/")[1]] == rows[sched][flag]
    for sched, row in rows.items():
        assert row[flag] > 0 and row["reward/failed_frac"] == 1.0, (sched, row)
    assert rows["tail"][flag] >= rows["plain"][flag]  # tail over-provisions: at least the plain step's samples
