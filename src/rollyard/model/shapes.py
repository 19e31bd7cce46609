"""The shapes of a decoder module, read once by each fast forward (``llama.LlamaFast``, ``gemma3.Gemma3Fast``).

Its own module: ``llama`` imports ``gemma3`` (the dispatch), so a helper in either would be an import circle.
"""

from __future__ import annotations

import torch


def read_shapes(fwd, model) -> torch.Tensor:
    """Set a fast forward's ``model`` and its shapes from a decoder module (``model.model.layers``), shared by
    ``LlamaFast`` and ``gemma3.Gemma3Fast``: ``L`` layers, ``H`` / ``KVH`` query / key-value heads, ``hd`` head dim,
    ``D`` hidden, ``I`` MLP width, ``context``, attention ``scale``, ``device`` and ``weight_dtype``. Returns the
    first parameter (its device and dtype)."""
    fwd.model = model
    cfg, inner = model.config, model.model
    attn = inner.layers[0].self_attn
    fwd.L = len(inner.layers)
    fwd.H = cfg.num_attention_heads
    fwd.KVH = getattr(cfg, "num_key_value_heads", None) or fwd.H
    fwd.hd = attn.head_dim
    fwd.D = cfg.hidden_size
    fwd.I = inner.layers[0].mlp.gate_proj.weight.shape[0]
    fwd.context = int(cfg.max_position_embeddings)
    fwd.scale = float(attn.scaling)
    p = next(model.parameters())
    fwd.device, fwd.weight_dtype = p.device, p.dtype
    return p
