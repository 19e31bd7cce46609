"""Every field of TRL 1.16's GRPOConfig is a name rollyard knows (issue 47, item 4): set, converted, accepted with a
note (speed, memory, logging), or refused in one line that says why and names the closest rollyard setting, never
"unknown config key". TRL's value where it is rollyard's behaviour too is accepted. trl itself is not needed: the
field list is TRL 1.16's ``trl/trainer/grpo_config.py``, frozen here."""

from __future__ import annotations

import pytest

from rollyard import aliases
from rollyard.cli import main
from rollyard.config import ConfigError, load_config

GRPO_CONFIG_FIELDS = """
learning_rate model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout cast_lm_head_to_fp32
remove_unused_columns num_generations num_generations_eval max_completion_length ds3_gather_for_generation
shuffle_dataset pad_to_multiple_of generation_batch_size steps_per_generation temperature top_p top_k min_p
generation_kwargs chat_template_kwargs repetition_penalty cache_implementation use_vllm vllm_mode
vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url vllm_server_host
vllm_server_port vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length
vllm_tensor_parallel_size beta num_iterations epsilon delta epsilon_high sapo_temperature_neg
sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg importance_sampling_level
reward_weights multi_objective_aggregation scale_rewards loss_type mask_truncated_completions sync_ref_model
ref_model_mixup_alpha ref_model_sync_steps top_entropy_quantile entropy_coef use_adaptive_entropy
entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target max_tool_calling_iterations
vllm_importance_sampling_correction vllm_importance_sampling_mode vllm_importance_sampling_clip_max
vllm_importance_sampling_clip_min off_policy_mask_threshold use_bias_correction_kl log_completions
log_multimodal num_completions_to_print log_unique_prompts log_completions_hub_repo
use_transformers_continuous_batching transformers_continuous_batching_config use_transformers_paged
vllm_importance_sampling_cap
""".split()


def test_every_grpo_config_field_is_a_name_rollyard_knows():
    assert len(GRPO_CONFIG_FIELDS) == 79
    trl = {a.name for a in aliases.ALIASES_LIST if a.source == aliases.TRL}
    assert [f for f in GRPO_CONFIG_FIELDS if f not in trl] == []


