"""The TRL and verl users' paths, end to end, with a locally built chat model (tiny Qwen2, BPE).

The TRL path goes through ``rollyard.train(...)`` with Python objects (model, tokenizer, message-list
rows, two TRL-style batched reward functions with weights); the verl path through the CLI with a
verl-layout Parquet file and ``compute_score``. Both read back what a user would look at: rendered
prompts, TensorBoard event files, the W&B offline file, plots, completions.jsonl, summary.json.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from ecosystem_rewards import brevity, says_answer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

import rollyard
from rollyard.cli import main
from rollyard.config import ConfigError, load_config
from rollyard.model.loading import eos_ids
from rollyard.reward.dispatcher import UNSCORED
from rollyard.rollout.engine import RolloutEngine
from rollyard.tasks import chat
from rollyard.tasks.base import DataError, Prompt
from rollyard.telemetry import rundir
from rollyard.types import Request

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SMALL = {"steps": 2, "checkpoint_every": 2, "progress": False, "sft": {"auto": False},
         "rollout": {"prompts_per_step": 3, "samples_per_prompt": 2, "max_new_tokens": 6},
         "reward": {"num_workers": 1}}


def rendered(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def no_nan(text: str):
    def bad(name):
        raise ValueError(f"{name} is not valid JSON")
    return json.loads(text, parse_constant=bad)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(model, tokenizer, directory): random-init bf16 Qwen2 with a BPE tokenizer trained here, a chat
    template, and two EOS ids in its generation config (``<|im_end|>`` and ``<|endoftext|>``)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} plus {b}? The answer is {a + b}." for a in range(20) for b in range(20)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT
    ids = tokenizer.convert_tokens_to_ids(SPECIALS)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                      tie_word_embeddings=True, eos_token_id=[ids[2], ids[0]], pad_token_id=ids[0])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    path = tmp_path_factory.mktemp("chat_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer, path


def trl_rows() -> list[dict]:
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}], "answer": str(a + b)}
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2)]]
    rows.append({"prompt": [{"role": "user", "content": "What is 9 plus 9?"}], "answer": "skip", "id": "skipme"})
    return rows


# ------------------------------------------------------------------------------------ TRL path
def test_trl_user_path(chat_model, tmp_path, capsys):
    model, tokenizer, _ = chat_model
    run_dir = tmp_path / "trl"
    config = {**SMALL, "out_dir": str(run_dir), "data": {"seed": 1},
              "reward": {"num_workers": 1, "weights": [1.0, 0.5]},
              "log": {"tensorboard": True, "wandb": True, "completions_every": 1}}
    run = rollyard.train(config, model=model, tokenizer=tokenizer, dataset=trl_rows(),
                         reward_funcs=[says_answer, brevity], overrides=["rollout.prompts_per_step=6"])
    out = capsys.readouterr().out

    assert run.run_dir == run_dir and [r["step"] for r in run.metrics] == [0, 1]
    assert run.config.data.task is None  # a dataset turns the built-in task off
    assert run.config.reward.hooks == ["ecosystem_rewards:says_answer", "ecosystem_rewards:brevity"]

    # Prompts rendered by the chat template, completions logged with their rewards.
    recs = list(rundir.read_jsonl(run_dir / rundir.COMPLETIONS))
    assert {r["step"] for r in recs} == {0, 1}
    contents = {m["prompt"][0]["content"] for m in trl_rows()}
    assert {r["prompt"] for r in recs} <= {rendered(c) for c in contents}
    assert all(isinstance(r["completion"], str) and r["version"] == r["step"] for r in recs)
    for r in recs:
        text = r["completion"]
        # The reward is the weighted sum of the two functions' own values.
        assert r["reward"] == pytest.approx(r["rewards"][0] + 0.5 * r["rewards"][1])
        assert r["rewards"][1] == pytest.approx(1.0 - min(len(text), 50) / 50)
    # The row whose functions all returned None is left out of the loss: dead-lettered, never trained.
    assert all(not r["id"].startswith("skipme") for r in recs)
    dead = list(rundir.read_jsonl(run_dir / rundir.DEADLETTER))
    assert dead and all(d["source"].startswith("skipme") and d["reason"] == UNSCORED for d in dead)

    # Metrics: each function's own, the learning rate, the share of flat groups; no reward errors.
    for row in run.metrics:
        assert row["reward/errors"] == 0 and row["learning_rate"] == pytest.approx(run.config.trainer.lr)
        assert 0.0 <= row["frac_reward_zero_std"] <= 1.0
        assert {"rewards/says_answer/mean", "rewards/brevity/mean", "rewards/brevity/std"} <= set(row)

    # No held-out set: said so, and summary.json is valid JSON (null, not NaN).
    assert "no held-out eval" in out
    summary = no_nan((run_dir / rundir.SUMMARY).read_text())
    assert summary["eval_before"] is None and summary["eval_after"] is None and run.summary["steps"] == 2

    # TensorBoard event files, read back, under TRL's names, holding the logged values.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward", "reward_std", "learning_rate", "frac_reward_zero_std",
            "rewards/says_answer/mean", "rewards/brevity/mean", "completions/mean_length",
            "time/rollout", "staleness/max"} <= tags
    assert "completions/text_summary" in acc.Tags()["tensors"]  # the completions table, as text
    tb = [(e.step, e.value) for e in acc.Scalars("reward")]
    assert [s for s, _ in tb] == [0, 1]
    assert [v for _, v in tb] == pytest.approx([r["reward"] for r in run.metrics], abs=1e-6)

    # W&B, offline, no login: the run file holds the same metric names.
    wandb_files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(wandb_files) == 1 and b"rewards/says_answer/mean" in wandb_files[0].read_bytes()
    tables = list((run_dir / "wandb").glob("offline-run-*/files/media/table/completions_*.table.json"))
    assert len(tables) == 2 and all(json.loads(t.read_text())["columns"] == ["step", "prompt", "completion", "reward"]
                                    for t in tables)

    # Plots: four real PNGs.
    assert sorted(p.name for p in run.plots) == ["lengths.png", "reward.png", "staleness.png", "time.png"]
    for p in run.plots:
        head = p.read_bytes()[:24]
        assert head[:8] == b"\x89PNG\r\n\x1a\n"
        assert int.from_bytes(head[16:20], "big") == 700 and int.from_bytes(head[20:24], "big") == 400

    # The exported model keeps its bf16 dtype and loads back with its chat template.
    exported = AutoModelForCausalLM.from_pretrained(run_dir / rundir.MODEL)
    assert exported.dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(run_dir / rundir.MODEL)
    assert tok.apply_chat_template(trl_rows()[0]["prompt"], tokenize=False, add_generation_prompt=True) \
        == rendered("What is 1 plus 2?")


def test_report_command_rewrites_plots(chat_model, tmp_path, capsys):
    _, _, path = chat_model
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in trl_rows()[:3]) + "\n")
    run_dir = tmp_path / "r"
    assert main(["train", f"model.name={path}", f"data.path={data}", f"data.eval_path={data}",
                 "reward.hook=ecosystem_rewards:says_answer", "reward.correctness=true", "log.plots=false", "steps=2",
                 "sft.auto=false", "progress=false", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                 "rollout.max_new_tokens=4", "reward.num_workers=1", f"out_dir={run_dir}"]) == 0
    assert not (run_dir / rundir.PLOTS).exists()
    evals = list(rundir.read_jsonl(run_dir / rundir.EVAL))
    assert [e["step"] for e in evals] == [0, 2]  # held-out accuracy before and after, for the plot
    capsys.readouterr()
    assert main(["report", str(run_dir)]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(Path(p).name for p in printed) == ["lengths.png", "reward.png", "staleness.png", "time.png"]
    assert main(["report", str(tmp_path / "nope")]) == 2


# ----------------------------------------------------------------------------------- verl path
def test_verl_user_path(chat_model, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    _, _, path = chat_model
    rows = [{"data_source": "toy/arith", "prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"split": "train", "index": i}} for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6)])]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    run_dir = tmp_path / "verl"
    assert main(["train", f"model.name={path}", f"data.path={data}",
                 "data.fields={ground_truth: reward_model.ground_truth}", "reward.hook=ecosystem_rewards:compute_score",
                 "steps=2", "sft.auto=false", "progress=false", "rollout.prompts_per_step=2",
                 "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "reward.num_workers=1",
                 "log.completions_every=1", "log.plots=false", f"out_dir={run_dir}"]) == 0
    metrics = list(rundir.read_jsonl(run_dir / rundir.METRICS))
    assert len(metrics) == 2 and all(m["reward/errors"] == 0 for m in metrics)
    recs = list(rundir.read_jsonl(run_dir / rundir.COMPLETIONS))
    for r in recs:
        assert r["prompt"] in {rendered(x["prompt"][0]["content"]) for x in rows}
        truth = next(x["reward_model"]["ground_truth"] for x in rows if rendered(x["prompt"][0]["content"]) == r["prompt"])
        assert r["reward"] == pytest.approx(float(truth in r["completion"]) + 0.1 * (len(r["completion"]) % 3))


def test_one_dataset_serves_trl_and_verl_functions_together(chat_model, tmp_path):
    """``data.fields={ground_truth: answer}`` gives compute_score its ground truth and TRL functions still
    get ``answer``; compute_score's dict extras are logged as rewards/<fn>/<key>; trainer_state is passed."""
    _, _, path = chat_model
    rows = [{**r, "data_source": "toy/arith", "extra_info": {"split": "train"}} for r in trl_rows()[:4]]
    data = tmp_path / "both.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run_dir = tmp_path / "both"
    hooks = "[ecosystem_rewards:says_answer, ecosystem_rewards:compute_score, ecosystem_rewards:step_seen]"
    assert main(["train", f"model.name={path}", f"data.path={data}", "data.fields={ground_truth: answer}",
                 f"reward.hooks={hooks}", "steps=2", "sft.auto=false", "progress=false", "log.plots=false",
                 "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
                 "reward.num_workers=1", f"out_dir={run_dir}"]) == 0
    metrics = list(rundir.read_jsonl(run_dir / rundir.METRICS))
    assert [m["reward/errors"] for m in metrics] == [0, 0]
    assert all({"rewards/says_answer/mean", "rewards/compute_score/mean", "rewards/compute_score/acc"} <= set(m)
               for m in metrics)
    assert [m["rewards/compute_score/acc"] for m in metrics] == [0.0, 0.0]
    assert [m["rewards/step_seen/mean"] for m in metrics] == [0.0, 1.0]  # trainer_state.global_step
    assert not any("reward/accuracy" in m for m in metrics)  # user functions: no correctness signal declared


