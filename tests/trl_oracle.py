"""TRL 1.16 as the oracle (issue 53, item 3): TRL's own ``GRPOTrainer``, built offline on a tiny in-memory model,
computes its loss and every parameter's gradient for a batch of completions we give it.

A helper module, not a test file: ``tests/test_trl_oracle_harness.py`` checks the harness itself, the rollyard-vs-TRL
comparison tests build on it. Needs ``trl==1.16.0`` (the ``test`` extra); CPU, fp32, no vLLM, no hub, no wandb.

API
---
``tiny_tokenizer()`` / ``tiny_model(seed=0, ...)``
    A BPE tokenizer trained here (vocab ~300, ``<|endoftext|>`` pad, ``<|im_end|>`` EOS) and a random-init fp32
    Qwen2 (2 layers, hidden 32, untied head) over it. ``tiny_model`` returns a fresh model each call (same seed:
    same weights), so rollyard and TRL can each get their own copy (``copy.deepcopy`` or ``save_pretrained`` work
    too). Note TRL patches the model it is given (``add_fused_lm_head``: its ``forward`` gains ``fused_lm_head=``):
    give TRL its own copy.

``build_trl_trainer(model, tokenizer, *, reward_funcs=1, **grpo_config_kwargs) -> GRPOTrainer``
    ``GRPOTrainer(model, reward_funcs, GRPOConfig(...), Dataset, tokenizer)`` in well under a second. Every
    ``GRPOConfig`` name is passed through as given (``loss_type``, ``importance_sampling_level``, ``epsilon``,
    ``epsilon_high``, ``delta``, ``beta``, ``use_bias_correction_kl``, ``temperature``, ``max_completion_length``
    (the ``dr_grpo`` constant), ``mask_truncated_completions``, ``top_entropy_quantile``, ``entropy_coef``,
    ``use_adaptive_entropy`` / ``entropy_*``, ``off_policy_mask_threshold``, ``sapo_*``, ``vespo_*``,
    ``scale_rewards``, ``reward_weights``, ``multi_objective_aggregation``, ``num_iterations``,
    ``gradient_accumulation_steps``, ``steps_per_generation``, ``vllm_importance_sampling_correction`` /
    ``_mode`` / ``_clip_max`` / ``_clip_min``, the lr-schedule and optimizer names...), with these defaults unless
    given: ``num_generations=2``, ``per_device_train_batch_size=4``, ``max_completion_length=16``,
    ``temperature=1.0``, ``report_to="none"``, ``use_cpu=True``, ``bf16=False``, ``output_dir`` a temporary folder.
    Two names TRL cannot build offline are emulated:

    * ``use_vllm=True``: the trainer is built without vLLM, then ``trainer.use_vllm`` is set, so that
      ``_generate_and_score_completions`` takes its vLLM importance-sampling path (rollout log-probs =
      ``sampling_per_token_logps`` from the batch) and ``_compute_loss`` multiplies by the ratio. TRL's own
      start-up check for ``vespo`` (only the token_* IS modes) is repeated here.
    * ``beta != 0``: TRL builds its reference model ``from_pretrained(model.config._name_or_path)``; the model is
      saved under ``output_dir`` first and its ``_name_or_path`` pointed there, so the reference is a copy of the
      weights the trainer was built with (unless a batch gives ``ref_per_token_logps``).

    ``reward_funcs=k``: k reward functions named ``r0..r{k-1}`` returning each sequence's ``reward[j]`` (used only
    when a batch gives rewards instead of advantages).

``trl_inputs(trainer, batch, *, num_items_in_batch=None) -> dict``
    The ``inputs`` dict ``_compute_loss`` takes, built by TRL's own ``_generate_and_score_completions`` (padding,
    masks, ``mask_truncated_completions``, ``num_items_in_batch``, old / ref log-probs, the vLLM importance-sampling
    ratio for every ``vllm_importance_sampling_mode`` and clip bounds, reward -> advantage): generation is replaced by
    TRL's ``rollout_func`` hook returning the batch's token ids (and ``env_mask`` = tool masks), rewards come from the
    reward functions above, and where a batch gives old / ref log-probs TRL's forward for them is replaced by the
    given values (so the IS ratio is TRL's ``exp(old - sampling)`` with the given ``old``). ``batch`` is a list of
    sequences, one dict each (one row per completion, groups of ``num_generations`` consecutive rows):

    ===========================  ====================================================================================
    ``prompt_ids``               list[int], required. TRL left-pads prompts with the pad id (mask 0).
    ``completion_ids``           list[int], required, EOS included if the sequence ended. Right-padded (mask 0).
    ``advantage``                float: the sequence's advantage, used as is (TRL's reward normalisation skipped).
    ``reward``                   float or list[float] (one per reward function), instead of ``advantage``: TRL
                                 computes the advantages (``scale_rewards``, ``multi_objective_aggregation``,
                                 ``reward_weights``). Every row gives one or the other, the whole batch alike.
    ``old_per_token_logps``      list[float] per completion token (pi_old). Absent: on-policy (TRL uses
                                 ``per_token_logps.detach()``, or with ``use_vllm`` its own no-grad forward).
    ``sampling_per_token_logps`` list[float] per completion token: the rollout engine's log-probs (vLLM's in TRL).
                                 Needed with ``use_vllm``; ``None`` entries become NaN (ratio 1, as in TRL). Also read
                                 by ``off_policy_mask_threshold``.
    ``ref_per_token_logps``      list[float] per completion token (with ``beta != 0``). Absent: TRL's reference model.
    ``tool_mask``                list[int] per completion token, 1 = model token, 0 = tool output (TRL ``env_mask``).
    ===========================  ====================================================================================

    ``num_items_in_batch`` overrides TRL's count (the loss-mask sum over this batch), e.g. to stand for a larger
    generation batch. The returned tensors: ``prompt_ids`` / ``prompt_mask`` (B, P), ``completion_ids`` /
    ``completion_mask`` (B, C), ``advantages`` (B,), ``num_items_in_batch`` (scalar), and when present
    ``old_per_token_logps``, ``sampling_per_token_logps``, ``ref_per_token_logps``, ``tool_mask`` (B, C),
    ``importance_sampling_ratio`` (B, C) for token_* modes, (B, 1) for sequence_* modes.

``trl_loss_and_grads(trainer, batch, *, micro_batches=None, grad_accum=None, num_items_in_batch=None)``
    ``-> (loss: float, grads: dict[str, Tensor], metrics: dict[str, float])``: one optimizer step's gradient. Builds
    ``trl_inputs`` for the whole batch (the generation batch: padded once, ``num_items_in_batch`` counted once, as
    TRL does), splits it in order into ``micro_batches`` (default: the config's ``gradient_accumulation_steps``)
    equal parts with TRL's ``split_tensor_dict`` (TRL shuffles the generation batch first; here the order is the
    caller's, and a part holds ``len(batch) / micro_batches`` rows whatever ``per_device_train_batch_size`` says),
    sets ``trainer.current_gradient_accumulation_steps = grad_accum or micro_batches`` and ``model.train()``, then
    per part calls TRL's ``trainer.compute_loss(model, inputs)`` (= ``_compute_loss``) and ``backward()``, as TRL's
    ``training_step`` does (GRPO's ``loss_is_scaled_for_ga`` is True: no further division). With
    ``steps_per_generation`` > ``gradient_accumulation_steps`` (several optimizer steps per generation batch), pass
    one step's rows and the whole generation batch's ``num_items_in_batch``. ``accelerator.sync_gradients`` is False but on the last part, as inside an accumulation
    window (the adaptive entropy controller updates once). ``loss`` is the sum of the parts' losses: the scalar whose
    gradient ``grads`` is; ``grads`` maps every parameter name (``model.named_parameters()``) with a gradient to a
    clone; ``metrics`` maps each of TRL's ``_metrics["train"]`` names logged during the call to the mean of its values
    (``entropy``, ``clip_ratio/*``, ``kl``, ``sampling/importance_sampling_ratio/*``, ``entropy_coef``...). The
    model's gradients are zeroed first and left holding the result; no optimizer step is taken. State
    ``_compute_loss`` reads and the caller may set on the trainer: ``entropy_coef``, ``_last_world_entropy``
    (adaptive entropy: the bonus applies only when it is <= ``entropy_target``; inf at start-up), ``beta``.

``build_trl_gkd_trainer(model, teacher, tokenizer, **gkd_config_kwargs) -> GKDTrainer``
    TRL's experimental ``GKDTrainer(model, teacher, GKDConfig(...), Dataset, tokenizer)`` (``lmbda``, ``beta``,
    ``seq_kd``, ``temperature``, ``max_new_tokens``...), with ``_DEFAULTS``' offline settings; its dataset is a
    placeholder (the batch comes from ``trl_gkd_step``).

``trl_gkd_step(trainer, prompts) -> (completions, loss, grads)``
    One ``GKDTrainer.training_step`` on ``prompts`` (lists of token ids, left-padded with the pad id as TRL's ChatML
    collator pads them): TRL draws on- or off-policy (``random.random() <= lmbda``), generates with its own
    ``generate_on_policy_outputs`` (the student's model, or with ``seq_kd`` the teacher's) and takes its
    ``compute_loss`` and backward. ``completions``: each row's loss tokens (TRL's labels != -100: up to and including
    the first EOS), ``loss`` TRL's, ``grads`` every parameter's gradient (cloned; zeroed first, no optimizer step).

``trl_lr_schedule(trainer_kwargs, n_steps) -> list[float]``
    The learning rate of each of ``n_steps`` optimizer steps of a TRL run with these ``GRPOConfig`` kwargs
    (``learning_rate``, ``lr_scheduler_type``, ``warmup_steps``, ``lr_scheduler_kwargs``, ``optim``...):
    ``create_optimizer_and_scheduler(num_training_steps=n_steps)`` (as ``max_steps=n_steps`` gives). transformers 5
    has no ``warmup_ratio`` (``GRPOConfig(warmup_ratio=...)`` raises TypeError there): a float ``warmup_steps`` < 1
    is the ratio, and ``warmup_ratio`` given here is passed as that;
    then ``lrs[i]`` is the rate step ``i`` (0-based) applies. transformers 5.19 logs the rate the step used (read
    before ``lr_scheduler.step()``), so TRL's ``learning_rate`` logged at ``global_step`` k (1-based) is ``lrs[k-1]``.

TRL behaviour to know (1.16, ``grpo_trainer.py``)
-------------------------------------------------
* Normalisation is per micro-batch for ``grpo`` / ``sapo`` (mean over sequences of each sequence's token mean),
  ``bnpo`` (token mean over the micro-batch) and ``luspo`` (sum over tokens, mean over sequences), each then divided
  by ``current_gradient_accumulation_steps``; ``dr_grpo`` divides the micro-batch's token sum by
  ``B_micro * max_completion_length`` and by the accumulation steps; ``dapo`` / ``cispo`` / ``vespo`` divide by
  ``num_items_in_batch`` (loss-mask tokens of the whole generation batch) * ``grad_accum / steps_per_generation``.
* The log-probs are of ``logits / temperature`` (TRL's fused LM head), also in the loss.
* ``use_bias_correction_kl`` defaults to True: with ``beta != 0`` the KL term is multiplied by the (differentiable)
  ratio, which changes its gradient even on-policy.
* The vLLM IS ratio uses ``old_per_token_logps`` (the policy at generation time), not the current log-probs; its
  default mode is ``sequence_mask`` with ``clip_max=3.0``; ``vespo`` folds it into its gamma weights instead of
  multiplying the loss.
* No ``position_ids`` are passed: left-padded prompts shift the positions (RoPE: equal up to float rounding).
* Adaptive entropy (``use_adaptive_entropy``) applies no bonus in the first optimizer step (``_last_world_entropy``
  starts at inf); each step's end measures the entropy and moves ``entropy_coef`` by ``entropy_coef_delta`` for the
  next one. The static bonus is ``entropy_coef`` x the token-mean entropy / grad_accum, whatever the loss type.
* ``warmup_ratio`` is gone from transformers 5 (``warmup_steps`` < 1 is the ratio); the ``learning_rate`` TRL logs
  at a step is the rate that step used.
"""

