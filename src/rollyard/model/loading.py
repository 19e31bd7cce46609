"""Tiny built-in policies, a character tokenizer, and loading any local Hugging Face causal LM.

Nothing here downloads: presets are random-init Llama-architecture models built from a config, the tokenizer
is built from a fixed character set, and a real model loads only from a local directory or a local GGUF
file (``gguf.py``: dequantized once, cached by hash). Every
model rollyard exports loads back with ``AutoModelForCausalLM.from_pretrained(dir)`` and
``AutoTokenizer.from_pretrained(dir)``.
"""

from __future__ import annotations

import copy
import json
import string
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from rollyard.config import ConfigError, RunConfig
from rollyard.model import gguf

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
CHARS = string.digits + string.ascii_letters + " +-*/=()<>?.,:;!'\"#[]{}_|^%&$@~\n"

# name -> LlamaConfig fields (Llama, not Qwen2: transformers 5 forces its own BPE tokenizer on
# a qwen2 directory, which would drop the character tokenizer's spaces on reload). Parameter counts are printed by `rollyard train` at start.
PRESETS: dict[str, dict] = {
    # ~0.5M parameters: the default for tests and the CPU demo.
    "tiny": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=5,
                 num_attention_heads=4, num_key_value_heads=2),
    # ~4M parameters: the "real but still CPU" size used by benchmarks.
    "small": dict(hidden_size=256, intermediate_size=640, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4),
    # ~0.6M parameters, head_dim 64: the size vLLM's CPU attention accepts (rollout.backend=vllm).
    "tiny64": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=2, num_key_value_heads=1),
}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer in Hugging Face format (one token per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
    return fast


def build_preset(name: str, tokenizer, seed: int = 0, max_position_embeddings: int = 512):
    """Random-init Llama-architecture causal LM of preset ``name`` sized to ``tokenizer``'s vocabulary."""
    if name not in PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}: expected one of {sorted(PRESETS)} or a local "
            f"Hugging Face model directory"
        )
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **PRESETS[name],
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model


def load_policy(name_or_path: str, seed: int = 0, max_position_embeddings: int = 512):
    """Return ``(model, tokenizer)`` for a preset name, a local HF model directory, or a GGUF file (or a
    directory holding one), converted once and cached by its hash (``model/gguf.py``)."""
    path = Path(gguf.resolve(name_or_path))
    if path.is_dir():
        check_causal_lm_dir(path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"model.name={path}: the model directory does not load ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]}); point it at a directory written by save_pretrained") from None
        tied = set(getattr(model, "_tied_weights_keys", None) or ())
        missing = [k for k in info.get("missing_keys", ()) if k not in tied and not (
            "lm_head" in k and getattr(model.config, "tie_word_embeddings", False))]
        if missing:
            raise ConfigError(f"model.name={path}: {len(missing)} weights are not in the directory (e.g. {missing[0]}); "
                              f"they would train from a random init. Save the whole causal LM with save_pretrained")
        own_memory(model)
        return model, tokenizer
    if path.exists():
        raise ConfigError(f"model.name={path} is a file; expected a Hugging Face model directory (with config.json), "
                          f"a .gguf file or a preset ({', '.join(sorted(PRESETS))})")
    if name_or_path not in PRESETS:
        where = "" if Path(name_or_path).is_absolute() else f" (relative to {Path.cwd()})"
        raise ConfigError(f"model.name={name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an "
                          f"existing model directory, .gguf file or pkg:<module>{where}; fix the path or use model.name=tiny")
    tokenizer = char_tokenizer()
    return build_preset(name_or_path, tokenizer, seed, max_position_embeddings), tokenizer


