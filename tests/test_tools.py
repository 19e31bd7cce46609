"""Tools and multi-turn rollouts (issue 37): schemas, parsing, the chat template's tool turn, isolated
tool workers, the multi-turn loop over the real engine, and the trainer keeping tool tokens out of the loss."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import tool_chat
import torch

from rollyard.config import ConfigError, RunConfig
from rollyard.env import setup, template, tools
from rollyard.env.executor import Job, ToolExecutor
from rollyard.env.loop import MultiTurn, Toolbox, busy_intervals, generate
from rollyard.reward.hooks import MESSAGES_KEY
from rollyard.rollout.engine import Engine, RolloutEngine
from rollyard.trainer.trainer import Trainer
from rollyard.types import Request, WeightUpdate

ADD_SCHEMA = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first addend"},
                                                     "b": {"type": "integer", "description": "the second addend"}},
                   "required": ["a", "b"]},
    "return": {"type": "string"}}}


# ------------------------------------------------------------------------------------ start-up checks
def test_a_tool_schema_is_what_trl_builds_from_hints_and_docstring():
    (spec,) = tools.tool_specs(["tool_fns:add"])
    assert spec.name == "add" and spec.schema == ADD_SCHEMA
    target, specs, has_reward = tools.environment_specs("tool_fns:Counter")
    assert target == ("module", "tool_fns", "Counter") and has_reward
    assert [s.name for s in specs] == ["increment"]  # reset / get_reward are not tools
    assert "self" not in specs[0].schema["function"]["parameters"]["properties"]


@pytest.mark.parametrize("cfg, says", [
    ({"functions": ["tool_fns:no_hints"]}, "missing a type hint"),
    ({"functions": ["tool_fns:no_docstring"]}, "no docstring"),
    ({"functions": ["tool_fns:nothing_here"]}, "cannot be imported"),
    ({"functions": ["no_colon"]}, "malformed"),
    ({"functions": ["tool_fns:Counter"]}, "not a function"),
    ({"functions": ["tool_fns:add", "tool_fns:add"]}, "given twice"),
    ({"environment": "tool_fns:NoReset"}, "has no reset() method"),
    ({"environment": "tool_fns:add"}, "expected a class"),
    ({"environment": "tool_fns:Counter", "functions": ["tool_fns:add"]}, "both set"),
])
def test_bad_tools_are_one_line_errors_naming_the_rule(cfg, says):
    with pytest.raises(ConfigError) as e:
        setup.specs(RunConfig(tools=cfg))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_chat_template_without_tool_support_is_refused():
    tok = tool_chat.tokenizer()
    template.check_template(tok, [ADD_SCHEMA])  # the tool template passes
    tok.chat_template = tool_chat.PLAIN_CHAT
    with pytest.raises(ConfigError, match="no tool support: it lacks the tools' schemas in the prompt, the <tool_call> format;"):
        template.check_template(tok, [ADD_SCHEMA])
    tok.chat_template = None
    with pytest.raises(ConfigError, match="tools need a chat template"):
        template.check_template(tok, [ADD_SCHEMA])


# SmolLM2-135M-Instruct's own chat template (its tokenizer_config): ChatML, no tools, no tool_call format
SMOLLM2_CHAT = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
                "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SMOLLM2_TOOLS = str(Path(__file__).resolve().parents[1] / "examples" / "smollm2_tools.jinja")


def test_smollm2s_template_is_refused_for_tools_and_the_shipped_override_makes_it_usable():
    """SmolLM2's template renders no tools: refused in one line that names data.chat_template. With
    data.chat_template=examples/smollm2_tools.jinja the run's tokenizer gets a template that passes the check,
    renders a chat without tools exactly as SmolLM2's own, and puts the calls' JSON schema in the system turn."""
    tok = tool_chat.tokenizer()  # ChatML specials, as SmolLM2's tokenizer
    tok.chat_template = SMOLLM2_CHAT
    with pytest.raises(ConfigError, match="no tool support.*set data.chat_template") as e:
        template.check_template(tok, [ADD_SCHEMA])
    assert "\n" not in str(e.value)
    plain = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}]
    own = tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    setup.chat_template(RunConfig(data={"chat_template": SMOLLM2_TOOLS}, tools={"functions": ["tool_fns:add"]}), tok)
    template.check_template(tok, [ADD_SCHEMA])
    assert tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == own
    prompt = tok.decode(template.prompt_with_tools(tok, tool_chat.QUESTION, [ADD_SCHEMA]))
    assert '"name": "add"' in prompt and "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    import importlib.util  # the example's demonstrations split where this template's tool turn is
    spec = importlib.util.spec_from_file_location("smollm2_tools", SMOLLM2_TOOLS.replace(".jinja", ".py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    head, tail = template.tool_turn_bounds(tok, "<|im_end|>")
    assert (example.TOOL_HEAD, example.TOOL_TAIL) == (head, tail)
    assert template.demo_turns(example.demo("2+3", "5"), head, tail) == [
        ('<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call><|im_end|>', True),
        (f"{head}5{tail}", False), ("5", True)]
    other = tool_chat.tokenizer()  # a run without tools keeps the tokenizer's own template
    setup.chat_template(RunConfig(data={"chat_template": SMOLLM2_TOOLS}), other)
    assert other.chat_template == tool_chat.TOOL_CHAT


def test_a_chat_demo_for_sft_is_the_multi_turn_rollouts_sequence_and_mask():
    """A chat dataset's demonstration (call, the template's tool turn, the answer) is, for the warm start, the
    prompt with the tools' schemas and token for token the trajectory the loop builds, tool turn masked."""
    from rollyard import sft
    from rollyard.tasks.base import Prompt

    tok = tool_chat.tokenizer()
    cfg = RunConfig(tools={"functions": ["tool_fns:add"]})
    setup.chat_template(cfg, tok)  # keeps the tokenizer's template (it has tool support)
    tools_ = sft.tool_demos(cfg, tok)
    prompt, turn1, tool, turn2 = tool_chat.conversation(tok, [ADD_SCHEMA])
    demo = f"{tool_chat.CALL}<|im_end|>{tools_.head}5{tools_.tail}The answer is 5."
    p = Prompt("q", tok.apply_chat_template(tool_chat.QUESTION, tokenize=False, add_generation_prompt=True),
               {"answer": "5"}, demo=demo, messages=tool_chat.QUESTION)
    ((ids, comp, mask),) = sft.demos([p], tok, tools_)
    assert ids == prompt and comp == turn1 + tool + turn2
    assert mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)  # the loop's completion_mask
    ((plain_ids, plain, plain_mask),) = sft.demos([p], tok)  # a run without tools: the rendered text, all trained
    assert plain_ids != prompt and plain_mask == [1] * len(plain)


