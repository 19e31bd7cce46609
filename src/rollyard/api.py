"""The Python API: ``rollyard.train(...)``, the same run ``rollyard train`` starts.

    import rollyard

    def correct(prompts, completions, answer, **kwargs):          # a TRL reward function
        return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]

    run = rollyard.train({"model": {"name": "path/to/hf_model"}, "steps": 50},
                         dataset=[{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}],
                         reward_funcs=[correct])
    run.summary["eval_after"], run.metrics[-1]["reward"], run.run_dir

What is given as Python objects is written into ``RUN_DIR/inputs/`` and named in the config: the
model and tokenizer (``inputs/model``, in their own dtype), the dataset (``inputs/train.jsonl``);
reward functions become ``module:function`` paths (the reward workers import them by name, so they
must be module-level functions; in a script, guard the call with ``if __name__ == "__main__":``).
The run is then described entirely by its ``config.yaml``, and ``rollyard train --resume RUN_DIR``
continues it like any other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollyard.config import ConfigError, MissingPackage, RunConfig, from_dict, get_dotted, load_config, read_file
from rollyard.reward.hooks import path_of
from rollyard.telemetry import rundir
from rollyard.telemetry.report import console, quiet_third_party

INPUTS = "inputs"


@dataclass
class Run:
    """A finished run: its directory, resolved config, summary.json, metrics.jsonl rows and plot files."""

    run_dir: Path
    config: RunConfig
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    plots: list[Path]


def train(config: RunConfig | dict | str | Path | None = None, *, model=None, tokenizer=None,
          dataset: str | Path | Iterable[dict] | None = None,
          reward_funcs: Callable | str | list[Callable | str] | None = None,
          overrides: list[str] = (), resume: str | Path | None = None,
          tools: list[Callable | str] | None = None,
          environment_factory: type | Callable | str | None = None) -> Run:
    """Train with ``config`` (a RunConfig, a mapping of sections, or a TOML/YAML file) plus
    ``key.sub=value`` ``overrides``; ``model``/``tokenizer``/``dataset``/``reward_funcs`` replace
    ``model.name``/``data.path``/``reward.hooks``. ``resume=RUN_DIR`` continues that run from its
    latest checkpoint (with its saved config). Bad input raises ConfigError, DataError or HookError.

    ``tools`` (TRL's: type-hinted, documented module-level functions, sync or async, returning anything:
    the model reads ``str(value)`` as in TRL) and ``environment_factory`` (as TRL 1.18 defines it: a class
    or a module-level function returning an instance; one instance per rollout, ``reset(**row)``, its public
    methods the tools, optional ``get_reward``) make the rollouts multi-turn (``tools.functions`` /
    ``tools.environment``; ``rollyard.env``), run in isolated tool workers with ``tools.timeout_s``. An
    environment's ``get_reward`` is one more reward function, logged under the class's name, after
    ``reward_funcs`` (the only one when no reward function is given).
    """
    from rollyard import placement

    quiet_third_party()
    if resume is not None:
        if config is not None or any(x is not None for x in (model, tokenizer, dataset, reward_funcs, tools,
                                                            environment_factory)):
            raise ConfigError("resume=RUN_DIR continues a run with its saved config and inputs; pass only "
                              "overrides with it (no config, model, tokenizer, dataset, reward_funcs, tools or "
                              "environment_factory)")
        cfg = _resume_config(Path(resume), overrides)
    else:
        data, values = _as_dict(config), _reward_values(reward_funcs)
        if isinstance(config, GRPOConfig):  # a TRL script's arguments: TRL's defaults where rollyard's differ
            data = with_trl_defaults(data)
        values.update(_tool_values(data, overrides, values, tools, environment_factory))
        run_dir = Path(from_dict(data, overrides, values).out_dir)
        _check_fresh(run_dir)
        cfg = from_dict(data, overrides, {**values, **_inputs(run_dir, model, tokenizer, dataset)})
    summary = placement.train(cfg, cfg.out_dir, resume=resume is not None)
    run = Path(cfg.out_dir)
    return Run(run, cfg, summary, list(rundir.read_jsonl(run / rundir.METRICS)), _plots(run, cfg))


class GRPOConfig(dict):
    """TRL's ``GRPOConfig`` as a TRL script builds it: its keyword arguments in TRL's names and units, which
    :class:`GRPOTrainer` hands to :func:`train` as the config (the mapping: ``rollyard config --trl``; a name
    without an equivalent stops the run in one line naming the closest rollyard setting). TRL's defaults where
    rollyard's differ (:data:`TRL_SCRIPT_DEFAULTS`: the linear schedule, beta2 0.999) fill the names not given. With it a TRL script
    runs by changing ``from trl import GRPOConfig, GRPOTrainer`` to ``from rollyard import ...`` alone."""

    def __init__(self, output_dir: str | None = None, **kwargs: Any):
        super().__init__(kwargs if output_dir is None else {"output_dir": output_dir, **kwargs})

    def __getattr__(self, name: str) -> Any:  # a script reads back what it set: training_args.output_dir
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"GRPOConfig has no {name!r} set (only the names given are kept)") from None


# TRL's defaults where rollyard's own differ (TRL name -> TRL's default), added on the TRL-script path only (a
# GRPOConfig, or GRPOTrainer's args) to the names a script did not set: it trains as it would in TRL.
TRL_SCRIPT_DEFAULTS: dict[str, Any] = {
    "lr_scheduler_type": "linear",  # transformers' TrainingArguments; rollyard's trainer.lr_schedule: constant
    "adam_beta2": 0.999,  # transformers'; rollyard's trainer.adam_beta2: 0.99
    "epsilon": 0.2,  # both clip bounds (epsilon_high defaults to epsilon); rollyard's algo.clip_high: 0.28
    "use_bias_correction_kl": True,  # the KL term times the ratio; rollyard's algo.kl_bias_correction: false
}


def with_trl_defaults(args: dict) -> dict:
    """``args`` (TRL names, as a script gave them) plus :data:`TRL_SCRIPT_DEFAULTS` for the names it did not set,
    where it does not set the rollyard key either (``{"trainer": {"lr_schedule": ...}}``)."""
    from rollyard.aliases import ALIASES

    missing = object()

    def given(dotted: str) -> bool:
        return get_dotted(args, dotted, missing) is not missing

    out = dict(args)
    for name, value in TRL_SCRIPT_DEFAULTS.items():
        if name not in out and not any(given(key) for key in ALIASES[name].to):
            out[name] = value
    # with vLLM, TRL corrects the rollout mismatch by its own default (sequence_mask, cap 3.0); without, not at all
    # (its generation is the trainer's own forward): rollyard keeps its default correction there
    if out.get("use_vllm") and not any(n.startswith("vllm_importance_sampling") for n in out) and not given(
            "algo.tis_mode"):
        out["vllm_importance_sampling_correction"] = True
    if not given("algo.std_eps"):  # TRL divides by std + 1e-4 (rollyard: 1e-6)
        out["algo"] = {**out.get("algo", {}), "std_eps": 1e-4}
    return out


# GRPOTrainer's arguments rollyard has no equivalent for: why, and the closest rollyard setting
NO_EQUIVALENT = {
    "eval_dataset": "held-out prompts are a file the run reads; closest rollyard setting: data.eval_path",
    "reward_processing_classes": "rollyard runs no reward models; closest rollyard setting: reward_funcs (a function "
                                 "that scores with the model)",
    "callbacks": "rollyard's loop takes no Trainer callbacks; closest rollyard setting: log.* (every step's row is in "
                 "metrics.jsonl)",
    "optimizers": "the trainer builds its own AdamW; closest rollyard setting: trainer.lr / trainer.weight_decay",
    "quantization_config": "the trainer keeps fp32 or bf16 weights; closest rollyard setting: trainer.precision",
    "peft_config": "a PEFT config object is not read; closest rollyard setting: model.lora.r / model.lora.alpha / "
                   "model.lora.targets",
    "rollout_func": "rollouts are the engine's; closest rollyard setting: tools= / environment_factory= (multi-turn)",
}


class GRPOTrainer:
    """TRL's ``GRPOTrainer`` signature over :func:`train`: ``GRPOTrainer(model, reward_funcs, args,
    train_dataset, processing_class=..., tools=..., environment_factory=...).train()`` is ``train(args,
    model=model, tokenizer=processing_class, dataset=train_dataset, reward_funcs=reward_funcs, ...)``
    and returns its :class:`Run`. An argument rollyard has no equivalent for is refused when given
    (``NO_EQUIVALENT``: ConfigError, one line with the closest setting)."""

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | dict | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None):  # TRL 1.16-1.18's order
        given = {"eval_dataset": eval_dataset, "reward_processing_classes": reward_processing_classes,
                 "callbacks": callbacks, "optimizers": None if tuple(optimizers) == (None, None) else optimizers,
                 "quantization_config": quantization_config, "peft_config": peft_config, "rollout_func": rollout_func}
        for name, value in given.items():
            if value is not None:
                raise ConfigError(f"GRPOTrainer({name}=...): no rollyard equivalent: {NO_EQUIVALENT[name]}")
        self.model, self.reward_funcs, self.args, self.train_dataset = model, reward_funcs, args, train_dataset
        self.processing_class, self.tools, self.environment_factory = processing_class, tools, environment_factory

    def train(self) -> Run:
        return train(with_trl_defaults(dict(self.args or {})), model=self.model, tokenizer=self.processing_class,
                     dataset=self.train_dataset, reward_funcs=self.reward_funcs, tools=self.tools,
                     environment_factory=self.environment_factory)


# data.* settings that decide the training prompt stream; a checkpoint's dataset cursor is only valid for it
STREAM_KEYS = ("task", "task_options", "path", "fields", "train_size", "seed", "chat_template")


def _resume_config(run: Path, overrides: list[str]) -> RunConfig:
    """The saved config of run directory ``run`` plus ``overrides``; ConfigError (one line, with the fix)
    when ``run`` is no run directory or an override changes the prompt stream the checkpoint is in."""
    if not run.is_dir():
        what = "is a file" if run.exists() else "does not exist"
        raise ConfigError(f"--resume {run}: {what}; expected a run directory written by `rollyard train` "
                          f"(e.g. runs/demo-20261123-101500), or start a new run with --config")
    if not (run / rundir.CONFIG).is_file():
        raise ConfigError(f"--resume {run}: no {rundir.CONFIG} in it, so it is not a run directory (or its first "
                          f"start failed before writing one); pass the directory `rollyard train` wrote, or start "
                          f"a new run")
    saved = load_config(run / rundir.CONFIG, [f"out_dir={run}"])
    cfg = load_config(run / rundir.CONFIG, [*overrides, f"out_dir={run}"])
    for key in STREAM_KEYS:
        was, now = getattr(saved.data, key), getattr(cfg.data, key)
        if was != now:
            raise ConfigError(f"--resume {run} data.{key}={now!r}: the run's checkpoint continues its prompt stream, "
                              f"which data.{key}={was!r} made; drop the data.{key} override (or start a new run with "
                              f"it)")
    return cfg


def _as_dict(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, RunConfig):
        return config.model_dump(mode="json")
    if isinstance(config, (str, Path)):
        return read_file(config)
    return config


def _check_fresh(run: Path) -> None:
    metrics = run / rundir.METRICS
    if metrics.exists() and metrics.stat().st_size > 0:
        raise ConfigError(f"run directory {run} already holds a run; pass resume={str(run)!r} to continue it, "
                          f"or choose another out_dir")


def _reward_values(reward_funcs) -> dict[str, Any]:
    """``reward.hooks`` naming ``reward_funcs`` (functions or hook paths)."""
    if reward_funcs is None:
        return {}
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    try:
        return {"reward.hooks": [f if isinstance(f, str) else path_of(f) for f in funcs]}
    except ValueError as e:
        raise ConfigError(f"reward_funcs: {e}") from None


def _tool_values(data: dict, overrides, values: dict, tools, environment_factory) -> dict[str, Any]:
    """``tools.*`` naming ``tools`` / ``environment_factory``, and the environment's reward as a hook."""
    from rollyard.env import rewards
    from rollyard.env import tools as env_tools

    out: dict[str, Any] = {}
    if tools is not None:
        out["tools.functions"] = [env_tools.path_or_name(f) for f in (tools if isinstance(tools, (list, tuple))
                                                                        else [tools])]
    if environment_factory is None:
        return out
    if isinstance(environment_factory, dict):
        raise ConfigError(f"environment_factory is a dict of {len(environment_factory)} environments (TRL's per-example "
                          f"'environment' field): rollyard runs one environment per run; closest: one class whose "
                          f"reset(**row) picks the behaviour from the row's columns")
    out["tools.environment"] = path = env_tools.path_or_name(environment_factory)
    cls = env_tools.environment_class(env_tools.load(path, "environment_factory")[0], f"environment_factory {path!r}")
    if callable(getattr(cls, "get_reward", None)):
        cfg = from_dict(data, overrides, values)
        hooks = list(cfg.reward.hooks or ([cfg.reward.hook] if cfg.reward.hook else []))
        out["reward.hooks"] = [*hooks, rewards.hook_path(getattr(cls, "__name__", "environment"))]
        out["reward.hook"] = None
        if cfg.reward.weights:
            out["reward.weights"] = [*cfg.reward.weights, 1.0]
    return out


