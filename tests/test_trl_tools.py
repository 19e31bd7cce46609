"""A TRL user's tools run unchanged (issue 47, item 1): any return value goes back as TRL's loop sends it
(``str(value)``, a list of content blocks as it is), a tool that raises becomes TRL's ``{'error': ...}`` turn
and a failed call, schemas are transformers' ``get_json_schema``. A TRL GRPO script with ``tools=`` running with
only its import line changed: tests/test_trl_script.py."""

from __future__ import annotations

import pytest
import tool_chat
import trl_tools
from transformers.utils import get_json_schema

from rollyard.env import template, tools
from rollyard.env.executor import Job, ToolExecutor
from rollyard.env.loop import Toolbox, generate
from rollyard.reward.hooks import MESSAGES_KEY
from rollyard.rollout.engine import RolloutEngine
from rollyard.types import Request

DOCUMENTED = ["add", "multiply", "get_current_temperature", "get_weather", "divide", "describe", "async_add"]


def test_trls_documented_tools_get_transformers_schemas_and_go_back_as_trl_sends_them():
    specs = tools.tool_specs([f"trl_tools:{n}" for n in DOCUMENTED])
    assert specs[0].schema == {"type": "function", "function": {
        "name": "add", "description": "Adds two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first integer."},
                                                         "b": {"type": "integer", "description": "The second integer."}},
                       "required": ["a", "b"]},
        "return": {"type": "integer", "description": "The sum of the two integers."}}}
    for spec in specs:  # the schema TRL renders into the prompt: transformers' own, for every documented form
        assert spec.schema == get_json_schema(getattr(trl_tools, spec.name)), spec.name
    calls = [("add", {"a": 2, "b": 3}), ("multiply", {"a": 2, "b": 1.5}),
             ("get_current_temperature", {"location": "Paris, France", "unit": "celsius"}),
             ("get_weather", {"city": "Paris"}), ("divide", {"a": 1, "b": 0}), ("describe", {"topic": "x"}),
             ("async_add", {"a": 4, "b": 5})]
    with ToolExecutor(specs, num_workers=1, timeout_s=10.0) as ex:
        jobs = ex.run([Job(i, "call", f"s{i}", name, args) for i, (name, args) in enumerate(calls)])
        got = {j.name: (j.status, j.value) for j in jobs}
        assert got["add"] == ("ok", "5") and got["multiply"] == ("ok", "3.0")
        assert got["get_current_temperature"] == ("ok", "22.0")
        assert got["get_weather"] == ("ok", "{'city': 'Paris', 'sky': 'clear', 'temperature': 21}")
        assert got["describe"] == ("ok", [{"type": "text", "text": "about x"}])  # content blocks pass through
        assert got["async_add"] == ("ok", "9")  # an async tool is awaited
        assert got["divide"][0] == "error"
        assert tools.error_content(got["divide"][1]) == "{'error': 'division by zero'}"  # TRL: {"error": str(e)}
        assert ex.stats["calls"] == 7 and ex.stats["errors"] == 1


def test_error_content_is_trls_error_dict_for_every_failure_the_executor_reports():
    assert tools.error_content("KeyError: 'x'") == "{'error': \"'x'\"}"
    assert tools.error_content("TimeoutError: no answer within 1s (the worker was killed)") == \
        "{'error': 'no answer within 1s (the worker was killed)'}"
    assert tools.error_content("ValueError: ") == "{'error': ''}"
    assert tools.error_content("not an exception line") == "{'error': 'not an exception line'}"


@pytest.fixture(scope="module")
def taught():
    tok = tool_chat.tokenizer()
    schemas = [s.schema for s in tools.tool_specs(["tool_fns:add"])]  # the schema the model was taught with
    return tok, schemas, tool_chat.taught_model(tok, schemas)


def _rollout(taught, path: str):
    tok, schemas, model = taught
    specs = tools.tool_specs([path])
    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, temperature=0.0)
    prompt = tool_chat.conversation(tok, schemas)[0]
    with ToolExecutor(specs, num_workers=1) as ex:
        req = Request("q0", prompt, n=2, max_new_tokens=100, meta={MESSAGES_KEY: tool_chat.QUESTION})
        return generate(engine, [req], Toolbox(tok, schemas, ex, 3))


def test_an_int_returning_tool_gives_the_trajectory_a_string_one_gives(taught):
    tok, schemas, _ = taught
    samples, _, metrics, _ = _rollout(taught, "trl_tools:add")  # -> int, returns 5
    prompt, turn1, tool, turn2 = tool_chat.conversation(tok, schemas, "5")
    assert [s.completion_ids for s in samples] == [turn1 + tool + turn2] * 2
    assert metrics["tools/calls"] == 2 and metrics["tools/errors"] == 0


def test_a_raising_tool_is_trls_error_turn_and_a_failed_call(taught):
    tok, schemas, _ = taught
    samples, _, metrics, _ = _rollout(taught, "trl_tools_down:add")
    _, turn1, _, _ = tool_chat.conversation(tok, schemas)
    error = template.turn_tokens(tok, [("add", "{'error': 'the adder service is down'}")], "<|im_end|>")
    for s in samples:
        assert s.completion_ids[:len(turn1) + len(error)] == turn1 + error  # the model reads TRL's error turn
        assert s.completion_mask[len(turn1):len(turn1) + len(error)] == [0] * len(error)
    assert metrics["tools/calls"] == 2 and metrics["tools/errors"] == 2  # each counted as a failed call