def test_tool_calls_are_parsed_and_a_malformed_one_is_an_error_for_the_model():
    text = ('x <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> y '
            '<tool_call>{"name": "nap", "arguments": "{\\"seconds\\": 0}"}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1,}</tool_call>'
            '<tool_call>["add"]</tool_call><tool_call>{"name": "add", "arguments": 3}</tool_call>'
            '<tool_call>{"name": "cut')
    calls = template.parse_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("add", {"a": 1, "b": 2}), ("nap", {"seconds": 0})]
    assert [c.error is not None for c in calls] == [False, False, True, True, True, True]
    assert "not valid JSON" in calls[2].error and '"name": <tool>' in calls[3].error
    assert template.parse_calls("no calls here") == []


# ---------------------------------------------------------------------------------- isolated workers
def test_tool_failures_are_that_calls_error_and_counted_never_the_runs():
    specs = tools.tool_specs(["tool_fns:add", "tool_fns:nap", "tool_fns:die", "tool_fns:number", "tool_fns:divide"])
    with ToolExecutor(specs, num_workers=2, timeout_s=1.0) as ex:
        jobs = ex.run([Job(1, "call", "s1", "add", {"a": 2, "b": 3}), Job(2, "call", "s2", "nap", {"seconds": 30}),
                       Job(3, "call", "s3", "die", {}), Job(4, "call", "s4", "number", {}),
                       Job(5, "call", "s5", "divide", {"a": 1, "b": 0}), Job(6, "call", "s6", "nope", {}),
                       Job(7, "call", "s7", "add", {"a": 1})])
        got = {j.key: (j.status, str(j.value)) for j in jobs}
        assert got[1] == ("ok", "5")
        assert got[2][0] == "error" and got[2][1].startswith("TimeoutError") and jobs[1].seconds < 10
        assert got[3] == ("error", "RuntimeError: the tool's worker died (exit code 3)")
        assert got[4] == ("ok", "7")  # a non-string output goes back as str(value), as TRL sends it
        assert got[5][1].startswith("ZeroDivisionError") and got[6][1].startswith("LookupError: unknown tool 'nope'")
        assert "missing 1 required positional argument" in got[7][1]
        assert ex.stats == {"calls": 7, "errors": 5, "timeouts": 1, "crashes": 1, "cut": 0, "printed_bytes": 0}
        # the replaced workers serve the next calls
        assert [j.value for j in ex.run([Job(8, "call", "s8", "add", {"a": 4, "b": 5}),
                                         Job(9, "call", "s9", "add", {"a": 1, "b": 1})])] == ["9", "2"]


