"""The trainer role: packed forward/backward over completion tokens, one optimizer step per call.

Data path of one micro-batch (see :mod:`rollyard.trainer.packing`)::

    rows [B, T] (one packed row, or length-sorted right-padded rows) --decoder--> hidden
    [B * T, H] --select--> [N, H] (positions predicting completion tokens) --chunked lm_head +
    log_softmax(./T) + gather--> logp [N]

The layout is chosen per micro-batch (``layout="auto"``): padded rows need only causal attention
(no mask tensor), a packed row pays attention over the whole row with a dense mask; many short
sequences are cheaper padded, a few very uneven ones packed. ``fast_forward`` (default on) runs
padded rows of a model with a fast forward (Llama family, Gemma 3) through ``families.train_hidden`` (checked against the
decoder at first use): fused q|k|v and gate|up matmuls, RoPE as one cat, and on CPU a grouped
causal attention in plain matmuls instead of SDPA's kernels, and fp32 projections (forward and
both gradients) and the lm_head on oneDNN where it beats MKL (:mod:`rollyard.model.gemm`).

The full ``[L, V]`` logits never exist: logits are computed ``logprob_chunk`` rows at a time,
and under autograd each chunk is checkpointed, so the backward pass recomputes one chunk's
logits at a time instead of keeping them all. Prompt positions never reach the lm_head.

Precision (``precision=``): ``fp32``, or ``bf16`` autocast (matmuls in bf16, weights, optimizer
state and log_softmax in fp32); ``auto`` is bf16 on CUDA, and on a CPU with native bf16 once the decoder's
matrices are large enough (:func:`auto_precision`), else fp32. A CPU with AVX512-BF16
or AMX runs bf16 matmuls ~2x faster than fp32 on oneDNN (measured ~400 vs ~200 GFLOP/s, one core;
MKL's fp32 ~92), so ``bf16`` pays there too. Under it, padded rows take the fast forward's grouped attention and
packed rows (HF decoder) SDPA's math kernel: a bf16 flash-attention backward measured ~5x slower
than the whole fp32 step's matmuls at 32 x 68 tokens.
Memory (``activation_checkpointing=True``): each decoder layer keeps only its input for the backward and
is recomputed there (the module's ``gradient_checkpointing``), so one micro-batch's activations fall from
~(10 x hidden + 4 x intermediate) x layers floats per token to ~hidden x layers plus one layer's worth.
Dropout: the module's train/eval mode is left as the caller set it (the tiny presets and most
causal LMs have no dropout; with dropout on, pi_old and mu would be noisy).
"""

from __future__ import annotations

import contextlib
import math
import re
import time
import warnings

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from rollyard import schedule
from rollyard.algo import correction, distill, support
from rollyard.algo.entropy_control import EntropyControl
from rollyard.algo.loss import AGGS
from rollyard.algo.policy_loss import Batch, LossSpec, policy_loss
from rollyard.config import RunConfig, schedule_length
from rollyard.model import families
from rollyard.model import gemm as cpu_gemm
from rollyard.model import memory as cpu_memory
from rollyard.trainer import head as head_grad
from rollyard.trainer.adamw_bf16 import AdamWBf16
from rollyard.trainer.numerics import SkipGuard
from rollyard.trainer.packing import LAYOUTS, MicroBatch, plan, prefix_shared
from rollyard.types import Sample

PRECISIONS = ("auto", "fp32", "bf16")
ENTROPY_STATE = "entropy_control"  # param-group key: the adaptive entropy bonus's state (algo/entropy_control.py)
SCHEDULE_STEP = "schedule_step"  # param-group key: optimizer steps taken, the learning-rate schedule's position
OPTIMIZER_STATES = ("fp32", "bf16")  # AdamW moments: torch.optim.AdamW, or bf16 (trainer/adamw_bf16.py)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 1024,
    softcap: float | None = None,
    with_entropy: bool = False,
    top_p: float = 1.0,
    top_k: int = 0,
    entropy_grad: bool = False,
    fp32_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(lm_head(hidden) / temperature)[i, targets[i]]`` for ``hidden [N, H]``.

    Returns ``(logp [N] fp32, entropy [N] fp32 or None)``; entropy carries a gradient only with ``entropy_grad``
    (a loss with an entropy bonus). ``fp32_head``: the head's matmul in fp32 under bf16 autocast. At most
    ``chunk x V`` logits exist at a time, forward and backward (each chunk is checkpointed when
    gradients are needed). ``softcap``: the model's final-logit soft cap (Gemma-2 style), if any.
    """
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters()))

    if need_grad and not entropy_grad and hidden.shape[0] and head_grad.applies(lm_head, hidden, softcap, support.active(top_p, top_k)):
        # one weight-sized gradient instead of one per chunk plus the sum (trainer/head.py: 262k-vocab heads)
        lp, ent = head_grad.HeadLogprobs.apply(hidden, lm_head.weight, targets, float(temperature), int(chunk),
                                               with_entropy)
        return lp, (ent if with_entropy else None)
    plain = type(lm_head) is torch.nn.Linear and not (lm_head._forward_hooks or lm_head._forward_pre_hooks)

    def one_chunk(h: torch.Tensor, y: torch.Tensor):
        if fp32_head and torch.is_autocast_enabled(h.device.type):  # TRL's cast_lm_head_to_fp32
            with torch.autocast(h.device.type, enabled=False):
                logits = torch.nn.functional.linear(h.float(), lm_head.weight.float(),
                                                    None if lm_head.bias is None else lm_head.bias.float())
        else:
            logits = (cpu_gemm.linear(h, lm_head.weight, lm_head.bias) if plain else lm_head(h)).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if temperature != 1.0:
            logits = logits / temperature
        if support.active(top_p, top_k):  # the support the rollout sampled from, renormalised (algo/support.py)
            logits = support.restrict(logits, top_p, top_k, y)
        logz = torch.logsumexp(logits, dim=-1)
        lp = logits.gather(-1, y[:, None]).squeeze(-1) - logz
        ent = None
        if with_entropy and entropy_grad and need_grad:  # H = logz - sum_v p_v logit_v, differentiable
            ent = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        elif with_entropy:
            # After every tensor the backward needs has been saved: checkpoint's recomputation
            # stops early (before this) in the backward pass, so entropy costs one pass, not two.
            # H = logz - sum_v p_v * logit_v, as a batched dot product (no second [n, V] buffer).
            with torch.no_grad():
                p = (logits - logz[:, None]).exp_()
                ent = logz - torch.bmm(p[:, None, :], logits[:, :, None]).view(-1)
        return lp, ent

    lps, ents = [], []
    for s in range(0, hidden.shape[0], chunk):
        h, y = hidden[s:s + chunk], targets[s:s + chunk]
        if need_grad:
            lp, ent = checkpoint(one_chunk, h, y, use_reentrant=False)
        else:
            lp, ent = one_chunk(h, y)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


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


def _decoder(model):
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
    dec = _decoder(model)
    was_training = model.training
    model.eval()
    try:
        packed = dec(input_ids=torch.cat([a, b])[None], position_ids=pos, use_cache=False).last_hidden_state[0, 6:]
        alone = dec(input_ids=b[None], position_ids=pos[:, :5], use_cache=False).last_hidden_state[0]
    finally:
        model.train(was_training)
    scale = alone.float().abs().max().clamp(min=1e-6)
    return bool(((packed.float() - alone.float()).abs().max() / scale) < tol)


def _quantiles(x: torch.Tensor, qs: list[float]) -> list[float]:
    """Linear-interpolated quantiles (torch.quantile's definition) without its 16M-element cap."""
    if x.numel() == 0:
        return [float("nan")] * len(qs)
    v = x.float().sort().values
    n = v.numel()
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, n - 1)
        out.append(float(v[lo] + (v[hi] - v[lo]) * (pos - lo)) if hi != lo else float(v[lo]))
    return out


