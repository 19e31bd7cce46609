"""TRL and verl names in configs: accepted, converted, listed, and refused in one line where rollyard has none."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rollyard import aliases
from rollyard.cli import main
from rollyard.config import ConfigError, load_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "config-mapping.md"


def test_trl_names_as_overrides_with_the_batch_unit_converted():
    cfg = load_config(None, ["learning_rate=1e-6", "num_generations=4", "per_device_train_batch_size=8",
                             "gradient_accumulation_steps=2", "max_completion_length=32", "beta=0.04",
                             "epsilon=0.2", "epsilon_high=0.28", "report_to=tensorboard", "save_steps=5"])
    assert cfg.trainer.lr == pytest.approx(1e-6) and cfg.rollout.samples_per_prompt == 4
    assert cfg.rollout.prompts_per_step == 8 * 2 // 4  # 16 completions of 4 per prompt
    assert (cfg.rollout.max_new_tokens, cfg.algo.kl_coef, cfg.algo.clip_low, cfg.algo.clip_high) == (32, 0.04, 0.2, 0.28)
    assert cfg.log.tensorboard and not cfg.log.wandb and cfg.checkpoint_every == 5
    # epsilon alone is both bounds (TRL: epsilon_high defaults to epsilon); dp multiplies the completions
    cfg = load_config(None, ["epsilon=0.1", "trainer.dp=2", "per_device_train_batch_size=4", "num_generations=8"])
    assert (cfg.algo.clip_low, cfg.algo.clip_high, cfg.rollout.prompts_per_step) == (0.1, 0.1, 1)


def test_verl_names_nested_in_a_file_and_dotted_overrides(tmp_path):
    f = tmp_path / "verl.yaml"
    f.write_text(yaml.safe_dump({
        "data": {"train_batch_size": 16, "max_response_length": 24, "train_files": ["train.parquet"],
                 "prompt_key": "question", "eval_size": 50},
        "actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}, "clip_ratio": 0.2, "use_kl_loss": True,
                                        "kl_loss_coef": 0.01, "ppo_mini_batch_size": 16,
                                        "ppo_micro_batch_size_per_gpu": 4},
                              "rollout": {"n": 4, "name": "hf", "temperature": 0.9}},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_training_steps": 3, "logger": ["console", "wandb"], "save_freq": 2},
        "custom_reward_function": {"path": "my_reward.py"},
    }))
    cfg = load_config(f, ["actor_rollout_ref.rollout.n=8"])
    assert (cfg.rollout.prompts_per_step, cfg.rollout.max_new_tokens, cfg.rollout.samples_per_prompt) == (16, 24, 8)
    assert cfg.data.path == "train.parquet" and cfg.data.fields == {"prompt": "question"} and cfg.data.eval_size == 50
    assert (cfg.trainer.lr, cfg.algo.clip_low, cfg.algo.clip_high, cfg.algo.kl_coef) == (1e-6, 0.2, 0.2, 0.01)
    assert cfg.rollout.backend == "native" and cfg.rollout.temperature == 0.9
    assert (cfg.steps, cfg.checkpoint_every, cfg.log.wandb, cfg.log.tensorboard) == (3, 2, True, False)
    assert cfg.reward.hook == "my_reward.py:compute_score"


@pytest.mark.parametrize("args, says", [
    (["loss_type=gspo"], "no rollyard equivalent for loss_type 'gspo'; TRL 1.16's are 'grpo'"),
    (["steps_per_generation=3", "gradient_accumulation_steps=2"], "steps_per_generation=3 is not a multiple of "
                                                                  "gradient_accumulation_steps=2"),
    (["max_steps=5", "num_iterations=2"], "max_steps=5 optimizer steps is not a whole number of generation batches"),
    (["per_device_train_batch_size=3"], "3 completions is not a multiple of num_generations=8"),
    (["learning_rate=1e-6", "trainer.lr=1e-5"], "learning_rate sets trainer.lr=1e-06 but trainer.lr=1e-05 is set too"),
    (["algorithm.adv_estimator=gae"], "no rollyard equivalent for adv_estimator 'gae'; rollyard supports 'grpo'"),
    (["report_to=mlflow"], "no rollyard equivalent for tracker 'mlflow'"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=5", "data.train_batch_size=16"], "is not a multiple of "
                                                                                     "ppo_mini_batch_size=5"),
    # a wrongly typed value is reported under the name typed, not the rollyard key it sets
    (["learning_rate=abc"], "invalid config: learning_rate: Input should be a valid number"),
    (["max_completion_length=-3"], "max_completion_length: Input should be greater than or equal to 1 (got -3; "
                                   "TRL's name for rollyard's rollout.max_new_tokens)"),
    (["actor_rollout_ref.rollout.n=two"], "actor_rollout_ref.rollout.n: Input should be a valid integer"),
])
def test_an_alias_rollyard_cannot_honour_is_one_line_exit_2(args, says, capsys):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, args)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_wrongly_typed_alias_in_a_file_is_named_as_typed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: abc\nrollout:\n  temperature: hot\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "learning_rate: Input should be a valid number" in str(e.value) and "trainer.lr:" not in str(e.value)
    assert "rollout.temperature: Input should be a valid number" in str(e.value)  # a rollyard key: its own name


@pytest.mark.parametrize("key, suggested", [
    ("learning_rat", "learning_rate"), ("num_generation", "num_generations"),
    ("max_completion_len", "max_completion_length"), ("actor_rollout_ref.rollout.nn", "actor_rollout_ref.rollout.n"),
])
def test_did_you_mean_searches_aliases(key, suggested):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}=1"])
    assert repr(key) in str(e.value) and f"did you mean {suggested!r} (" in str(e.value)


def test_memory_only_knobs_are_accepted_with_a_note(capsys):
    key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    cfg = load_config(None, [f"{key}=4"])
    assert cfg == load_config(None, [])
    assert f"{key} (verl) is accepted and ignored" in capsys.readouterr().err
    assert load_config(None, ["gradient_checkpointing=true"]).trainer.activation_checkpointing  # TRL's name, kept


def test_config_prints_the_mapping_and_the_doc_is_current(capsys):
    assert main(["config", "--trl"]) == 0
    out = capsys.readouterr().out
    assert "learning_rate" in out and "trainer.lr" in out and "per_device_train_batch_size" in out
    assert main(["config", "--verl"]) == 0
    assert "actor_rollout_ref.rollout.n" in capsys.readouterr().out
    assert DOC.read_text() == aliases.markdown(), "docs/config-mapping.md is stale: rollyard config --markdown > it"
    for a in aliases.ALIASES_LIST:  # every alias names real rollyard keys
        for key in a.to:
            node = load_config(None, []).model_dump()
            for part in key.split("."):
                node = node[part]
