"""How a batch is cut into micro-batches: the cost model of a micro-batch and of an attention pair, and the start-up
check that the model keeps packed sequences apart (``trainer/packing.py`` plans with them)."""

from __future__ import annotations

import torch


def attention_pair_weight(model) -> float:
    """Cost of one (query, key) attention pair relative to one token's matmul work (FLOPs ratio).

    Per layer a pair costs ~4 x hidden FLOPs (q.k and p.v); a token costs ~2 x the parameters
    it touches. Used only to choose a micro-batch layout (:func:`rollyard.trainer.packing.plan`).
    """
    cfg = model.config
    work = 4.0 * getattr(cfg, "hidden_size", 1) * getattr(cfg, "num_hidden_layers", 1)
    return work / max(2.0 * sum(p.numel() for p in model.parameters()), 1.0)


# One micro-batch's fixed cost (Python and per-op dispatch of its forward and backward) per
# decoder layer, in FLOPs of matmul work. Calibrated on CPU (2 threads) by timing trainer steps of
# the same 32 sequences (completions 20-64 tokens) cut into 1-6 micro-batches: the fastest cut
# for the small preset came at ~6e8 (2 groups: 11% faster than 1), for tiny at <= 2e8 (2 groups; tiny's per-token
# work is more elementwise than its FLOPs say); 3e8 is between. On CUDA, kernel launches
# (~0.3 ms a layer) against ~3e14 FLOP/s: an estimate, not measured here.
MICRO_BATCH_FLOPS_PER_LAYER = {"cpu": 3e8, "cuda": 1e11}


# Under bf16 autocast on a CPU every micro-batch casts each weight to bf16 in its forward (again in the
# recompute with activation checkpointing) and each weight's gradient back to fp32: memory-bound work that
# grows with the parameters, as a token position's matmul work does, so it is a count of token positions
# whatever the model's size. Measured on SmolLM2-135M (2 threads, bf16, 32 sequences of 47-71 tokens, 5
# interleaved rounds, 2026-11-26): cut into 4 micro-batches (the per-layer cost alone) a step took 7.43 s
# with checkpointing and 5.93 s without, into 2 (this cost added) 6.59 and 5.41 s, into 1 7.08 and 6.65 s
# (16% more pad positions); each extra micro-batch cost ~140-160 positions.
AUTOCAST_POSITIONS_PER_MICRO_BATCH = 150.0


def micro_batch_cost(model, device: torch.device, precision: str = "fp32") -> float:
    """One more micro-batch's fixed cost in units of one token's position-wise work (the units of
    :func:`rollyard.trainer.packing.layout_cost`): what splitting a batch into groups of similar
    lengths must save in pad positions and attention pairs to pay."""
    layers = getattr(model.config, "num_hidden_layers", 1)
    per_layer = MICRO_BATCH_FLOPS_PER_LAYER.get(device.type, MICRO_BATCH_FLOPS_PER_LAYER["cuda"])
    cost = layers * per_layer / max(6.0 * sum(p.numel() for p in model.parameters()), 1.0)
    return cost + (AUTOCAST_POSITIONS_PER_MICRO_BATCH if precision == "bf16" and device.type == "cpu" else 0.0)


def decoder_of(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.base_model


@torch.no_grad()
def packing_is_isolated(model, tol: float = 0.05) -> bool:
    """Whether ``model`` keeps packed sequences apart (two forwards of a few tokens; start-up).

    Packs sequences A and B in one row with restarting ``position_ids`` and compares B's hidden
    states with B run alone, relative to their scale. A leak across the boundary moves them by
    O(1); rounding by ~1e-6 in fp32, ~1e-2 in bf16. Dropout is off for the check.
    """
    V = model.config.vocab_size
    dev = next(model.parameters()).device
    a = torch.arange(3, 3 + 6, device=dev) % V
    b = torch.arange(11, 11 + 5, device=dev) % V
    pos = torch.cat([torch.arange(6), torch.arange(5)]).to(dev)[None]
    dec = decoder_of(model)
    was_training = model.training
    model.eval()
    try:
        packed = dec(input_ids=torch.cat([a, b])[None], position_ids=pos, use_cache=False).last_hidden_state[0, 6:]
        alone = dec(input_ids=b[None], position_ids=pos[:, :5], use_cache=False).last_hidden_state[0]
    finally:
        model.train(was_training)
    scale = alone.float().abs().max().clamp(min=1e-6)
    return bool(((packed.float() - alone.float()).abs().max() / scale) < tol)
