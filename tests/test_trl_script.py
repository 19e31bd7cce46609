"""A TRL GRPO script with ``tools=`` runs with only its import line changed (issue 47, item 1): ``from trl import
GRPOConfig, GRPOTrainer`` becomes ``from rollyard import GRPOConfig, GRPOTrainer`` (``api.GRPOTrainer`` over
``rollyard.train``), the rest of the file is TRL's, run as a script (``runpy`` as ``__main__``: the reward and
tool workers import its functions from the file). trl itself is not needed.
The model is tests/tool_chat.py's tiny Qwen2 taught to call add(2, 3) and answer with the result."""

from __future__ import annotations

import difflib
import json
import runpy

import pytest
import tool_chat

from rollyard import GRPOConfig, GRPOTrainer
from rollyard.config import ConfigError
from rollyard.env import tools
from rollyard.telemetry import rundir

TRL_SCRIPT = '''\
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

model_id = "{model}"


def add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def correct(completions, answer, **kwargs):
    return [1.0 if f"answer is {{a}}." in c[-1]["content"] else 0.0 for c, a in zip(completions, answer)]


if __name__ == "__main__":
    dataset = [{{"prompt": [{{"role": "user", "content": "What is 2 plus 3?"}}], "answer": "5"}}] * 4
    model = AutoModelForCausalLM.from_pretrained(model_id)
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    training_args = GRPOConfig(
        output_dir="{out}",
        learning_rate=1e-6,
        num_generations=2,
        temperature=0.0,
        per_device_train_batch_size=2,
        max_completion_length=80,
        max_steps=2,
        max_tool_calling_iterations=3,
        logging_steps=1,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=correct,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        tools=[add],
    )
    trainer.train()
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = tool_chat.tokenizer()
    schemas = [s.schema for s in tools.tool_specs(["tool_fns:add"])]
    path = tmp_path_factory.mktemp("taught")
    tool_chat.taught_model(tok, schemas).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow  # one end-to-end run at the script's defaults (2 reward and 2 tool workers): 127 s at load 16 on 2 cores
def test_a_trl_grpo_script_with_tools_runs_with_only_its_import_line_changed(model_dir, tmp_path):
    trl = TRL_SCRIPT.format(model=model_dir, out=tmp_path / "run")
    ported = trl.replace("from trl import GRPOConfig, GRPOTrainer", "from rollyard import GRPOConfig, GRPOTrainer")
    changed = [d for d in difflib.ndiff(trl.splitlines(), ported.splitlines()) if d[:1] in "+-"]
    assert changed == ["- from trl import GRPOConfig, GRPOTrainer", "+ from rollyard import GRPOConfig, GRPOTrainer"]
    script = tmp_path / "grpo_tools.py"
    script.write_text(ported)
    runpy.run_path(str(script), run_name="__main__")  # `python grpo_tools.py`, in this process (no second start-up)
    config = (tmp_path / "run" / rundir.CONFIG).read_text()
    assert "grpo_tools.py:add" in config and "grpo_tools.py:correct" in config  # the script's own functions
    rows = [json.loads(line) for line in (tmp_path / "run" / rundir.METRICS).read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:  # greedy: each of the 2 samples calls add(2, 3) -> 5 (an int, sent as "5") and says so
        assert row["tools/calls"] == 2 and row["tools/errors"] == 0 and row["reward"] == 1.0
    # the script sets no lr_scheduler_type: TRL's linear decay over its 2 optimizer steps, and TRL's beta2
    assert [r["learning_rate"] for r in rows] == pytest.approx([1e-6, 5e-7])
    assert "lr_schedule: linear" in config and "adam_beta2: 0.999" in config


def test_grpo_config_keeps_trls_names_and_reads_them_back():
    args = GRPOConfig("out", learning_rate=1e-6, num_generations=2)
    assert dict(args) == {"output_dir": "out", "learning_rate": 1e-6, "num_generations": 2}
    assert args.output_dir == "out" and args.num_generations == 2
    with pytest.raises(AttributeError, match="beta"):
        _ = args.beta


@pytest.mark.parametrize("name, says", [("eval_dataset", "data.eval_path"), ("peft_config", "model.lora.r"),
                                        ("callbacks", "log."), ("optimizers", "trainer.lr"),
                                        ("quantization_config", "trainer.precision"),
                                        ("reward_processing_classes", "reward_funcs"), ("rollout_func", "tools=")])
def test_a_trainer_argument_without_an_equivalent_is_one_line_naming_the_closest_setting(name, says):
    value = (object(), None) if name == "optimizers" else [object()]
    with pytest.raises(ConfigError) as e:
        GRPOTrainer(model="m", args=GRPOConfig("out"), **{name: value})
    line = str(e.value)
    assert len(line.splitlines()) == 1 and f"GRPOTrainer({name}=...)" in line
    assert "no rollyard equivalent" in line and f"closest rollyard setting: {says}" in line
    GRPOTrainer(model="m", optimizers=(None, None))  # TRL's defaults are no request at all
