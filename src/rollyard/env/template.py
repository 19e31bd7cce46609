"""The chat template's side of tool calling: the prompt with the tools in it, the model's tool calls,
the tool turn's tokens.

Token-in/token-out: the model's tokens are never re-tokenized. Only what the environment says is
tokenized here, as the *suffix* the chat template renders after an assistant turn: the text between
the assistant message's end and the next assistant turn's start, i.e. (Qwen2/Hermes templates)
``\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``.
It is found by rendering a probe conversation with and without the tool messages and taking the
difference, so it is whatever the template says, not a format written down here.

Tool calls are read in the one format chat templates of this family ask for (Qwen2, Qwen2.5,
Qwen3, Hermes, and the test template): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one per call, several per turn allowed. A template that renders neither the tools nor a tool
message, or never mentions ``<tool_call>``, cannot carry a tool conversation: ConfigError at start-up.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from rollyard.config import ConfigError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.S)
_PROBE_USER, _PROBE_REPLY, _PROBE_OUT = "probe question 7", "probe reply 7", "probe tool output 7"


@dataclass(frozen=True)
class Call:
    """A parsed tool call: ``name`` and ``arguments``, or ``error`` (the model's formatting mistake)."""

    name: str = ""
    arguments: dict | None = None
    error: str | None = None


def parse_calls(text: str) -> list[Call]:
    """Every ``<tool_call>`` block of one assistant turn, in order; a block that is not
    ``{"name": str, "arguments": object}`` JSON comes back as a Call with ``error`` (told to the model)."""
    out = []
    for m in _CALL.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            out.append(Call(error=f"tool call is not valid JSON ({e.msg} at char {e.pos}): {body[:200]!r}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.append(Call(error=f'tool call must be {{"name": <tool>, "arguments": {{...}}}}, got {body[:200]!r}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            out.append(Call(error=f"tool call {obj['name']!r}: arguments must be a JSON object, got {args!r}"[:300]))
            continue
        out.append(Call(obj["name"], args))
    return out


def _render(tokenizer, messages, tools=None, gen=False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)


def check_template(tokenizer, schemas: list[dict]) -> None:
    """ConfigError (one line) unless the tokenizer's chat template can hold a tool conversation."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError("tools need a chat template (the tools and the tool turns are rendered by it), but the "
                          "tokenizer has none; use a chat model's tokenizer or set data.chat_template (a Jinja template "
                          "or .jinja file)")
    name = schemas[0]["function"]["name"]
    try:
        prompt = _render(tokenizer, [{"role": "user", "content": _PROBE_USER}], schemas, gen=True)
        suffix = tool_suffix(tokenizer, [(name, _PROBE_OUT)])
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a template error is the user's input
        raise ConfigError(f"the chat template fails on a tool conversation ({type(e).__name__}: {e}); use a "
                          f"template with tool support (e.g. Qwen2's)") from None
    missing = [what for what, ok in (("the tools' schemas in the prompt", name in prompt),
                                     ("tool messages", _PROBE_OUT in suffix),
                                     ("the <tool_call> format", OPEN in template)) if not ok]
    if missing:
        raise ConfigError(f"the chat template has no tool support: it lacks {', '.join(missing)}; set "
                          f"data.chat_template to a template with tool support (Qwen2/Hermes style: tools in the "
                          f"system turn, <tool_call>{{json}}</tool_call>, 'tool' role messages; SmolLM2: "
                          f"examples/smollm2_tools.jinja)")


def tool_suffix(tokenizer, results: list[tuple[str, str]]) -> str:
    """The text after an assistant turn's content that the template renders for tool messages
    ``[(name, content)]``, up to and including the next assistant turn's start."""
    head = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
    tools = [{"role": "tool", "name": n, "content": c} for n, c in results]
    full = _render(tokenizer, head + tools, gen=True)
    cut = full.rfind(_PROBE_REPLY)
    if cut < 0:
        raise ConfigError("the chat template drops the assistant's content from the conversation; a tool turn "
                          "cannot follow it; use a template with tool support")
    return full[cut + len(_PROBE_REPLY):]


def turn_tokens(tokenizer, results: list[tuple[str, str]], ended_with: str) -> list[int]:
    """Token ids of the tool turn after a model turn whose last token was ``ended_with`` (its text):
    the template's suffix without the end-of-turn text the model already produced."""
    suffix = tool_suffix(tokenizer, results)
    if ended_with and suffix.startswith(ended_with):
        suffix = suffix[len(ended_with):]
    return tokenizer(suffix, add_special_tokens=False)["input_ids"]


def tool_turn_bounds(tokenizer, ended_with: str) -> tuple[str, str]:
    """``(head, tail)``: the text of a tool turn before and after the tool's output, as :func:`turn_tokens` renders
    it after a model turn whose last token was ``ended_with`` (calculator: ``<tool_response>``, ``</tool_response>``)."""
    suffix = tool_suffix(tokenizer, [("probe", _PROBE_OUT)])
    if ended_with and suffix.startswith(ended_with):
        suffix = suffix[len(ended_with):]
    cut = suffix.find(_PROBE_OUT)
    if cut < 0:
        raise ConfigError("the chat template does not render a tool message's content; use a template with tool "
                          "support (Qwen2/Hermes style: 'tool' role messages)")
    return suffix[:cut], suffix[cut + len(_PROBE_OUT):]


def demo_turns(text: str, head: str, tail: str) -> list[tuple[str, bool]]:
    """A demonstration split into ``(text, is the model's)`` pieces: each tool turn (``head`` ... ``tail``, the
    template's rendering of tool messages, as :func:`tool_turn_bounds` gives them) is the environment's, the rest
    the model's. Only a whole tool turn counts; a ``head`` without its ``tail`` stays the model's text."""
    out: list[tuple[str, bool]] = []
    pos = 0
    while head and tail:
        start = text.find(head, pos)
        end = text.find(tail, start + len(head)) if start >= 0 else -1
        if end < 0:
            break
        end += len(tail)
        if start > pos:
            out.append((text[pos:start], True))
        out.append((text[start:end], False))
        pos = end
    if pos < len(text):
        out.append((text[pos:], True))
    return out


def prompt_with_tools(tokenizer, messages: list[dict], schemas: list[dict]) -> list[int]:
    """The chat prompt's token ids with the tools' schemas rendered in, ending at the assistant turn."""
    return tokenizer(_render(tokenizer, messages, schemas, gen=True), add_special_tokens=False)["input_ids"]
