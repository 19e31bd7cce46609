"""Memory a run needs, sized at start-up: the rollout KV budget in bytes, and a check that the roles fit.

The KV budget is set as memory (``rollout.kv_memory_gb``, as vLLM's ``kv_cache_memory_bytes``) and turned
into tokens by the model's KV bytes per token (``2 x layers x kv_heads x head_dim x element size``: 46 kB
for SmolLM2-135M in fp32). Auto (0) sizes it to one step's sequences, so a 135M model does not reserve 6 GB
of cache for a 24-token task. :func:`check_fits` refuses, before anything is allocated, a configuration
whose KV budget or whose trainer (weights, gradients, AdamW state and one micro-batch's activations)
cannot fit in the memory the machine has available: one line with both numbers and the fix, instead of
an out-of-memory kill mid-run.

The activation estimate (fp32, per token per decoder layer, what the backward keeps): ~10 hidden-sized
tensors (norms, q|k|v, attention out, residuals) and 4 intermediate-sized (gate|up, SwiGLU) plus two
heads x row-length attention tensors; with ``trainer.activation_checkpointing`` the layer inputs only,
plus one layer's worth during its recomputation. It is a sizing rule, not the plan's prediction
(``rollyard plan`` prices memory independently; ``memory/*_peak_gb`` is what a run measured).
"""

from __future__ import annotations

import math
import os

from rollyard.config import ConfigError, RunConfig

GB = 1e9
AUTO_FRACTION = 0.25  # auto KV budget: at most this share of the available memory
PROMPT_ALLOWANCE = 512  # auto KV budget: prompt tokens per sequence (a longer prompt fits with fewer slots)
ACT_HIDDEN, ACT_INTERMEDIATE = 10, 4  # activation floats per token per layer, in hidden / intermediate units


def available_bytes() -> int:
    """The memory the kernel says can be allocated without swapping (``MemAvailable``), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def head_dim(c) -> int:
    return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


def kv_bytes_per_token(model_config, element_bytes: int = 4) -> int:
    """KV-cache bytes one token holds: K and V for every layer's KV heads."""
    c = model_config
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim(c) * element_bytes


def kv_element_bytes(cfg: RunConfig, device: str) -> int:
    """The cache's element size: fp32 on CPU, else the rollout dtype. A CPU engine computing in bf16 with the compiled
    attention kernel keeps a bf16 cache (``model/fast.py``): counted here at fp32's 4 bytes all the same, the larger,
    so a budget in memory is never exceeded (such an engine holds the tokens in half of it)."""
    if device.startswith("cpu"):
        return 4
    return 4 if cfg.rollout.dtype == "fp32" else 2


def sequences_in_flight(cfg: RunConfig) -> int:
    """Sequences the engine holds at once in a step (tail rounds over-provision; async keeps later steps' too)."""
    r, t = cfg.rollout, cfg.tail
    n = r.samples_per_prompt
    prompts = r.prompts_per_step
    if r.scheduler == "tail":
        n, prompts = n + t.extra_samples, math.ceil(prompts * t.overprovision)
    if cfg.placement == "async":
        prompts *= 1 + max(cfg.max_staleness, 0)
    return min(r.max_concurrent, prompts * n)


def kv_budget_bytes(cfg: RunConfig, model_config, device: str = "cpu", available: int | None = None) -> int:
    """``rollout.kv_memory_gb`` in bytes, or for 0 the auto size (one step's sequences, capped at a
    quarter of the available memory)."""
    if cfg.rollout.kv_memory_gb > 0:
        return int(cfg.rollout.kv_memory_gb * GB)
    per_token = kv_bytes_per_token(model_config, kv_element_bytes(cfg, device))
    width = min(_context(cfg, model_config), PROMPT_ALLOWANCE + cfg.rollout.max_new_tokens)
    need = sequences_in_flight(cfg) * width * per_token
    cap = AUTO_FRACTION * (available_bytes() if available is None else available)
    return int(max(min(need, cap), width * per_token))  # at least one sequence of that width