@pytest.mark.parametrize("hook, fields, says", [
    ("ecosystem_rewards:needs_solution", "{}", "needs_solution(prompts, completions, solution, **kwargs) cannot be "
     "called as TRL does"),
    ("ecosystem_rewards:compute_score", "{}", "no ground truth for compute_score"),
])
def test_a_reward_function_that_cannot_work_fails_before_training(chat_model, tmp_path, capsys, hook, fields, says):
    _, _, path = chat_model
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in trl_rows()[:3]) + "\n")
    run_dir = tmp_path / "bad"
    assert main(["train", f"model.name={path}", f"data.path={data}", f"data.fields={fields}", f"reward.hook={hook}",
                 "steps=2", "sft.auto=false", "progress=false", "rollout.prompts_per_step=2",
                 "rollout.samples_per_prompt=2", "reward.num_workers=1", f"out_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert says in err and "before training" in err and len(err.strip().splitlines()) == 1
    assert not (run_dir / rundir.METRICS).exists()


def test_a_trl_grpo_script_config_and_a_verl_config_port_end_to_end(chat_model, tmp_path):
    """A TRL GRPOConfig (as a script passes it) and a verl config, in their own names, train as written."""
    _, _, path = chat_model
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({**r, "data_source": "toy/arith", "extra_info": {"split": "train"}})
                              for r in trl_rows()[:4]) + "\n")
    trl = tmp_path / "grpo.yaml"
    trl.write_text(yaml.safe_dump({
        "model_name_or_path": str(path), "dataset_name": str(data), "output_dir": str(tmp_path / "trl"),
        "learning_rate": 1e-5, "num_generations": 2, "max_completion_length": 4, "beta": 0.04, "epsilon": 0.2,
        "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "report_to": "none",
        "logging_steps": 1, "save_steps": 2, "max_steps": 2, "bf16": False, "gradient_checkpointing": True,
    }))
    assert main(["train", "--config", str(trl), "reward.hook=ecosystem_rewards:says_answer", "sft.auto=false",
                 "progress=false", "log.plots=false", "reward.num_workers=1"]) == 0
    cfg = load_config(tmp_path / "trl" / rundir.CONFIG)  # the resolved copy, in rollyard's names
    assert (cfg.trainer.lr, cfg.rollout.samples_per_prompt, cfg.rollout.max_new_tokens) == (1e-5, 2, 4)
    assert (cfg.rollout.prompts_per_step, cfg.algo.kl_coef, cfg.algo.clip_high, cfg.trainer.precision) == (2, 0.04, 0.2,
                                                                                                          "fp32")
    rows = list(rundir.read_jsonl(tmp_path / "trl" / rundir.METRICS))
    assert len(rows) == 2 and all(r["reward/errors"] == 0 and r["learning_rate"] == pytest.approx(1e-5) for r in rows)
    assert (tmp_path / "trl" / rundir.CHECKPOINTS / "step_000002").is_dir()  # save_steps

    verl = tmp_path / "verl.yaml"
    verl.write_text(yaml.safe_dump({
        "data": {"train_files": [str(data)], "train_batch_size": 2, "max_response_length": 4,
                 "fields": {"ground_truth": "answer"}},
        "actor_rollout_ref": {"model": {"path": str(path)},
                              "actor": {"optim": {"lr": 1e-5}, "ppo_mini_batch_size": 2, "use_kl_loss": False,
                                        "ppo_micro_batch_size_per_gpu": 2, "clip_ratio": 0.2},
                              "rollout": {"n": 2, "name": "hf", "temperature": 1.0}},
        "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True},
        "trainer": {"total_training_steps": 2, "save_freq": 2, "default_local_dir": str(tmp_path / "verl"),
                    "logger": ["console"], "n_gpus_per_node": 1},
        "custom_reward_function": {"path": str(Path(__file__).with_name("ecosystem_rewards.py")),
                                   "name": "compute_score"},
    }))
    assert main(["train", "--config", str(verl), "sft.auto=false", "progress=false", "log.plots=false",
                 "reward.num_workers=1"]) == 0
    cfg = load_config(tmp_path / "verl" / rundir.CONFIG)
    assert (cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.trainer.lr, cfg.steps) == (2, 2, 1e-5, 2)
    rows = list(rundir.read_jsonl(tmp_path / "verl" / rundir.METRICS))
    assert len(rows) == 2 and all(r["reward/errors"] == 0 and "rewards/compute_score/acc" in r for r in rows)


