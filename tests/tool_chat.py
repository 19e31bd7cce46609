"""A tiny tool-calling chat model built in the test: a BPE tokenizer, a Qwen2-style template with tool
support, and a random Qwen2 taught (by a few hundred supervised steps, greedy) one tool conversation."""

from __future__ import annotations

import tempfile

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

from rollyard.env import template

TOOL_CHAT = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}. "
    "Call: <tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
QUESTION = [{"role": "user", "content": "What is 2 plus 3?"}]


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} plus {b}? The answer is {a + b}. {CALL} <tool_response> Tools: add nap system user "
              f"assistant" for a in range(10) for b in range(10)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    out.chat_template = TOOL_CHAT
    # Through a save and a load beside a Qwen2 config, as a run reads it: AutoTokenizer then builds
    # transformers' Qwen2 tokenizer, whose pre-tokenizer splits digits (the trained one does not).
    with tempfile.TemporaryDirectory() as d:
        out.save_pretrained(d)
        Qwen2Config(vocab_size=len(out)).save_pretrained(d)
        return AutoTokenizer.from_pretrained(d)


def conversation(tok, schemas: list[dict], tool_output: str = "5") -> tuple[list[int], list[int], list[int], list[int]]:
    """(prompt, model turn 1, tool turn, model turn 2) token ids of the taught conversation."""
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    prompt = template.prompt_with_tools(tok, QUESTION, schemas)
    turn1 = tok(CALL, add_special_tokens=False)["input_ids"] + [eot]
    tool = template.turn_tokens(tok, [("add", tool_output)], "<|im_end|>")
    turn2 = tok(f"The answer is {tool_output}.", add_special_tokens=False)["input_ids"] + [eot]
    return prompt, turn1, tool, turn2


def taught_model(tok, schemas: list[dict], steps: int = 80, heads: int = 4, head_dim: int = 16):
    """A tiny fp32 Qwen2 that, greedy, calls add(2, 3) and then answers with the tool's output
    (``head_dim=64``: one vLLM's CPU attention runs)."""
    ids = tok.convert_tokens_to_ids(SPECIALS)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=heads * head_dim, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=ids[2], pad_token_id=ids[0])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    p, t1, tool, t2 = conversation(tok, schemas)
    x = torch.tensor([p + t1 + tool + t2])
    labels = torch.tensor([[-100] * len(p) + t1 + tool + t2])
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3)
    for _ in range(steps):
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return model