def cache_tokens(cfg: RunConfig, model, device: str = "cpu") -> int:
    """The engine's KV budget in tokens: the byte budget over the bytes per token, at most ``rollout.max_cache_tokens``."""
    per_token = kv_bytes_per_token(model.config, kv_element_bytes(cfg, device))
    tokens = max(1, min(cfg.rollout.max_cache_tokens, kv_budget_bytes(cfg, model.config, device) // per_token))
    if cfg.rollout.backend == "vllm" and cfg.rollout.kv_memory_gb == 0:
        tokens = max(tokens, _context(cfg, model.config))  # vLLM refuses a cache smaller than one max_model_len sequence
    return tokens


def _context(cfg: RunConfig, model_config) -> int:
    return int(getattr(model_config, "max_position_embeddings", None) or cfg.model.context)


def activation_bytes(model_config, tokens: int, row_length: int, checkpointing: bool) -> int:
    """fp32 bytes one training micro-batch of ``tokens`` (rows of ``row_length``) keeps for its backward."""
    c = model_config
    H, inter, L = c.hidden_size, getattr(c, "intermediate_size", 4 * c.hidden_size), c.num_hidden_layers
    layer = ACT_HIDDEN * H + ACT_INTERMEDIATE * inter + 2 * c.num_attention_heads * row_length
    per_token = (H * L + layer) if checkpointing else layer * L
    return 4 * tokens * per_token


def trainer_bytes(cfg: RunConfig, model) -> int:
    """Weights, gradients and AdamW's two moments (fp32, or bf16 with trainer.optimizer_state=bf16) for the
    trainable parameters, plus the frozen weights and one micro-batch's activations (rows of max_new_tokens
    + 512 tokens, at most the context)."""
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if cfg.model.lora.r == 0 else 0
    tokens = micro_batch_tokens(cfg, model.config)
    moments = 4 if cfg.trainer.optimizer_state == "bf16" else 8  # AdamW's two moments per trainable parameter
    return 4 * params + (4 + moments) * trainable + activation_bytes(
        model.config, tokens, _row(cfg, model.config), cfg.trainer.activation_checkpointing)


def micro_batch_held(setting: int, batch: int) -> int:
    """The memory rule for a training micro-batch, the one both the start-up check (here) and the plan's review
    of a run (``plan/review.py``) apply: it holds ``trainer.micro_batch_tokens`` (``setting``), at most one step's
    whole ``batch`` of tokens, so that a large bound meaning 'one micro-batch' is not priced as if it were
    filled. ``batch`` < 1: not known, the setting as it is."""
    return max(1, min(setting, batch)) if batch >= 1 else setting


def micro_batch_tokens(cfg: RunConfig, model_config) -> int:
    """The most tokens one training micro-batch holds at start-up, where the step's batch is bounded by its
    sequences at the context length (``micro_batch_held``)."""
    batch = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt * _context(cfg, model_config)
    return micro_batch_held(cfg.trainer.micro_batch_tokens, batch)


def _row(cfg: RunConfig, model_config) -> int:
    """A training row's length for the attention term: a sequence as the auto KV budget sizes one."""
    return min(cfg.trainer.micro_batch_tokens, _context(cfg, model_config), PROMPT_ALLOWANCE + cfg.rollout.max_new_tokens)


def check_fits(cfg: RunConfig, model, device: str = "cpu", available: int | None = None) -> None:
    """ConfigError when the KV budget, or the KV budget and the trainer together, exceed the available memory
    (CPU: the machine's; a GPU run's memory is the device's and is not checked here)."""
    if not device.startswith("cpu"):
        return
    avail = available_bytes() if available is None else available
    kv = kv_budget_bytes(cfg, model.config, device, avail)
    if kv > avail:
        raise ConfigError(f"rollout.kv_memory_gb={cfg.rollout.kv_memory_gb:g} is above the {avail / GB:.1f} GB this "
                          f"machine has available; set rollout.kv_memory_gb <= {avail / GB * 0.5:.1f} (or 0: sized "
                          f"from the model's {kv_bytes_per_token(model.config, kv_element_bytes(cfg, device)) / 1e3:.0f} "
                          f"kB per token)")
    train = trainer_bytes(cfg, model)
    if kv + train > avail:
        tokens = micro_batch_tokens(cfg, model.config)
        act = activation_bytes(model.config, tokens, _row(cfg, model.config), cfg.trainer.activation_checkpointing)
        fix = ("lower trainer.micro_batch_tokens" if cfg.trainer.activation_checkpointing
               else "set trainer.activation_checkpointing=true or lower trainer.micro_batch_tokens")
        raise ConfigError(f"the run needs ~{(kv + train) / GB:.1f} GB (KV cache {kv / GB:.1f} GB, trainer "
                          f"{(train - act) / GB:.1f} GB weights + gradients + AdamW, {act / GB:.1f} GB activations of a "
                          f"{tokens}-token micro-batch) but {avail / GB:.1f} GB is available; "
                          f"{fix}, or lower rollout.kv_memory_gb")