def test_tool_workers_are_isolated_by_memory_cpu_and_working_directory(tmp_path):
    specs = tools.tool_specs(["tool_fns:hog", "tool_fns:spin", "tool_fns:where"])
    with ToolExecutor(specs, num_workers=1, timeout_s=20.0, memory_mb=300, cpu_s=1.0) as ex:
        (mem,) = ex.run([Job(1, "call", "s", "hog", {"mb": 600})])
        assert mem.status == "error" and mem.value.startswith("MemoryError")
        (cpu,) = ex.run([Job(2, "call", "s", "spin", {"seconds": 5.0})])
        assert cpu.status == "error" and "SIGXCPU" in cpu.value and ex.stats["crashes"] == 1
        (cwd,) = ex.run([Job(3, "call", "s", "where", {})])
        assert cwd.value.startswith(ex._workdir) and cwd.value != str(tmp_path)


def test_an_environment_instance_per_sample_keeps_its_state_and_reward():
    target, specs, _ = tools.environment_specs("tool_fns:Counter")
    with ToolExecutor(specs, target, num_workers=2, timeout_s=5.0) as ex:
        assert [j.value for j in ex.run([Job(0, "reset", "a", args={"target": 2}), Job(1, "reset", "b")])] \
            == ["reach 2", "reach 3"]
        ex.run([Job(2, "call", "a", "increment", {"by": 1}), Job(3, "call", "b", "increment", {"by": 3})])
        assert ex.run([Job(4, "call", "a", "increment", {"by": 1})])[0].value == "2"  # a's own counter
        assert [j.value for j in ex.run([Job(5, "reward", "a"), Job(6, "reward", "b")])] == [1.0, 1.0]
        lost = ex.run([Job(7, "call", "a", "increment", {"by": 1})])[0]  # dropped after its reward
        assert lost.status == "error" and "environment lost" in lost.value


# -------------------------------------------------------------------------------- the multi-turn loop
@pytest.fixture(scope="module")
def taught():
    tok = tool_chat.tokenizer()
    specs = tools.tool_specs(["tool_fns:add"])
    schemas = [s.schema for s in specs]
    return tok, specs, schemas, tool_chat.taught_model(tok, schemas, heads=2, head_dim=64)  # vLLM can run it too


def _rollout(taught, max_iterations=3, n=2, max_new_tokens=100):
    tok, specs, schemas, model = taught
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, temperature=0.0)
    prompt = tool_chat.conversation(tok, schemas)[0]
    with ToolExecutor(specs, num_workers=1) as ex:
        req = Request("q0", prompt, n=n, max_new_tokens=max_new_tokens, meta={MESSAGES_KEY: tool_chat.QUESTION})
        return generate(engine, [req], Toolbox(tok, schemas, ex, max_iterations))