def adamw(params: list, **kw) -> torch.optim.AdamW:
    """AdamW over ``params`` (tensors, or param groups), fused (one kernel per parameter: ~2.5x less optimizer time
    on CPU than the per-op loop; what transformers' Trainer, and so TRL, use by default) where every parameter is a
    plain floating tensor on CPU or CUDA; the per-op loop otherwise (sharded DTensors, other devices)."""
    from torch.distributed.tensor import DTensor

    flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.is_floating_point()
                for p in flat)
    opt = torch.optim.AdamW(params, fused=fused or None, **kw)
    # The kernel is this process's choice, not the checkpoint's: load_state_dict would otherwise
    # bring back the saving run's flag (a fused one on sharded parameters fails at the next step).
    opt.register_load_state_dict_post_hook(_keep_kernel_choice)
    return opt


def _keep_kernel_choice(opt: torch.optim.Optimizer) -> None:
    for g in opt.param_groups:
        g["fused"] = opt.defaults["fused"]


# transformers' Trainer (and so TRL) leaves biases and normalisation weights out of weight decay: a parameter of a
# LayerNorm module, or one whose lower-cased name holds "bias", "layernorm", "rmsnorm", a part "norm" or "..._norm"
NO_DECAY_NAME = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def decayed(model) -> set[str]:
    """Names of ``model``'s parameters that transformers' Trainer applies weight decay to (see NO_DECAY_NAME)."""
    in_norm = {f"{m}.{n}" if m else n for m, mod in model.named_modules() if isinstance(mod, torch.nn.LayerNorm)
               for n, _ in mod.named_parameters(recurse=False)}
    return {n for n, _ in model.named_parameters() if n not in in_norm and not NO_DECAY_NAME.search(n.lower())}


