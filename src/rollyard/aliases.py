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
    spg, gbs = ctx.alias("steps_per_generation"), ctx.alias("generation_batch_size")
    if spg is not None and gbs is not None:
        raise NoEquivalent("steps_per_generation and generation_batch_size are both set (TRL refuses it too); keep one")
    if gbs is not None:
        if _int("generation_batch_size", gbs) % (per * dp):
            raise NoEquivalent(f"generation_batch_size={gbs} is not a multiple of per_device_train_batch_size x "
                               f"trainer.dp = {per * dp}; make it one")
        spg = gbs // (per * dp)
    spg = ga if spg is None else _int("steps_per_generation", spg)
    if spg % ga:
        raise NoEquivalent(f"steps_per_generation={spg} is not a multiple of gradient_accumulation_steps={ga}: rollyard "
                           f"steps the optimizer on whole batches of {completions} completions; make it one")
    return {"rollout.prompts_per_step": completions * (spg // ga) // n, "trainer.mini_batches": spg // ga}


def _trl_generation(value: Any, ctx: Ctx) -> dict[str, Any]:
    """steps_per_generation / generation_batch_size: None (TRL's default) alone changes nothing."""
    if value is None and not any(ctx.alias(n) is not None for n in (
            "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size")):
        return {}
    return _trl_batch(value, ctx)


def _trl_steps(value: Any, ctx: Ctx) -> dict[str, Any]:
    """TRL's max_steps counts optimizer steps; a rollyard step makes epochs x mini_batches of them."""
    steps = _int("max_steps", value)
    mini = _trl_batch(None, ctx)["trainer.mini_batches"]
    per_step = mini * _int("num_iterations", ctx.alias("num_iterations", 1))
    if steps % per_step:
        raise NoEquivalent(f"max_steps={steps} optimizer steps is not a whole number of generation batches of "
                           f"{per_step} optimizer steps each (num_iterations x steps_per_generation / "
                           f"gradient_accumulation_steps); make it a multiple of {per_step}")
    return {"steps": steps // per_step}


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


_LOSS_TYPES = {"grpo": ("ppo_clip", "seq-mean-token-mean"), "bnpo": ("ppo_clip", "token-mean"),
               "dapo": ("ppo_clip", "token-mean"), "dr_grpo": ("ppo_clip", "seq-mean-token-sum-norm"),
               "luspo": ("ppo_clip", "seq-mean-token-sum"), "cispo": ("cispo", "token-mean"),
               "sapo": ("sapo", "seq-mean-token-mean"), "vespo": ("vespo", "token-mean")}


def _loss_type(value: Any, _ctx: Ctx) -> dict[str, Any]:
    if value not in _LOSS_TYPES:
        raise NoEquivalent(f"no rollyard equivalent for loss_type {value!r}; TRL 1.16's are "
                           f"{', '.join(repr(k) for k in _LOSS_TYPES)}")
    loss, agg = _LOSS_TYPES[value]
    return {"algo.policy_loss": loss, "algo.loss_agg": agg}


def _scale_rewards(value: Any, _ctx: Ctx) -> dict[str, Any]:
    table = {True: ("group", True), "group": ("group", True), "batch": ("batch", True), False: ("group", False),
             "none": ("group", False)}
    if value not in table or (isinstance(value, bool) is False and isinstance(value, int)):
        raise NoEquivalent(f"no rollyard equivalent for scale_rewards {value!r}; rollyard supports 'group', "
                           f"'batch', 'none', true, false")
    scope, on = table[value]
    return {"algo.normalize_std": on, "algo.std_scope": scope}


def _sync_ref(_value: Any, ctx: Ctx) -> dict[str, Any]:
    on = ctx.alias("sync_ref_model", False)
    return {"reference.sync_every": _int("ref_model_sync_steps", ctx.alias("ref_model_sync_steps", 512)) if on else 0}


_TRL_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _trl_is(_value: Any, ctx: Ctx) -> dict[str, Any]:
    """TRL's rollout correction: its mode and cap, TRL's defaults (sequence_mask, 3.0) where not given."""
    if ctx.alias("vllm_importance_sampling_correction", True) is False:
        return {"algo.tis_mode": "none"}
    mode = ctx.alias("vllm_importance_sampling_mode", "sequence_mask")
    if mode not in _TRL_IS_MODES:
        raise NoEquivalent(f"vllm_importance_sampling_mode must be one of {', '.join(_TRL_IS_MODES)}, got {mode!r}")
    cap = ctx.alias("vllm_importance_sampling_clip_max", ctx.alias("vllm_importance_sampling_cap", 3.0))
    return {"algo.tis_mode": mode, "algo.tis_cap": cap}


def _verl_loss_mode(value: Any, _ctx: Ctx) -> dict[str, Any]:
    table = {"vanilla": ("ppo_clip", "token"), "gspo": ("ppo_clip", "sequence"), "cispo": ("cispo", "token")}
    if value not in table:
        raise NoEquivalent(f"no rollyard equivalent for policy_loss.loss_mode {value!r}; rollyard supports "
                           f"{', '.join(repr(k) for k in table)} (and TRL's loss_type values: sapo, vespo, ...)")
    return {"algo.policy_loss": table[value][0], "algo.ratio_level": table[value][1]}


def _verl_mini(value: Any, ctx: Ctx) -> dict[str, Any]:
    batch = ctx.alias("data.train_batch_size", ctx.keys("rollout.prompts_per_step"))
    mini = _int("ppo_mini_batch_size", value)
    if batch is None or batch % mini:
        raise NoEquivalent(f"data.train_batch_size={batch} is not a multiple of ppo_mini_batch_size={mini}: verl cuts "
                           f"the batch into whole mini-batches; make it a multiple of {mini}")
    return {"trainer.mini_batches": batch // mini}


def _verl_overlong(_value: Any, ctx: Ctx) -> dict[str, Any]:
    on = ctx.alias("reward_model.overlong_buffer.enable", False)
    return {"algo.overlong_buffer": _int("overlong_buffer.len", ctx.alias("reward_model.overlong_buffer.len", 0))
            if on else 0}


def _no(name: str, source: str, why: str, closest: str, neutral: tuple = ()) -> Alias:
    """A name with no rollyard equivalent: using it stops the run with ``why`` and the closest rollyard setting;
    the ``neutral`` values (those that change nothing, e.g. TRL's defaults) are accepted."""
    keep = f" ({' / '.join(repr(n) for n in neutral)} accepted: changes nothing)" if neutral else ""
    return Alias(name, source, (), f"{why}; closest rollyard setting: {closest}{keep}", neutral=neutral)


def _beta(value: Any, ctx: Ctx) -> dict[str, Any]:
    """TRL's ``beta`` is GRPOConfig's KL coefficient, but GKDConfig's interpolation of the generalized JSD."""
    gkd = ctx.keys("algo.objective") == "gkd" or any(ctx.alias(n) is not None for n in ("lmbda", "seq_kd"))
    return {"algo.gkd_beta" if gkd else "algo.kl_coef": value}


def _epochs(value: Any, ctx: Ctx) -> dict[str, Any]:
    if ctx.alias("max_steps") is not None:  # as in TRL (transformers' Trainer): max_steps wins over epochs
        return {}
    return {"data.epochs": value}


# transformers' schedules rollyard does not have (rollyard.schedule.SCHEDULES has the rest, by the same names)
_NO_SCHEDULE = {"reduce_lr_on_plateau": "it follows an eval metric; rollyard's schedules follow the step count",
                "greedy": "it follows an eval metric; rollyard's schedules follow the step count",
                "warmup_stable_decay": "not implemented"}


def _lr_schedule(value: Any, _ctx: Ctx) -> dict[str, Any]:
    name = str(getattr(value, "value", value)).lower()  # transformers' SchedulerType is a str enum
    if name in _NO_SCHEDULE:
        raise NoEquivalent(f"no rollyard equivalent for lr_scheduler_type {name!r} ({_NO_SCHEDULE[name]}); closest "
                           f"rollyard setting: trainer.lr_schedule=cosine_with_min_lr (rollyard config lists them)")
    return {"trainer.lr_schedule": name}


def _trl_warmup_steps(value: Any, _ctx: Ctx) -> dict[str, Any]:
    # transformers 5: an integer >= 1 is steps, a float in [0, 1) a share of the training steps (get_warmup_steps)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise NoEquivalent(f"warmup_steps must be a number >= 0 (steps, or a share of the steps below 1), got {value!r}")
    return {"trainer.warmup_steps": int(value)} if value >= 1 or value == 0 else {"trainer.warmup_ratio": float(value)}


def _schedule_kwargs(value: Any, _ctx: Ctx) -> dict[str, Any]:
    if isinstance(value, str):  # transformers accepts the dict as a JSON string (the command line's form)
        import json
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise NoEquivalent(f"lr_scheduler_kwargs {value!r} is neither a mapping nor JSON; give e.g. "
                               f'{{"num_cycles": 1}}') from None
    if value is not None and not isinstance(value, dict):
        raise NoEquivalent(f"lr_scheduler_kwargs must be a mapping of the schedule's arguments, got {value!r}")
    return {"trainer.lr_schedule_kwargs": dict(value or {})}


_FP32_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")  # torch's AdamW, fp32 moments (adamw_hf: transformers 4's)


def _optim(value: Any, _ctx: Ctx) -> dict[str, Any]:
    name = str(getattr(value, "value", value)).lower()
    if name in _FP32_ADAMW:
        return {"trainer.optimizer_state": "fp32"}
    raise NoEquivalent(f"no rollyard equivalent for optim {name!r}: rollyard's optimizer is AdamW with fp32 moments "
                       f"({', '.join(_FP32_ADAMW)}) or bf16 moments; closest rollyard setting: "
                       f"trainer.optimizer_state=bf16 (4 bytes of optimizer state per parameter instead of 8)")


_VERL_OPTIM = "actor_rollout_ref.actor.optim."
_BY_STEP = {"trainer.lr_schedule_unit": "step"}  # verl steps its scheduler once per generation batch


def _verl_warmed(ctx: Ctx) -> dict[str, Any]:
    """verl's default schedule ('constant') warms up: rollyard's constant_with_warmup, unless a schedule is named."""
    named = any(ctx.alias(_VERL_OPTIM + n) is not None for n in ("lr_scheduler_type", "warmup_style"))
    return {} if named or ctx.keys("trainer.lr_schedule") is not None else {"trainer.lr_schedule": "constant_with_warmup"}


def _verl_warmup_steps(value: Any, ctx: Ctx) -> dict[str, Any]:
    if value is None or value <= 0:  # verl: None, 0 or negative delegate to lr_warmup_steps_ratio
        return {}
    return {"trainer.warmup_steps": _int("lr_warmup_steps", value), **_BY_STEP, **_verl_warmed(ctx)}


def _verl_warmup_ratio(value: Any, ctx: Ctx) -> dict[str, Any]:
    if (ctx.alias(_VERL_OPTIM + "lr_warmup_steps") or -1) > 0 or not value:
        return {}
    return {"trainer.warmup_ratio": value, "trainer.warmup_rounding": "floor", **_BY_STEP,  # verl: int(ratio x steps)
            **_verl_warmed(ctx)}


def _verl_schedule(value: Any, ctx: Ctx) -> dict[str, Any]:
    name = str(value).lower()
    cycles, floor = ctx.alias(_VERL_OPTIM + "num_cycles"), ctx.alias(_VERL_OPTIM + "min_lr_ratio")
    if name == "constant":  # verl's constant schedule warms up (lr_warmup_steps) and then holds the rate
        return {"trainer.lr_schedule": "constant_with_warmup", **_BY_STEP}
    if name != "cosine":
        raise NoEquivalent(f"no rollyard equivalent for verl's lr_scheduler_type {value!r}; verl's FSDP actor has "
                           f"'constant' and 'cosine'")
    kwargs = {} if cycles is None else {"num_cycles": cycles}
    if floor:
        return {"trainer.lr_schedule": "cosine_with_min_lr", "trainer.lr_schedule_kwargs": {**kwargs, "min_lr_rate": floor},
                **_BY_STEP}
    return {"trainer.lr_schedule": "cosine", "trainer.lr_schedule_kwargs": kwargs, **_BY_STEP}


def _verl_cosine_arg(name: str, neutral: tuple) -> Callable[[Any, Ctx], dict[str, Any]]:
    def convert(value: Any, ctx: Ctx) -> dict[str, Any]:
        kind = ctx.alias(_VERL_OPTIM + "lr_scheduler_type", ctx.alias(_VERL_OPTIM + "warmup_style", "constant"))
        if str(kind).lower() != "cosine" and value not in neutral:
            raise NoEquivalent(f"{name} shapes verl's cosine schedule, but the schedule is {kind!r} (verl ignores it "
                               f"there); set {_VERL_OPTIM}lr_scheduler_type=cosine, or remove {name}")
        return {}  # read by the schedule's conversion
    return convert


def _verl_betas(value: Any, _ctx: Ctx) -> dict[str, Any]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise NoEquivalent(f"betas must be two numbers [beta1, beta2], got {value!r}")
    return {"trainer.adam_beta1": float(value[0]), "trainer.adam_beta2": float(value[1])}


def _ignored(name: str, source: str, why: str) -> Alias:
    return Alias(name, source, (), why, ignored=True)


def _same(name: str, source: str, key: str) -> Alias:
    return Alias(name, source, (key,), "same value")


_BATCH = "completions -> prompts: x gradient_accumulation_steps x trainer.dp / num_generations (the batch rule)"
_ONE_UPDATE = "rollyard takes one optimizer step per batch of rollouts, never several on one batch"
_REUSE = ("max_staleness with placement=async (each sample trained once, up to that many weight versions old, the "
          "ratio and clip correcting for it); remove it")
_SUPPORT = "rollout.top_p / rollout.top_k (the trainer's ratio is taken over the same support); remove it"
_NO_SERVER = "rollyard starts no vLLM server: its engines run in-process in each rollout worker"
_MEMORY = "memory only, the math is the same: rollyard sizes micro-batches by trainer.micro_batch_tokens"

ALIASES_LIST: list[Alias] = [
    # ---- TRL GRPOConfig (and the TRL script's model / dataset arguments)
    _same("learning_rate", TRL, "trainer.lr"),
    _same("num_generations", TRL, "rollout.samples_per_prompt"),
    _same("max_completion_length", TRL, "rollout.max_new_tokens"),
    _same("max_tool_calling_iterations", TRL, "tools.max_tool_calling_iterations"),
    Alias("beta", TRL, ("algo.kl_coef", "algo.gkd_beta"), "GRPOConfig: same value as algo.kl_coef; GKDConfig (with "
          "lmbda or seq_kd, or algo.objective=gkd): same value as algo.gkd_beta", _beta),
    Alias("epsilon", TRL, ("algo.clip_low", "algo.clip_high"), "clip_low; clip_high too unless epsilon_high is given",
          _epsilon),
    _same("epsilon_high", TRL, "algo.clip_high"),
    Alias("per_device_train_batch_size", TRL, ("rollout.prompts_per_step", "trainer.mini_batches"), _BATCH,
          _trl_batch),
    Alias("gradient_accumulation_steps", TRL, ("rollout.prompts_per_step", "trainer.mini_batches"), _BATCH,
          _trl_batch),
    _same("temperature", TRL, "rollout.temperature"),
    _same("top_p", TRL, "rollout.top_p"),
    Alias("max_steps", TRL, ("steps",), "optimizer steps -> steps = max_steps / (num_iterations x "
          "steps_per_generation / gradient_accumulation_steps): a rollyard step is one generation batch", _trl_steps),
    _same("seed", TRL, "seed"),
    _same("output_dir", TRL, "out_dir"),
    Alias("weight_decay", TRL, ("trainer.weight_decay", "trainer.decay_norms_and_biases"), "same value, on the "
          "weights transformers' Trainer decays: not biases nor normalisation weights (decay_norms_and_biases=false)",
          lambda v, _c: {"trainer.weight_decay": v, "trainer.decay_norms_and_biases": False}),
    _same("max_grad_norm", TRL, "trainer.max_grad_norm"),
    Alias("logging_steps", TRL, ("log.progress_every",), "progress line every N steps (metrics.jsonl has every step)"),
    _same("save_steps", TRL, "checkpoint_every"),
    _same("save_total_limit", TRL, "keep_checkpoints"),
    _same("eval_steps", TRL, "eval_every"),
    Alias("report_to", TRL, ("log.wandb", "log.tensorboard"), "wandb / tensorboard / all / none -> log.wandb, "
          "log.tensorboard", _trackers),
    _same("reward_weights", TRL, "reward.weights"),
    Alias("scale_rewards", TRL, ("algo.normalize_std", "algo.std_scope"), "true / 'group' -> normalize_std, "
          "std_scope=group; 'batch' -> std_scope=batch; false / 'none' -> normalize_std=false", _scale_rewards),
    Alias("loss_type", TRL, ("algo.policy_loss", "algo.loss_agg"), "grpo -> ppo_clip, seq-mean-token-mean; dapo / "
          "bnpo -> ppo_clip, token-mean (bnpo: over the optimizer batch, TRL's per device micro-batch: equal with "
          "gradient_accumulation_steps=1); dr_grpo -> ppo_clip, seq-mean-token-sum-norm; luspo -> ppo_clip, "
          "seq-mean-token-sum; cispo -> cispo, token-mean; sapo -> sapo, seq-mean-token-mean; vespo -> vespo, "
          "token-mean", _loss_type),
    Alias("bf16", TRL, ("trainer.precision",), "true -> bf16, false -> fp32",
          _choice("trainer.precision", {True: "bf16", False: "fp32"}, "bf16")),
    Alias("use_vllm", TRL, ("rollout.backend",), "true -> vllm, false -> native",
          _choice("rollout.backend", {True: "vllm", False: "native"}, "use_vllm")),
    _same("model_name_or_path", TRL, "model.name"),
    Alias("dataset_name", TRL, ("data.path",), "a local .jsonl or .parquet file (no Hub download)"),
    Alias("num_train_epochs", TRL, ("data.epochs",), "data.epochs: steps = ceil(epochs x training prompts / "
          "rollout.prompts_per_step), each prompt generated once per epoch; max_steps wins when both are set, as in "
          "TRL", _epochs),
    Alias("lr_scheduler_type", TRL, ("trainer.lr_schedule",), "same name (transformers' schedules; "
          "reduce_lr_on_plateau, greedy and warmup_stable_decay refused); a TRL script that sets none gets TRL's "
          "'linear'", _lr_schedule),
    Alias("warmup_ratio", TRL, ("trainer.warmup_ratio",), "same value: ceil(ratio x optimizer steps) warm-up steps "
          "(transformers 4's name; transformers 5 takes a share below 1 in warmup_steps)"),
    Alias("warmup_steps", TRL, ("trainer.warmup_steps", "trainer.warmup_ratio"), "an integer >= 1 -> "
          "trainer.warmup_steps; a float below 1 -> trainer.warmup_ratio (transformers 5's share of the steps)",
          _trl_warmup_steps),
    Alias("max_prompt_length", TRL, ("data.max_prompt_tokens", "data.prompt_truncation"), "TRL before 1.0: prompts "
          "cut to their last max_prompt_length tokens (data.prompt_truncation=left)",
          lambda v, _c: {} if v is None else {"data.max_prompt_tokens": v, "data.prompt_truncation": "left"}),
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
    # ---- TRL 1.16's loss and optimisation-loop settings
    Alias("num_iterations", TRL, ("trainer.epochs",), "same value: passes over each generation batch"),
    Alias("steps_per_generation", TRL, ("trainer.mini_batches", "rollout.prompts_per_step"), "mini_batches = "
          "steps_per_generation / gradient_accumulation_steps (must divide); the generation batch is that many "
          "optimizer batches (the batch rule)", _trl_generation),
    Alias("generation_batch_size", TRL, ("trainer.mini_batches", "rollout.prompts_per_step"), "completions -> "
          "prompts_per_step = generation_batch_size / num_generations; mini_batches = generation_batch_size / "
          "(per_device_train_batch_size x gradient_accumulation_steps x trainer.dp)", _trl_generation),
    _same("delta", TRL, "algo.delta"),
    _same("sapo_temperature_pos", TRL, "algo.sapo_temperature_pos"),
    _same("sapo_temperature_neg", TRL, "algo.sapo_temperature_neg"),
    _same("vespo_k_pos", TRL, "algo.vespo_k_pos"),
    _same("vespo_lambda_pos", TRL, "algo.vespo_lambda_pos"),
    _same("vespo_k_neg", TRL, "algo.vespo_k_neg"),
    _same("vespo_lambda_neg", TRL, "algo.vespo_lambda_neg"),
    Alias("importance_sampling_level", TRL, ("algo.ratio_level",), "'token' / 'sequence' (GSPO) / 'sequence_token' "
          "(GSPO-token)", _choice("algo.ratio_level", {"token": "token", "sequence": "sequence",
                                                        "sequence_token": "sequence_token"},
                                  "importance_sampling_level")),
    Alias("multi_objective_aggregation", TRL, ("algo.multi_objective",), "same value ('sum_then_normalize' / "
          "'normalize_then_sum')", _choice("algo.multi_objective", {"sum_then_normalize": "sum_then_normalize",
                                                                    "normalize_then_sum": "normalize_then_sum"},
                                           "multi_objective_aggregation")),
    _same("mask_truncated_completions", TRL, "algo.mask_truncated"),
    Alias("sync_ref_model", TRL, ("reference.sync_every",), "true -> reference.sync_every = ref_model_sync_steps "
          "(512 if not given); false -> 0", _sync_ref),
    Alias("ref_model_sync_steps", TRL, ("reference.sync_every",), "read with sync_ref_model=true", _sync_ref),
    _same("ref_model_mixup_alpha", TRL, "reference.mixup_alpha"),
    _same("top_entropy_quantile", TRL, "algo.top_entropy_quantile"),
    _same("entropy_coef", TRL, "algo.entropy_coef"),
    _same("use_adaptive_entropy", TRL, "algo.adaptive_entropy"),
    _same("entropy_coef_min", TRL, "algo.entropy_coef_min"),
    _same("entropy_coef_max", TRL, "algo.entropy_coef_max"),
    _same("entropy_coef_delta", TRL, "algo.entropy_coef_delta"),
    _same("entropy_target", TRL, "algo.entropy_target"),
    Alias("vllm_importance_sampling_correction", TRL, ("algo.tis_mode", "algo.tis_cap"), "false -> "
          "tis_mode=none; true -> TRL's mode and cap (vllm_importance_sampling_mode, default sequence_mask; "
          "vllm_importance_sampling_clip_max, default 3.0)", _trl_is),
    Alias("vllm_importance_sampling_mode", TRL, ("algo.tis_mode", "algo.tis_cap"), "same mode; the cap "
          "vllm_importance_sampling_clip_max (TRL's default 3.0 when not given)", _trl_is),
    Alias("vllm_importance_sampling_clip_max", TRL, ("algo.tis_cap",), "same value", _trl_is),
    Alias("vllm_importance_sampling_cap", TRL, ("algo.tis_cap",), "TRL's older name of "
          "vllm_importance_sampling_clip_max", _trl_is),
    _same("vllm_importance_sampling_clip_min", TRL, "algo.tis_min"),
    _same("off_policy_mask_threshold", TRL, "algo.off_policy_mask_threshold"),
    _same("use_bias_correction_kl", TRL, "algo.kl_bias_correction"),
    _same("disable_dropout", TRL, "trainer.disable_dropout"),
    _same("cast_lm_head_to_fp32", TRL, "trainer.lm_head_fp32"),
    # ---- the rest of TRL 1.16's GRPOConfig fields: speed / memory / logging knobs are accepted with a note; a
    # field that changes the math is refused (TRL's default accepted where it is rollyard's behaviour too)
    _no("model_init_kwargs", TRL, "rollyard loads the model directory with from_pretrained itself",
        "model.name (a local directory) / trainer.precision", (None, {})),
    _ignored("remove_unused_columns", TRL, "every dataset column reaches the reward functions (as with False)"),
    _ignored("num_generations_eval", TRL, "held-out eval is greedy, one sample per prompt"),
    _ignored("ds3_gather_for_generation", TRL, "DeepSpeed ZeRO-3 only: rollyard's rollout holds its own full copy "
                                               "of the weights (trainer.sharding=fsdp shards the trainer's)"),
    Alias("shuffle_dataset", TRL, ("data.shuffle",), "same value (false: the prompts in file order every pass)"),
    _ignored("pad_to_multiple_of", TRL, "padding only: rollyard packs sequences on its own"),
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
    Alias("optim", TRL, ("trainer.optimizer_state",), f"{' / '.join(_FP32_ADAMW)} -> fp32 (torch's AdamW); any "
          "other optimizer (8-bit, paged, Adafactor, ...) refused, closest trainer.optimizer_state=bf16", _optim),
    _same("adam_beta1", TRL, "trainer.adam_beta1"),
    Alias("adam_beta2", TRL, ("trainer.adam_beta2",), "same value (a TRL script that sets none gets TRL's 0.999; "
          "rollyard's own default is 0.99)"),
    _same("adam_epsilon", TRL, "trainer.adam_eps"),
    Alias("lr_scheduler_kwargs", TRL, ("trainer.lr_schedule_kwargs",), "same mapping (or its JSON string): "
          "num_cycles, min_lr / min_lr_rate, lr_end, power, timescale, warmup_lr_rate", _schedule_kwargs),
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
    # ---- TRL GKDConfig (experimental GKDTrainer; temperature and beta above, in a GKD context)
    Alias("lmbda", TRL, ("algo.objective", "algo.gkd_lmbda"), "algo.objective=gkd, algo.gkd_lmbda = the same value "
          "(the share of prompts trained on the student's own samples; TRL draws once per batch, rollyard per "
          "prompt)", lambda v, _c: {"algo.objective": "gkd", "algo.gkd_lmbda": v}),
    Alias("seq_kd", TRL, ("algo.objective", "algo.gkd_seq_kd"), "algo.objective=gkd, algo.gkd_seq_kd = the same "
          "value (the off-policy share, 1 - lmbda of the prompts, trains on completions the teacher samples)",
          lambda v, _c: {"algo.objective": "gkd", "algo.gkd_seq_kd": v}),
    _same("max_new_tokens", TRL, "rollout.max_new_tokens"),
    _same("teacher_model_name_or_path", TRL, "teacher.model"),
    # ---- verl (dotted, as in its YAML / Hydra overrides)
    _same("data.train_batch_size", VERL, "rollout.prompts_per_step"),
    _same("data.max_response_length", VERL, "rollout.max_new_tokens"),
    Alias("data.train_files", VERL, ("data.path",), "one file", lambda v, _c: _one_file(v, "data.path")),
    Alias("data.val_files", VERL, ("data.eval_path",), "one file", lambda v, _c: _one_file(v, "data.eval_path")),
    Alias("data.prompt_key", VERL, ("data.fields",), "data.fields = {prompt: <key>}",
          lambda v, c: {"data.fields": {**(c.keys("data.fields") or {}), "prompt": v}}),
    Alias("data.max_prompt_length", VERL, ("data.max_prompt_tokens",), "same value: a longer prompt is dead-lettered "
          "with its reason (verl's filter_overlong_prompts), or cut by data.truncation"),
    Alias("data.truncation", VERL, ("data.prompt_truncation",), "'left' / 'right' cut the prompt; 'error' -> drop: "
          "rollyard dead-letters the prompt with its reason instead of stopping the run",
          _choice("data.prompt_truncation", {"left": "left", "right": "right", "error": "drop"}, "truncation")),
    _ignored("data.filter_overlong_prompts", VERL, "rollyard always dead-letters a prompt over data.max_prompt_tokens "
                                                   "(or the context) with its reason"),
    _same("actor_rollout_ref.model.path", VERL, "model.name"),
    _same("actor_rollout_ref.actor.optim.lr", VERL, "trainer.lr"),
    _same("actor_rollout_ref.actor.optim.weight_decay", VERL, "trainer.weight_decay"),
    Alias(_VERL_OPTIM + "lr_warmup_steps", VERL, ("trainer.warmup_steps", "trainer.lr_schedule_unit",
                                                  "trainer.lr_schedule"),
          "> 0 -> trainer.warmup_steps, counted in steps (lr_schedule_unit=step, as verl steps its scheduler once per "
          "batch; lr_schedule constant_with_warmup unless one is named); None, 0 or negative -> "
          "lr_warmup_steps_ratio decides", _verl_warmup_steps),
    Alias(_VERL_OPTIM + "lr_warmup_steps_ratio", VERL, ("trainer.warmup_ratio", "trainer.warmup_rounding",
                                                        "trainer.lr_schedule_unit", "trainer.lr_schedule"),
          "trainer.warmup_ratio, rounded down as verl does (warmup_rounding=floor), in steps (lr_schedule "
          "constant_with_warmup unless one is named); unused when lr_warmup_steps > 0", _verl_warmup_ratio),
    Alias(_VERL_OPTIM + "lr_scheduler_type", VERL, ("trainer.lr_schedule", "trainer.lr_schedule_kwargs",
                                                    "trainer.lr_schedule_unit"),
          "'constant' -> constant_with_warmup (verl's warms up); 'cosine' -> cosine, or cosine_with_min_lr when "
          "min_lr_ratio > 0; counted in steps (lr_schedule_unit=step)", _verl_schedule),
    Alias(_VERL_OPTIM + "warmup_style", VERL, ("trainer.lr_schedule", "trainer.lr_schedule_kwargs",
                                               "trainer.lr_schedule_unit"),
          "verl's older name of lr_scheduler_type: the same rule", _verl_schedule),
    Alias(_VERL_OPTIM + "min_lr_ratio", VERL, ("trainer.lr_schedule_kwargs",), "cosine only: min_lr_rate of "
          "cosine_with_min_lr (None / 0 accepted with any schedule)", _verl_cosine_arg("min_lr_ratio", (None, 0, 0.0))),
    Alias(_VERL_OPTIM + "num_cycles", VERL, ("trainer.lr_schedule_kwargs",), "cosine only: num_cycles (0.5, verl's "
          "default, accepted with any schedule)", _verl_cosine_arg("num_cycles", (None, 0.5))),
    Alias(_VERL_OPTIM + "betas", VERL, ("trainer.adam_beta1", "trainer.adam_beta2"), "[beta1, beta2] -> "
          "trainer.adam_beta1, trainer.adam_beta2", _verl_betas),
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
    Alias("actor_rollout_ref.actor.loss_agg_mode", VERL, ("algo.loss_agg",), "same value (token-mean, "
          "seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm)",
          _choice("algo.loss_agg", {m: m for m in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                                   "seq-mean-token-sum-norm")}, "loss_agg_mode")),
    _same("actor_rollout_ref.actor.entropy_coeff", VERL, "algo.entropy_coef"),
    _same("actor_rollout_ref.actor.clip_ratio_c", VERL, "algo.delta"),
    Alias("actor_rollout_ref.actor.policy_loss.loss_mode", VERL, ("algo.policy_loss", "algo.ratio_level"),
          "'vanilla' -> ppo_clip, token; 'gspo' -> ppo_clip, sequence; 'cispo' -> cispo", _verl_loss_mode),
    Alias("actor_rollout_ref.actor.ppo_mini_batch_size", VERL, ("trainer.mini_batches",),
          "mini_batches = data.train_batch_size / ppo_mini_batch_size (prompts; must divide)", _verl_mini),
    _same("actor_rollout_ref.actor.ppo_epochs", VERL, "trainer.epochs"),
    Alias("algorithm.filter_groups.enable", VERL, ("algo.dynamic_sampling",), "same value (groups of equal "
          "rewards dropped, more drawn)", None),
    _same("algorithm.filter_groups.max_num_gen_batches", VERL, "algo.dynamic_sampling_rounds"),
    Alias("algorithm.filter_groups.metric", VERL, (), "'acc' / 'score' (rollyard filters on the reward)",
          _choice("", {"acc": None, "score": None}, "filter_groups.metric")),
    Alias("reward_model.overlong_buffer.enable", VERL, ("algo.overlong_buffer",), "true -> overlong_buffer = "
          "overlong_buffer.len; false -> 0", _verl_overlong),
    Alias("reward_model.overlong_buffer.len", VERL, ("algo.overlong_buffer",), "read with enable=true",
          _verl_overlong),
    _same("reward_model.overlong_buffer.penalty_factor", VERL, "algo.overlong_penalty"),
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
    Alias("trainer.total_epochs", VERL, ("data.epochs",), "data.epochs: steps = ceil(epochs x training prompts / "
          "data.train_batch_size); trainer.total_training_steps wins when both are set, as in verl",
          lambda v, c: {} if c.alias("trainer.total_training_steps") is not None else {"data.epochs": v}),
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