def test_a_multi_turn_sample_is_token_in_token_out_with_tool_tokens_masked(taught):
    tok, _, schemas, model = taught
    samples, rejected, metrics, busy = _rollout(taught)
    prompt, turn1, tool, turn2 = tool_chat.conversation(tok, schemas)
    assert not rejected and [s.id for s in samples] == ["q0#0", "q0#1"]
    for s in samples:
        # exactly the ids the model produced and read: its call, the tool's turn (add(2, 3) ran: "5"), its answer
        assert s.prompt_ids == prompt and s.completion_ids == turn1 + tool + turn2
        assert "<tool_response>\n5\n</tool_response>" in tok.decode(tool)
        assert s.completion_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
        assert s.finish_reason == "stop" and len(s.logprobs) == len(s.versions) == len(s.completion_ids)
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.completion_mask) if m == 0)
    assert metrics["tools/calls"] == 2 and metrics["tools/errors"] == 0 and metrics["tools/turns_mean"] == 1.0
    assert len(busy) >= 1 and all(b > a > 0 for a, b in busy)  # the tool role's wall-clock intervals
    # the sampling logprobs of the model's tokens are the trainer's (greedy: T = 1), recomputed over the context
    trainer = Trainer(copy.deepcopy(model), micro_batch_tokens=4096)
    (lp,) = trainer.logprobs(samples[:1])
    keep = torch.tensor(samples[0].completion_mask, dtype=torch.bool)
    assert torch.allclose(lp[keep], torch.tensor(samples[0].logprobs)[keep], atol=1e-4)


def test_the_vllm_backend_runs_the_same_multi_turn_rollout(taught):
    pytest.importorskip("vllm")
    from rollyard.rollout.vllm import VllmEngine

    tok, specs, schemas, model = taught
    prompt, turn1, tool, turn2 = tool_chat.conversation(tok, schemas)
    engine = VllmEngine(copy.deepcopy(model), eos_token_id=tok.eos_token_id, temperature=0.0, max_cache_tokens=4096)
    try:  # closed: vLLM's in-process engine holds a default process group until then (the suite's leak check)
        with ToolExecutor(specs, num_workers=1) as ex:
            req = Request("q0", prompt, n=2, max_new_tokens=100, meta={MESSAGES_KEY: tool_chat.QUESTION})
            samples, _, metrics, _ = generate(engine, [req], Toolbox(tok, schemas, ex, 3))
    finally:
        engine.close()
    assert [s.completion_ids == turn1 + tool + turn2 for s in samples] == [True, True]
    assert samples[0].completion_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    assert metrics["tools/calls"] == 2


def test_the_tool_turn_cap_ends_a_sample_without_running_its_call(taught):
    tok, _, schemas, _ = taught
    samples, _, metrics, busy = _rollout(taught, max_iterations=0, n=1)
    turn1 = tool_chat.conversation(tok, schemas)[1]
    assert samples[0].completion_ids == turn1 and samples[0].completion_mask == [1] * len(turn1)
    assert metrics["tools/calls"] == 0 and metrics["tools/truncated"] == 1 and busy == []


def test_the_token_budget_counts_tool_tokens(taught):
    tok, _, schemas, _ = taught
    _, turn1, tool, _ = tool_chat.conversation(tok, schemas)
    budget = len(turn1) + 3  # room for the call and 3 tokens of the tool's turn
    (s,), _, _, _ = _rollout(taught, n=1, max_new_tokens=budget)
    assert s.finish_reason == "length" and s.completion_ids == turn1 + tool[:3]


def test_the_trainer_keeps_tool_tokens_out_of_the_loss(taught):
    tok, _, schemas, model = taught
    samples, _, _, _ = _rollout(taught, n=1)
    s = samples[0]
    s.advantage = 1.0
    _, turn1, _, turn2 = tool_chat.conversation(tok, schemas)

    def grads(sample):
        trainer = Trainer(copy.deepcopy(model), micro_batch_tokens=4096)
        acc = trainer.accumulate_gradients([sample])
        return torch.cat([p.grad.flatten() for p in trainer.params]), acc

    g, acc = grads(s)
    assert acc["tokens"] == len(turn1) + len(turn2)  # the loss's denominator counts the model's tokens only
    assert float(acc["diff_max"]) < 1e-3  # the tool tokens' 0.0 placeholders are not in the logprob canary
    other = copy.deepcopy(s)  # a tool token's placeholder logprob is not read
    other.logprobs = [lp if m else -5.0 for lp, m in zip(s.logprobs, s.completion_mask)]
    assert torch.equal(grads(other)[0], g)
    unmasked = copy.deepcopy(s)  # without the mask the tool tokens would be trained on
    unmasked.completion_mask = None
    assert not torch.allclose(grads(unmasked)[0], g)