def _inputs(run: Path, model, tokenizer, dataset) -> dict[str, Any]:
    """Write Python-object inputs under ``RUN_DIR/inputs`` and return the config values naming them."""
    values: dict[str, Any] = {}
    if model is not None and not isinstance(model, (str, Path)):
        if tokenizer is None:
            raise ConfigError("model= is a model object but tokenizer= is missing: pass its tokenizer too "
                              "(or pass model= as a Hugging Face model directory)")
        path = run / INPUTS / "model"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        values["model.name"] = str(path.resolve())
    elif tokenizer is not None:
        raise ConfigError("tokenizer= is given without a model object; a model directory carries its own "
                          "tokenizer: save the tokenizer into it, or pass model= as the model object")
    elif model is not None:
        values["model.name"] = str(model)
    if dataset is not None:
        values["data.path"] = str(dataset) if isinstance(dataset, (str, Path)) else _write_rows(run, dataset)
    return values


def _write_rows(run: Path, rows: Iterable[dict]) -> str:
    path = run / INPUTS / "train.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise ConfigError(f"dataset row {i} is a {type(row).__name__}, expected a dict of columns "
                                  f"(e.g. {{'prompt': ..., 'answer': ...}})")
            try:
                f.write(json.dumps(row) + "\n")
            except TypeError as e:
                raise ConfigError(f"dataset row {i} is not JSON-serialisable ({e}); give plain strings, numbers, "
                                  f"lists and dicts") from None
    return str(path.resolve())


def _plots(run: Path, cfg: RunConfig) -> list[Path]:
    if not cfg.log.plots:
        return []
    from rollyard.telemetry.plots import write_plots
    try:
        paths = write_plots(run)
    except MissingPackage as e:
        console.print(f"plots skipped: {e}")
        return []
    console.print(f"plots: {run / rundir.PLOTS}/ ({', '.join(p.name for p in paths)})")
    return paths
