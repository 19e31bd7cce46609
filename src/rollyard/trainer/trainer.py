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
import time
import warnings

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from rollyard import schedule
from rollyard.algo import correction
from rollyard.algo import support as algo_support
from rollyard.algo.entropy_control import EntropyControl
from rollyard.algo.loss import AGGS
from rollyard.algo.policy_loss import Batch, LossSpec, policy_loss
from rollyard.model import families
from rollyard.model import gemm as cpu_gemm
from rollyard.model import kernels as cpu_kernels
from rollyard.model import memory as cpu_memory
from rollyard.trainer import head as head_grad
from rollyard.trainer.layout import attention_pair_weight, decoder_of, micro_batch_cost, packing_is_isolated
from rollyard.trainer.logprobs import chunked_support_logprobs, chunked_token_logprobs
from rollyard.trainer.metrics import quantiles, step_metrics
from rollyard.trainer.numerics import SkipGuard
from rollyard.trainer.optim import ENTROPY_STATE, SCHEDULE_STEP, build_optimizer, step_on_zero_gradient
from rollyard.trainer.packing import LAYOUTS, MicroBatch, plan, prefix_shared
from rollyard.trainer.precision import PRECISIONS, auto_precision
from rollyard.trainer.recompute import kept_layers
from rollyard.types import Sample


def _check_args(loss: LossSpec, temperature: float, precision: str, layout: str) -> None:
    if loss.agg not in AGGS:
        raise ValueError(f"loss_agg={loss.agg!r}: expected one of {AGGS}")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: logprobs are taken under log_softmax(logits / T), "
                         f"T must be > 0 (use 1.0 for greedy rollouts)")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {PRECISIONS}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")


