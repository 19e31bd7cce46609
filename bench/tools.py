"""Held-out accuracy with a calculator tool vs without, on the same tiny chat model and budget (issue 37).

Task: "What is A times B?" for two-digit A, B (a tenth of the pairs held out by a fixed hash). Both arms
start from the same random tiny Qwen2 (BPE tokenizer trained here, a Qwen2-style chat template with tool
support), get the same warm-start budget (``--sft-steps`` supervised steps on demonstrations) and the
same GRPO budget (``--rl-steps`` steps of ``rollyard.train``), then greedy held-out accuracy:

- ``tools``: demonstrations call ``multiply(a, b)`` and copy its output (the warm start teaches the
  tool-call format; the tool turn is masked out of the SFT loss as it is out of the RL loss); RL and
  eval run multi-turn with the tool in isolated workers;
- ``no tools``: demonstrations answer directly; RL and eval single-turn.

    .venv/bin/python bench/tools.py                       # defaults below, ~10-20 min on 2 busy cores
    .venv/bin/python bench/tools.py --sft-steps 100 --rl-steps 4 --eval 40   # a smoke run

Accuracy: the final answer "The answer is N." with N = A x B. Not a test: it prints a table.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}. "
    "Call: <tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return str(a * b)


def correct(prompts, completions, answer, **kwargs):
    """TRL reward: 1 when the completion's last words state the product."""
    return [float(c[0]["content"].rstrip().endswith(f"The answer is {a}.")) for c, a in zip(completions, answer)]


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} times {b}?"}]


def split() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    held = [p for p in pairs if hashlib.sha256(f"{p}".encode()).digest()[0] < 26]  # ~10%
    train = [p for p in pairs if p not in set(held)]
    return train, held