def test_the_tool_role_is_the_union_of_the_calls_intervals():
    jobs = [Job(k, "call", "s", started=a, seconds=d) for k, (a, d) in enumerate([(10.0, 2.0), (11.0, 0.5), (11.5, 1.0),
                                                                                  (20.0, 1.0), (0.0, 5.0)])]
    assert busy_intervals(jobs) == [(10.0, 12.5), (20.0, 21.0)]  # the last one never ran (started 0)


def test_an_environment_per_sample_serves_the_calls_and_its_reward_lands_in_meta(taught):
    tok, _, schemas, model = taught
    target, specs, has_reward = tools.environment_specs("tool_fns:Adder")
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, temperature=0.0)
    prompt, turn1, tool, turn2 = tool_chat.conversation(tok, schemas)
    with ToolExecutor(specs, target, num_workers=2) as ex:
        box = Toolbox(tok, [s.schema for s in specs], ex, 3, environment="Adder", env_reward=has_reward)
        req = Request("q0", prompt, n=2, max_new_tokens=100, meta={MESSAGES_KEY: tool_chat.QUESTION})
        samples, _, metrics, _ = generate(engine, [req], box)
    assert [s.completion_ids == turn1 + tool + turn2 for s in samples] == [True, True]
    assert [s.meta["env_reward"] for s in samples] == [1.0, 1.0] and metrics["tools/calls"] == 2


def test_new_weights_with_inflight_abort_end_every_trajectory_in_progress(taught):
    tok, specs, schemas, model = taught
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, temperature=0.0)
    prompt, turn1, _, _ = tool_chat.conversation(tok, schemas)
    with ToolExecutor(specs, num_workers=1) as ex:
        turns = MultiTurn(engine, Toolbox(tok, schemas, ex, 3))
        turns.submit([Request("q0", prompt, n=2, max_new_tokens=100, meta={MESSAGES_KEY: tool_chat.QUESTION})])
        for _ in range(5):  # six tokens into the first turn (the first step samples two: prefill, decode)
            assert turns.step() == []
        aborted = turns.load_weights(WeightUpdate(version=1, mode="inprocess"), inflight="abort")
        assert sorted(s.id for s in aborted) == ["q0#0", "q0#1"] and turns.idle
        assert all(s.finish_reason == "abort" and s.completion_ids == turn1[:6] for s in aborted)
        assert engine.version == 1


def test_abort_while_a_tool_runs_ends_the_trajectory_and_ignores_the_late_output(taught):
    tok, _, schemas, model = taught
    specs = tools.tool_specs(["tool_fns_slow:add"])  # 1.5 s per call
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, temperature=0.0)
    prompt, turn1, _, _ = tool_chat.conversation(tok, schemas)
    with ToolExecutor(specs, num_workers=1) as ex:
        turns = MultiTurn(engine, Toolbox(tok, schemas, ex, 3))
        turns.submit([Request("q0", prompt, n=1, max_new_tokens=100, meta={MESSAGES_KEY: tool_chat.QUESTION})])
        while not engine.idle:  # the first model turn, up to its tool call
            assert turns.step() == []
        assert ex.busy and not turns.idle and turns.num_active == 1 and engine.num_active == 0
        (s,) = turns.abort(["q0"])
        assert s.finish_reason == "abort" and s.completion_ids == turn1
        assert list(turns.results()) == [] and turns.idle  # the tool's late answer went to nobody
        assert engine.idle


def test_a_multi_turn_group_completes_at_keep_trajectories(taught):
    """``submit(keep=2)`` over 3 trajectories: the first 2 to end come out; the third is stopped (``surplus()``)."""
    tok, specs, schemas, model = taught
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, temperature=0.0)
    prompt, turn1, tool, turn2 = tool_chat.conversation(tok, schemas)
    with ToolExecutor(specs, num_workers=1) as ex:
        turns = MultiTurn(engine, Toolbox(tok, schemas, ex, 3))
        req = Request("q0", prompt, n=3, max_new_tokens=100, meta={MESSAGES_KEY: tool_chat.QUESTION})
        assert isinstance(turns, Engine) and turns.submit([req], keep=2) == [] and turns.busy
        out = list(turns.results())
        assert len(out) == 2 and all(s.completion_ids == turn1 + tool + turn2 for s in out)
        (cut,) = turns.surplus()
        assert cut.id not in {s.id for s in out} and turns.surplus() == []
        assert turns.idle and not turns.busy and engine.idle