from __future__ import annotations

import atexit
import functools
import math
import shutil
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_DEFAULTS = {"num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 16, "temperature": 1.0,
             "report_to": "none", "use_cpu": True, "bf16": False, "save_strategy": "no", "logging_steps": 1,
             "seed": 0}


@functools.lru_cache(maxsize=1)
def _scratch_root() -> str:
    """One directory per test process for the tokenizer files and TRL's output dirs, removed when it exits."""
    root = tempfile.mkdtemp(prefix="trl_oracle_")
    atexit.register(shutil.rmtree, root, True)
    return root


@functools.lru_cache(maxsize=1)
def _tokenizer_files() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} plus {b}? The answer is {a + b}." for a in range(20) for b in range(20)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    path = tempfile.mkdtemp(prefix="tok_", dir=_scratch_root())
    out.save_pretrained(path)
    return path


def tiny_tokenizer():
    """A BPE tokenizer trained on a few hundred arithmetic sentences (vocab ~300; pad ``<|endoftext|>``, EOS
    ``<|im_end|>``). Each call returns a new object over the same files."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(_tokenizer_files())


def tiny_model(seed: int = 0, tokenizer=None, hidden: int = 32, layers: int = 2, tie: bool = False):
    """A random-init fp32 Qwen2 over ``tiny_tokenizer()``'s vocabulary, the same weights for the same seed."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tok = tokenizer or tiny_tokenizer()
    pad, _, eos = tok.convert_tokens_to_ids(SPECIALS)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie, eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _reward_fn(j: int):
    def reward(completions, **kwargs):
        return [float(r) for r in kwargs[f"_oracle_reward{j}"]]
    reward.__name__ = f"r{j}"
    return reward


