"""Two-digit sums with a calculator tool, for SmolLM2-135M-Instruct (docs/tools.md).

    python examples/smollm2_tools.py OUT_DIR     # OUT_DIR/train.jsonl (2000) and OUT_DIR/eval.jsonl (64), with a demo column

The rows of ``examples/real_model/sums.py`` (same prompts, same disjoint held-out pairs), each with a ``demo``
column for the warm start that teaches the tool-call format (``data.fields={demo: demo}``): the model's call
``<tool_call>{"name": "calc", "arguments": {"expr": "27+82"}}</tool_call>``, its end of turn, the tool turn as
``examples/smollm2_tools.jinja`` renders it (masked out of the SFT loss, as out of the GRPO loss), and the
answer copied from it; :func:`answer_after_tools` is the reward of both arms. SmolLM2's own template has no tools: the run needs
``data.chat_template=examples/smollm2_tools.jinja`` (without it, tools stop the run at start-up in one line).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EOT = "<|im_end|>"  # SmolLM2's end of turn (its EOS)
# The tool turn examples/smollm2_tools.jinja renders after a model turn ends (env/template.tool_turn_bounds)
TOOL_HEAD, TOOL_TAIL = "\n<|im_start|>user\n<tool_response>\n", "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def answer_after_tools(completion: str, prompt: str, meta: dict) -> float:
    """1.0 when the last integer after the last tool response is the sum (the model's answer, never the tool's own
    output), else 0.0; without a tool turn, the last integer of the completion (``sums.py:last_integer_is_sum``).
    ``reward.hook=examples/smollm2_tools.py:answer_after_tools`` with ``reward.correctness=true``, in both arms."""
    found = re.findall(r"-?\d+", completion.rsplit("</tool_response>", 1)[-1])
    return float(bool(found) and found[-1] == str(meta["answer"]).strip())


def _sums():
    spec = importlib.util.spec_from_file_location("sums", HERE / "real_model" / "sums.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo(expr: str, answer: str) -> str:
    """The completion the warm start trains on (the tool turn in it is context only)."""
    call = json.dumps({"name": "calc", "arguments": {"expr": expr}})
    return f"<tool_call>{call}</tool_call>{EOT}{TOOL_HEAD}{answer}{TOOL_TAIL}{answer}"


def with_demos(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        a, b = r["id"].split("-")[1:]
        out.append({**r, "demo": demo(f"{a}+{b}", r["answer"])})
    return out


def write(out_dir: str | Path) -> tuple[Path, Path]:
    return _sums().write(out_dir, with_demos)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/smollm2_tools.py OUT_DIR")
    for p in write(sys.argv[1]):
        print(p)