@pytest.mark.parametrize("override, says", [
    ("generation_kwargs={min_tokens: 4}", "rollout.temperature / rollout.top_p / rollout.top_k"),
    ("vllm_mode=server", "placement=disaggregated"),
    ("repetition_penalty=1.1", "rollout.top_p / rollout.top_k"),
    ("min_p=0.1", "rollout.top_p / rollout.top_k"),
])
def test_a_field_that_changes_the_math_is_one_line_naming_the_closest_setting(override, says, capsys, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert "no rollyard equivalent" in str(e.value) and f"closest rollyard setting: {says}" in str(e.value)
    assert main(["train", override, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "unknown config key" not in err


@pytest.mark.parametrize("overrides, expect", [
    (["loss_type=dr_grpo"], {"algo.policy_loss": "ppo_clip", "algo.loss_agg": "seq-mean-token-sum-norm"}),
    (["loss_type=grpo"], {"algo.loss_agg": "seq-mean-token-mean"}),
    (["loss_type=cispo", "epsilon_high=5.0"], {"algo.policy_loss": "cispo", "algo.clip_high": 5.0}),
    (["loss_type=sapo", "sapo_temperature_pos=0.5"], {"algo.policy_loss": "sapo", "algo.sapo_temperature_pos": 0.5}),
    (["loss_type=vespo", "vespo_k_pos=1.5"], {"algo.policy_loss": "vespo", "algo.vespo_k_pos": 1.5}),
    (["importance_sampling_level=sequence"], {"algo.ratio_level": "sequence"}),
    (["delta=4.0"], {"algo.delta": 4.0}),
    (["disable_dropout=true"], {"trainer.disable_dropout": True}),
    (["cast_lm_head_to_fp32=true"], {"trainer.lm_head_fp32": True}),
    (["entropy_coef=0.01"], {"algo.entropy_coef": 0.01}),
    (["use_adaptive_entropy=true", "entropy_target=0.5"], {"algo.adaptive_entropy": True, "algo.entropy_target": 0.5}),
    (["top_entropy_quantile=0.2"], {"algo.top_entropy_quantile": 0.2}),
    (["mask_truncated_completions=true"], {"algo.mask_truncated": True}),
    (["sync_ref_model=true", "beta=0.04"], {"reference.sync_every": 512, "reference.mixup_alpha": 0.6}),
    (["sync_ref_model=true", "ref_model_sync_steps=8", "ref_model_mixup_alpha=0.9", "beta=0.04"],
     {"reference.sync_every": 8, "reference.mixup_alpha": 0.9}),
    (["vllm_importance_sampling_correction=true"], {"algo.tis_mode": "sequence_mask", "algo.tis_cap": 3.0}),
    (["vllm_importance_sampling_mode=token_truncate", "vllm_importance_sampling_clip_max=2.5",
      "vllm_importance_sampling_clip_min=0.5"], {"algo.tis_mode": "token_truncate", "algo.tis_cap": 2.5,
                                                 "algo.tis_min": 0.5}),
    (["vllm_importance_sampling_correction=false"], {"algo.tis_mode": "none"}),
    (["off_policy_mask_threshold=0.5"], {"algo.off_policy_mask_threshold": 0.5}),
    (["use_bias_correction_kl=true"], {"algo.kl_bias_correction": True}),
    (["multi_objective_aggregation=normalize_then_sum", "reward.hooks=[a:f, b:g]"],
     {"algo.multi_objective": "normalize_then_sum"}),
    (["scale_rewards=batch"], {"algo.std_scope": "batch", "algo.normalize_std": True}),
    (["num_iterations=2"], {"trainer.epochs": 2}),
    (["num_train_epochs=2", "data.train_size=100", "per_device_train_batch_size=8", "num_generations=4"],
     {"data.epochs": 2.0, "steps": 100}),
    (["num_train_epochs=2", "max_steps=3"], {"steps": 3}),
    (["shuffle_dataset=false"], {"data.shuffle": False}),
    (["max_prompt_length=64"], {"data.max_prompt_tokens": 64, "data.prompt_truncation": "left"}),
    (["per_device_train_batch_size=8", "gradient_accumulation_steps=2", "steps_per_generation=4", "num_generations=4"],
     {"trainer.mini_batches": 2, "rollout.prompts_per_step": 8}),
    (["per_device_train_batch_size=8", "generation_batch_size=32", "num_generations=4"],
     {"trainer.mini_batches": 4, "rollout.prompts_per_step": 8}),
    (["max_steps=12", "num_iterations=2", "per_device_train_batch_size=8", "steps_per_generation=3",
      "num_generations=8"], {"steps": 2, "trainer.mini_batches": 3, "trainer.epochs": 2}),
])
def test_trls_loss_and_loop_names_set_rollyards_keys(overrides, expect):
    cfg = load_config(None, overrides)
    for key, value in expect.items():
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        assert node == value, (key, node, value)


def test_trls_values_that_are_rollyards_behaviour_and_speed_knobs_change_nothing():
    same = ["shuffle_dataset=true", "vllm_mode=colocate", "importance_sampling_level=token",
            "entropy_coef=0.0", "use_adaptive_entropy=false", "entropy_target=0.2", "sync_ref_model=false",
            "multi_objective_aggregation=sum_then_normalize", "disable_dropout=false",
            "use_bias_correction_kl=false", "generation_batch_size=null", "sapo_temperature_neg=1.05",
            "vllm_tensor_parallel_size=1", "vllm_server_port=9000", "vllm_gpu_memory_utilization=0.5",
            "pad_to_multiple_of=64", "remove_unused_columns=true", "use_transformers_continuous_batching=true"]
    assert load_config(None, same) == load_config(None, [])
    with pytest.raises(ConfigError):  # a bool is not the number it equals: True is no neutral 1
        load_config(None, ["vllm_tensor_parallel_size=true"])


def test_config_trl_lists_the_new_names_with_their_rule(capsys):
    assert main(["config", "--trl"]) == 0
    out = capsys.readouterr().out
    for name in ("disable_dropout", "vllm_mode", "entropy_coef", "vllm_importance_sampling_mode", "log_multimodal"):
        assert any(line.startswith(name + " ") for line in out.splitlines()), name


def test_the_training_arguments_a_trl_script_commonly_sets_are_known():
    """GRPOConfig inherits transformers' TrainingArguments: the ones TRL's examples set are known too, with the same
    three outcomes."""
    cfg = load_config(None, ["disable_tqdm=true", "data_seed=5", "run_name=x", "logging_dir=logs", "optim=adamw_torch",
                             "push_to_hub=false",
                             "save_strategy=steps", "fp16=false", "deepspeed=null", "eval_strategy=no",
                             "use_liger_kernel=true", "torch_compile=true"])
    assert cfg == load_config(None, ["progress=false", "data.seed=5"])
    for override, says in [("optim=adafactor", "trainer.optimizer_state"),
                           ("fp16=true", "trainer.precision=bf16"), ("push_to_hub=true", "out_dir"),
                           ("save_strategy=epoch", "checkpoint_every"), ("deepspeed=ds.json", "trainer.dp")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert f"closest rollyard setting: {says}" in str(e.value) and len(str(e.value).splitlines()) == 1, override
