"""TRL's GRPOConfig names and common verl names, accepted as aliases of rollyard's config keys.

One table (:data:`ALIASES`) is the source of the aliases accepted in config files and overrides, of
``rollyard config --trl`` / ``--verl`` and of ``docs/config-mapping.md`` (:func:`markdown`; a test
checks the doc is current). Each alias names the rollyard keys it sets and the rule: the same value,
a unit conversion, or why rollyard has no equivalent (then using it is one line and exit 2, never a
silent drop). Memory-only knobs that do not change what is computed are accepted with a note.

The one unit that differs: TRL counts a batch in completions, rollyard in prompts.
``rollout.prompts_per_step = per_device_train_batch_size x gradient_accumulation_steps x trainer.dp
/ num_generations`` (TRL's defaults 8, 1 and 8 where a name is not given); it must divide evenly.
verl's ``data.train_batch_size`` already counts prompts.

Standard library only (the config layer imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

TRL, VERL = "TRL", "verl"
TRL_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_generations": 8}
BATCH_RULE = ("rollout.prompts_per_step = per_device_train_batch_size x gradient_accumulation_steps x trainer.dp "
              "/ num_generations (TRL counts completions, rollyard prompts)")


class NoEquivalent(ValueError):
    """This alias (or this value of it) has no rollyard equivalent; the message says why and what to do."""


@dataclass(frozen=True)
class Ctx:
    """What a conversion may read: the other aliases of the same source, and rollyard keys (dotted)."""

    aliases: dict[str, Any]
    keys: Callable[[str], Any]  # dotted rollyard key -> value or None (the source's own, else the earlier config)

    def alias(self, name: str, default: Any = None) -> Any:
        return self.aliases.get(name, default)


@dataclass(frozen=True)
class Alias:
    name: str
    source: str
    to: tuple[str, ...]  # the rollyard keys it sets; () when it sets none (no equivalent, checked, ignored)
    rule: str  # "same value", the conversion, or why there is no equivalent
    convert: Callable[[Any, Ctx], dict[str, Any]] | None = None  # None: the value, unchanged, to to[0]
    ignored: bool = False  # memory / speed only: accepted with a note, nothing set
    neutral: tuple = ()  # no equivalent, but these values change nothing (TRL's defaults): accepted, nothing set

    def apply(self, value: Any, ctx: Ctx) -> dict[str, Any]:
        if self.ignored:
            return {}
        if self.convert is None and not self.to:
            if any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in self.neutral) or (
                    value is None and None in self.neutral):  # a bool matches a bool only (True == 1 is no match)
                return {}
            raise NoEquivalent(f"no rollyard equivalent: {self.rule}")
        return self.convert(value, ctx) if self.convert else {self.to[0]: value}


# ------------------------------------------------------------------------------------ conversions
def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NoEquivalent(f"{name} must be a positive integer, got {value!r}")
    return value


def _trl_batch(_value: Any, ctx: Ctx) -> dict[str, Any]:
    per = _int("per_device_train_batch_size", ctx.alias("per_device_train_batch_size",
                                                        TRL_DEFAULTS["per_device_train_batch_size"]))
    ga = _int("gradient_accumulation_steps", ctx.alias("gradient_accumulation_steps",
                                                       TRL_DEFAULTS["gradient_accumulation_steps"]))
    n = _int("num_generations", ctx.alias("num_generations", ctx.keys("rollout.samples_per_prompt")
                                          or TRL_DEFAULTS["num_generations"]))
    dp = ctx.keys("trainer.dp") or 1
    completions = per * ga * dp
    if completions % n:
        raise NoEquivalent(f"per_device_train_batch_size x gradient_accumulation_steps x trainer.dp = {per} x {ga} "
                           f"x {dp} = {completions} completions is not a multiple of num_generations={n}; rollyard "
                           f"counts a step in whole prompts ({BATCH_RULE}): make it a multiple of {n}")
    return {"rollout.prompts_per_step": completions // n}


def _epsilon(value: Any, ctx: Ctx) -> dict[str, Any]:
    # TRL: epsilon_high defaults to epsilon; verl: clip_ratio is both bounds unless low/high are given.
    high = "epsilon_high" if "epsilon_high" in ctx.aliases else "actor_rollout_ref.actor.clip_ratio_high"
    out = {"algo.clip_low": value}
    if high not in ctx.aliases and ctx.keys("algo.clip_high") is None:
        out["algo.clip_high"] = value
    return out


def _verl_clip(value: Any, ctx: Ctx) -> dict[str, Any]:
    out = {}
    if "actor_rollout_ref.actor.clip_ratio_low" not in ctx.aliases and ctx.keys("algo.clip_low") is None:
        out["algo.clip_low"] = value
    if "actor_rollout_ref.actor.clip_ratio_high" not in ctx.aliases and ctx.keys("algo.clip_high") is None:
        out["algo.clip_high"] = value
    return out


def _choice(key: str, table: dict[Any, Any], what: str) -> Callable[[Any, Ctx], dict[str, Any]]:
    def convert(value: Any, _ctx: Ctx) -> dict[str, Any]:
        v = value.lower() if isinstance(value, str) else value
        if v not in table:
            raise NoEquivalent(f"no rollyard equivalent for {what} {value!r}; rollyard supports "
                               f"{', '.join(repr(k) for k in table)}")
        return {key: table[v]} if key else {}
    return convert


def _trackers(value: Any, _ctx: Ctx) -> dict[str, Any]:
    names = [value] if isinstance(value, str) else list(value or [])
    names = [str(n).lower() for n in names]
    if "all" in names:
        names = ["wandb", "tensorboard"]
    bad = [n for n in names if n not in ("wandb", "tensorboard", "none", "console")]
    if bad:
        raise NoEquivalent(f"no rollyard equivalent for tracker {bad[0]!r}; rollyard logs to wandb, tensorboard "
                           f"and metrics.jsonl (always)")
    return {"log.wandb": "wandb" in names, "log.tensorboard": "tensorboard" in names}


def _verl_kl(value: Any, ctx: Ctx) -> dict[str, Any]:
    on = ctx.alias("actor_rollout_ref.actor.use_kl_loss", False)
    coef = ctx.alias("actor_rollout_ref.actor.kl_loss_coef", 0.001)  # verl's default coefficient
    return {"algo.kl_coef": float(coef) if on else 0.0}


def _verl_hook(_value: Any, ctx: Ctx) -> dict[str, Any]:
    path = ctx.alias("custom_reward_function.path")
    if not path:
        raise NoEquivalent("custom_reward_function.name without custom_reward_function.path: give the file too")
    return {"reward.hook": f"{path}:{ctx.alias('custom_reward_function.name', 'compute_score')}"}


def _one_file(value: Any, key: str) -> dict[str, Any]:
    files = [value] if isinstance(value, str) else list(value or [])
    if len(files) != 1:
        raise NoEquivalent(f"{len(files)} files given; rollyard reads one {key} file: concatenate them")
    return {key: files[0]}


def _same_as_batch(name: str) -> Callable[[Any, Ctx], dict[str, Any]]:
    def convert(value: Any, ctx: Ctx) -> dict[str, Any]:
        batch = ctx.alias("data.train_batch_size", ctx.keys("rollout.prompts_per_step"))
        if value != batch:
            raise NoEquivalent(f"{name}={value} is smaller than the batch ({batch} prompts): rollyard takes one "
                               f"optimizer step per batch; set {name} = data.train_batch_size, or lower the batch")
        return {}
    return convert


def _log_completions(value: Any, ctx: Ctx) -> dict[str, Any]:
    return {"log.completions_every": int(ctx.alias("logging_steps", 1)) if value else 0}


def _inflight(value: Any, ctx: Ctx) -> dict[str, Any]:
    if value == -1:
        return {}
    tasks = _int("max_inflight_tasks", value)
    workers = ctx.keys("rollout.workers") or 1
    return {"rollout.max_concurrent": -(-tasks // workers)}


def _token_budget(value: Any, _ctx: Ctx) -> dict[str, Any]:
    return {} if value is None else {"trainer.micro_batch_tokens": _int("token_budget", value)}


def _no(name: str, source: str, why: str, closest: str, neutral: tuple = ()) -> Alias:
    """A name with no rollyard equivalent: using it stops the run with ``why`` and the closest rollyard setting;
    the ``neutral`` values (those that change nothing, e.g. TRL's defaults) are accepted."""
    keep = f" ({' / '.join(repr(n) for n in neutral)} accepted: changes nothing)" if neutral else ""
    return Alias(name, source, (), f"{why}; closest rollyard setting: {closest}{keep}", neutral=neutral)


def _epochs(value: Any, ctx: Ctx) -> dict[str, Any]:
    if ctx.alias("max_steps") is not None:  # as in TRL (transformers' Trainer): max_steps wins over epochs
        return {}
    raise NoEquivalent("no rollyard equivalent: rollyard counts optimizer steps, not passes over the data; closest "
                       "rollyard setting: steps (max_steps): epochs x dataset rows / rollout.prompts_per_step")


def _ignored(name: str, source: str, why: str) -> Alias:
    return Alias(name, source, (), why, ignored=True)


def _same(name: str, source: str, key: str) -> Alias:
    return Alias(name, source, (key,), "same value")


_BATCH = "completions -> prompts: x gradient_accumulation_steps x trainer.dp / num_generations (the batch rule)"
_ONE_UPDATE = "rollyard takes one optimizer step per batch of rollouts, never several on one batch"
_REUSE = ("max_staleness with placement=async (each sample trained once, up to that many weight versions old, the "
          "ratio and clip correcting for it); remove it")
_NO_WARMUP = "trainer.lr (constant from the first step; lower it for a gentler start); remove it"
_SUPPORT = "rollout.top_p / rollout.top_k (the trainer's ratio is taken over the same support); remove it"
_NO_SERVER = "rollyard starts no vLLM server: its engines run in-process in each rollout worker"
_MEMORY = "memory only, the math is the same: rollyard sizes micro-batches by trainer.micro_batch_tokens"

ALIASES_LIST: list[Alias] = [
    # ---- TRL GRPOConfig (and the TRL script's model / dataset arguments)
    _same("learning_rate", TRL, "trainer.lr"),
    _same("num_generations", TRL, "rollout.samples_per_prompt"),
    _same("max_completion_length", TRL, "rollout.max_new_tokens"),
    _same("max_tool_calling_iterations", TRL, "tools.max_tool_calling_iterations"),
    _same("beta", TRL, "algo.kl_coef"),
    Alias("epsilon", TRL, ("algo.clip_low", "algo.clip_high"), "clip_low; clip_high too unless epsilon_high is given",
          _epsilon),
    _same("epsilon_high", TRL, "algo.clip_high"),
    Alias("per_device_train_batch_size", TRL, ("rollout.prompts_per_step",), _BATCH, _trl_batch),
    Alias("gradient_accumulation_steps", TRL, ("rollout.prompts_per_step",), _BATCH, _trl_batch),
    _same("temperature", TRL, "rollout.temperature"),
    _same("top_p", TRL, "rollout.top_p"),
    _same("max_steps", TRL, "steps"),
    _same("seed", TRL, "seed"),
    _same("output_dir", TRL, "out_dir"),
    _same("weight_decay", TRL, "trainer.weight_decay"),
    _same("max_grad_norm", TRL, "trainer.max_grad_norm"),
    Alias("logging_steps", TRL, ("log.progress_every",), "progress line every N steps (metrics.jsonl has every step)"),
    _same("save_steps", TRL, "checkpoint_every"),
    _same("save_total_limit", TRL, "keep_checkpoints"),
    _same("eval_steps", TRL, "eval_every"),
    Alias("report_to", TRL, ("log.wandb", "log.tensorboard"), "wandb / tensorboard / all / none -> log.wandb, "
          "log.tensorboard", _trackers),
    _same("reward_weights", TRL, "reward.weights"),
    Alias("scale_rewards", TRL, ("algo.normalize_std",), "true / 'group' -> true; false / 'none' -> false",
          _choice("algo.normalize_std", {True: True, False: False, "group": True, "none": False}, "scale_rewards")),
    Alias("loss_type", TRL, ("algo.loss_agg",), "'grpo' -> seq-mean; 'bnpo' / 'dapo' -> token-mean",
          _choice("algo.loss_agg", {"grpo": "seq-mean", "bnpo": "token-mean", "dapo": "token-mean"}, "loss_type")),
    Alias("bf16", TRL, ("trainer.precision",), "true -> bf16, false -> fp32",
          _choice("trainer.precision", {True: "bf16", False: "fp32"}, "bf16")),
    Alias("use_vllm", TRL, ("rollout.backend",), "true -> vllm, false -> native",
          _choice("rollout.backend", {True: "vllm", False: "native"}, "use_vllm")),
    _same("model_name_or_path", TRL, "model.name"),
    Alias("dataset_name", TRL, ("data.path",), "a local .jsonl or .parquet file (no Hub download)"),
    _no("num_iterations", TRL, _ONE_UPDATE, _REUSE, (1,)),
    _no("steps_per_generation", TRL, _ONE_UPDATE, _REUSE, (None,)),
    Alias("num_train_epochs", TRL, (), "accepted beside max_steps (which wins, as in TRL); alone: no equivalent "
          "(rollyard counts optimizer steps), closest rollyard setting: steps (max_steps)", _epochs),
    _no("lr_scheduler_type", TRL, "rollyard keeps the learning rate constant", "trainer.lr (the constant rate); "
        "remove it", ("constant",)),
    _no("warmup_ratio", TRL, "rollyard has no learning-rate warm-up", _NO_WARMUP, (0,)),
    _no("warmup_steps", TRL, "rollyard has no learning-rate warm-up", _NO_WARMUP, (0,)),
    _no("max_prompt_length", TRL, "rollyard does not truncate prompts (one longer than the context is an error)",
        "model.context (prompt + rollout.max_new_tokens must fit it); remove it", (None,)),
    Alias("top_k", TRL, ("rollout.top_k",), "same value (None -> 0: off); the trainer's ratio over the same support",
          lambda v, _c: {"rollout.top_k": 0 if v is None else v}),
    _no("repetition_penalty", TRL, "a penalty changes the sampled distribution in a way the trainer's ratio does not "
                                   "model", _SUPPORT, (1.0,)),
    _no("min_p", TRL, "rollyard's sampling support is top-k then top-p (algo/support.py)", _SUPPORT, (None, 0)),
    _same("gradient_checkpointing", TRL, "trainer.activation_checkpointing"),
    _ignored("per_device_eval_batch_size", TRL, "held-out eval is greedy, one sample per prompt"),
    _ignored("logging_first_step", TRL, "metrics.jsonl has every step"),
    Alias("log_completions", TRL, ("log.completions_every",), "true -> completions.jsonl every logging_steps (1 "
          "if not given), false -> never", _log_completions),
    _ignored("num_completions_to_print", TRL, "completions go to completions.jsonl (log.completions_every), not the "
                                              "console"),
    _no("chat_template_kwargs", TRL, "rollyard renders prompts with the chat template as it is",
        "data.chat_template (a template with the behaviour built in)", (None, {})),
    Alias("dtype", TRL, ("trainer.precision",), "'float32' -> fp32, 'bfloat16' -> bf16, 'auto' -> auto (float16: no "
          "equivalent, use bfloat16)", _choice("trainer.precision", {"float32": "fp32", "bfloat16": "bf16",
                                                                     "auto": "auto"}, "dtype")),
    Alias("trust_remote_code", TRL, (), "false only (rollyard runs architectures transformers ships)",
          _choice("", {False: None}, "trust_remote_code")),
    # ---- the rest of TRL 1.16's GRPOConfig fields: speed / memory / logging knobs are accepted with a note; a
    # field that changes the math is refused (TRL's default accepted where it is rollyard's behaviour too)
    _no("model_init_kwargs", TRL, "rollyard loads the model directory with from_pretrained itself",
        "model.name (a local directory) / trainer.precision", (None, {})),
    _no("disable_dropout", TRL, "rollyard leaves dropout as the model's config sets it",
        "the model's config.json (its dropout probabilities at 0)", (False,)),
    _no("cast_lm_head_to_fp32", TRL, "rollyard sets one precision for the whole trainer model, no fp32 head apart",
        "trainer.precision=fp32 (every weight in fp32)", (False,)),
    _ignored("remove_unused_columns", TRL, "every dataset column reaches the reward functions (as with False)"),
    _ignored("num_generations_eval", TRL, "held-out eval is greedy, one sample per prompt"),
    _ignored("ds3_gather_for_generation", TRL, "DeepSpeed ZeRO-3 only: rollyard's rollout holds its own full copy "
                                               "of the weights (trainer.sharding=fsdp shards the trainer's)"),
    _no("shuffle_dataset", TRL, "rollyard always hands prompts out in a seeded order, reshuffled every pass",
        "data.seed (the order's seed)", (True,)),
    _ignored("pad_to_multiple_of", TRL, "padding only: rollyard packs sequences on its own"),
    _no("generation_batch_size", TRL, _ONE_UPDATE + " (a generation batch larger than the training batch is "
        "several)", _REUSE, (None,)),
    _no("generation_kwargs", TRL, "rollyard's sampler takes temperature, top-p and top-k only, the distribution "
        "the trainer's ratio models", "rollout.temperature / rollout.top_p / rollout.top_k", (None, {})),
    _ignored("cache_implementation", TRL, "the rollout engine keeps its own KV cache (rollout.kv_memory_gb)"),
    _no("vllm_mode", TRL, "rollyard runs vLLM in-process in the rollout worker of each placement",
        "placement=disaggregated (rollout workers with their own vLLM engine, as 'server')", ("colocate",)),
    _no("vllm_model_impl", TRL, "rollyard's vLLM engine runs vLLM's own model implementation",
        "rollout.backend=native (rollyard's engine runs any transformers causal LM)", ("vllm",)),
    _ignored("vllm_enable_sleep_mode", TRL, "rollyard's colocated vLLM engine always sleeps around the trainer's step "
                                            "on GPU (nothing to free on CPU)"),
    _no("vllm_structured_outputs_regex", TRL, "rollyard samples unconstrained (a constraint changes the distribution "
        "the trainer's ratio models)", "a reward function that scores the format", (None,)),
    _ignored("vllm_server_host", TRL, _NO_SERVER),
    _ignored("vllm_server_port", TRL, _NO_SERVER),
    _ignored("vllm_group_port", TRL, _NO_SERVER + " (weights go over sync.transport)"),
    _ignored("vllm_gpu_memory_utilization", TRL, "memory only: see rollout.kv_memory_gb"),
    _no("vllm_max_model_length", TRL, "vLLM's context is the model's", "model.context (prompt + rollout.max_new_tokens "
        "must fit it)", (None,)),
    _no("vllm_tensor_parallel_size", TRL, "one vLLM engine runs on one device in each rollout worker",
        "rollout.workers (more engines, each with its own copy)", (1,)),
    _no("delta", TRL, "rollyard's loss is the standard PPO clip, without a second upper bound", "algo.clip_high",
        (None,)),
    _no("sapo_temperature_neg", TRL, "only loss_type='sapo' reads it, which rollyard has not", "loss_type "
        "(algo.loss_agg) with algo.clip_low / algo.clip_high", (1.05,)),
    _no("sapo_temperature_pos", TRL, "only loss_type='sapo' reads it, which rollyard has not", "loss_type "
        "(algo.loss_agg) with algo.clip_low / algo.clip_high", (1.0,)),
    _no("vespo_k_pos", TRL, "only loss_type='vespo' reads it, which rollyard has not", "algo.tis_cap", (2.0,)),
    _no("vespo_lambda_pos", TRL, "only loss_type='vespo' reads it, which rollyard has not", "algo.tis_cap", (3.0,)),
    _no("vespo_k_neg", TRL, "only loss_type='vespo' reads it, which rollyard has not", "algo.tis_cap", (3.0,)),
    _no("vespo_lambda_neg", TRL, "only loss_type='vespo' reads it, which rollyard has not", "algo.tis_cap", (2.0,)),
    _no("importance_sampling_level", TRL, "rollyard's ratio and clip are per token ('token')",
        "algo.clip_low / algo.clip_high", ("token",)),
    _no("multi_objective_aggregation", TRL, "rollyard sums the weighted rewards, then normalises per group "
        "('sum_then_normalize')", "reward.weights / algo.normalize_std", ("sum_then_normalize",)),
    _no("mask_truncated_completions", TRL, "a completion cut at max_new_tokens is trained on like the others",
        "rollout.max_new_tokens (fewer completions cut)", (False,)),
    _no("sync_ref_model", TRL, "rollyard's reference model stays the initial policy", "algo.kl_coef", (False,)),
    _no("ref_model_mixup_alpha", TRL, "only sync_ref_model=True reads it", "algo.kl_coef", (0.6,)),
    _no("ref_model_sync_steps", TRL, "only sync_ref_model=True reads it", "algo.kl_coef", (512,)),
    _no("top_entropy_quantile", TRL, "every completion token is in rollyard's loss", "algo.loss_agg", (1.0,)),
    _no("entropy_coef", TRL, "rollyard's loss has no entropy term", "algo.kl_coef (its only extra term)", (0, 0.0)),
    _no("use_adaptive_entropy", TRL, "rollyard's loss has no entropy term", "algo.kl_coef (its only extra term)",
        (False,)),
    _no("entropy_coef_min", TRL, "only use_adaptive_entropy=True reads it", "algo.kl_coef", (0, 0.0)),
    _no("entropy_coef_max", TRL, "only use_adaptive_entropy=True reads it", "algo.kl_coef", (1.0,)),
    _no("entropy_coef_delta", TRL, "only use_adaptive_entropy=True reads it", "algo.kl_coef", (0.005,)),
    _no("entropy_target", TRL, "only use_adaptive_entropy=True reads it", "algo.kl_coef", (0.2,)),
    _no("vllm_importance_sampling_correction", TRL, "rollyard always corrects the rollout / trainer mismatch by "
        "truncated importance sampling per token", "algo.tis_cap (its cap)", (True,)),
    _no("vllm_importance_sampling_mode", TRL, "rollyard truncates per token ('token_truncate')", "algo.tis_cap",
        ("token_truncate",)),
    _no("vllm_importance_sampling_clip_max", TRL, "rollyard's cap applies per token, TRL's default mode per "
        "sequence", "algo.tis_cap (the per-token cap)"),
    _no("vllm_importance_sampling_clip_min", TRL, "rollyard's truncation has no lower bound", "algo.tis_cap", (None,)),
    _no("vllm_importance_sampling_cap", TRL, "rollyard's cap applies per token, TRL's default mode per sequence",
        "algo.tis_cap (the per-token cap)", (None,)),
    _no("off_policy_mask_threshold", TRL, "rollyard masks no sequence by its KL", "max_staleness / algo.tis_cap",
        (None,)),
    _no("use_bias_correction_kl", TRL, "rollyard's k3 KL term is not weighted by the importance ratio",
        "algo.kl_coef", (False,)),
    _ignored("log_multimodal", TRL, "rollyard's prompts are text"),
    _ignored("log_unique_prompts", TRL, "completions.jsonl has every sample (log.completions_every)"),
    _no("log_completions_hub_repo", TRL, "rollyard uploads nothing", "log.completions_every (completions.jsonl in the "
        "run directory)", (None,)),
    _ignored("use_transformers_continuous_batching", TRL, "speed only: rollyard's engine batches continuously "
                                                          "(rollout.backend)"),
    _ignored("transformers_continuous_batching_config", TRL, "speed only: see rollout.max_concurrent"),
    _ignored("use_transformers_paged", TRL, "speed only: rollyard's engine batches continuously (rollout.backend)"),
    # ---- transformers' TrainingArguments fields a TRL script commonly sets (GRPOConfig inherits them)
    _ignored("run_name", TRL, "the run is named by its directory (out_dir)"),
    _ignored("logging_dir", TRL, "logs go to the run directory (out_dir; log.tensorboard writes there too)"),
    _ignored("logging_strategy", TRL, "metrics.jsonl has every step"),
    _ignored("log_level", TRL, "console output only"),
    Alias("disable_tqdm", TRL, ("progress",), "true -> progress=false", lambda v, _c: {} if v is None else
          {"progress": not v}),
    _ignored("dataloader_num_workers", TRL, "speed only: prompts are read once into the prompt feed"),
    _ignored("dataloader_pin_memory", TRL, "speed only: prompts are read once into the prompt feed"),
    _ignored("do_train", TRL, "rollyard train always trains"),
    _ignored("do_eval", TRL, "held-out eval runs every eval_every steps (eval_steps) and before and after"),
    _ignored("eval_strategy", TRL, "held-out eval runs every eval_every steps (eval_steps) and before and after"),
    _ignored("eval_on_start", TRL, "a held-out eval runs before the first step whenever there is a held-out set (summary eval_before)"),
    _no("save_strategy", TRL, "rollyard checkpoints every checkpoint_every steps and at the end",
        "checkpoint_every (save_steps)", ("steps",)),
    _ignored("save_only_model", TRL, "a checkpoint keeps the optimizer state too, so --resume continues exactly"),
    _no("push_to_hub", TRL, "rollyard uploads nothing", "out_dir (the run directory holds the model)", (False,)),
    _no("hub_model_id", TRL, "rollyard uploads nothing", "out_dir (the run directory holds the model)", (None,)),
    _no("optim", TRL, "the trainer's optimizer is AdamW (torch's, fused where it can)",
        "trainer.optimizer_state (fp32 or bf16 moments)", ("adamw_torch", "adamw_torch_fused")),
    _no("adam_beta1", TRL, "rollyard's AdamW betas are fixed at (0.9, 0.99)", "trainer.lr", (0.9,)),
    _no("adam_beta2", TRL, "rollyard's AdamW betas are fixed at (0.9, 0.99), not transformers' default 0.999",
        "trainer.lr", (0.99,)),
    _no("adam_epsilon", TRL, "rollyard's AdamW epsilon is fixed at 1e-8", "trainer.lr", (1e-8,)),
    _no("lr_scheduler_kwargs", TRL, "rollyard keeps the learning rate constant", "trainer.lr (the constant rate)",
        (None, {})),
    _ignored("gradient_checkpointing_kwargs", TRL, "rollyard's activation checkpointing has no options "
                                                   "(trainer.activation_checkpointing)"),
    _no("fp16", TRL, "rollyard trains in fp32 or bf16", "trainer.precision=bf16", (False,)),
    _no("tf32", TRL, "rollyard does not switch matmuls to TF32", "trainer.precision", (None, False)),
    _ignored("torch_compile", TRL, "speed only: rollyard's trainer runs eagerly"),
    _ignored("use_liger_kernel", TRL, "memory only: rollyard computes logprobs in chunks of the vocabulary "
                                      "(trainer.logprob_chunk), never the whole logits tensor"),
    Alias("data_seed", TRL, ("data.seed",), "same value (None: data.seed's default)",
          lambda v, _c: {} if v is None else {"data.seed": v}),
    _no("deepspeed", TRL, "rollyard's trainer does not run DeepSpeed", "trainer.dp / trainer.sharding=fsdp", (None,)),
    _ignored("ddp_find_unused_parameters", TRL, "rollyard's data-parallel ranks (trainer.dp) all-reduce gradients themselves, no torch DDP"),
    # ---- TRL AsyncGRPOConfig (AsyncGRPOTrainer, stable since TRL 1.18): staleness, weight-sync cadence, buffers
    Alias("max_staleness", TRL, ("max_staleness",), "same value: weight versions a trained sample may lag the "
          "trainer (placement=async)"),
    Alias("weight_sync_steps", TRL, ("sync.every",), "same value: optimizer steps between weight syncs"),
    Alias("max_inflight_tasks", TRL, ("rollout.max_concurrent",), "rollouts in flight over all workers -> per "
          "rollout worker: ceil(max_inflight_tasks / rollout.workers); -1 (auto) -> rollyard's default",
          _inflight),
    Alias("token_budget", TRL, ("trainer.micro_batch_tokens",), "tokens one forward row holds (same unit); "
          "unset -> rollyard's default", _token_budget),
    _ignored("queue_maxsize", TRL, "rollyard's buffer of finished samples is bounded at admission by max_staleness "
                                   "(work older than it is never started)"),
    _ignored("fork_threshold_tokens", TRL, "rollyard never re-tokenizes a conversation (token-in/token-out), so "
                                           "there is no drift to fork on"),
    _ignored("vllm_server_base_url", TRL, "rollyard calls no vLLM server: rollout.backend=vllm runs vLLM inside each "
                                          "rollout worker (rollout.workers, placement=async)"),
    _ignored("vllm_server_timeout", TRL, _NO_SERVER),
    _ignored("request_timeout", TRL, _NO_SERVER),
    _ignored("weight_sync_timeout", TRL, _NO_SERVER + " (a weight sync that fails stops the run with its reason)"),
    _ignored("heartbeat_stale_after_s", TRL, "a rollout actor that dies is detected by Ray and replaced "
                                             "(its prompts requeued)"),
    _ignored("ignore_data_skip", TRL, "a resumed run continues its prompt stream from the checkpoint's cursor"),
    _no("router_aux_loss_coef", TRL, "rollyard adds no mixture-of-experts load-balancing loss",
        "none (algo.kl_coef is the only extra loss term); remove it", (None, 0)),
    # ---- verl (dotted, as in its YAML / Hydra overrides)
    _same("data.train_batch_size", VERL, "rollout.prompts_per_step"),
    _same("data.max_response_length", VERL, "rollout.max_new_tokens"),
    Alias("data.train_files", VERL, ("data.path",), "one file", lambda v, _c: _one_file(v, "data.path")),
    Alias("data.val_files", VERL, ("data.eval_path",), "one file", lambda v, _c: _one_file(v, "data.eval_path")),
    Alias("data.prompt_key", VERL, ("data.fields",), "data.fields = {prompt: <key>}",
          lambda v, c: {"data.fields": {**(c.keys("data.fields") or {}), "prompt": v}}),
    _no("data.max_prompt_length", VERL, "rollyard does not truncate prompts (one longer than the context is an "
                                        "error)", "model.context (prompt + rollout.max_new_tokens must fit it); "
                                                  "remove it"),
    _same("actor_rollout_ref.model.path", VERL, "model.name"),
    _same("actor_rollout_ref.actor.optim.lr", VERL, "trainer.lr"),
    _same("actor_rollout_ref.actor.optim.weight_decay", VERL, "trainer.weight_decay"),
    _same("actor_rollout_ref.actor.grad_clip", VERL, "trainer.max_grad_norm"),
    Alias("actor_rollout_ref.actor.clip_ratio", VERL, ("algo.clip_low", "algo.clip_high"),
          "both bounds unless clip_ratio_low / clip_ratio_high are given", _verl_clip),
    _same("actor_rollout_ref.actor.clip_ratio_low", VERL, "algo.clip_low"),
    _same("actor_rollout_ref.actor.clip_ratio_high", VERL, "algo.clip_high"),
    Alias("actor_rollout_ref.actor.use_kl_loss", VERL, ("algo.kl_coef",), "kl_coef = kl_loss_coef if true, else 0",
          _verl_kl),
    Alias("actor_rollout_ref.actor.kl_loss_coef", VERL, ("algo.kl_coef",), "kl_coef = kl_loss_coef if use_kl_loss, "
          "else 0", _verl_kl),
    Alias("actor_rollout_ref.actor.kl_loss_type", VERL, (), "'low_var_kl' (k3) only",
          _choice("", {"low_var_kl": None, "k3": None}, "kl_loss_type")),
    Alias("actor_rollout_ref.actor.loss_agg_mode", VERL, ("algo.loss_agg",),
          "'token-mean' -> token-mean; 'seq-mean-token-mean' -> seq-mean",
          _choice("algo.loss_agg", {"token-mean": "token-mean", "seq-mean-token-mean": "seq-mean"}, "loss_agg_mode")),
    Alias("actor_rollout_ref.actor.entropy_coeff", VERL, (), "0 only (rollyard has no entropy bonus)",
          _choice("", {0: None}, "entropy_coeff")),
    Alias("actor_rollout_ref.actor.ppo_mini_batch_size", VERL, (),
          "must equal data.train_batch_size (one optimizer step per batch)",
          _same_as_batch("actor_rollout_ref.actor.ppo_mini_batch_size")),
    _no("actor_rollout_ref.actor.ppo_epochs", VERL, _ONE_UPDATE, _REUSE),
    _ignored("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", VERL, _MEMORY),
    _ignored("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", VERL, _MEMORY),
    _ignored("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", VERL, _MEMORY),
    _ignored("actor_rollout_ref.rollout.gpu_memory_utilization", VERL, "memory only: see rollout.kv_memory_gb"),
    _same("actor_rollout_ref.model.enable_gradient_checkpointing", VERL, "trainer.activation_checkpointing"),
    _ignored("actor_rollout_ref.model.use_remove_padding", VERL, "rollyard packs sequences on its own"),
    _same("actor_rollout_ref.rollout.n", VERL, "rollout.samples_per_prompt"),
    _same("actor_rollout_ref.rollout.temperature", VERL, "rollout.temperature"),
    _same("actor_rollout_ref.rollout.top_p", VERL, "rollout.top_p"),
    Alias("actor_rollout_ref.rollout.top_k", VERL, ("rollout.top_k",), "same value; -1 (verl's off) -> 0",
          lambda v, _c: {"rollout.top_k": 0 if v in (-1, None) else v}),
    Alias("actor_rollout_ref.rollout.name", VERL, ("rollout.backend",), "'vllm' -> vllm; 'hf' -> native",
          _choice("rollout.backend", {"vllm": "vllm", "hf": "native"}, "rollout.name")),
    Alias("algorithm.adv_estimator", VERL, (), "'grpo' only (rollyard's advantages are GRPO's)",
          _choice("", {"grpo": None}, "adv_estimator")),
    _same("algorithm.norm_adv_by_std_in_grpo", VERL, "algo.normalize_std"),
    Alias("algorithm.use_kl_in_reward", VERL, (), "false only (rollyard's KL is a loss term: "
          "actor.use_kl_loss)", _choice("", {False: None}, "use_kl_in_reward")),
    _same("trainer.total_training_steps", VERL, "steps"),
    _no("trainer.total_epochs", VERL, "rollyard counts optimizer steps, not passes over the data",
        "trainer.total_training_steps (steps): epochs x dataset rows / data.train_batch_size"),
    _same("trainer.save_freq", VERL, "checkpoint_every"),
    _same("trainer.test_freq", VERL, "eval_every"),
    _same("trainer.default_local_dir", VERL, "out_dir"),
    _same("trainer.project_name", VERL, "log.wandb_project"),
    _ignored("trainer.experiment_name", VERL, "the run directory (out_dir) names the run"),
    Alias("trainer.logger", VERL, ("log.wandb", "log.tensorboard"), "['console', 'wandb', 'tensorboard'] -> "
          "log.wandb, log.tensorboard", _trackers),
    _ignored("trainer.n_gpus_per_node", VERL, "rollyard places roles by `placement` and trainer.dp"),
    _ignored("trainer.nnodes", VERL, "rollyard places roles by `placement` and trainer.dp"),
    Alias("custom_reward_function.path", VERL, ("reward.hook",), "reward.hook = <path>:<name> (name default "
          "compute_score)", _verl_hook),
    Alias("custom_reward_function.name", VERL, ("reward.hook",), "reward.hook = <path>:<name>", _verl_hook),
]
ALIASES: dict[str, Alias] = {a.name: a for a in ALIASES_LIST}


def is_prefix(dotted: str) -> bool:
    """Some alias lies under ``dotted`` (a verl section such as ``actor_rollout_ref.rollout``)."""
    return any(name.startswith(dotted + ".") for name in ALIASES)


def convert(found: dict[str, Any], keys: Callable[[str], Any]) -> tuple[dict[str, Any], list[str]]:
    """The rollyard values (dotted key -> value) the aliases ``found`` (name -> value) set, and the notes
    for accepted-and-ignored ones. NoEquivalent (naming the alias) for one rollyard cannot honour, or for
    two aliases that set one key to different values."""
    ctx = Ctx(found, keys)
    out: dict[str, Any] = {}
    by: dict[str, str] = {}
    notes = []
    for name, value in found.items():
        a = ALIASES[name]
        try:
            values = a.apply(value, ctx)
        except NoEquivalent as e:
            raise NoEquivalent(f"{name} ({a.source}) = {value!r}: {e}") from None
        if a.ignored:
            notes.append(f"{name} ({a.source}) is accepted and ignored: {a.rule}")
        for key, v in values.items():
            if key in out and out[key] != v:
                raise NoEquivalent(f"{by[key]} and {name} both set {key}, to {out[key]!r} and {v!r}; keep one")
            out[key], by[key] = v, name
    return out, notes


def table(source: str) -> list[tuple[str, str, str]]:
    """``(alias, rollyard keys, rule)`` rows of ``source`` (TRL or verl)."""
    rows = []
    for a in ALIASES_LIST:
        if a.source == source:
            to = ", ".join(a.to) or ("(accepted, ignored)" if a.ignored else "(value checked)" if a.convert
                                     else "(no equivalent)")
            rows.append((a.name, to, a.rule))
    return rows


def text(source: str) -> str:
    """The mapping as aligned plain text (``rollyard config --trl`` / ``--verl``)."""
    rows = table(source)
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    head = f"{source} name -> rollyard key (rule); {BATCH_RULE}" if source == TRL else f"{source} name -> rollyard key (rule)"
    return "\n".join([head] + [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows])


def markdown() -> str:
    """``docs/config-mapping.md``: both tables, generated from :data:`ALIASES_LIST`."""
    out = ["# TRL and verl names in rollyard configs", "",
           "Generated from `src/rollyard/aliases.py` by `rollyard config --markdown`; do not edit by hand.", "",
           "Every name below is accepted in a config file (nested sections for verl's dotted names) and as an",
           "override (`learning_rate=1e-6`, `actor_rollout_ref.rollout.n=8`). A name with no rollyard equivalent",
           "stops the run with one line (exit 2); a memory-only knob is accepted with a note. The resolved",
           "config (`RUN_DIR/config.yaml`) holds rollyard's names.", "",
           f"Batch unit: {BATCH_RULE}; the product must be a multiple of num_generations. verl's",
           "`data.train_batch_size` counts prompts already.", ""]
    for source in (TRL, VERL):
        out += [f"## {source}", "", f"| {source} | rollyard | rule |", "|---|---|---|"]
        out += [f"| `{a}` | {b if b.startswith('(') else '`' + b + '`'} | {c.replace('|', '/')} |"
                for a, b, c in table(source)]
        out.append("")
    return "\n".join(out)
