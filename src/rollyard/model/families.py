"""Model families, routed in one place: the table from a model to its fast forward, and the HF fallback.

A model's ``config.model_type`` picks its family in :data:`FAMILIES` (a ``fast.FastForward`` subclass, one file
each: ``llama.py`` for Llama / Qwen2 / Qwen3 / Mistral, ``gemma3.py`` for Gemma 3's text model). The family's
``unsupported_reason`` then says whether this model of it takes the fast path (a variant it does not implement:
sliding windows on a Llama, soft-capped attention on a Gemma, ...). A model with no family, or one its family
refuses, takes the HF fallback: the rollout's HF backends (``rollout/hf.py``) and the trainer's module forward.

Every caller routes through here: the native rollout backend (:func:`fast_forward`, :func:`unsupported_reason`)
and the trainer (:func:`train_hidden`, :func:`train_forward_matches`, :func:`train_unsupported_reason`). A new
family is one file with a ``FastForward`` subclass and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from rollyard.model import gemm, gemma3, llama
from rollyard.model import kernels as cpu_kernels
from rollyard.model.fast import FastForward, softcap

FAMILIES: tuple[type[FastForward], ...] = (llama.LlamaFast, gemma3.Gemma3Fast)
_BY_TYPE = {t: family for family in FAMILIES for t in family.MODEL_TYPES}
MODEL_TYPES = tuple(_BY_TYPE)


def family_of(model) -> type[FastForward] | None:
    """The fast forward of ``model``'s family (by ``config.model_type``), or None: the HF fallback."""
    return _BY_TYPE.get(getattr(getattr(model, "config", None), "model_type", None))


def unsupported_reason(model) -> str | None:
    """``None`` if ``model`` can use the fast path (its family's forward), else why not (it takes the HF fallback)."""
    family = family_of(model)
    if family is None:
        mtype = getattr(getattr(model, "config", None), "model_type", None)
        return f"model_type {mtype!r} is not one of {MODEL_TYPES}"
    return family.unsupported_reason(model)


def fast_forward(model, compute_dtype: torch.dtype | None = None) -> FastForward:
    """``model``'s fast forward (prefill and decode over its weights, computed in ``compute_dtype``, None: the
    module's); ValueError where it has none."""
    family = family_of(model)
    if family is None:
        raise ValueError(f"fast path unsupported: {unsupported_reason(model)}")
    return family(model, compute_dtype)


def train_hidden(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 segments: torch.Tensor | None = None, rows_grad: bool = False, kept_layers: int = 0) -> torch.Tensor:
    """Final-norm hidden states ``[B, T, D]`` through ``model``'s family's training forward
    (``FastForward.train_hidden``: padded rows, or the prefix-shared layout's ``position_ids`` and ``segments``;
    ``rows_grad``, ``kept_layers``: see there)."""
    family = family_of(model)
    if family is None:
        raise ValueError(f"fast training forward unsupported: {unsupported_reason(model)}")
    return family.train_hidden(model, input_ids, position_ids, segments, rows_grad, kept_layers)


_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def train_unsupported_reason(model) -> str | None:
    """``None`` if :func:`train_hidden` computes what the module would, else why not.

    Beyond :func:`unsupported_reason`: ``train_hidden`` reads the projections' ``.weight``
    directly and never calls a module, so anything that works through module calls would be
    skipped without a trace: a PEFT adapter wrapping a projection (its LoRA factors would get no
    gradient), FSDP's per-layer all-gather hooks (sharded weights; the ranks would hang), or any
    other forward hook (gradient checkpointing it honours). A numeric check alone cannot see an adapter
    whose B factor is still zero.
    """
    reason = unsupported_reason(model)
    if reason:
        return reason
    if getattr(model.config, "attention_dropout", 0.0):
        return "attention dropout"
    for i, layer in enumerate(model.model.layers):
        for m in layer.modules():
            if m._forward_hooks or m._forward_pre_hooks:
                return f"layer {i} has forward hooks ({type(m).__name__}: FSDP or another wrapper)"
        for name in _PROJECTIONS:
            mod = layer.get_submodule(name)
            if type(mod) is not torch.nn.Linear:
                return (f"layer {i} {name} is {type(mod).__module__}.{type(mod).__qualname__}, not a plain "
                        f"torch.nn.Linear (an adapter?)")
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "sharded (DTensor) parameters"
    return None


@torch.no_grad()
def train_forward_matches(model, tol: float = 1e-4) -> bool:
    """Whether :func:`train_hidden` may stand in for the HF decoder: nothing it would bypass
    (:func:`train_unsupported_reason`), and equal outputs on a short random batch (relative max error)."""
    if train_unsupported_reason(model) is not None:
        return False
    dev = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)).to(dev)
    # In the weights' own precision: a caller's bf16 autocast would put both sides' rounding
    # (~1e-2) above ``tol`` and fail the check for the wrong reason.
    with torch.autocast(dev.type, enabled=False):
        try:
            got = train_hidden(model, ids).float()
        except cpu_kernels.KernelsRequired:
            raise
        except (RuntimeError, ValueError, TypeError, AttributeError, IndexError):  # an unexpected family variant
            return False
        ref = model.model(input_ids=ids, use_cache=False).last_hidden_state.float()
    return bool(((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)) < tol)


# Modules whose training forward computes what their own forward does: checked once per module
# (:func:`train_forward_matches`), as the trainer checks it before it trains through it.
_MATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def completion_logits(model, ids: torch.Tensor, C: int) -> torch.Tensor:
    """Logits ``[C, V]`` at the last ``C`` positions of ``ids [1, T]`` under ``model``, in its weights' precision
    (no grad): through :func:`train_hidden` where it computes what the module does (the trainer's layers; fp32
    matmuls on oneDNN where ``model.gemm`` uses it) and the head at those positions only; else the module's forward.
    The logprob canary's trainer side (``sync/canary.py``): SmolLM2-135M's 31-token probe on 2 threads took 86 ms
    through the HF module (its MKL matmuls at 31 rows read the weights at ~7 GB/s), ~43 ms here."""
    if model not in _MATCHES:
        _MATCHES[model] = family_of(model) is not None and train_forward_matches(model)
    with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):
        if not _MATCHES[model]:
            keep = {"logits_to_keep": C} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
            return model(input_ids=ids, use_cache=False, **keep).logits[0, -C:]
        head = model.get_output_embeddings()
        logits = gemm.linear(train_hidden(model, ids)[0, -C:], head.weight, head.bias)
        return softcap(logits, getattr(model.config, "final_logit_softcapping", None))
