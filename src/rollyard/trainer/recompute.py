"""How many decoder layers a checkpointed micro-batch keeps un-recomputed (``trainer.activation_checkpointing=auto``).

With every layer recomputed (``true``) a step's trainer memory still reaches the weights, the optimizer state and
*every* gradient: the step starts with no gradient (``zero_grad(set_to_none=True)``), the backward allocates them
all, and the optimizer step reads them together. Activations held for the backward are freed as it goes, the last
layer's first. So the layers nearest the head can keep their activations (no recompute) without raising that peak,
as long as, at the backward's start, what they hold plus the LM head's transient (its weight gradient, made first,
and two chunks of logits) is no more than the gradients still to be allocated: past that point each kept layer's
activations are freed as its own gradients are made.

Only a step's first micro-batch can keep any (a later one starts with every gradient allocated), only on the fast
training forward (``model.families.train_hidden``; HF's decoder layers recompute all), and only the trainable
parameters' gradients count (a LoRA policy's are small: it recomputes everything).
"""

from __future__ import annotations

from rollyard.model import kv_budget


def layer_bytes(config, tokens: int, row_length: int, concatenated: bool = True) -> int:
    """An upper bound on what one decoder layer of the fast training forward holds for its backward, fp32, for a
    micro-batch of ``tokens`` in rows of ``row_length``: the start-up memory check's per-layer activations
    (``kv_budget.activation_bytes``, ~10 hidden + 4 intermediate + 2 x heads x row floats per token), and with
    ``concatenated`` the layer's concatenated q|k|v and gate|up weights, which its products keep where they are not
    taken by parts (``model.gemm.linear_parts``). Measured on SmolLM2-135M's layer at 294 tokens in rows of 147: 20.8
    MB held with the concatenations (26.4 MB bounded here), 11.5 MB by parts (17.1 MB bounded)."""
    c = config
    L = c.num_hidden_layers
    hd = kv_budget.head_dim(c)
    inter = getattr(c, "intermediate_size", 4 * c.hidden_size)
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    fused = c.hidden_size * ((c.num_attention_heads + 2 * kv_heads) * hd + 2 * inter) if concatenated else 0
    return kv_budget.activation_bytes(c, tokens, row_length, False) // L + 4 * fused


def kept_layers(config, tokens: int, row_length: int, free_grad_bytes: int, head_bytes: int,
                concatenated: bool = True) -> int:
    """How many of the last decoder layers keep their activations (module docstring): their :func:`layer_bytes`
    together within ``free_grad_bytes`` (the trainable parameters' gradients not yet allocated) less ``head_bytes``
    (the LM head's transient at the backward's start). 0 where nothing fits."""
    budget = free_grad_bytes - head_bytes
    if budget <= 0:
        return 0
    return min(config.num_hidden_layers, budget // layer_bytes(config, tokens, row_length, concatenated))
