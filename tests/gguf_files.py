"""Write a small Llama-architecture model as a GGUF file with the ``gguf`` package (for tests; no download).

The layout is llama.cpp's (GGUF's documented tensor names): ``token_embd``, ``blk.N.attn_q`` ..., Q and K
rows permuted into the interleaved-pairs rotary order GGUF stores for Llama (transformers' loader
un-permutes them), a GPT-2-style BPE vocabulary with its merges, the chat template under
``tokenizer.chat_template``. Tied embeddings: no ``output.weight`` tensor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on sums, with ChatML specials and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a}+{b}? Answer with the number only. {a + b}" for a in range(10, 40) for b in range(10, 40)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    out.chat_template = CHAT
    return out


def tiny_llama(tokenizer, seed: int = 0):
    """Random-init Llama with grouped-query attention (4 query heads, 2 KV heads) and tied embeddings."""
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's half-split rotary rows -> GGUF's interleaved pairs (per head: rows 0..d/2-1 and d/2..d-1 interleave)."""
    rest = w.shape[1:]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, tokenizer, path: Path, *, chat_template: str | None = CHAT, architecture: str = "llama",
               float_type=np.float32) -> Path:
    """``model`` (a Llama) and ``tokenizer`` (a byte-level BPE) as one GGUF file at ``path``.
    ``float_type``: the numpy type of the 2-D weights (np.float64 makes a file gguf cannot dequantize)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("rollyard-test-tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    data = tokenizer.backend_tokenizer.to_str()
    import json
    bpe = json.loads(data)["model"]
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tokenizer.all_special_tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    big = lambda a: a.astype(float_type)  # noqa: E731
    w.add_tensor("token_embd.weight", big(sd["model.embed_tokens.weight"]))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", big(_rope_permute(sd[p + "self_attn.q_proj.weight"], heads)))
        w.add_tensor(f"blk.{i}.attn_k.weight", big(_rope_permute(sd[p + "self_attn.k_proj.weight"], kv_heads)))
        w.add_tensor(f"blk.{i}.attn_v.weight", big(sd[p + "self_attn.v_proj.weight"]))
        w.add_tensor(f"blk.{i}.attn_output.weight", big(sd[p + "self_attn.o_proj.weight"]))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", big(sd[p + "mlp.gate_proj.weight"]))
        w.add_tensor(f"blk.{i}.ffn_up.weight", big(sd[p + "mlp.up_proj.weight"]))
        w.add_tensor(f"blk.{i}.ffn_down.weight", big(sd[p + "mlp.down_proj.weight"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
