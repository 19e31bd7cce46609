"""A tiny Gemma 3 (text) model, random init, written as a GGUF file with the ``gguf`` package (for tests; no download).

Gemma-3-shaped where it matters: sliding-window attention on five layers of six (window 4 here, so a test's
sequences cross it), QK-norm, GeGLU, RMSNorm on (1 + w) (random norm weights, so the 1 + w matters), embeddings
scaled by sqrt(hidden), tied head. The GGUF layout is llama.cpp's for ``gemma3`` (tensor names from the ``gguf``
package's own map; norm weights stored as 1 + w, as llama.cpp writes them and transformers' loader reads them back)
and so is the tokenizer: a sentencepiece-style vocabulary (``tokenizer.ggml.model = llama``: Gemma's specials, byte
fallback, ``\u2581`` for a space) that transformers rebuilds as a ``GemmaTokenizer``, as it does Gemma-3-270M's.
No chat template: a base model (``data.chat_template`` or plain prompts).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GemmaTokenizer

WINDOW = 4
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
CHARS = "\u2581" + "".join(chr(c) for c in range(33, 127))


def gemma_tokenizer() -> GemmaTokenizer:
    """Gemma's tokenizer class over a tiny vocabulary: the specials, the 256 byte-fallback tokens, one token per
    printable character and a few pairs (``\u2581`` + a digit), as a GGUF of a Gemma holds it."""
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + list(CHARS) + [f"\u2581{d}" for d in "0123456789"]
    vocab = {t: i for i, t in enumerate(tokens)}
    return GemmaTokenizer(vocab=vocab, merges=[("\u2581", d) for d in "0123456789"])


def tiny_gemma3(tokenizer, seed: int = 0, layers: int = 6, head_dim: int = 16, context: int = 128) -> Gemma3ForCausalLM:
    """Random-init Gemma 3 text model (layer 6 of 6 full attention, the rest sliding), fp32, norms randomized.
    ``head_dim=32`` for vLLM's CPU attention (its smallest head size); ``context``: max_position_embeddings
    (Gemma-3-270M's is 32768)."""
    cfg = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=context,
                           sliding_window=WINDOW, rms_norm_eps=1e-6, tie_word_embeddings=True,
                           bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.05)  # scaled by sqrt(64) at the input: keeps the logits O(1)
    return model


def write_gemma3_gguf(model: Gemma3ForCausalLM, tokenizer, path: Path, chat_template: str | None = None) -> Path:
    """``model`` and ``tokenizer`` (:func:`gemma_tokenizer`) as one GGUF file of architecture ``gemma3``."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("rollyard-test-tiny-gemma3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["full_attention"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    kinds = {"<unk>": gguf.TokenType.UNKNOWN, **{t: gguf.TokenType.CONTROL for t in SPECIALS if t != "<unk>"}}
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_scores([-float(i) for _, i in vocab])
    w.add_token_types([kinds.get(t, gguf.TokenType.BYTE if t.startswith("<0x") else gguf.TokenType.NORMAL)
                       for t, _ in vocab])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_unk_token_id(tokenizer.unk_token_id)
    w.add_add_bos_token(True)
    if chat_template:
        w.add_chat_template(chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    for key, value in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied: the embedding
        base = key.removesuffix(".weight")
        data = value.detach().float().numpy()
        if "norm" in base:
            data = data + np.float32(1.0)  # llama.cpp stores Gemma's norm multiplier, 1 + w
        w.add_tensor(f"{names.get_name(base)}.weight", data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