def _trl():
    """``trl`` (GRPOConfig, GRPOTrainer), imported without its warning that vllm 0.32 is newer than it supports
    (vLLM is never used here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
        from trl import GRPOConfig, GRPOTrainer
    return GRPOConfig, GRPOTrainer


def build_trl_trainer(model, tokenizer, *, reward_funcs: int = 1, **grpo_config_kwargs):
    """TRL's ``GRPOTrainer`` on ``model`` (see the module docstring for what is emulated)."""
    from datasets import Dataset

    GRPOConfig, GRPOTrainer = _trl()

    kwargs = {**_DEFAULTS, **grpo_config_kwargs}
    use_vllm = bool(kwargs.pop("use_vllm", False))
    kwargs.setdefault("output_dir", tempfile.mkdtemp(prefix="out_", dir=_scratch_root()))
    if kwargs.get("beta", 0.0) != 0.0:  # TRL loads its reference from the policy's name_or_path
        ref_dir = Path(kwargs["output_dir"]) / "reference_init"
        model.save_pretrained(ref_dir)
        model.config._name_or_path = str(ref_dir)
    args = GRPOConfig(**kwargs)
    rows = max(args.generation_batch_size, 2)
    dataset = Dataset.from_dict({"prompt": ["What is 1 plus 2?"] * rows})
    funcs = [_reward_fn(j) for j in range(reward_funcs)]
    trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    if use_vllm:  # TRL's vLLM importance-sampling path, without vLLM (generation comes from trl_inputs)
        if (trainer.loss_type == "vespo" and trainer.vllm_importance_sampling_correction
                and trainer.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")):
            raise ValueError("VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or "
                             f"'token_mask'. Got: {trainer.vllm_importance_sampling_mode}.")  # TRL's own check
        trainer.use_vllm = True
        trainer.args.use_vllm = True
        trainer._last_loaded_step = trainer.state.global_step  # never sync weights to a vLLM that is not there
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def _padded(rows: list[list[float | None]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.tensor([math.nan if x is None else float(x) for x in row], dtype=torch.float32)
    return out


def _column(batch: list[dict], key: str) -> list | None:
    have = [key in s and s[key] is not None for s in batch]
    if any(have) and not all(have):
        raise ValueError(f"{key}: given for some sequences and not others")
    return [s[key] for s in batch] if all(have) else None


def trl_inputs(trainer, batch: list[dict], *, num_items_in_batch: int | float | None = None) -> dict[str, Any]:
    """The ``inputs`` of ``_compute_loss`` for ``batch``, built by TRL's ``_generate_and_score_completions``."""
    tok = trainer.processing_class
    for s in batch:
        n = len(s["completion_ids"])
        for key in ("old_per_token_logps", "sampling_per_token_logps", "ref_per_token_logps", "tool_mask"):
            if s.get(key) is not None and len(s[key]) != n:
                raise ValueError(f"{key} has {len(s[key])} values for {n} completion tokens")
    advantages = _column(batch, "advantage")
    rewards = _column(batch, "reward")
    if (advantages is None) == (rewards is None):
        raise ValueError("give every sequence an 'advantage' or every sequence a 'reward'")
    if rewards is None:
        rewards = [0.0] * len(batch)
    n_funcs = len(trainer.reward_funcs)
    rewards = [list(r) if isinstance(r, (list, tuple)) else [r] for r in rewards]
    if any(len(r) != n_funcs for r in rewards):
        raise ValueError(f"each reward needs {n_funcs} values (one per reward function)")
    sampling = _column(batch, "sampling_per_token_logps")
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction and sampling is None:
        raise ValueError("use_vllm with vllm_importance_sampling_correction needs sampling_per_token_logps")
    old = _column(batch, "old_per_token_logps")
    ref = _column(batch, "ref_per_token_logps")
    if ref is not None and trainer.beta == 0.0:
        raise ValueError("ref_per_token_logps given but beta == 0 (TRL would not read them)")
    tool_mask = _column(batch, "tool_mask")

    def rollout(prompts, _trainer):
        out = {"prompt_ids": [list(s["prompt_ids"]) for s in batch],
               "completion_ids": [list(s["completion_ids"]) for s in batch], "logprobs": sampling}
        if tool_mask is not None:
            out["env_mask"] = [list(m) for m in tool_mask]
        return out

    given = {}
    if old is not None:
        given[id(trainer.model)] = old
    if ref is not None and trainer.ref_model is not None:
        given[id(trainer.ref_model)] = ref
    forward = trainer._get_per_token_logps_and_entropies

    def logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if id(model) in given:  # no-grad old / ref pass: the batch's values stand for TRL's forward
            return _padded(given[id(model)], logits_to_keep), None, None
        return forward(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    rows = [{"prompt": tok.decode(s["prompt_ids"]), **{f"_oracle_reward{j}": r[j] for j in range(n_funcs)}}
            for s, r in zip(batch, rewards, strict=True)]
    saved_rollout = trainer.rollout_func
    trainer.rollout_func, trainer._get_per_token_logps_and_entropies = rollout, logps
    try:
        inputs = trainer._generate_and_score_completions(rows)
    finally:
        trainer.rollout_func = saved_rollout
        del trainer._get_per_token_logps_and_entropies  # back to the class's method
    width = inputs["completion_ids"].size(1)
    if old is not None and "old_per_token_logps" not in inputs:  # TRL skipped its pass (aligned, no vLLM IS)
        inputs["old_per_token_logps"] = _padded(old, width)
    if ref is not None and "ref_per_token_logps" not in inputs:
        inputs["ref_per_token_logps"] = _padded(ref, width)
    if advantages is not None:
        inputs["advantages"] = torch.tensor([float(a) for a in advantages], dtype=torch.float32)
    if num_items_in_batch is not None:
        inputs["num_items_in_batch"] = torch.tensor(num_items_in_batch, dtype=torch.float32)
    return inputs


def trl_loss_and_grads(trainer, batch: list[dict], *, micro_batches: int | None = None, grad_accum: int | None = None,
                       num_items_in_batch: int | float | None = None) -> tuple[float, dict[str, torch.Tensor], dict]:
    """TRL's loss and gradients for ``batch`` (see the module docstring)."""
    from trl.trainer.utils import split_tensor_dict

    micro_batches = micro_batches or trainer.args.gradient_accumulation_steps
    if len(batch) % micro_batches:
        raise ValueError(f"{len(batch)} sequences do not split into {micro_batches} equal micro-batches")
    model = trainer.model
    model.train()
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    inputs = trl_inputs(trainer, batch, num_items_in_batch=num_items_in_batch)
    parts = split_tensor_dict(inputs, micro_batches) if micro_batches > 1 else [inputs]
    trainer.current_gradient_accumulation_steps = grad_accum or micro_batches
    model.zero_grad(set_to_none=True)
    state = trainer.accelerator.gradient_state
    total = 0.0
    try:
        for i, part in enumerate(parts):
            state._set_sync_gradients(i == len(parts) - 1)
            loss = trainer.compute_loss(model, part)
            loss.backward()
            total += loss.item()
    finally:
        state._set_sync_gradients(True)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items() if v}
    return total, grads, metrics


def trl_lr_schedule(trainer_kwargs: dict, n_steps: int) -> list[float]:
    """The learning rate each of ``n_steps`` optimizer steps applies in TRL with these ``GRPOConfig`` kwargs."""
    kwargs = {"max_steps": n_steps, **trainer_kwargs}
    if "warmup_ratio" in kwargs:  # transformers 5 dropped it: warmup_steps < 1 is the ratio (ceil(ratio * n) steps)
        if "warmup_steps" in kwargs:
            raise ValueError("warmup_ratio and warmup_steps both given")
        kwargs["warmup_steps"] = float(kwargs.pop("warmup_ratio"))
    tok = tiny_tokenizer()
    trainer = build_trl_trainer(tiny_model(tokenizer=tok), tok, **kwargs)
    trainer.create_optimizer_and_scheduler(num_training_steps=n_steps)
    lrs = []
    for _ in range(n_steps):
        lrs.append(trainer.lr_scheduler.get_last_lr()[0])
        trainer.optimizer.step()  # no gradients: nothing moves, but the scheduler sees the steps in order
        trainer.lr_scheduler.step()
    return lrs


def build_trl_gkd_trainer(model, teacher, tokenizer, **gkd_config_kwargs):
    """TRL's ``GKDTrainer`` on ``model`` and ``teacher`` (see the module docstring)."""
    from datasets import Dataset

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
        warnings.filterwarnings("ignore", message=".*experimental")
        from trl.experimental.gkd import GKDConfig, GKDTrainer

    kwargs = {k: v for k, v in _DEFAULTS.items() if k not in ("num_generations", "max_completion_length")}
    kwargs = {**kwargs, **gkd_config_kwargs}
    kwargs.setdefault("output_dir", tempfile.mkdtemp(prefix="out_", dir=_scratch_root()))
    placeholder = Dataset.from_dict({"messages": [[{"role": "user", "content": "What is 1 plus 2?"}]] * 2})
    trainer = GKDTrainer(model=model, teacher_model=teacher, args=GKDConfig(**kwargs), train_dataset=placeholder,
                         processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return trainer


def trl_gkd_step(trainer, prompts: list[list[int]]) -> tuple[list[list[int]], float, dict[str, torch.Tensor]]:
    """One TRL ``GKDTrainer.training_step`` on ``prompts`` (see the module docstring)."""
    pad = trainer.processing_class.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    inputs = {"prompts": ids, "prompt_attention_mask": mask, "input_ids": ids.clone(), "attention_mask": mask.clone(),
              "labels": torch.full_like(ids, -100)}
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.training_step(trainer.model, inputs)  # replaces inputs' ids, mask and labels by the generated ones
    completions = [[int(t) for t in row if t != -100] for row in inputs["labels"]]
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return completions, float(loss), grads