def tied_head(model) -> bool:
    """The input embedding and the LM head are one trainable tensor (SmolLM2, Gemma 3)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight and embed.weight.requires_grad


def packs(model) -> bool:
    """Whether the trainer packs ``model``'s sequences into shared rows. Fails over at start-up, not silently an
    hour in: if its attention does not turn restarting position_ids into sequence boundaries, padded only."""
    if packing_is_isolated(model):
        return True
    warnings.warn(f"{type(model).__name__} ({model.config._attn_implementation} attention) lets packed "
                  f"sequences attend across boundaries; rollyard will not pack (padded micro-batches "
                  f"only). Use attn_implementation='sdpa', 'eager' or 'flash_attention_2'.", stacklevel=3)
    return False


def no_dropout(model) -> None:
    """Every dropout probability of ``model`` to 0: ``nn.Dropout`` modules and HF attention's functional dropout."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


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
        _check_args(loss, temperature, precision, layout)
        self.device = torch.device(device)
        if self.device.type == "cpu":
            cpu_memory.keep_freed_memory()  # activations reuse the last step's pages (see cpu_memory)
        self.model = model.to(self.device)
        self.checkpointing = bool(activation_checkpointing)
        self.keep_layers = activation_checkpointing == "auto"  # the last layers un-recomputed where free (recompute.py)
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
            no_dropout(model)
        self.entropy = entropy if entropy is not None else EntropyControl(start=loss.entropy_coef)
        # Leave samples that cannot move the weights out of the forward/backward (moves_weights); off only
        # to measure or test against the unskipped step.
        self.skip_zero_advantage = skip_zero_advantage
        # Each group's prompt computed once in training and scoring (micro_batches); off only to measure or test.
        self.share_prompts = share_prompts
        self._said_unshared: dict[int, object] = {}
        self.layout = layout
        self.fast_forward = fast_forward
        self._fast: dict[int, tuple[object, bool]] = {}  # id(model) -> (model, fast forward usable)
        self.attn_weight = attention_pair_weight(model)
        self.group_cost = micro_batch_cost(model, self.device, self.precision)
        self.skips = SkipGuard(max_skipped_steps)  # non-finite loss/gradient: skip loudly, stop if it repeats
        self.optimizer_s = 0.0  # seconds of the last optimizer step (clip + AdamW): train/optimizer_s
        self.optimizer, self.params = build_optimizer(model, optimizer_state, lr=lr, betas=betas, eps=eps,
                                                      weight_decay=weight_decay,
                                                      decay_norms_and_biases=decay_norms_and_biases)
        # The learning rate of optimizer step k is lr x the schedule's multiplier (rollyard/schedule.py) at
        # k // schedule_every of schedule_steps, set before the step by schedule_lr(); k is kept in the optimizer's
        # param groups, so a checkpoint (and every data-parallel rank's copy of it) carries it.
        self.base_lr = lr
        self.lr_schedule = (lr_schedule, int(schedule_steps), int(warmup_steps),
                            schedule.resolve(lr_schedule, lr_schedule_kwargs, lr, int(warmup_steps)), int(schedule_every))
        self.packing = packs(self.model)

    # -- the packed forward ---------------------------------------------------------------------

    def _autocast(self):
        if self.precision != "bf16":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        if self.device.type == "cpu":
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        return stack

    def _forward(self, model, mb: MicroBatch, with_entropy: bool = False, entropy_grad: bool = False, support=None,
                 kept: int = 0):
        """``(logp [N], entropy [N] | None)`` of ``mb``'s completion tokens under ``model``. ``support`` (GKD,
        ``algo/gkd.py``) adds a third result: an int ``k``, the top-``k`` ``(ids [N, k], logp [N, k])`` of the whole
        distribution at each position (a teacher's); ``[N, k]`` ids, the log-probs at them (the student's). Both come
        from the same logits chunks as the sampled tokens' log-probs, one pass over the LM head, unless the rollout's
        support is truncated (top-p / top-k) or the entropy carries a gradient: then the head is computed twice.
        ``kept``: the last decoder layers the fast forward leaves un-recomputed (:meth:`_kept_layers`)."""
        decoder = decoder_of(model)
        ids = mb.input_ids.to(self.device, non_blocking=True)
        pos = None if mb.position_ids is None else mb.position_ids.to(self.device, non_blocking=True)
        # an embedding tied to the LM head gets the head's dense gradient in this backward: the lookup's as the rows
        # it touched, the same sums (fast.RowsGradLookup); CPU only (elsewhere the dense backward is another kernel),
        # a plain tensor only (a sharded DTensor's gradient stays what FSDP expects)
        rows = (self.device.type == "cpu" and torch.is_grad_enabled() and tied_head(model)
                and type(model.get_input_embeddings().weight.data) is torch.Tensor)
        with self._autocast():
            if mb.segments is not None:  # prefix-shared rows (only planned for a model on the fast forward)
                hidden = families.train_hidden(model, ids, pos, mb.segments.to(self.device, non_blocking=True), rows,
                                               kept_layers=kept)
            elif pos is None and self._use_fast(model):
                hidden = families.train_hidden(model, ids, rows_grad=rows, kept_layers=kept)  # padded, fast forward
            else:
                # No attention_mask: restarting position_ids => block-diagonal causal mask (packed);
                # position_ids None => plain causal, pads after every real token (padded; packing.py).
                hidden = decoder(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.rows.to(self.device, non_blocking=True))
            head, softcap = model.get_output_embeddings(), getattr(model.config, "final_logit_softcapping", None)
            targets = mb.targets.to(self.device, non_blocking=True)
            if support is None:
                return chunked_token_logprobs(
                    hidden, head, targets, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    chunk=self.logprob_chunk, softcap=softcap, with_entropy=with_entropy, entropy_grad=entropy_grad,
                    fp32_head=self.lm_head_fp32)
            kw = dict(temperature=self.temperature, chunk=self.logprob_chunk, softcap=softcap, fp32_head=self.lm_head_fp32)
            support = support if isinstance(support, int) else support.to(self.device, non_blocking=True)
            one_pass = not algo_support.active(self.top_p, self.top_k) and not entropy_grad
            lp, ent, top_ids, at = chunked_support_logprobs(hidden, head, targets, support,
                                                            with_entropy=with_entropy and one_pass, **kw)
            if not one_pass:  # the sampled tokens' log-probs over the rollout's support (or a differentiable entropy)
                lp, ent = chunked_token_logprobs(
                    hidden, head, targets, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    chunk=self.logprob_chunk, softcap=softcap, with_entropy=with_entropy, entropy_grad=entropy_grad,
                    fp32_head=self.lm_head_fp32)
            return lp, ent, ((top_ids, at) if isinstance(support, int) else at)

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

    @torch.no_grad()
    def top_k_logprobs(self, samples: list[Sample], model, k: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per sample ``(logp [len], ids [len, k], top_logp [len, k])`` (CPU) under ``model`` in one pass: the sampled
        tokens' log-probs (as :meth:`logprobs`) and the ``k`` most likely tokens of the whole distribution at each
        completion position with their log-probs (a GKD teacher's, ``algo/gkd.py``)."""
        out = [(torch.zeros(0), torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k)) for _ in samples]
        for mb in self.micro_batches(samples, model):
            lp, _, (ids, top) = self._forward(model, mb, support=k)
            for i, a, b, c in zip(mb.members, lp.float().cpu().split(mb.lengths), ids.cpu().split(mb.lengths),
                                  top.float().cpu().split(mb.lengths)):
                out[i] = (a, b, c)
        return out

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
            if self.loss.gkd_beta is not None and s.completion_ids and (
                    s.teacher_top_ids is None or len(s.teacher_top_ids) != len(s.completion_ids)):
                raise ValueError(
                    f"sample {s.id!r}: algo.objective=gkd needs the teacher's top-k ids and log-probs for every "
                    f"completion token, got {None if s.teacher_top_ids is None else len(s.teacher_top_ids)} for "
                    f"{len(s.completion_ids)}; fill them with trainer.top_k_logprobs(samples, teacher, k)")
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
               "distill_kl_sum": zero.clone(), "gkd_jsd_sum": zero.clone(), "gkd": self.loss.gkd_beta is not None,
               "eff_entropy_sum": zero.clone(), "eff_tokens": zero.clone(),
               "clipped": zero.clone(), "capped": zero.clone(), "diff_sum": zero.clone(), "diff_max": zero.clone(),
               "log_ratio": [], "tokens": num_tokens, "seqs": num_seqs, "micro_batches": 0, "packed_tokens": 0,
               "want_kl": want_kl, "distill": self.loss.distill_coef > 0,
               # the computed share: diagnostics (entropy, logprob gap, KL) are means over the computed tokens
               "computed_tokens": sum(sum(masks[i]) for i in trained),
               "skipped_seqs": num_seqs - len(trained),
               "positions": sum(positions), "skipped_positions": sum(positions) - sum(positions[i] for i in trained),
               "computed_positions": 0, "recomputed_positions": 0.0}
        head_grad.CLOCK.take()
        layers = getattr(self.model.config, "num_hidden_layers", 1)
        for mb in self.micro_batches([samples[i] for i in trained]):
            idx = [trained[k] for k in mb.members]  # into ``samples``
            kept = self._kept_layers(mb)
            b = self._loss_batch(mb, samples, idx, masks, old_logprobs, entropy_masks, want_kl, kept)
            loss, st = policy_loss(self.loss, b, den_tokens, den_seqs, ent_tokens, self.entropy.coef)
            loss.backward()
            self._accumulate(acc, b, loss, st)
            acc["micro_batches"] += 1
            acc["packed_tokens"] += mb.num_tokens
            acc["computed_positions"] += mb.real_positions
            if self.checkpointing:  # the positions' layers the backward computed again (each layer's share)
                acc["recomputed_positions"] += mb.real_positions * (layers - kept) / layers
        acc["lm_head_s"] = head_grad.CLOCK.take()  # the LM head's logprobs, forward and backward (trainer/head.py)
        return acc

    def _kept_layers(self, mb: MicroBatch) -> int:
        """How many of the policy's last decoder layers ``mb``'s forward leaves un-recomputed: under
        ``activation_checkpointing=auto`` on the fast forward, what ``recompute.kept_layers`` lets fit in the
        gradients not yet allocated less the LM head's transient (its weight gradient if trainable, two chunks of
        logits); else 0."""
        fast = mb.segments is not None or (mb.position_ids is None and self._use_fast(self.model))
        if not (self.keep_layers and fast and torch.is_grad_enabled()):
            return 0
        free = sum(p.numel() * p.element_size() for p in self.params if p.grad is None)
        head = self.model.get_output_embeddings().weight
        chunk = min(self.logprob_chunk, int(mb.rows.numel()))
        head_bytes = (4 * head.numel() if head.requires_grad and head.grad is None else 0) + 8 * chunk * head.shape[0]
        dtype = torch.bfloat16 if self.precision == "bf16" else head.dtype  # bf16: autocast's concatenated casts
        return kept_layers(self.model.config, mb.input_ids.numel(), mb.input_ids.shape[1], free, head_bytes,
                           concatenated=not cpu_gemm.by_parts(dtype, self.device))

    def _loss_batch(self, mb: MicroBatch, samples: list[Sample], idx: list[int], masks, old_logprobs, entropy_masks,
                    want_kl: bool, kept: int = 0) -> Batch:
        """The loss's per-token tensors of one micro-batch (``idx``: its members' indices into ``samples``)."""
        dev = self.device
        members = [samples[i] for i in idx]

        def cat(rows) -> torch.Tensor:
            return torch.tensor([x for r in rows for x in r], dtype=torch.float32).to(dev, non_blocking=True)

        gkd = self.loss.gkd_beta is not None  # the student's log-probs at the teacher's top-k ids (algo/gkd.py)
        ids = torch.tensor([x for s in members for x in s.teacher_top_ids], dtype=torch.long) if gkd else None
        logp, ent, *at = self._forward(self.model, mb, with_entropy=True, entropy_grad=self.loss.needs_entropy_grad(),
                                       support=ids, kept=kept)
        # one update per batch: pi_old is the current policy, from this same forward (no extra pass)
        old = logp.detach() if old_logprobs is None else torch.cat(
            [old_logprobs[i].reshape(-1).float() for i in idx]).to(dev)
        adv = torch.tensor([s.advantage for s in members], dtype=torch.float32).repeat_interleave(
            torch.tensor(mb.lengths)).to(dev, non_blocking=True)
        return Batch(logp=logp, old_logp=old, rollout_logp=cat(s.logprobs for s in members), adv=adv,
                     seq_index=mb.seq_index.to(dev, non_blocking=True), mask=cat(masks[i] for i in idx),
                     ref_logp=cat(s.ref_logprobs for s in members) if want_kl else None, entropy=ent,
                     teacher_logp=cat(s.teacher_logprobs for s in members) if self.loss.distill_coef > 0 else None,
                     entropy_mask=None if entropy_masks is None else cat(entropy_masks[i].tolist() for i in idx),
                     support_logp=at[0] if gkd else None,
                     teacher_support_logp=torch.tensor([x for s in members for x in s.teacher_top_logprobs],
                                                       dtype=torch.float32).to(dev) if gkd else None)

    def _accumulate(self, acc: dict, b: Batch, loss: torch.Tensor, st: dict) -> None:
        with torch.no_grad():
            keep = b.mask > 0
            log_ratio = (b.old_logp - b.rollout_logp)[keep]
            raw = correction.BY_MODE[self.loss.is_mode](b.old_logp, b.rollout_logp, b.seq_index, b.mask, None, None)
            acc["loss"] += loss.detach()
            acc["pg_loss"] += st["pg_loss"]
            if "distill_kl_sum" in st:
                acc["distill_kl_sum"] += st["distill_kl_sum"]
            if "gkd_jsd_sum" in st:
                acc["gkd_jsd_sum"] += st["gkd_jsd_sum"]
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
        with_grad = [p for p in self.params if p.grad is not None]
        grads = [p.grad for p in with_grad]  # (one pass over them on the compiled kernel where it takes them)
        grad_norm = cpu_kernels.grad_norm(grads)
        if grad_norm is None:
            grad_norm = torch.nn.utils.get_total_norm(grads)
        # clip_grad_norm_'s factor, max_norm / (norm + 1e-6) clamped to 1: a pass over the gradients only where it
        # is below 1 (a factor of 1 leaves them as they are)
        if float(grad_norm) + 1e-6 > self.max_grad_norm:
            torch.nn.utils.clip_grads_with_norm_(with_grad, self.max_grad_norm, grad_norm)
        skipped = self.skips.check(loss, float(grad_norm))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_s = time.perf_counter() - t0  # the step's clip + AdamW (per step, by parameter count)
        return float(grad_norm), skipped

    def zero_gradient_step(self, loss: float = 0.0) -> tuple[float, bool]:
        """The optimizer step of a step that computed nothing (every sample skipped): AdamW's step on the zero
        gradient, without allocating one where ``optim.step_on_zero_gradient`` applies (the same update), else on
        zero-filled gradients (:meth:`zero_missing_grads`). Returns ``(grad_norm, skipped)`` as
        :meth:`_optimizer_step`."""
        t0 = time.perf_counter()
        if math.isfinite(loss) and all(p.grad is None for p in self.params) and step_on_zero_gradient(self.optimizer):
            self.skips.check(loss, 0.0)
            self.optimizer_s = time.perf_counter() - t0
            return 0.0, False
        self.zero_missing_grads()
        return self._optimizer_step(loss)

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
            if acc["micro_batches"] == 0:  # every sample skipped: the step on the zero gradient still runs
                grad_norm, skipped = self.zero_gradient_step(float(acc["loss"]))
            else:
                grad_norm, skipped = self._optimizer_step(float(acc["loss"]))
        coef = self.entropy.coef
        if float(acc["eff_tokens"]) > 0:  # a step that computed no token measured no entropy
            self.entropy.update(float(acc["eff_entropy_sum"]) / float(acc["eff_tokens"]))
        if self.entropy.adaptive:  # kept in the optimizer's state, so a checkpoint carries it (resume continues it)
            self.optimizer.param_groups[0][ENTROPY_STATE] = self.entropy.state()
        ratio = torch.cat(acc["log_ratio"]).exp() if acc["log_ratio"] else torch.zeros(0)
        p05, p50, p95 = quantiles(ratio, [0.05, 0.5, 0.95])
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