def test_multi_turn_declares_the_engine_contract_it_delegates():
    """``MultiTurn`` is an ``Engine`` (``rollout/engine.py``'s Protocol) by its own methods: each member of the
    contract is defined on it (no ``__getattr__`` passing unknown names to the engine), as on ``RolloutEngine``."""
    members = [n for n in vars(Engine) if not n.startswith("_")]
    assert "__getattr__" not in vars(MultiTurn) and {"submit", "busy", "surplus", "score", "sleep"} <= set(members)
    for cls in (MultiTurn, RolloutEngine):
        assert [n for n in members if getattr(cls, n) is getattr(Engine, n)] == [], cls  # none left to the stub


# ---------------------------------------------------------------------------------- a run, end to end
SMALL = {"steps": 2, "checkpoint_every": 2, "progress": False, "sft": {"auto": False}, "log": {"plots": False},
         "rollout": {"prompts_per_step": 1, "samples_per_prompt": 2, "max_new_tokens": 80, "temperature": 0.0},
         "reward": {"num_workers": 1}, "tools": {"num_workers": 1}}


def _tool_latency_reaches_metrics_and_summary(run) -> None:
    """Every step's row has the tool calls' latency percentiles and the summary those over the run's calls."""
    called = [r for r in run.metrics if r.get("tools/calls", 0) > 0]  # async: a step may see no worker's item
    for row in run.metrics:
        p = [row[f"tools/latency_{q}_s"] for q in ("p50", "p90", "p99", "max")]
        assert (0 < p[0] <= p[1] <= p[2] <= p[3] < 30) if row in called else p == [0.0] * 4, row
    total = run.summary["tool_latency_s"]
    assert total["calls"] == sum(r["tools/calls"] for r in called) > 0
    assert total["max_s"] == max(r["tools/latency_max_s"] for r in called)
    assert min(r["tools/latency_p50_s"] for r in called) <= total["p50_s"] <= total["p90_s"] <= total["p99_s"]


def test_a_trl_tool_calling_script_runs_with_rollyard_train(taught, tmp_path):
    import json

    import tool_fns

    import rollyard

    tok, _, _, model = taught
    rows = [{"prompt": tool_chat.QUESTION, "answer": "5"}] * 4
    run = rollyard.train({**SMALL, "out_dir": str(tmp_path / "run")}, model=copy.deepcopy(model), tokenizer=tok,
                         dataset=rows, reward_funcs=[tool_fns.says_answer], tools=[tool_fns.add])
    assert run.config.tools.functions == ["tool_fns:add"]
    assert len(run.metrics) == 2
    for row in run.metrics:  # greedy: each sample calls add(2, 3), reads "5" and says so
        assert row["tools/calls"] == 2 and row["tools/errors"] == 0 and row["reward"] == 1.0
        assert row["time/tool"] > 0  # the tool role, timed on its own
    _tool_latency_reaches_metrics_and_summary(run)
    spans = [json.loads(line) for line in (run.run_dir / "spans.jsonl").read_text().splitlines()]
    assert {"rollout", "tool", "train"} <= {s["role"] for s in spans}
    # the ledger's tools edge: per call "add" + '{"a": 2, "b": 3}' out (3 + 16 B) and "5" back (1 B); 2 calls a step
    from rollyard.plan.review import review
    ledger = [json.loads(line) for line in (run.run_dir / "traffic.jsonl").read_text().splitlines()]
    assert [(r["bytes"], r["count"]) for r in ledger if r["edge"] == "tools"] == [(40, 2), (40, 2)]
    assert json.loads((run.run_dir / "run.json").read_text())["tools"] == ["tool_fns:add"]
    row = {t["edge"]: t for t in review(run.run_dir).traffic}["tools"]
    assert row["measured"] == 80 and row["status"] == "unpriced"  # counted by review; what a model sends has no formula


