"""TRL 1.18's surface beyond GRPOConfig (issue 47, items 2 and 4): AsyncGRPOConfig's names with their units
converted and shown by ``rollyard config --trl``, TRL's neutral defaults accepted, a name without an equivalent
refused in one line naming the closest rollyard setting, and ``environment_factory`` as TRL defines it (any
callable, one instance per rollout, ``reset``, tool methods, a reward read from the environment)."""

from __future__ import annotations

import copy

import pytest
import tool_chat
import trl_tools

from rollyard import aliases
from rollyard.cli import main
from rollyard.config import ConfigError, load_config
from rollyard.env import tools


def test_async_grpo_config_names_set_rollyards_keys_with_units_converted(capsys):
    cfg = load_config(None, ["placement=async", "rollout.workers=2", "max_staleness=2", "weight_sync_steps=3",
                             "max_inflight_tasks=13", "token_budget=2048", "queue_maxsize=64",
                             "vllm_server_base_url=http://localhost:8000", "request_timeout=30", "dtype=bfloat16",
                             "log_completions=true", "logging_steps=5"])
    assert (cfg.max_staleness, cfg.sync.every) == (2, 3)
    assert cfg.rollout.max_concurrent == 7  # 13 rollouts in flight over 2 workers: ceil(13 / 2) per worker
    assert cfg.trainer.micro_batch_tokens == 2048 and cfg.trainer.precision == "bf16"
    assert cfg.log.completions_every == 5 and cfg.log.progress_every == 5
    err = capsys.readouterr().err
    assert "queue_maxsize (TRL) is accepted and ignored" in err and "vllm_server_base_url (TRL) is accepted" in err
    default = load_config(None, []).rollout.max_concurrent
    assert load_config(None, ["max_inflight_tasks=-1"]).rollout.max_concurrent == default  # -1: TRL's auto


def test_config_trl_shows_the_async_names(capsys):
    assert main(["config", "--trl"]) == 0
    out = capsys.readouterr().out
    for name, key in [("max_staleness", "max_staleness"), ("weight_sync_steps", "sync.every"),
                      ("max_inflight_tasks", "rollout.max_concurrent"), ("token_budget", "trainer.micro_batch_tokens"),
                      ("top_k", "rollout.top_k")]:
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert key in line, line


def test_trls_neutral_defaults_are_accepted():
    cfg = load_config(None, ["repetition_penalty=1.0", "min_p=null", "num_iterations=1", "warmup_ratio=0",
                             "lr_scheduler_type=constant", "top_k=null", "steps_per_generation=null", "max_steps=3",
                             "num_train_epochs=3", "chat_template_kwargs={}", "trust_remote_code=false"])
    assert cfg == load_config(None, ["steps=3"])
    assert load_config(None, ["top_k=20"]).rollout.top_k == 20
    assert load_config(None, ["actor_rollout_ref.rollout.top_k=-1"]).rollout.top_k == 0  # verl's off
    assert load_config(None, ["actor_rollout_ref.rollout.top_k=50"]).rollout.top_k == 50


@pytest.mark.parametrize("args, says", [
    (["repetition_penalty=1.1"], "closest rollyard setting: rollout.top_p / rollout.top_k"),
    (["min_p=0.05"], "closest rollyard setting: rollout.top_p / rollout.top_k"),
    (["chat_template_kwargs={enable_thinking: false}"], "closest rollyard setting: data.chat_template"),
])
def test_a_name_without_an_equivalent_is_one_line_naming_the_closest_setting(args, says, capsys, tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert says in str(e.value) and "no rollyard equivalent" in str(e.value)
    assert main(["train", *args, f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_every_refusal_names_a_closest_setting():
    for a in aliases.ALIASES_LIST:
        if not a.to and a.convert is None and not a.ignored:
            assert "closest rollyard setting: " in a.rule, a.name


def test_a_factory_function_is_an_environment_factory_as_in_trl():
    target, specs, has_reward = tools.environment_specs("trl_tools:make_adder_env")
    assert target == ("module", "trl_tools", "make_adder_env") and has_reward
    assert [s.name for s in specs] == ["add"] and specs[0].schema["function"]["parameters"]["required"] == ["a", "b"]
    with pytest.raises(ConfigError, match="expected a class or a function"):
        tools.environment_class(3, "environment_factory 'x'")


def test_an_environment_factory_run_trains_on_the_environments_reward(tmp_path):
    import rollyard

    tok = tool_chat.tokenizer()
    schemas = [s.schema for s in tools.tool_specs(["tool_fns:add"])]
    model = tool_chat.taught_model(tok, schemas)
    rows = [{"prompt": tool_chat.QUESTION, "answer": "5"}] * 4
    small = {"steps": 1, "progress": False, "sft": {"auto": False}, "log": {"plots": False},
             "rollout": {"prompts_per_step": 1, "samples_per_prompt": 2, "max_new_tokens": 80, "temperature": 0.0},
             "reward": {"num_workers": 1}, "tools": {"num_workers": 1}, "out_dir": str(tmp_path / "run")}
    run = rollyard.train(small, model=copy.deepcopy(model), tokenizer=tok, dataset=rows,
                         environment_factory=trl_tools.make_adder_env)  # no reward_funcs: the environment's reward
    assert run.config.tools.environment == "trl_tools:make_adder_env"
    assert run.config.reward.hooks == ["rollyard.env.rewards:AdderEnv"]  # logged under the class's name, as TRL does
    (row,) = run.metrics  # each rollout's own instance: add(2, 3) once (an int, sent as "5"), async get_reward 1
    assert row["reward"] == 1.0 and row["tools/calls"] == 2 and row["tools/errors"] == 0  # the only reward: get_reward
    with pytest.raises(ConfigError, match="closest: one class whose reset"):
        rollyard.train(small, model=model, tokenizer=tok, dataset=rows,
                       environment_factory={"a": trl_tools.make_adder_env, "b": trl_tools.AdderEnv})


def test_a_factory_made_environment_runs_in_the_tool_workers_with_their_timeout():
    from rollyard.env.executor import Job, ToolExecutor

    target, specs, _ = tools.environment_specs("trl_tools:make_slow_env")
    with ToolExecutor(specs, target, num_workers=1, timeout_s=1.0) as ex:
        ex.run([Job(0, "reset", "a"), Job(1, "reset", "b")])
        assert [j.value for j in ex.run([Job(2, "call", "a", "wait", {"seconds": 0.1})])] == ["waited 0.1"]
        (hung,) = ex.run([Job(3, "call", "b", "wait", {"seconds": 30})])
        assert hung.status == "error" and hung.value.startswith("TimeoutError") and hung.seconds < 10
        assert ex.stats["timeouts"] == 1 and ex.stats["errors"] == 1
        (lost,) = ex.run([Job(4, "call", "a", "wait", {"seconds": 0})])  # its worker was replaced: a's instance too
        assert lost.status == "error" and "environment lost" in lost.value