class Trainer:
    """Owns the policy's optimizer; scores samples and takes optimizer steps on them.

    ``micro_batch_tokens`` bounds the packed row length of one forward/backward (a longer single
    sequence gets a micro-batch of its own); gradients accumulate over all micro-batches of a
    call, with loss denominators taken over the whole call, so the update does not depend on how
    the batch was split. Only useful work is computed: a sample that cannot move the weights
    (:meth:`moves_weights`: advantage exactly 0 and no KL term) is left out of the forward/backward
    (``skip_zero_advantage``), its tokens kept in the denominators.
    """

    def __init__(self, model, *, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8, max_grad_norm=1.0,
                 micro_batch_tokens=4096, temperature=1.0, logprob_chunk=1024, loss_agg="token-mean",
                 clip_low=0.2, clip_high=0.2, kl_coef=0.0, tis_cap=2.0, device="cpu",
                 max_skipped_steps=3, layout="auto", fast_forward=True, precision="auto",
                 activation_checkpointing=False, optimizer_state="fp32", top_p=1.0, top_k=0, skip_zero_advantage=True,
                 share_prompts=True, loss: LossSpec | None = None, mask_truncated=False, disable_dropout=False,
                 lm_head_fp32=False,
                 entropy: EntropyControl | None = None, lr_schedule="constant", schedule_steps=0, warmup_steps=0,
                 lr_schedule_kwargs=None, schedule_every=1, decay_norms_and_biases=True):
        if loss is None:  # the plain GRPO loss from the short keywords
            loss = LossSpec(agg=loss_agg, clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef, is_cap=tis_cap)
        if loss.agg not in AGGS:
            raise ValueError(f"loss_agg={loss.agg!r}: expected one of {AGGS}")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature}: logprobs are taken under log_softmax(logits / T), "
                             f"T must be > 0 (use 1.0 for greedy rollouts)")
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
        self.device = torch.device(device)
        if self.device.type == "cpu":
            cpu_memory.keep_freed_memory()  # activations reuse the last step's pages (see cpu_memory)
        self.model = model.to(self.device)
        if activation_checkpointing:
            # The module's own flag: the fast forward (families.train_hidden) recomputes each layer under it, and
            # so do HF decoder layers (in train mode, HF's rule). Non-reentrant: works with frozen inputs (LoRA).
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.precision = auto_precision(model, self.device) if precision == "auto" else precision
        self.max_grad_norm = max_grad_norm
        self.micro_batch_tokens = micro_batch_tokens
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.logprob_chunk = logprob_chunk
        self.loss = loss  # what the loss computes (algo/policy_loss.py)
        self.loss_agg, self.kl_coef = loss.agg, loss.kl_coef
        self.mask_truncated = mask_truncated
        self.lm_head_fp32 = lm_head_fp32
        if disable_dropout:  # TRL's disable_dropout: pi_old, mu and the training forward agree exactly
            for m in model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
                if isinstance(getattr(m, "attention_dropout", None), float):  # HF attention's functional dropout
                    m.attention_dropout = 0.0
        self.entropy = entropy if entropy is not None else EntropyControl(start=loss.entropy_coef)
        # Leave samples that cannot move the weights out of the forward/backward (moves_weights); off only
        # to measure or test against the unskipped step.
        self.skip_zero_advantage = skip_zero_advantage
        # Each group's prompt computed once in training and scoring (micro_batches); off only to measure or test.
        self.share_prompts = share_prompts
        self._said_unshared: dict[int, object] = {}
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
        self.layout = layout
        self.fast_forward = fast_forward
        self._fast: dict[int, tuple[object, bool]] = {}  # id(model) -> (model, fast forward usable)
        self.attn_weight = attention_pair_weight(model)
        self.group_cost = micro_batch_cost(model, self.device, self.precision)
        self.skips = SkipGuard(max_skipped_steps)  # non-finite loss/gradient: skip loudly, stop if it repeats
        self.optimizer_s = 0.0  # seconds of the last optimizer step (clip + AdamW): train/optimizer_s
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for _, p in named]}]
        if weight_decay and not decay_norms_and_biases:  # transformers' rule: no decay on biases and norms
            keep = decayed(model)
            groups = [g for g in ({"params": [p for n, p in named if n in keep]},
                                  {"params": [p for n, p in named if n not in keep], "weight_decay": 0.0}) if g["params"]]
        self.params = [p for g in groups for p in g["params"]]  # the optimizer's order (its state's indices)
        if optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer_state={optimizer_state!r}: expected one of {OPTIMIZER_STATES}")
        if optimizer_state == "bf16":  # bf16 moments, stochastically rounded (trainer/adamw_bf16.py)
            self.optimizer = AdamWBf16(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        else:
            self.optimizer = adamw(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        # The run's AdamW settings, not a checkpoint's: load_state_dict brings back the saving run's betas, eps and
        # weight decay, so a resume that changes them (trainer.adam_beta2=...) would otherwise keep the old ones.
        settings = [{k: g[k] for k in ("betas", "eps", "weight_decay")} for g in self.optimizer.param_groups]

        def keep_settings(opt: torch.optim.Optimizer) -> None:
            for group, mine in zip(opt.param_groups, settings, strict=True):
                group.update(mine)
        self.optimizer.register_load_state_dict_post_hook(keep_settings)
        # The learning rate of optimizer step k is lr x the schedule's multiplier (rollyard/schedule.py) at
        # k // schedule_every of schedule_steps, set before the step by schedule_lr(); k is kept in the optimizer's
        # param groups, so a checkpoint (and every data-parallel rank's copy of it) carries it.
        self.base_lr = lr
        self.lr_schedule = (lr_schedule, int(schedule_steps), int(warmup_steps),
                            schedule.resolve(lr_schedule, lr_schedule_kwargs, lr, int(warmup_steps)), int(schedule_every))
        # Fail over at start-up, not silently an hour in: if this model's attention does not turn
        # restarting position_ids into sequence boundaries, train one sequence per micro-batch.
        self.packing = packing_is_isolated(self.model)
        if not self.packing:
            warnings.warn(f"{type(model).__name__} ({model.config._attn_implementation} attention) lets packed "
                          f"sequences attend across boundaries; rollyard will not pack (padded micro-batches "
                          f"only). Use attn_implementation='sdpa', 'eager' or 'flash_attention_2'.",
                          stacklevel=2)

    # -- the packed forward ---------------------------------------------------------------------

    def _autocast(self):
        if self.precision != "bf16":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        if self.device.type == "cpu":
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        return stack

    def _forward(self, model, mb: MicroBatch, with_entropy: bool = False, entropy_grad: bool = False):
        """``(logp [N], entropy [N] | None)`` of ``mb``'s completion tokens under ``model``."""
        decoder = _decoder(model)
        ids = mb.input_ids.to(self.device, non_blocking=True)
        pos = None if mb.position_ids is None else mb.position_ids.to(self.device, non_blocking=True)
        with self._autocast():
            if mb.segments is not None:  # prefix-shared rows (only planned for a model on the fast forward)
                hidden = families.train_hidden(model, ids, pos, mb.segments.to(self.device, non_blocking=True))
            elif pos is None and self._use_fast(model):
                hidden = families.train_hidden(model, ids)  # padded rows, a fast forward: fewer ops
            else:
                # No attention_mask: restarting position_ids => block-diagonal causal mask (packed);
                # position_ids None => plain causal, pads after every real token (padded; packing.py).
                hidden = decoder(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.rows.to(self.device, non_blocking=True))
            return chunked_token_logprobs(
                hidden, model.get_output_embeddings(), mb.targets.to(self.device, non_blocking=True),
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, chunk=self.logprob_chunk,
                softcap=getattr(model.config, "final_logit_softcapping", None), with_entropy=with_entropy,
                entropy_grad=entropy_grad, fp32_head=self.lm_head_fp32)

    def _use_fast(self, model) -> bool:
        """Whether padded rows of ``model`` take ``families.train_hidden`` (checked once per model).

        On by default. Trainer step, 32 x 68 tokens, 2 threads, same process interleaved
        (``bench`` numbers in bench/README.md): bf16 0.74x (tiny) and 0.83x (small) the HF
        module's time; fp32 0.85x (tiny) and 0.71x (small), mostly from oneDNN's fp32 matmuls
        (the HF modules' ``nn.Linear`` calls MKL).
        """
        if not self.fast_forward:
            return False
        if id(model) not in self._fast:
            self._fast[id(model)] = (model, families.train_forward_matches(model))
        return self._fast[id(model)][1]

    def _pack(self, pairs):
        layout = self.layout if self.packing else "padded"
        return plan(pairs, self.micro_batch_tokens, layout, self.attn_weight, self.group_cost)

    def micro_batches(self, samples: list[Sample], model=None) -> list[MicroBatch]:
        """``samples``' micro-batches for ``model`` (default: the policy): a group's prompt once, followed by
        its completions (``packing.prefix_shared``; groups by ``request_id``), where the model runs on the fast
        training forward and some group has several samples; else :meth:`_pack`'s unshared layouts."""
        pairs = [(s.prompt_ids, s.completion_ids) for s in samples]
        keys = [s.request_id for s in samples]
        if self.share_prompts and self.layout == "auto" and len(set(keys)) < len(keys) and self._shares(model):
            return prefix_shared(pairs, keys, self.micro_batch_tokens, self.attn_weight, self.group_cost)
        return self._pack(pairs)

    def _shares(self, model) -> bool:
        """Whether ``model`` can take the prefix-shared layout (it needs the fast forward's attention mask);
        a model on the HF fallback keeps the unshared packing, said once per model."""
        model = self.model if model is None else model
        if self._use_fast(model):
            return True
        if id(model) not in self._said_unshared:
            self._said_unshared[id(model)] = model
            why = ("trainer fast_forward=False" if not self.fast_forward
                   else families.train_unsupported_reason(model) or "its output differs from the HF decoder's")
            warnings.warn(f"{type(model).__name__}: each prompt is computed once per sample, not once per group "
                          f"(prefix sharing needs the fast Llama-family training forward: {why})", stacklevel=3)
        return False

    def moves_weights(self, s: Sample) -> bool:
        """Whether ``s`` can change the update: it has completion tokens, and a nonzero advantage or
        a KL term. With ``kl_coef == 0`` (and the loss has no entropy term) a sample whose advantage is
        exactly 0 contributes exactly 0 to every parameter's gradient (each token's surrogate is
        ``-min(r * 0, clip(r) * 0) = 0``), so its forward and backward are left out; its tokens still
        count in the loss denominators of the whole batch, so the update is unchanged. A KL, entropy or teacher term
        (:meth:`LossSpec.needs_every_sample`, or an adaptive entropy bonus) makes every sample matter."""
        every = self.loss.needs_every_sample() or self.entropy.on or not self.skip_zero_advantage
        return bool(s.completion_ids) and (s.advantage != 0.0 or every)

    def trained_indices(self, samples: list[Sample]) -> list[int]:
        """Indices of the samples the forward/backward computes (:meth:`moves_weights`)."""
        return [i for i, s in enumerate(samples) if self.moves_weights(s)]

    def zero_missing_grads(self) -> None:
        """Give every trainable parameter a zero gradient where it has none: a step that computed nothing
        (every sample skipped) still takes its optimizer step, as the unskipped step would on its exactly
        zero gradient (AdamW's moments decay and move the weights)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    @torch.no_grad()
    def logprobs(self, samples: list[Sample], model=None) -> list[torch.Tensor]:
        """Per-sample completion-token logprobs (fp32, CPU) under ``log_softmax(logits / T)``.

        ``model`` defaults to the policy; pass the frozen reference model to get reference
        logprobs through the same packed path. No gradients, no optimizer state touched.
        """
        return self.logprobs_and_entropy(samples, model, with_entropy=False)[0]

    @torch.no_grad()
    def logprobs_and_entropy(self, samples: list[Sample], model=None, with_entropy: bool = True):
        """``(logprobs, entropies)``: per sample ``[len]`` fp32 CPU tensors (entropies ``None`` without
        ``with_entropy``), one no-grad pass: the old policy's log-probs of a generation batch, and the entropies
        a top-entropy mask is taken from."""
        model = self.model if model is None else model
        out: list[torch.Tensor] = [torch.zeros(0) for _ in samples]
        ents: list[torch.Tensor] = [torch.zeros(0) for _ in samples]
        for mb in self.micro_batches(samples, model):
            lp, ent = self._forward(model, mb, with_entropy=with_entropy)
            for i, part in zip(mb.members, lp.float().cpu().split(mb.lengths)):
                out[i] = part
            if with_entropy:
                for i, part in zip(mb.members, ent.float().cpu().split(mb.lengths)):
                    ents[i] = part
        return out, (ents if with_entropy else None)

    # -- RL step --------------------------------------------------------------------------------

    def loss_mask(self, s: Sample) -> list[int]:
        """Per completion token, 1 in the loss: the model's own tokens, none of a completion cut at the response
        cap when ``mask_truncated`` (TRL's ``mask_truncated_completions``)."""
        if self.mask_truncated and s.finish_reason == "length":
            return [0] * len(s.completion_ids)
        return s.loss_mask

    def _check_inputs(self, samples: list[Sample], old_logprobs) -> None:
        if old_logprobs is not None and len(old_logprobs) != len(samples):
            raise ValueError(f"old_logprobs has {len(old_logprobs)} entries for {len(samples)} samples")
        for i, s in enumerate(samples):
            if len(s.logprobs) != len(s.completion_ids):
                raise ValueError(
                    f"sample {s.id!r}: {len(s.logprobs)} rollout logprobs for {len(s.completion_ids)} completion "
                    f"tokens; the rollout engine must return one sampling-time logprob per generated token "
                    f"(the TIS correction and the logprob_diff canary need them)")
            if self.kl_coef > 0 and s.completion_ids and (s.ref_logprobs is None or len(s.ref_logprobs) != len(s.completion_ids)):
                raise ValueError(
                    f"sample {s.id!r}: kl_coef={self.kl_coef} > 0 needs ref_logprobs for every completion token, "
                    f"got {None if s.ref_logprobs is None else len(s.ref_logprobs)} for {len(s.completion_ids)}; "
                    f"fill them with trainer.logprobs(samples, model=reference) or set kl_coef=0")
            if self.loss.distill_coef > 0 and s.completion_ids and (
                    s.teacher_logprobs is None or len(s.teacher_logprobs) != len(s.completion_ids)):
                raise ValueError(
                    f"sample {s.id!r}: a distillation objective needs teacher_logprobs for every completion token, "
                    f"got {None if s.teacher_logprobs is None else len(s.teacher_logprobs)} for "
                    f"{len(s.completion_ids)}; fill them with trainer.logprobs(samples, model=teacher)")
            if old_logprobs is not None and len(old_logprobs[i]) != len(s.completion_ids):
                raise ValueError(f"sample {s.id!r}: old_logprobs has {len(old_logprobs[i])} entries for "
                                 f"{len(s.completion_ids)} completion tokens")

    def accumulate_gradients(self, samples: list[Sample], old_logprobs: list[torch.Tensor] | None = None,
                             denominators: tuple[int, int] | None = None,
                             entropy_masks: list[torch.Tensor] | None = None) -> dict:
        """Forward/backward every micro-batch of ``samples``, adding into ``.grad``; no step.

        Returns raw accumulators (tensors) that :meth:`step` turns into metrics. Exposed so tests
        can compare the accumulated gradient across micro-batch sizes. ``denominators``
        (``num_tokens, num_seqs`` of the loss aggregation) default to this call's; ``(1, 1)`` makes
        the loss a plain sum, for a caller that scales the gradient once per step itself
        (trainer/streaming.py), or the whole step's counts when ``samples``
        is one data-parallel rank's share (trainer/dp.py). ``entropy_masks`` (per sample ``[len]``, from
        :func:`rollyard.algo.policy_loss.entropy_mask`): the top-entropy tokens the policy term keeps.
        """
        self._check_inputs(samples, old_logprobs)
        masks = [self.loss_mask(s) for s in samples]
        num_tokens = sum(sum(m) for m in masks)  # tool tokens (env/loop.py) carry no loss
        num_seqs = sum(1 for s in samples if s.completion_ids)
        den_tokens, den_seqs = denominators if denominators is not None else (num_tokens, num_seqs)
        ent_tokens = den_tokens if entropy_masks is None else int(sum(
            float((torch.as_tensor(m, dtype=torch.float32) * e).sum()) for m, e in zip(masks, entropy_masks)))
        want_kl = self.kl_coef > 0 or (num_seqs > 0 and all(s.ref_logprobs is not None for s in samples if s.completion_ids))
        # Only what moves the weights is computed (moves_weights); the denominators above stay the whole batch's.
        trained = [i for i in self.trained_indices(samples) if any(masks[i])]
        positions = [len(s.prompt_ids) + len(s.completion_ids) - 1 if s.completion_ids else 0 for s in samples]
        zero = torch.zeros((), device=self.device)
        acc = {"loss": zero.clone(), "pg_loss": zero.clone(), "kl_sum": zero.clone(), "entropy_sum": zero.clone(),
               "distill_kl_sum": zero.clone(),
               "eff_entropy_sum": zero.clone(), "eff_tokens": zero.clone(),
               "clipped": zero.clone(), "capped": zero.clone(), "diff_sum": zero.clone(), "diff_max": zero.clone(),
               "log_ratio": [], "tokens": num_tokens, "seqs": num_seqs, "micro_batches": 0, "packed_tokens": 0,
               "want_kl": want_kl, "distill": self.loss.distill_coef > 0,
               # the computed share: diagnostics (entropy, logprob gap, KL) are means over the computed tokens
               "computed_tokens": sum(sum(masks[i]) for i in trained),
               "skipped_seqs": num_seqs - len(trained),
               "positions": sum(positions), "skipped_positions": sum(positions) - sum(positions[i] for i in trained),
               "computed_positions": 0}
        head_grad.CLOCK.take()
        for mb in self.micro_batches([samples[i] for i in trained]):
            idx = [trained[k] for k in mb.members]  # into ``samples``
            b = self._loss_batch(mb, samples, idx, masks, old_logprobs, entropy_masks, want_kl)
            loss, st = policy_loss(self.loss, b, den_tokens, den_seqs, ent_tokens, self.entropy.coef)
            loss.backward()
            self._accumulate(acc, b, loss, st)
            acc["micro_batches"] += 1
            acc["packed_tokens"] += mb.num_tokens
            acc["computed_positions"] += mb.real_positions
        acc["lm_head_s"] = head_grad.CLOCK.take()  # the LM head's logprobs, forward and backward (trainer/head.py)
        return acc

    def _loss_batch(self, mb: MicroBatch, samples: list[Sample], idx: list[int], masks, old_logprobs, entropy_masks,
                    want_kl: bool) -> Batch:
        """The loss's per-token tensors of one micro-batch (``idx``: its members' indices into ``samples``)."""
        dev = self.device
        members = [samples[i] for i in idx]

        def cat(rows) -> torch.Tensor:
            return torch.tensor([x for r in rows for x in r], dtype=torch.float32).to(dev, non_blocking=True)

        logp, ent = self._forward(self.model, mb, with_entropy=True, entropy_grad=self.loss.needs_entropy_grad())
        # one update per batch: pi_old is the current policy, from this same forward (no extra pass)
        old = logp.detach() if old_logprobs is None else torch.cat(
            [old_logprobs[i].reshape(-1).float() for i in idx]).to(dev)
        adv = torch.tensor([s.advantage for s in members], dtype=torch.float32).repeat_interleave(
            torch.tensor(mb.lengths)).to(dev, non_blocking=True)
        return Batch(logp=logp, old_logp=old, rollout_logp=cat(s.logprobs for s in members), adv=adv,
                     seq_index=mb.seq_index.to(dev, non_blocking=True), mask=cat(masks[i] for i in idx),
                     ref_logp=cat(s.ref_logprobs for s in members) if want_kl else None, entropy=ent,
                     teacher_logp=cat(s.teacher_logprobs for s in members) if self.loss.distill_coef > 0 else None,
                     entropy_mask=None if entropy_masks is None else cat(entropy_masks[i].tolist() for i in idx))

    def _accumulate(self, acc: dict, b: Batch, loss: torch.Tensor, st: dict) -> None:
        with torch.no_grad():
            keep = b.mask > 0
            log_ratio = (b.old_logp - b.rollout_logp)[keep]
            raw = correction.BY_MODE[self.loss.is_mode](b.old_logp, b.rollout_logp, b.seq_index, b.mask, None, None)
            acc["loss"] += loss.detach()
            acc["pg_loss"] += st["pg_loss"]
            if "distill_kl_sum" in st:
                acc["distill_kl_sum"] += st["distill_kl_sum"]
            if "kl_sum" in st:
                acc["kl_sum"] += st["kl_sum"]
            acc["entropy_sum"] += (b.entropy.detach() * b.mask).sum()
            eff = b.mask if b.entropy_mask is None else b.mask * b.entropy_mask
            acc["eff_entropy_sum"] += (b.entropy.detach() * eff).sum()
            acc["eff_tokens"] += eff.sum()
            acc["clipped"] += st["clipped"]
            acc["capped"] += ((st["is_weight"] != raw) & keep).sum()
            acc["diff_sum"] += log_ratio.abs().sum()
            if log_ratio.numel():
                acc["diff_max"] = torch.maximum(acc["diff_max"], log_ratio.abs().max())
            acc["log_ratio"].append(log_ratio)

    def schedule_lr(self) -> float:
        """Set the rate of the optimizer step about to run (lr x the schedule at the count of steps taken so far)
        and count this step; returns the rate. Called once per :meth:`step` whether or not the update runs: a
        skipped non-finite step and a step with nothing to learn advance the schedule too, so the rate is a function
        of the step count (rollyard/schedule.py)."""
        name, total, warmup, args, every = self.lr_schedule
        k = int(self.optimizer.param_groups[0].get(SCHEDULE_STEP, 0))
        lr = self.base_lr * schedule.multiplier(name, k // every, total, warmup, args)
        for g in self.optimizer.param_groups:
            g["lr"], g[SCHEDULE_STEP] = lr, k + 1
        return lr

    def _optimizer_step(self, loss: float = 0.0) -> tuple[float, bool]:
        """Clip, step, zero; returns ``(grad_norm, skipped)``. A non-finite loss or gradient norm
        skips the update (printed and counted by ``self.skips``, which raises if it repeats)."""
        t0 = time.perf_counter()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        skipped = self.skips.check(loss, float(grad_norm))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_s = time.perf_counter() - t0  # the step's clip + AdamW (per step, by parameter count)
        return float(grad_norm), skipped

    def step(self, samples: list[Sample], old_logprobs: list[torch.Tensor] | None = None,
             entropy_masks: list[torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step over all ``samples``; returns float metrics (see module docs).

        Uses ``sample.advantage`` (per sequence, broadcast over its tokens), ``sample.logprobs``
        (the rollout's mu, for TIS and the canaries) and ``sample.ref_logprobs`` (when
        ``kl_coef > 0``). ``old_logprobs`` (per sample, e.g. from :meth:`logprobs` before the first
        of several updates on one batch) is pi_old; ``None`` means pi_old = the current policy,
        taken from this same forward (no extra pass). ``entropy_masks``: see :meth:`accumulate_gradients`.
        """
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_s = 0.0
        if ENTROPY_STATE in self.optimizer.param_groups[0]:  # a resumed run's adaptive entropy coefficient
            self.entropy.load(self.optimizer.param_groups[0][ENTROPY_STATE])
        acc = self.accumulate_gradients(samples, old_logprobs, entropy_masks=entropy_masks)
        lr = self.schedule_lr()
        skipped = False
        if acc["tokens"] == 0:
            grad_norm = 0.0  # nothing to learn from; leave the weights (and Adam's moments) alone
            self.optimizer.zero_grad(set_to_none=True)
        else:
            if acc["micro_batches"] == 0:
                self.zero_missing_grads()  # every sample skipped: the step on the zero gradient still runs
            grad_norm, skipped = self._optimizer_step(float(acc["loss"]))
        coef = self.entropy.coef
        if float(acc["eff_tokens"]) > 0:  # a step that computed no token measured no entropy
            self.entropy.update(float(acc["eff_entropy_sum"]) / float(acc["eff_tokens"]))
        if self.entropy.adaptive:  # kept in the optimizer's state, so a checkpoint carries it (resume continues it)
            self.optimizer.param_groups[0][ENTROPY_STATE] = self.entropy.state()
        ratio = torch.cat(acc["log_ratio"]).exp() if acc["log_ratio"] else torch.zeros(0)
        p05, p50, p95 = _quantiles(ratio, [0.05, 0.5, 0.95])
        return {"loss": float(acc["loss"]), "pg_loss": float(acc["pg_loss"]), "grad_norm": grad_norm,
                "ratio_p05": p05, "ratio_p50": p50, "ratio_p95": p95,
                **step_metrics([acc]), "skipped": float(skipped), "skipped_steps": float(self.skips.total),
                "optimizer_s": self.optimizer_s, "lr": lr, **({"entropy_coef": coef} if self.entropy.on else {})}

    # -- supervised warm start --------------------------------------------------------------------

    def sft_step(self, sequences: list[tuple]) -> dict[str, float]:
        """One optimizer step on the mean NLL of the completion tokens of ``(prompt, completion[, mask])``: every
        token, or those where ``mask`` is 1 (0: context only, a tool's output in a multi-turn demonstration, as
        the GRPO loss masks it)."""
        self.optimizer.zero_grad(set_to_none=True)
        masks = [s[2] if len(s) > 2 else [1] * len(s[1]) for s in sequences]
        num_tokens = sum(sum(m) for m in masks)
        total = torch.zeros((), device=self.device)
        mbs = self._pack([(s[0], s[1]) for s in sequences])
        for mb in mbs:
            logp, _ = self._forward(self.model, mb)
            keep = torch.tensor([x for i in mb.members for x in masks[i]], dtype=logp.dtype, device=logp.device)
            loss = -(logp * keep).sum() / max(num_tokens, 1)
            loss.backward()
            total += loss.detach()
        grad_norm = self._optimizer_step(float(total))[0] if num_tokens else 0.0
        return {"loss": float(total), "grad_norm": grad_norm, "tokens": float(num_tokens),
                "micro_batches": float(len(mbs))}


def step_metrics(accs: list[dict]) -> dict[str, float]:
    """The counting metrics of one step from its accumulators (one per ``accumulate_gradients`` call).

    ``clip_frac`` is over every loss token (a skipped sample's tokens are never clipped); ``entropy``,
    ``tis_capped_frac``, ``logprob_diff`` and ``kl`` are means over the tokens the forward computed.
    ``skipped_frac``: the share of the step's sequences left out of the forward/backward because they
    cannot move the weights (:meth:`Trainer.moves_weights`); ``skipped_positions_frac``: their share of
    the step's positions (``len(prompt) + len(completion) - 1`` per sequence, before any packing).
    ``positions``: that count over every sequence (what an unshared, unskipped step computes without
    padding); ``computed_positions``: the real (not pad) positions the micro-batches computed, each
    shared prompt prefix once: the work 6 x params x positions prices (``packed_tokens`` adds the pads).
    ``lm_head_s``: seconds in the LM head's logprobs, forward and backward, when ``trainer/head.py`` computed them
    (a 262k-vocabulary head is most of Gemma 3's step).
    """
    def total(key: str) -> float:
        return float(sum(float(a[key]) for a in accs))

    n, computed = max(total("tokens"), 1.0), max(total("computed_tokens"), 1.0)
    out = {"clip_frac": total("clipped") / n, "entropy": total("entropy_sum") / computed,
           "tis_capped_frac": total("capped") / computed, "logprob_diff": total("diff_sum") / computed,
           "logprob_diff_max": max((float(a["diff_max"]) for a in accs), default=0.0),
           "tokens": total("tokens"), "packed_tokens": total("packed_tokens"), "micro_batches": total("micro_batches"),
           "skipped_frac": total("skipped_seqs") / max(total("seqs"), 1.0),
           "skipped_positions_frac": total("skipped_positions") / max(total("positions"), 1.0),
           "positions": total("positions"), "computed_positions": total("computed_positions")}
    if accs and all(a["want_kl"] for a in accs):
        out["kl"] = total("kl_sum") / computed
    if any(a.get("distill") for a in accs):  # the student's reverse KL to the teacher, per token (algo/distill.py)
        out["distill_kl"] = total("distill_kl_sum") / computed
    head_s = sum(float(a.get("lm_head_s", 0.0)) for a in accs)
    if head_s:  # seconds of the step in the LM head (trainer/head.py's path: a plain head, fp32 or bf16 weights)
        out["lm_head_s"] = head_s
    return out


# bench/precision.py on this 2-core AVX512-BF16 CPU (30 layers, SmolLM2's 49152 vocabulary, one 32 x 64-token
# batch), bf16 / fp32 step time: width 256 (22.6M decoder matmul parameters) 0.81, width 576 (119M) 0.64; with
# 4 layers (3M and 16M, the lm_head dominating) 1.17 and 1.14. Below this size bf16 autocast's casts cost more
# than its matmuls save: the tiny presets (0.3-4.5M) stay fp32.
BF16_MIN_DECODER_PARAMS = 20_000_000


def decoder_matmul_params(model) -> int:
    """Parameters of the decoder layers' matrices (embeddings and lm_head left out): what bf16 speeds up."""
    return sum(p.numel() for n, p in model.named_parameters()
               if p.dim() == 2 and "embed" not in n and "lm_head" not in n)


def auto_precision(model, device: torch.device) -> str:
    """``trainer.precision=auto``: bf16 on a GPU, and on a CPU that multiplies bf16 natively (AVX512-BF16, AMX)
    once the decoder's matrices are large enough to repay the casts; fp32 otherwise."""
    if device.type == "cuda":
        return "bf16"
    if device.type == "cpu" and cpu_gemm.cpu_has_native_bf16() and decoder_matmul_params(model) >= BF16_MIN_DECODER_PARAMS:
        return "bf16"
    return "fp32"


def precision_choice(setting: str, model, device: torch.device) -> tuple[str, str]:
    """``(the precision the Trainer runs, why)`` for ``trainer.precision=setting``: the start-up line and run.json
    say it. The choice is :func:`auto_precision`'s (the Trainer's own); this only words it. An explicit bf16 on
    a CPU without native bf16 says that it is emulated there and slower than fp32."""
    cpu = device.type == "cpu"
    native = cpu and cpu_gemm.cpu_has_native_bf16()
    if setting != "auto":
        why = f"set by trainer.precision={setting}"
        if setting == "bf16" and cpu and not native:
            why += ("; this CPU has no native bf16 (no AVX512-BF16 or AMX): bf16 is emulated and slower than fp32 "
                    "(a trainer step measured 12-40x fp32's on such a CPU, 2026-11-27; bench/precision.py measures this "
                    "one); trainer.precision=fp32 or auto is faster here")
        return setting, why
    chosen = auto_precision(model, device)
    if not cpu:
        return chosen, f"auto: {chosen} on {device.type}"
    if not native:
        return chosen, "auto: fp32, this CPU has no native bf16 (no AVX512-BF16 or AMX)"
    n = decoder_matmul_params(model)
    side = ">=" if n >= BF16_MIN_DECODER_PARAMS else "<"
    return chosen, (f"auto: {chosen}, native bf16 on this CPU and {n / 1e6:.1f}M decoder matrix parameters {side} "
                    f"{BF16_MIN_DECODER_PARAMS / 1e6:.0f}M (below it bf16's casts cost more than its matmuls save)")


def trainer_kwargs(cfg: RunConfig) -> dict:
    """The Trainer's keyword arguments from the config (one place, so every rank builds the same one)."""
    t, a = cfg.trainer, cfg.algo
    return {"lr": t.lr, "weight_decay": t.weight_decay, "max_grad_norm": t.max_grad_norm,
            "micro_batch_tokens": t.micro_batch_tokens, "temperature": cfg.rollout.temperature or 1.0,
            # greedy rollouts record full logprobs (top-k / top-p do not change an argmax): the trainer's too
            "top_p": cfg.rollout.top_p if cfg.rollout.temperature else 1.0,
            "top_k": cfg.rollout.top_k if cfg.rollout.temperature else 0,
            "logprob_chunk": t.logprob_chunk, "loss": loss_spec(cfg), "mask_truncated": a.mask_truncated,
            "disable_dropout": t.disable_dropout, "lm_head_fp32": t.lm_head_fp32,
            "entropy": EntropyControl(start=a.entropy_coef, adaptive=a.adaptive_entropy, target=a.entropy_target,
                                      delta=a.entropy_coef_delta, low=a.entropy_coef_min, high=a.entropy_coef_max),
            "max_skipped_steps": t.max_skipped_steps, "precision": t.precision,
            "activation_checkpointing": t.activation_checkpointing, "optimizer_state": t.optimizer_state,
            "skip_zero_advantage": t.useful_work, "share_prompts": t.useful_work, **optimizer_settings(cfg)}


def optimizer_settings(cfg: RunConfig) -> dict:
    """AdamW's betas and epsilon, and the learning-rate schedule over the run's optimizer steps (or its steps)."""
    t = cfg.trainer
    total, every = schedule_length(cfg)
    return {"betas": (t.adam_beta1, t.adam_beta2), "eps": t.adam_eps, "lr_schedule": t.lr_schedule,
            "decay_norms_and_biases": t.decay_norms_and_biases,
            "schedule_steps": total, "schedule_every": every, "lr_schedule_kwargs": dict(t.lr_schedule_kwargs),
            "warmup_steps": schedule.warmup_steps(total, t.warmup_steps, t.warmup_ratio, t.warmup_rounding)}


def loss_spec(cfg: RunConfig) -> LossSpec:
    """What the loss computes, from ``algo.*`` (one place: every rank and every placement builds the same)."""
    a = cfg.algo
    return LossSpec(objective=a.policy_loss, agg="seq-mean-token-mean" if a.loss_agg == "seq-mean" else a.loss_agg,
                    level=a.ratio_level, clip_low=a.clip_low, clip_high=a.clip_high, delta=a.delta,
                    sapo_temperature_pos=a.sapo_temperature_pos, sapo_temperature_neg=a.sapo_temperature_neg,
                    vespo=(a.vespo_k_pos, a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg),
                    is_mode=a.tis_mode, is_cap=a.tis_cap, is_floor=a.tis_min,
                    off_policy_threshold=a.off_policy_mask_threshold, kl_coef=a.kl_coef,
                    kl_bias_correction=a.kl_bias_correction, entropy_coef=a.entropy_coef,
                    top_entropy_quantile=a.top_entropy_quantile, max_len=cfg.rollout.max_new_tokens,
                    reward_weight=distill.reward_weight(a.objective),
                    distill_coef=a.distill_coef if a.objective != "rl" else 0.0)