def test_an_environment_factory_run_logs_get_reward_under_the_class_name(taught, tmp_path):
    import tool_fns

    import rollyard

    tok, _, _, model = taught
    rows = [{"prompt": tool_chat.QUESTION, "answer": "5"}] * 4
    run = rollyard.train({**SMALL, "out_dir": str(tmp_path / "run"), "steps": 1}, model=copy.deepcopy(model),
                         tokenizer=tok, dataset=rows, reward_funcs=[tool_fns.says_answer],
                         environment_factory=tool_fns.Adder)
    assert run.config.tools.environment == "tool_fns:Adder"
    assert run.config.reward.hooks == ["tool_fns:says_answer", "rollyard.env.rewards:Adder"]
    (row,) = run.metrics  # each sample called its own Adder's add(2, 3) (get_reward 1) and said 5 (1)
    assert row["rewards/Adder/mean"] == 1.0 and row["rewards/says_answer/mean"] == 1.0 and row["reward"] == 2.0
    assert row["tools/calls"] == 2


@pytest.mark.parametrize("args, says", [
    (["tools.functions=[tool_fns:no_hints]"], "missing a type hint"),
    (["tools.functions=[tool_fns:add]", "rollout.scheduler=tail"], "tools with rollout.scheduler=tail"),
    (["tools.environment=tool_fns:NoReset"], "has no reset() method"),
    (["tools.functions=[tool_fns:add]"], "tools need a chat template"),  # the preset's tokenizer has none
    (["tools.functions=[tool_fns:add]", f"data.chat_template={SMOLLM2_CHAT!r}"], "no tool support"),
])
def test_bad_tool_settings_stop_the_cli_in_one_line(tmp_path, capsys, args, says):
    from rollyard.cli import main

    assert main(["train", f"out_dir={tmp_path / 'run'}", "steps=1", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("placement", ["async"])  # disaggregated runs the same rollout worker (passes too; ~35 s)
def test_ray_placements_run_tools_in_their_rollout_workers(taught, tmp_path, placement):
    import tool_fns

    import rollyard

    tok, _, _, model = taught
    rows = [{"prompt": tool_chat.QUESTION, "answer": "5"}] * 4
    by_file = f"{tool_fns.__file__}:add"  # the rollout actors import the tool by file (tests/ is not on their path)
    run = rollyard.train({**SMALL, "out_dir": str(tmp_path / "run"), "placement": placement, "max_staleness": 1},
                         model=copy.deepcopy(model), tokenizer=tok, dataset=rows,
                         reward_funcs=[tool_fns.says_answer], tools=[by_file])
    assert len(run.metrics) == 2
    assert sum(r.get("tools/calls", 0) for r in run.metrics) >= 4  # 2 samples x 2 steps, counted by the workers
    assert all(r["reward"] == 1.0 for r in run.metrics)  # each sample called add(2, 3) in a worker and said 5
    _tool_latency_reaches_metrics_and_summary(run)  # the workers ship each call's seconds; the driver takes percentiles
    spans = (run.run_dir / "spans.jsonl").read_text()
    assert '"role": "tool"' in spans


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_masked_tool_tokens_at_the_end_change_nothing_in_either_aggregation(taught, agg):
    """Causal attention: tokens after turn 1 cannot change its logprobs, so masked ones must not change
    the gradient either, whether the loss is a token mean or a per-sequence mean."""
    from rollyard.types import Sample

    tok, _, schemas, model = taught
    prompt, turn1, tool, _ = tool_chat.conversation(tok, schemas)
    lps = [-0.5] * len(turn1)

    def grad(completion, mask):
        s = Sample("q#0", "q", prompt, completion, lps + [0.0] * (len(completion) - len(turn1)),
                   [0] * len(completion), "stop", completion_mask=mask, advantage=1.0)
        trainer = Trainer(copy.deepcopy(model), micro_batch_tokens=4096, loss_agg=agg)
        trainer.accumulate_gradients([s])
        return torch.cat([p.grad.flatten() for p in trainer.params])

    alone = grad(turn1, None)
    with_tool = grad(turn1 + tool, [1] * len(turn1) + [0] * len(tool))
    assert torch.allclose(with_tool, alone, rtol=1e-5, atol=1e-7)
