"""Smaller bad inputs and environments, each one line naming the real cause and a fix that works:
a task option rollyard sets itself, an empty stop string, an address-space limit (``ulimit -v``) below
``reward.memory_mb`` (the run trains) and one too low for torch to load (one line, exit 2)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from rollyard.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["model.context=48", "data.train_size=16", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false",
        "reward.num_workers=1", "log.plots=false"]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_task_option_rollyard_sets_itself_is_one_line_naming_the_setting(tmp_path, capsys):
    assert main(["train", *TINY, "steps=1", "data.task_options={seed: 3}", f"out_dir={tmp_path / 'run'}"]) == 2
    line = _one_line(capsys)
    assert "data.task_options.seed=3: a task's seed is set by data.seed" in line and "set data.seed=3" in line
    assert "TypeError" not in line and "multiple values" not in line


def test_an_empty_stop_string_is_one_line_without_an_empty_suggestion(tmp_path, capsys):
    assert main(["train", *TINY, "steps=1", 'rollout.stop_tokens=[""]', f"out_dir={tmp_path / 'run'}"]) == 2
    line = _one_line(capsys)
    assert "rollout.stop_tokens holds an empty string" in line and "remove it" in line and "''" not in line


def _limited(limit_kb: int, args: list[str]) -> subprocess.CompletedProcess:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_kb << 10, limit_kb << 10))

    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "COLUMNS": "500"}
    return subprocess.run([sys.executable, "-m", "rollyard.cli", "train", *args], env=env, preexec_fn=limit,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS as Linux applies it")
def test_a_run_under_a_limit_below_reward_memory_mb_trains(tmp_path):
    proc = _limited(3_500_000, [*TINY, "steps=1", "reward.memory_mb=4096", f"out_dir={tmp_path / 'run'}"])
    assert proc.returncode == 0, proc.stderr  # the reward workers keep the lower limit they inherit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS as Linux applies it")
@pytest.mark.parametrize("limit_kb", [300_000, 600_000])
def test_a_limit_too_low_for_torch_is_one_line_exit_2(tmp_path, limit_kb):
    proc = _limited(limit_kb, [*TINY, "steps=1", f"out_dir={tmp_path / 'run'}"])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"rollyard train: error: out of memory under this process's address-space limit of {limit_kb >> 10} MB "
        f"(ulimit -v {limit_kb})"), proc.stderr


def test_a_torch_that_aborts_on_import_under_a_limit_is_the_out_of_memory_line(tmp_path, monkeypatch, capsys):
    """Under ulimit -v 600000 torch's native start-up once aborted the process (pybind11, SIGABRT) instead of
    raising: under a limit a child imports torch first, and its death by a signal is the out-of-memory line; a
    child that lacks a module lets the run go on to meet that error itself."""
    import resource

    from rollyard import cli

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nkill -ABRT $$\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cli.sys, "executable", str(fake))
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setattr(cli.resource, "getrlimit", lambda what: (600_000 << 10, resource.RLIM_INFINITY))
    ran = []
    monkeypatch.setattr(cli, "_main", lambda cmd, rest: ran.append(cmd) or 0)
    assert cli.main(["train"]) == 2 and ran == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rollyard train: error: out of memory under this process's "
                                               "address-space limit of 585 MB (ulimit -v 600000)"), err
    assert cli.main(["plan"]) == 0 and ran == ["plan"]  # plan does not load torch: no probe
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    assert cli.main(["train"]) == 0 and ran == ["plan", "train"]


def test_an_import_that_fails_without_an_exception_under_a_limit_is_the_out_of_memory_line(monkeypatch, capsys):
    """CPython's import system, failing an allocation under ulimit -v, can raise SystemError "returned NULL without
    setting an exception" (importing torch under 600 MB on one machine): the out-of-memory line where an
    address-space limit is set; with no limit, or another SystemError, the error propagates."""
    import resource

    from rollyard import cli

    def null(cmd, rest):
        raise SystemError("<function _find_and_load at 0x7f91f948fce0> returned NULL without setting an exception")

    monkeypatch.setattr(cli, "_main", null)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")  # what _memory_limit sets under a limit, restored after
    monkeypatch.setattr(cli.resource, "getrlimit", lambda what: (600_000 << 10, resource.RLIM_INFINITY))
    assert cli.main(["train"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rollyard train: error: out of memory under this process's "
                                               "address-space limit of 585 MB (ulimit -v 600000)"), err

    def other(cmd, rest):
        raise SystemError("error return without exception set")

    monkeypatch.setattr(cli, "_main", other)
    with pytest.raises(SystemError):
        cli.main(["train"])
    monkeypatch.setattr(cli, "_main", null)
    monkeypatch.setattr(cli.resource, "getrlimit", lambda what: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    with pytest.raises(SystemError):
        cli.main(["train"])


def test_an_import_that_cannot_allocate_is_the_out_of_memory_line_and_other_os_errors_propagate(monkeypatch, capsys):
    """Under a tight ulimit -v, importing torch can fail inside the import system itself (listing a package
    directory: OSError ENOMEM, not MemoryError), depending on where the limit lands: the same one line."""
    import errno

    from rollyard import cli

    def no_memory(cmd, rest):
        raise OSError(errno.ENOMEM, "Cannot allocate memory", "/site-packages/torch/jit")

    monkeypatch.setattr(cli, "_main", no_memory)
    assert cli.main(["train"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rollyard train: error: out of memory"), err

    def missing(cmd, rest):
        raise OSError(errno.ENOENT, "No such file or directory", "x")

    monkeypatch.setattr(cli, "_main", missing)
    with pytest.raises(FileNotFoundError):
        cli.main(["train"])


QUIET = """
import os, sys, warnings
from rollyard.rollout.vllm import _console_kept_clear
with _console_kept_clear():
    os.write(2, b"C-level stderr: a progress bar\\n")
    os.write(1, b"C-level stdout\\n")
    print("python stderr", file=sys.stderr)
    warnings.warn("a FutureWarning", FutureWarning)
print("after", file=sys.stderr)
"""


@pytest.mark.parametrize("level", ["ERROR", "INFO"])
def test_vllms_start_up_output_is_kept_off_the_console_unless_asked_for(level):
    env = {**os.environ, "PYTHONPATH": SRC, "VLLM_LOGGING_LEVEL": level}
    proc = subprocess.run([sys.executable, "-c", QUIET], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if level == "ERROR":
        assert proc.stderr == "after\n" and proc.stdout == "", (proc.stdout, proc.stderr)
    else:
        assert "C-level stderr" in proc.stderr and "python stderr" in proc.stderr and "C-level stdout" in proc.stdout


SECOND_RUN = """
import sys
import torch.distributed as dist
from rollyard.model.loading import load_policy
from rollyard.rollout.vllm import VllmEngine
model, tok = load_policy("tiny64", max_position_embeddings=48)
engine = VllmEngine(model, eos_token_id=tok.eos_token_id, max_concurrent=2, max_cache_tokens=256)
print("during", dist.is_initialized(), flush=True)
engine.close()
print("after", dist.is_initialized(), flush=True)
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)  # the next run's group
dist.destroy_process_group()
print("clean", flush=True)
"""


def test_an_in_process_vllm_engine_leaves_no_process_group_for_the_next_run(tmp_path):
    pytest.importorskip("vllm")
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SECOND_RUN, str(tmp_path / "pg")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["during True", "after False", "clean"], proc.stdout