# ------------------------------------------------------------------------------ the pieces
def test_chat_template_override_and_missing_template(chat_model):
    _, tokenizer, _ = chat_model
    p = Prompt(id="a", text="", meta={}, messages=[{"role": "user", "content": "hi"}])
    chat.render([p], tokenizer, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                "{% if add_generation_prompt %}assistant:{% endif %}")
    assert p.text == "user: hi\nassistant:"
    plain = Prompt(id="b", text="2+2=", meta={})
    chat.render([plain], tokenizer)
    assert plain.text == "2+2="  # plain strings are left as they are
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    with pytest.raises(DataError, match="prompt a is a message list but the tokenizer has no chat template"):
        chat.render([p], bare)


def test_every_eos_id_ends_a_sequence(chat_model):
    model, tokenizer, _ = chat_model
    ids = eos_ids(model, tokenizer)
    assert ids == sorted(tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"]))
    fp32 = copy.deepcopy(model).float()
    requests = [Request(id="r", prompt_ids=[5, 6, 7], n=4, max_new_tokens=5)]
    # With every id but one as EOS, a sequence stops at its first token unless it drew that one id.
    every = [i for i in range(len(tokenizer)) if i != 9]
    samples, _ = RolloutEngine(fp32, eos_token_id=every, temperature=1.0, seed=0).generate(requests)
    assert all(s.finish_reason == "stop" and len(s.completion_ids) == 1 for s in samples
               if s.completion_ids[0] != 9)
    assert any(s.finish_reason == "stop" for s in samples)


def test_reward_form_errors_name_the_three_forms(tmp_path, capsys):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def score(text, answer):\n    return 1.0\n")
    assert main(["train", f"reward.hook={bad}:score", "steps=1", f"out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "score(text, answer) matches none of the three accepted reward forms" in err
    for form in ("fn(completion, prompt, meta)", "fn(prompts, completions, **columns)",
                 "compute_score(data_source, solution_str, ground_truth, extra_info=None)"):
        assert form in err


def test_dataset_without_hook_and_api_input_errors(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert main(["train", f"data.path={data}", f"out_dir={tmp_path / 'r'}"]) == 2
    assert "has no built-in verifier: set reward.hook" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="not a module-level function"):
        rollyard.train({"out_dir": str(tmp_path / "x")}, reward_funcs=[lambda c, p, m: 1.0])
    with pytest.raises(ConfigError, match="tokenizer= is missing"):
        rollyard.train({"out_dir": str(tmp_path / "y")}, model=torch.nn.Linear(1, 1))


def test_hooks_sharing_a_function_name_get_distinct_metric_names():
    from rollyard.reward.hooks import names_of
    assert names_of(["a.py:score", "b:score", "c:fmt"]) == ["score_0", "score_1", "fmt"]


def test_config_defaults_that_do_not_surprise():
    assert load_config(None, ["data.path=x.jsonl"]).data.task is None
    assert load_config(None, ["data.path=x.jsonl", "data.task=repeat"]).data.task == "repeat"
    assert load_config(None, []).data.task == "arithmetic"
    with pytest.raises(ConfigError, match=r"reward\.weights has 1 entries for 2 reward function"):
        load_config(None, ["reward.hooks=[a:b, c:d]", "reward.weights=[1]"])


def test_missing_optional_packages_name_their_extra(tmp_path, monkeypatch, capsys):
    from rollyard.tasks.dataset import load_prompts

    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # `import pyarrow.parquet` now fails
    with pytest.raises(DataError, match=r"needs pyarrow, which is not installed; pip install 'rollyard\[parquet\]'"):
        load_prompts(tmp_path / "d.parquet")
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.METRICS).write_text(json.dumps({"step": 0, "reward": 0.5}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'rollyard[plots]'" in err


def test_import_rollyard_is_light_and_exports_train():
    code = "import sys, rollyard; assert 'torch' not in sys.modules; print(rollyard.train.__module__, rollyard.Run.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["rollyard.api", "Run"]


def test_trl_hooks_get_the_whole_batch_in_one_call_and_combine_by_weight():
    from rollyard.reward.dispatcher import RewardDispatcher
    from rollyard.types import Sample

    def sample(i: int, group: str, text: str) -> Sample:
        return Sample(id=f"{group}#{i}", request_id=group, prompt_ids=[1], completion_ids=[ord(c) for c in text] + [0],
                      logprobs=[], versions=[0], finish_reason="stop", meta={"prompt": "q?"})

    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    samples = [sample(0, "g1", "aa"), sample(1, "g1", "a"), sample(2, "g1", ""), sample(0, "g2", "b"),
               sample(1, "g2", "abc")]
    hooks = ["ecosystem_rewards:group_size", "ecosystem_rewards:length"]
    with RewardDispatcher(hooks, weights=[1.0, 0.5], num_workers=2, decode=decode, eos_token_id=[0]) as d:
        assert d.forms == ["trl", "sample"] and d.names == ["group_size", "length"]
        d.score(samples)
        for s in samples:
            assert s.reward_parts[0] == 5.0  # the step's whole batch was one call, as TRL calls it
            assert s.reward_parts[1] == len(decode(s.completion_ids[:-1]))
            assert s.reward_flag is None and s.reward == pytest.approx(5.0 + 0.5 * s.reward_parts[1])
    # A raise flags the whole batch; that hook counts 0, the others still score.
    with RewardDispatcher(["ecosystem_rewards:length", "ecosystem_rewards:fails_on_b"], weights=[1.0, 2.0],
                          num_workers=1, decode=decode, eos_token_id=[0]) as d:
        d.score(samples)
    assert all(s.reward_flag.startswith("error: hook 1: ValueError: saw b") for s in samples)
    assert [s.reward for s in samples] == pytest.approx([2.0, 1.0, 0.0, 1.0, 3.0])


def test_summary_json_is_strict_json():
    text = rundir.strict_json({"eval_after": float("nan"), "xs": [1.0, float("inf")], "n": 3})
    assert no_nan(text) == {"eval_after": None, "xs": [1.0, None], "n": 3}


def test_chat_rows_and_nested_fields_in_the_loader(tmp_path):
    from rollyard.tasks.dataset import load_prompts

    f = tmp_path / "chat.jsonl"
    good = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
            "reward_model": {"ground_truth": "4"}}
    f.write_text(json.dumps(good) + "\n")
    [p] = load_prompts(f, fields={"truth": "reward_model.ground_truth"})
    assert p.messages == good["prompt"] and p.text == "" and p.meta["truth"] == "4"
    for bad, rule in [({"prompt": []}, "empty message list"),
                      ({"prompt": [{"role": "user"}]}, r"message 0 is \{'role': 'user'\}, expected"),
                      ({"prompt": [{"role": "user", "content": "x"}]}, r"no 'reward_model.ground_truth' field")]:
        f.write_text(json.dumps(bad) + "\n")
        with pytest.raises(DataError, match=rf"chat\.jsonl:1: .*{rule}"):
            load_prompts(f, fields={"truth": "reward_model.ground_truth"})
