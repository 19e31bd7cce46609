"""The last bad inputs from the reliability probes: each is one line (rule, value, fix) and exit 2,
never a traceback, never a run that trains on nothing; and the held-out eval says what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollyard import checkpoint
from rollyard.cli import main
from rollyard.telemetry import rundir

TINY = ["model.context=48", "data.train_size=32", "data.eval_size=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "sft.auto=false", "progress=false",
        "reward.num_workers=1", "log.plots=false"]


def _one_line_exit_2(capsys, args: list[str]) -> str:
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rollyard {args[0]}: error:") and "Traceback" not in err[0], err
    return err[0]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_prompt_longer_than_the_context_fails_before_training(tmp_path, capsys):
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+" + "1" * 60 + "=", "answer": "1"}) + "\n" for i in range(5)))
    run = tmp_path / "run"
    line = _one_line_exit_2(capsys, ["train", *TINY, "steps=2", f"data.path={data}",
                                     "reward.hook=rollyard.reward.verifiers:exact_match", f"out_dir={run}"])
    assert "none fits the model's context of 48" in line and "set model.context=" in line
    assert not (run / rundir.METRICS).exists() and not (run / rundir.CONFIG).exists()  # not one step ran


def test_one_prompt_that_fits_is_enough_to_start(tmp_path):
    data = tmp_path / "mixed.jsonl"
    rows = [{"prompt": "1" * 60 + "=", "answer": "1"}] * 3 + [{"prompt": "1+1=", "answer": "2"}]
    data.write_text("".join(json.dumps({**r, "id": i}) + "\n" for i, r in enumerate(rows)))
    assert main(["train", *TINY, "steps=1", f"data.path={data}", "reward.hook=rollyard.reward.verifiers:exact_match",
                 f"out_dir={tmp_path / 'run'}"]) == 0


def test_resume_with_another_prompt_stream_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "steps=2", "checkpoint_every=1", f"out_dir={run}"]) == 0
    line = _one_line_exit_2(capsys, ["train", "--resume", str(run), "steps=3", "data.train_size=100"])
    assert "data.train_size=100" in line and "data.train_size=32" in line and "drop the data.train_size override" in line
    config = (run / rundir.CONFIG).read_text()
    assert main(["train", "--resume", str(run), "steps=3", "data.eval_size=2"]) == 0  # the held-out set may change
    assert (run / rundir.CONFIG).read_text() != config


def test_resume_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    line = _one_line_exit_2(capsys, ["train", "--resume", str(tmp_path / "nope")])
    assert "does not exist" in line and "expected a run directory written by `rollyard train`" in line
    line = _one_line_exit_2(capsys, ["train", "--resume", str(tmp_path)])
    assert "no config.yaml in it" in line


def test_unwritable_checkpoint_directory_mid_run_is_one_line(tmp_path, capsys, monkeypatch):
    real, calls = checkpoint.save_file, []

    def refuse_the_second(tensors, path):  # the disk turns read-only after the first checkpoint
        calls.append(path)
        if len(calls) > 1:
            raise PermissionError(13, "Permission denied", path)
        real(tensors, path)

    monkeypatch.setattr(checkpoint, "save_file", refuse_the_second)
    run = tmp_path / "run"
    line = _one_line_exit_2(capsys, ["train", *TINY, "steps=4", "checkpoint_every=1", f"out_dir={run}"])
    assert "cannot write checkpoint step 2" in line and "Permission denied" in line
    assert f"resume from step_000001 with --resume {run}" in line
    assert checkpoint.latest(run).name == "step_000001"


def test_every_line_malformed_still_writes_the_dead_letters(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1="}\nnot json\n')
    run = tmp_path / "run"
    line = _one_line_exit_2(capsys, ["train", *TINY, "steps=1", f"data.path={data}", "data.on_error=deadletter",
                                     "reward.hook=rollyard.reward.verifiers:exact_match", f"out_dir={run}"])
    assert "all 2 lines were malformed" in line and "no 'prompt' field" in line
    dead = _rows(run / rundir.DEADLETTER)
    assert [d["source"] for d in dead] == [f"{data}:1", f"{data}:2"] and all(d["reason"] for d in dead)


def test_a_missing_eval_file_names_data_eval_path(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    missing = tmp_path / "eval.jsonl"
    line = _one_line_exit_2(capsys, ["train", *TINY, "steps=1", f"data.path={data}", f"data.eval_path={missing}",
                                     "reward.hook=rollyard.reward.verifiers:exact_match", f"out_dir={tmp_path / 'r'}"])
    assert f"data.eval_path={missing}: no such dataset file; check data.eval_path" in line


@pytest.mark.parametrize("task", [None, "arithmetic"])
def test_naming_data_task_with_a_dataset_brings_back_its_verifier(tmp_path, capsys, task):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    args = ["train", *TINY, "steps=1", f"data.path={data}", f"out_dir={tmp_path / 'r'}"]
    if task is None:
        assert "has no built-in verifier" in _one_line_exit_2(capsys, args)
        return
    assert main([*args, f"data.task={task}"]) == 0
    assert "held-out greedy accuracy before RL" in capsys.readouterr().out  # the task's eval split, its verifier


def test_eval_labels_match_the_metrics_rows_and_the_count_is_explained(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "steps=4", "eval_every=2", "data.eval_size=100000", f"out_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "prompts: the whole arithmetic eval split, data.eval_size=100000 asks for more" in out
    evals = _rows(run / rundir.EVAL)
    with_eval = [r["step"] for r in _rows(run / rundir.METRICS) if "eval/accuracy" in r]
    assert with_eval == [0, 2]  # before RL, and after step 1 (the policy step 2 starts from)
    assert [e["step"] for e in evals] == [0, 2, 4]  # the last one, after step 3, has no row
    rows = {r["step"]: r for r in _rows(run / rundir.METRICS)}
    assert all(rows[e["step"]]["eval/accuracy"] == e["accuracy"] for e in evals[:2])


@pytest.mark.parametrize("message, says", [
    ({"role": "wizard", "content": "1+1="}, "message 0 has role 'wizard'"),
    ({"role": "User", "content": "1+1="}, "message 0 has role 'User'"),  # roles are lower case in every template
])
def test_a_chat_message_with_an_unknown_role_is_one_line(tmp_path, capsys, message, says):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [message], "answer": "2"}) + "\n"
                    + json.dumps({"prompt": [{"role": "user", "content": "1+2="}], "answer": "3"}) + "\n")
    line = _one_line_exit_2(capsys, ["train", *TINY, "steps=1", f"data.path={data}",
                                     "reward.hook=rollyard.reward.verifiers:exact_match", f"out_dir={tmp_path / 'r'}"])
    assert f"prompt chat:1: {says}" in line and "role one of system, developer, user, assistant, tool" in line


def test_a_vllm_start_up_error_is_the_only_line(tmp_path):
    """vLLM is imported in a fresh process (as by a user's first run): nothing it logs before its engine
    configures logging (its Triton notice) comes ahead of rollyard's one line."""
    import importlib.util
    import os
    import subprocess
    import sys
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (make setup VLLM=1)")
    src = Path(__file__).resolve().parents[1] / "src"
    proc = subprocess.run([sys.executable, "-m", "rollyard.cli", "train", *TINY, "rollout.backend=vllm",
                           "rollout.vllm={foo: 1}", f"out_dir={tmp_path / 'r'}"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(src)}, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rollout.vllm.foo is not a vLLM engine argument" in lines[0], proc.stderr
