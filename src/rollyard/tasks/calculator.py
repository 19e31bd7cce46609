"""Calculator: ``"47*38="`` -> ``"1786"``, which the model may solve by calling a calculator tool.

Products of two ``digits``-digit numbers (default 2: ``10*10`` to ``99*99``, 8,100 problems, ~10% held out by a
fixed hash of the problem text). A ~0.5M-parameter character model cannot multiply two-digit numbers, but it can
copy: with ``tools=1`` (the default) the run gets the tool :func:`calc` (TRL's ``tools=[calc]``) and each
demonstration calls it and copies its output, one tool turn per sample::

    47*38=<tool_call>{"name": "calc", "arguments": {"expr": "47*38"}}</tool_call><eos><tool_response>1786</tool_response>1786<eos>
    |prompt|model turn (in the loss)                                                |tool turn (masked in RL)             |answer

``tools=0`` is the same task without the tool: the demonstrations answer directly (``47*38=1786<eos>``) and the
rollouts are single-turn, so the two runs differ only in the tool (``bench/tools.py`` runs both).

The tool turn is the chat template's (``TEMPLATE``, the run's tokenizer's when it has none: a built-in preset's
character tokenizer has no chat template). The verifier (:func:`rollyard.reward.verifiers.calculator`) reads the
answer after the last tool response, so an answer copied from the tool counts and the tool's own output does not.
"""

from __future__ import annotations

import ast
import random

from rollyard.tasks.base import Prompt, draw_problems

NAME = "calculator"
VERIFIER = "rollyard.reward.verifiers:calculator"
TOOLS = [f"{__name__}:calc"]  # the run's tools with tools=1 (import paths: the tool workers import them)
EVAL_BUCKETS = 10  # one bucket in ten is held out
RESPONSE = ("<tool_response>", "</tool_response>")  # the tool turn's tags, as TEMPLATE renders them

# Tools named in the prompt (only a chat prompt renders it; the built-in prompts are plain text), every model
# turn ends with EOS, a tool message is the bare output between the response tags, no generation prompt.
TEMPLATE = (
    "{%- if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}. "
    "Call: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\n{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}" + RESPONSE[0] + "{{ m.content }}" + RESPONSE[1] +
    "{%- elif m.role == 'assistant' %}{{ m.content }}<eos>{%- else %}{{ m.content }}{%- endif %}{%- endfor %}")

MAX_DIGITS = 12  # the tool refuses larger numbers (a model-written expression must not cost unbounded CPU)


def calc(expr: str) -> str:
    """Evaluate an integer arithmetic expression with +, - and * (parentheses allowed).

    Args:
        expr: the expression, e.g. "47*38"
    """
    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = value(node.left), value(node.right)
            if max(abs(a), abs(b)) >= 10 ** MAX_DIGITS:
                raise ValueError(f"numbers of more than {MAX_DIGITS} digits")
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        raise ValueError(f"only integers, +, - and * are allowed, got {ast.dump(node)[:60]}")

    if len(expr) > 200:
        raise ValueError(f"expression of {len(expr)} characters, at most 200")
    return str(value(ast.parse(expr.strip(), mode="eval").body))


def call_text(expr: str) -> str:
    """The model turn that calls the tool on ``expr`` (the JSON the chat template's ``<tool_call>`` holds)."""
    return f'<tool_call>{{"name": "calc", "arguments": {{"expr": "{expr}"}}}}</tool_call>'


def demo(expr: str, answer: str, tools: bool) -> str:
    """A correct completion: with the tool, its call, the tool turn and the copied answer; without, the answer."""
    if not tools:
        return answer
    return f"{call_text(expr)}<eos>{RESPONSE[0]}{answer}{RESPONSE[1]}{answer}"


def problems(digits: int = 2) -> list[tuple[str, str]]:
    """Every ``(expression, product)`` pair of the task, in a fixed order."""
    if not 1 <= digits <= 4:
        raise ValueError(f"calculator: digits must be in 1..4, got {digits}")
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits
    return [(f"{a}*{b}", str(a * b)) for a in range(lo, hi) for b in range(lo, hi)]


def generate(split: str, n: int, seed: int, digits: int = 2, tools: int = 1) -> list[Prompt]:
    """``n`` prompts; ``tools`` (1 or 0) decides the demonstrations and whether the run gets :func:`calc`."""
    if tools not in (0, 1):
        raise ValueError(f"calculator: tools must be 1 (the run gets the calc tool) or 0 (no tool), got {tools!r}")
    rng = random.Random(f"{NAME}/{split}/{seed}/{digits}")
    drawn = draw_problems(problems(digits), split, n, EVAL_BUCKETS, rng,
                          f"calculator: digits={digits} leaves the {split} split empty; raise digits")
    return [Prompt(id=f"{NAME}/{split}/{i}", text=f"{expr}=", meta={"task": NAME, "answer": answer},
                   demo=demo(expr, answer, bool(tools))) for i, (expr, answer) in enumerate(drawn)]