def own_memory(model) -> None:
    """Give each CPU parameter memory of its own (a copy), in place of the safetensors file's private mapping
    that ``from_pretrained`` leaves the weights in.

    In that mapping the first write to each 4 KB page (the trainer's first optimizer step) is a copy-on-write fault.
    For SmolLM2-135M in a 2-core VM, that step's AdamW took 1.67 s instead of 0.12 s. The copy here takes 0.17 s and
    that step's AdamW 0.24 s. The file's pages are let go once the last weight has moved. Tied weights stay tied
    (one parameter, copied once)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.device.type == "cpu":
                p.data = p.data.clone()


def check_causal_lm_dir(path: Path) -> None:
    """ConfigError unless ``path/config.json`` parses and names a causal (decoder-only) LM."""
    if not (path / "config.json").exists():
        raise ConfigError(f"model.name={path} is not a Hugging Face model directory: config.json is missing; point "
                          f"it at a directory written by save_pretrained, or use a preset ({', '.join(sorted(PRESETS))})")
    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.name={path}: config.json does not load ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}); fix or re-save the model directory") from None
    archs = list(getattr(cfg, "architectures", None) or [])
    causal = [a for a in archs if a.endswith(("ForCausalLM", "LMHeadModel"))]
    if getattr(cfg, "is_encoder_decoder", False) or (archs and not causal):
        raise ConfigError(f"model.name={path} is not a causal language model: config.json names "
                          f"{', '.join(archs) or cfg.model_type} (expected *ForCausalLM); RL here needs a decoder-only "
                          f"LM with its language-model head")


def context_length(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 2048))


def eos_ids(model, tokenizer, stop: list[str] | tuple[str, ...] = ()) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS, all of ``generation_config.eos_token_id``
    (chat models list several, e.g. ``<|im_end|>`` and ``<|endoftext|>``) and the ``stop`` strings'
    (``rollout.stop_tokens``), each of which must be one token of ``tokenizer``."""
    ids = [tokenizer.eos_token_id]
    gen = getattr(model, "generation_config", None) if model is not None else None
    extra = getattr(gen, "eos_token_id", None)
    ids += extra if isinstance(extra, (list, tuple)) else [extra]
    for s in stop:
        if not s:
            raise ConfigError("rollout.stop_tokens holds an empty string, which is no token and can end nothing; "
                              "remove it (each stop string must be one token of the tokenizer, e.g. a newline)")
        enc = tokenizer.encode(s, add_special_tokens=False)
        if len(enc) != 1:
            raise ConfigError(f"rollout.stop_tokens: {s!r} is {len(enc)} tokens of this tokenizer ({enc}), and a stop "
                              f"token must be exactly one; give a string the tokenizer holds as one token"
                              + (f" (e.g. {tokenizer.decode(enc[:1])!r})" if enc else "") + ", or remove it")
        ids += enc
    return sorted({int(i) for i in ids if i is not None})


def source_dtype(name_or_path: str) -> torch.dtype | None:
    """The dtype a local model directory was saved in (its config.json), or None (a preset, a GGUF, or unstated)."""
    if gguf.gguf_file(name_or_path) is not None:
        return None  # dequantized to fp32; the export stays fp32
    path = Path(gguf.package_path(name_or_path)) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return getattr(torch, name, None) if isinstance(name, str) else None


ADAPTER_DIR = "adapter"


def lora_target_error(model, targets: list[str]) -> str | None:
    """Why ``targets`` cannot be LoRA-wrapped in ``model`` (a name no linear layer has), or None."""
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    missing = [t for t in targets if t not in linear]
    if not targets or missing:
        return (f"model.lora.targets={targets}: {missing or 'empty'} not among this model's linear layers "
                f"{linear}; set model.lora.targets to some of those")
    return None


def attach_lora(model, r: int, alpha: float, targets: list[str]):
    """Wrap ``model`` in a PEFT LoRA adapter of rank ``r`` on ``targets``; base weights frozen.

    Returns the ``PeftModel`` (only ``lora_A``/``lora_B`` require grad; the adapter starts as an
    identity: ``lora_B`` is zero). Raises ``ValueError`` when a target names no linear layer.
    """
    from peft import LoraConfig, get_peft_model

    why = lora_target_error(model, targets)
    if why:
        raise ValueError(why)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0))


def export(model, tokenizer, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` and ``tokenizer`` as a Hugging Face directory (safetensors), in ``dtype`` when given
    (the dtype the model came in: training runs in fp32, the export keeps the user's bf16).

    A PEFT model is written merged (``AutoModelForCausalLM.from_pretrained(out)`` loads the policy
    as trained) and its adapter in PEFT format under ``out/adapter`` (``PeftModel.from_pretrained(
    base, out / "adapter")`` loads it onto the base).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "merge_and_unload"):
        model.save_pretrained(out / ADAPTER_DIR)
        model = copy.deepcopy(model).merge_and_unload()
    if dtype is not None and dtype != next(model.parameters()).dtype:
        model = copy.deepcopy(model).to(dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def policy(cfg: RunConfig, device: str):
    """(model on ``device``, tokenizer, context length) for the run; a LoRA target that matches nothing
    fails here, at start-up."""
    model, tokenizer = load_policy(cfg.model.name, seed=cfg.model.seed, max_position_embeddings=cfg.model.context)
    lora = cfg.model.lora
    if lora.r > 0 and (why := lora_target_error(model, lora.targets)):  # at start-up, before any warm start
        raise ConfigError(why)
    return model.to(device), tokenizer, context_length(model)
