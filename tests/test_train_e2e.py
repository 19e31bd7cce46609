"""End to end through the CLI: a colocated run, its run directory, resume, and bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import train_interrupted
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollyard.cli import main
from rollyard.telemetry import rundir

pytestmark = pytest.mark.slow

TINY = ["model.context=48", "data.train_size=64", "data.eval_size=8", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "sft.auto=false", "progress=false", "log.plots=false",
        "reward.num_workers=1"]


def _metrics(run: Path) -> list[dict]:
    return list(rundir.read_jsonl(run / rundir.METRICS))


def _requests_per_step(run: Path) -> dict[int, list[str]]:
    return {s["step"]: s["requests"] for s in rundir.read_jsonl(run / rundir.SPANS) if s["role"] == "rollout"}


def test_run_dir_resume_and_same_data_order(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", *TINY, "steps=4", f"out_dir={straight}", "checkpoint_every=2"]) == 0
    for name in (rundir.CONFIG, rundir.METRICS, rundir.TRACE, rundir.TRAFFIC, rundir.SPANS, rundir.SUMMARY,
                 rundir.RUN_INFO, rundir.LENGTHS):
        assert (straight / name).exists(), name
    assert (straight / rundir.CHECKPOINTS / "step_000004").is_dir()
    model = AutoModelForCausalLM.from_pretrained(straight / rundir.MODEL)
    tok = AutoTokenizer.from_pretrained(straight / rundir.MODEL)
    assert tok.decode(tok("12+3=")["input_ids"]) == "12+3=" and model.config.vocab_size == len(tok)
    rows = _metrics(straight)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]
    for key in ("time/rollout", "time/reward", "time/algorithm", "time/train", "time/sync", "reward",
                "reward_std", "reward/accuracy", "completions/mean_length", "entropy", "grad_norm",
                "clip_ratio/region_mean", "train/ratio_p50", "train/logprob_diff", rundir.STALENESS_MAX):
        assert key in rows[0], key
    assert all(r[rundir.STALENESS_MAX] == 0 for r in rows)  # colocated is on-policy
    assert all(r["train/logprob_diff"] < 1e-3 for r in rows)  # engine and trainer agree
    ledger = list(rundir.read_jsonl(straight / rundir.TRAFFIC))
    weights = [r for r in ledger if r["edge"] == "weights"]
    # one sync per step, plus the start-up sync counted at step 0; in-process: zero bytes
    assert len(weights) == 4 and all(r["bytes"] == 0 and r["count"] == 1 + (r["step"] == 0) for r in weights)
    samples = [r["bytes"] for r in ledger if r["edge"] == "samples"]
    assert samples == [8 * r["tokens/generated"] for r in rows]
    summary = json.loads((straight / rundir.SUMMARY).read_text())
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0

    # Same run, interrupted after step 2 and resumed: same prompts in the same order, same numbers.
    train_interrupted(TINY, split, stop_at=2, steps=4)
    assert _requests_per_step(split) == _requests_per_step(straight)
    a, b = _metrics(straight), _metrics(split)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b):
        assert ra["reward"] == rb["reward"] and ra["loss"] == pytest.approx(rb["loss"], abs=1e-6)


def test_unknown_key_exit_2(capsys):
    assert main(["train", "rollout.temprature=1"]) == 2
    err = capsys.readouterr().err
    assert "rollout.temprature" in err and "rollout.temperature" in err


def test_broken_dataset_line_exit_2(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n')
    assert main(["train", *TINY, f"data.path={data}", "data.task=null", "reward.hook=rollyard.reward.verifiers:exact_match",
                 f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert "d.jsonl" in err and ":2" in err


def test_reward_hook_that_does_not_import_exit_2(tmp_path, capsys):
    assert main(["train", *TINY, "reward.hook=no_such_module:fn", f"out_dir={tmp_path / 'r'}"]) == 2
    assert "no_such_module" in capsys.readouterr().err


def test_console_script_exit_code(tmp_path):
    exe = Path(sys.executable).with_name("rollyard")
    proc = subprocess.run([str(exe), "train", "stpes=3"], capture_output=True, text=True)
    assert proc.returncode == 2 and "'steps'" in proc.stderr


def test_long_prompt_dead_lettered_and_hanging_verifier_survived(tmp_path):
    data = tmp_path / "d.jsonl"
    lines = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    lines.insert(2, {"prompt": "9" * 200 + "+1=", "answer": "x"})
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    run = tmp_path / "r"
    hook = str(Path(__file__).with_name("hooks_e2e.py")) + ":hang_on_two"
    assert main(["train", *TINY, "steps=2", "rollout.prompts_per_step=4", f"data.path={data}", "data.task=arithmetic",
                 f"reward.hook={hook}", "reward.timeout_s=0.5", f"out_dir={run}"]) == 0
    dead = list(rundir.read_jsonl(run / rundir.DEADLETTER))
    assert [d["source"] for d in dead if "longer than the model context" in d["reason"]]
    rows = _metrics(run)
    assert len(rows) == 2
    # 8 prompts taken cover the whole first epoch of 7: "1+1=" hung (and timed out) for each of its
    # 4 samples, once or twice, and the run went on.
    assert sum(r["reward/timeouts"] for r in rows) in (4, 8)
