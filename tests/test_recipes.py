"""TRL 1.16 is the oracle for every loss rollyard offers: the same tiny model, completions, advantages and old /
rollout / reference log-probs go to rollyard's Trainer and to TRL's own GRPOTrainer (``tests/trl_oracle.py``), and the
loss and every parameter's gradient agree in fp32. The names go through rollyard's config as a TRL user writes them
(``loss_type=...``), so the mapping is checked with the math."""

from __future__ import annotations

import copy
import math
import random
import zlib

import pytest
import torch

pytest.importorskip("trl", reason="TRL 1.16 is the oracle (pip install 'rollyard[test]')")

from trl_oracle import build_trl_trainer, tiny_model, tiny_tokenizer, trl_inputs, trl_loss_and_grads

from rollyard.algo.advantages import assign_advantages
from rollyard.algo.policy_loss import entropy_mask
from rollyard.api import with_trl_defaults
from rollyard.config import load_config
from rollyard.trainer.settings import trainer_kwargs
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample

MAX_LEN = 12  # max_completion_length: the dr_grpo constant and the truncation length


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def make_batch(tok, seed: int = 0, groups: int = 3, n: int = 2, off_policy: float = 0.3) -> list[dict]:
    """``groups x n`` sequences: random prompts, completions of 3..MAX_LEN tokens (some end in EOS, some are cut at
    MAX_LEN), advantages of both signs, and old / rollout / reference log-probs scattered around the model's own
    (filled in by ``with_logps``)."""
    rng = random.Random(seed)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    special = {tok.pad_token_id, eos, *tok.all_special_ids}
    vocab = [i for i in range(len(tok)) if i not in special]
    rows = []
    for _ in range(groups):
        prompt = [rng.choice(vocab) for _ in range(rng.randint(3, 6))]
        for _ in range(n):
            cut = rng.random() < 0.35
            k = MAX_LEN if cut else rng.randint(3, MAX_LEN - 1)
            comp = [rng.choice(vocab) for _ in range(k)]
            if not cut:
                comp[-1] = eos
            rows.append({"prompt_ids": prompt, "completion_ids": comp, "advantage": rng.choice([-1.3, -0.4, 0.6, 1.1])})
    return rows


def with_logps(model, batch: list[dict], seed: int, off: float = 0.3) -> list[dict]:
    """Fill old / sampling / ref log-probs: the model's own log-probs plus seeded noise (so ratios leave the clip
    range and the rollout correction truncates or masks some tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for row in batch:
            ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
            logits = model(input_ids=ids).logits[0, len(row["prompt_ids"]) - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(row["completion_ids"])[:, None]).squeeze(-1)
            old, sampled, ref = (lp + torch.randn(lp.shape, generator=g) * off for _ in range(3))
            out.append({**row, "old_per_token_logps": old.tolist(), "sampling_per_token_logps": sampled.tolist(),
                        "ref_per_token_logps": ref.tolist()})
    return out


def samples_of(batch: list[dict], tok) -> tuple[list[Sample], list[torch.Tensor]]:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    out, old = [], []
    for i, row in enumerate(batch):
        comp = row["completion_ids"]
        s = Sample(id=f"s{i}", request_id=f"g{i // 2}", prompt_ids=row["prompt_ids"], completion_ids=comp,
                   logprobs=row["sampling_per_token_logps"], versions=[0] * len(comp),
                   finish_reason="stop" if comp[-1] == eos else "length", ref_logprobs=row["ref_per_token_logps"],
                   completion_mask=row.get("tool_mask"))
        s.advantage = row["advantage"]
        out.append(s)
        old.append(torch.tensor(row["old_per_token_logps"]))
    return out, old


def rollyard_loss_and_grads(model, batch, tok, trl_names: dict, overrides=()):
    """rollyard's Trainer, configured from TRL's names through rollyard's config, over the same batch."""
    cfg = load_config(None, [f"{k}={v}" for k, v in with_trl_defaults(trl_names).items()] + list(overrides)
                      + [f"max_completion_length={MAX_LEN}", "trainer.precision=fp32", "rollout.temperature=1.0"])
    kw = trainer_kwargs(cfg)
    trainer = Trainer(model, **kw)
    samples, old = samples_of(batch, tok)
    masks = None
    if cfg.algo.top_entropy_quantile < 1.0:
        _, ents = trainer.logprobs_and_entropy(samples)
        masks = entropy_mask(ents, [torch.tensor(trainer.loss_mask(s), dtype=torch.float32) for s in samples],
                             cfg.algo.top_entropy_quantile)
    trainer.optimizer.zero_grad(set_to_none=True)
    acc = trainer.accumulate_gradients(samples, old, entropy_masks=masks)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(acc["loss"]), grads, acc