def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} times {b}? The answer is {a * b}. <tool_call>{{\"name\": \"multiply\", \"arguments\": "
              f"{{\"a\": {a}, \"b\": {b}}}}}</tool_call> <tool_response> Tools: system user assistant"
              for a in range(10, 100, 7) for b in range(10, 100, 11)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    with tempfile.TemporaryDirectory() as d:  # read back as a run reads it (beside a Qwen2 config)
        fast.save_pretrained(d)
        Qwen2Config(vocab_size=len(fast)).save_pretrained(d)
        return AutoTokenizer.from_pretrained(d)


def demo(tok, schemas, a: int, b: int, tools: bool) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, loss mask) of one demonstration."""
    from rollyard.env import template

    eot = tok.convert_tokens_to_ids("<|im_end|>")
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    answer = ids(f"The answer is {a * b}.") + [eot]
    if not tools:
        prompt = ids(tok.apply_chat_template(question(a, b), tokenize=False, add_generation_prompt=True))
        return prompt, answer, [1] * len(answer)
    prompt = template.prompt_with_tools(tok, question(a, b), schemas)
    call = ids(f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>') + [eot]
    turn = template.turn_tokens(tok, [("multiply", str(a * b))], "<|im_end|>")
    return prompt, call + turn + answer, [1] * len(call) + [0] * len(turn) + [1] * len(answer)


def warm_start(model, tok, schemas, train, tools: bool, steps: int, batch: int, lr: float, seed: int) -> None:
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):  # one right-padded batch per step
        rows = [demo(tok, schemas, a, b, tools) for a, b in rng.sample(train, batch)]
        width = max(len(p) + len(c) for p, c, _ in rows)
        x = torch.full((batch, width), tok.pad_token_id)
        labels = torch.full((batch, width), -100)
        attn = torch.zeros((batch, width), dtype=torch.long)
        for i, (p, c, m) in enumerate(rows):
            x[i, :len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p):len(p) + len(c)] = torch.tensor([t if k else -100 for t, k in zip(c, m)])
            attn[i, :len(p) + len(c)] = 1
        loss = model(input_ids=x, attention_mask=attn, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def evaluate(model, tok, schemas, held, tools: bool) -> float:
    from rollyard.env.executor import ToolExecutor
    from rollyard.env.loop import Toolbox, generate
    from rollyard.env.tools import tool_specs
    from rollyard.reward.hooks import MESSAGES_KEY
    from rollyard.rollout.engine import RolloutEngine
    from rollyard.types import Request

    engine = RolloutEngine(model, eos_token_id=tok.eos_token_id, temperature=0.0)
    reqs = [Request(f"e{i}", demo(tok, schemas, a, b, tools)[0], 1, 128, {MESSAGES_KEY: question(a, b)})
            for i, (a, b) in enumerate(held)]
    if tools:
        with ToolExecutor(tool_specs([f"{Path(__file__).resolve()}:multiply"]), num_workers=1) as ex:
            samples = generate(engine, reqs, Toolbox(tok, schemas, ex, 2)).samples
    else:
        samples = engine.generate(reqs)[0]
    texts = [tok.decode(s.completion_ids, skip_special_tokens=True) for s in samples]
    return sum(t.rstrip().endswith(f"The answer is {a * b}.") for t, (a, b) in zip(texts, held)) / len(held)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--sft-batch", type=int, default=16)
    ap.add_argument("--rl-steps", type=int, default=15)
    ap.add_argument("--eval", type=int, default=100, help="held-out problems evaluated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench-tools")
    ap.add_argument("--arms", nargs="+", choices=["tools", "no-tools"], default=["tools", "no-tools"])
    args = ap.parse_args(argv)

    import rollyard
    from rollyard.env.tools import tool_specs

    schemas = [s.schema for s in tool_specs([f"{Path(__file__).resolve()}:multiply"])]
    train, held = split()
    held = random.Random(1).sample(held, min(args.eval, len(held)))
    tok = tokenizer()
    ids = tok.convert_tokens_to_ids(SPECIALS)
    torch.manual_seed(args.seed)
    base = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=ids[2],
        pad_token_id=ids[0]), dtype=torch.float32)
    rows = [{"prompt": question(a, b), "answer": str(a * b)} for a, b in train]
    results = []
    for tools in [arm == "tools" for arm in args.arms]:
        name = "tools" if tools else "no tools"
        model = copy.deepcopy(base)
        t0 = time.time()
        warm_start(model, tok, schemas, train, tools, args.sft_steps, args.sft_batch, 3e-3, args.seed)
        sft_s, before = time.time() - t0, evaluate(model, tok, schemas, held, tools)
        cfg = {"out_dir": f"{args.out}/{name.replace(' ', '-')}-{int(time.time())}", "steps": args.rl_steps,
               "progress": False, "sft": {"auto": False}, "log": {"plots": False}, "seed": args.seed,
               "trainer": {"lr": 2e-4}, "checkpoint_every": 1000,
               "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 128, "temperature": 1.0},
               "reward": {"num_workers": 1}, "tools": {"num_workers": 2, "max_tool_calling_iterations": 2}}
        t0 = time.time()
        run = rollyard.train(cfg, model=model, tokenizer=tok, dataset=rows, reward_funcs=[correct],
                             tools=[multiply] if tools else None)
        rl_s = time.time() - t0
        trained = AutoModelForCausalLM.from_pretrained(run.run_dir / "model", dtype=torch.float32)
        after = evaluate(trained, tok, schemas, held, tools)
        rewards = [r["reward"] for r in run.metrics]
        results.append((name, before, after, sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3, sft_s, rl_s,
                        sum(r.get("tools/calls", 0) for r in run.metrics)))
    print(f"\nheld-out greedy accuracy on {len(held)} problems (same model, {args.sft_steps} SFT steps x "
          f"{args.sft_batch}, {args.rl_steps} GRPO steps of 8 prompts x 4)")
    print(f"{'arm':10s} {'after SFT':>10s} {'after RL':>10s} {'reward first3':>14s} {'reward last3':>13s} "
          f"{'SFT s':>7s} {'RL s':>7s} {'tool calls':>10s}")
    for name, before, after, r0, r1, sft_s, rl_s, calls in results:
        print(f"{name:10s} {before:10.1%} {after:10.1%} {r0:14.3f} {r1:13.3f} {sft_s:7.0f} {rl_s:7.0f} {calls:10.0f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