def for_trl(batch: list[dict], names: dict) -> list[dict]:
    """The batch as TRL reads it: reference log-probs only with a KL term, rollout log-probs only with vLLM."""
    drop = set()
    if not names.get("beta"):
        drop.add("ref_per_token_logps")
    if not names.get("use_vllm"):
        drop.add("sampling_per_token_logps")
    return [{k: v for k, v in row.items() if k not in drop} for row in batch]


def assert_same(ours, theirs, rtol=2e-4):
    loss_a, grads_a = ours[:2]
    loss_b, grads_b = theirs[:2]
    assert math.isclose(loss_a, loss_b, rel_tol=rtol, abs_tol=2e-5), (loss_a, loss_b)  # a loss near 0: absolute
    assert set(grads_a) == set(grads_b)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads_b.values()))
    assert norm > 1e-6  # the case moves the weights
    for name, g in grads_b.items():
        diff = float((grads_a[name] - g).abs().max())
        assert diff <= rtol * norm + 1e-7, (name, diff, norm)


# TRL's GRPOConfig names of each case; use_vllm brings TRL's rollout correction (rollyard's tis_mode), off it is none
CASES = {
    "grpo": {"loss_type": "grpo", "use_vllm": True, "vllm_importance_sampling_mode": "token_truncate",
             "vllm_importance_sampling_clip_max": 2.0},
    "dapo-clip-higher": {"loss_type": "dapo", "epsilon_high": 0.28, "use_vllm": True},  # TRL's sequence_mask, cap 3
    "bnpo-token-mask": {"loss_type": "bnpo", "use_vllm": True, "vllm_importance_sampling_mode": "token_mask",
                        "vllm_importance_sampling_clip_max": 1.3, "vllm_importance_sampling_clip_min": 0.7},
    "dr_grpo-seq-truncate": {"loss_type": "dr_grpo", "use_vllm": True,
                             "vllm_importance_sampling_mode": "sequence_truncate",
                             "vllm_importance_sampling_clip_max": 2.0, "vllm_importance_sampling_clip_min": 0.5},
    "luspo-sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.2, "use_vllm": True,
              "vllm_importance_sampling_mode": "token_truncate"},
    "sapo": {"loss_type": "sapo", "sapo_temperature_pos": 0.8, "sapo_temperature_neg": 1.3},
    "vespo": {"loss_type": "vespo", "use_vllm": True, "vllm_importance_sampling_mode": "token_truncate"},
    "delta": {"loss_type": "dapo", "delta": 1.15},
    "kl-bias-corrected": {"loss_type": "dapo", "beta": 0.2, "use_bias_correction_kl": True},
    "kl-plain": {"loss_type": "grpo", "beta": 0.2, "use_bias_correction_kl": False},
    "top-entropy": {"loss_type": "dapo", "top_entropy_quantile": 0.4},
    "entropy-bonus": {"loss_type": "bnpo", "entropy_coef": 0.05},
    "off-policy-mask": {"loss_type": "dapo", "off_policy_mask_threshold": 0.05, "use_vllm": True},
    "mask-truncated": {"loss_type": "grpo", "mask_truncated_completions": True},
    "no-correction": {"loss_type": "dapo"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_gradient_equal_trls(tok, case):
    names = CASES[case]
    base = tiny_model(seed=1, tokenizer=tok)
    batch = with_logps(base, make_batch(tok, seed=zlib.crc32(case.encode()) % 1000), seed=7)  # not hash(): salted per process
    trl = build_trl_trainer(copy.deepcopy(base), tok, max_completion_length=MAX_LEN, per_device_train_batch_size=6,
                            **names)
    theirs = trl_loss_and_grads(trl, for_trl(batch, names))
    rollyard_names = {k: v for k, v in with_trl_defaults(names).items() if k != "use_vllm"}  # vllm: TRL's mode
    if not names.get("use_vllm"):
        rollyard_names["vllm_importance_sampling_correction"] = False  # TRL without vLLM corrects nothing
    ours = rollyard_loss_and_grads(copy.deepcopy(base), batch, tok, rollyard_names)
    assert_same(ours, theirs)


def test_tool_tokens_are_out_of_both_losses(tok):
    base = tiny_model(seed=2, tokenizer=tok)
    batch = with_logps(base, make_batch(tok, seed=3), seed=5)
    for row in batch:  # the middle third of each completion is a tool's output
        k = len(row["completion_ids"])
        row["tool_mask"] = [0 if k // 3 <= i < 2 * k // 3 else 1 for i in range(k)]
    names = {"loss_type": "grpo", "beta": 0.1}
    trl = build_trl_trainer(copy.deepcopy(base), tok, max_completion_length=MAX_LEN, per_device_train_batch_size=6,
                            **names)
    assert_same(rollyard_loss_and_grads(copy.deepcopy(base), batch, tok,
                                        {**names, "vllm_importance_sampling_correction": False}),
                trl_loss_and_grads(trl, for_trl(batch, names)))


def test_a_case_with_a_different_setting_does_not_match(tok):
    """The comparison can fail: dapo's aggregation against TRL's grpo differs beyond tolerance."""
    base = tiny_model(seed=1, tokenizer=tok)
    batch = with_logps(base, make_batch(tok, seed=11), seed=7)
    trl = build_trl_trainer(copy.deepcopy(base), tok, max_completion_length=MAX_LEN, per_device_train_batch_size=6,
                            loss_type="grpo")
    theirs = trl_loss_and_grads(trl, for_trl(batch, {}))
    ours = rollyard_loss_and_grads(copy.deepcopy(base), batch, tok, {"loss_type": "dapo",
                                                                     "vllm_importance_sampling_correction": False})
    with pytest.raises(AssertionError):
        assert_same(ours, theirs)


@pytest.mark.parametrize("scale, aggregation, weights", [
    ("group", "sum_then_normalize", None), ("batch", "sum_then_normalize", None), ("none", "sum_then_normalize", None),
    ("group", "normalize_then_sum", [1.0, 0.5]), ("group", "sum_then_normalize", [1.0, 0.5])])
def test_advantages_equal_trls(tok, scale, aggregation, weights):
    """Rewards (two functions) become the same advantages as TRL's, with TRL's 1e-4 epsilon."""
    rng = random.Random(4)
    batch = make_batch(tok, seed=4, groups=4)
    for i, row in enumerate(batch):
        del row["advantage"]
        row["reward"] = [float(rng.randint(0, 2)), rng.random()] if i != 2 else [1.0, 0.25]
    batch[6]["reward"], batch[7]["reward"] = [1.0, 0.5], [1.0, 0.5]  # a group of equal rewards
    kw = {"scale_rewards": scale, "multi_objective_aggregation": aggregation}
    if weights:
        kw["reward_weights"] = weights
    trl = build_trl_trainer(tiny_model(tokenizer=tok), tok, reward_funcs=2, max_completion_length=MAX_LEN,
                            per_device_train_batch_size=8, **kw)
    theirs = trl_inputs(trl, batch)["advantages"]
    cfg = load_config(None, [f"{k}={v}" for k, v in kw.items() if k != "reward_weights"]
                      + ["reward.hooks=[a:f, b:g]"] + ([f"reward.weights={weights}"] if weights else []))
    samples = []
    for i, row in enumerate(batch):
        w = weights or [1.0, 1.0]
        s = Sample(id=f"s{i}", request_id=f"g{i // 2}", prompt_ids=row["prompt_ids"],
                   completion_ids=row["completion_ids"], logprobs=[0.0] * len(row["completion_ids"]), versions=[0],
                   finish_reason="stop", reward=sum(a * b for a, b in zip(w, row["reward"])),
                   reward_parts=list(row["reward"]))
        samples.append(s)
    a = cfg.algo
    assign_advantages(samples, a.normalize_std, 1e-4, a.std_scope, a.multi_objective, cfg.reward.weights)
    ours = torch.tensor([s.advantage for s in samples])
    assert torch.allclose(ours, theirs.float(), atol=2e-5), (ours, theirs)
