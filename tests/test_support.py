"""Unbiased sampling at top_p < 1 and top_k (issue 47, item 3): the rollout records the logprob of the truncated,
renormalised distribution it sampled from, and the trainer's ratio and loss use the same support
(``algo/support.py``), so at equal weights the gap is rounding and the ratio is 1 on-policy."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rollyard.algo import support
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.rollout.engine import RolloutEngine
from rollyard.trainer.trainer import Trainer
from rollyard.types import Request

TOK = char_tokenizer()
V = len(TOK)
CTX = 96


def naive_support(row: list[float], top_p: float, top_k: int) -> set[int]:
    """The support of one row, token by token: the k largest logits (ties at the k-th stay), then, over their
    renormalised probabilities in descending order, tokens until the mass taken reaches top_p."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if top_k:
        kth = row[order[top_k - 1]]
        order = [i for i in order if row[i] >= kth]
    z = sum(math.exp(row[i]) for i in order)
    kept, mass = set(), 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.add(i)
        mass += math.exp(row[i]) / z
    return kept


def test_the_support_is_top_k_then_top_p_on_known_rows():
    row = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]])  # softmax: .086 .234 .636 .032 .142
    kept = lambda p, k: set(support.support_mask(row, p, k)[0].nonzero().flatten().tolist())  # noqa: E731
    assert kept(0.7, 0) == {1, 2}  # .636 < .7, .636 + .234 >= .7
    assert kept(0.5, 0) == {2}  # the top token alone reaches it
    assert kept(1.0, 3) == {1, 2, 4}
    assert kept(0.85, 3) == {1, 2}  # over the top-3 renormalised (.629 .231 .140): .629 + .231 >= .85
    assert kept(0.9, 3) == {1, 2, 4}  # .860 < .9: the third stays
    assert kept(1.0, 0) == {0, 1, 2, 3, 4} and not support.active(1.0, 0)
    tie = torch.tensor([[1.0, 1.0, 0.0]])
    assert support.support_mask(tie, 1.0, 1)[0].tolist() == [True, True, False]  # ties at the k-th value stay


@pytest.mark.parametrize("top_p, top_k", [(0.9, 0), (1.0, 20), (0.8, 10), (0.3, 0)])
def test_the_support_matches_a_token_by_token_reference_on_random_rows(top_p, top_k):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, V, generator=g) * 3
    mask = support.support_mask(logits, top_p, top_k)
    for i in range(len(logits)):
        assert set(mask[i].nonzero().flatten().tolist()) == naive_support(logits[i].tolist(), top_p, top_k), i
    lq = torch.log_softmax(support.restrict(logits, top_p, top_k), -1)
    assert torch.allclose(lq.exp().sum(-1), torch.ones(64)) and (lq.exp()[~mask] == 0).all()
    y = torch.randint(0, V, (64,), generator=g)  # the trainer keeps its target even outside the support
    lt = torch.log_softmax(support.restrict(logits, top_p, top_k, y), -1).gather(1, y[:, None])
    assert torch.isfinite(lt).all()


def _model(seed=0):
    return build_preset("tiny", TOK, seed=seed, max_position_embeddings=CTX).eval()


def _samples(model, top_p, top_k, T=1.0):
    eng = RolloutEngine(model, eos_token_id=-1, temperature=T, top_p=top_p, top_k=top_k, max_concurrent=8, seed=3)
    g = torch.Generator().manual_seed(7)
    reqs = [Request(f"r{i}", torch.randint(4, V, (6,), generator=g).tolist(), n=4, max_new_tokens=20) for i in range(3)]
    samples, rejected = eng.generate(reqs)
    assert not rejected
    return samples


def _full_logprobs(model, s, T):
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1].float() / T
    return torch.log_softmax(logits, -1), logits


@pytest.mark.parametrize("top_p, top_k, T", [(0.9, 0, 1.0), (1.0, 20, 1.0), (0.9, 20, 0.8)])
def test_at_equal_weights_the_native_rollout_and_the_trainer_agree_on_the_truncated_logprobs(top_p, top_k, T):
    model = _model()
    samples = _samples(model, top_p, top_k, T)
    trainer = Trainer(copy.deepcopy(model), micro_batch_tokens=4096, temperature=T, top_p=top_p, top_k=top_k)
    got = trainer.logprobs(samples)
    diffs = torch.cat([(torch.tensor(s.logprobs) - lp).abs() for s, lp in zip(samples, got)])
    assert diffs.mean().item() <= 1e-6 and diffs.max().item() < 1e-5, (diffs.mean().item(), diffs.max().item())
    biased = []
    for s in samples:  # the renormalised logprob is what was sampled: every token inside the support, and
        full, logits = _full_logprobs(model, s, T)  # log q = log p - log(mass of the support) per token
        ids = torch.tensor(s.completion_ids)
        mask = support.support_mask(logits, top_p, top_k)
        assert mask.gather(1, ids[:, None]).all()
        mass = full.exp().masked_fill(~mask, 0).sum(-1)
        want = full.gather(1, ids[:, None]).squeeze(1) - mass.log()
        assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-4)
        biased.append((want - full.gather(1, ids[:, None]).squeeze(1)).abs())
    assert torch.cat(biased).mean() > 1e-2  # what the full distribution's logprob would have been off by


def test_the_ratio_is_one_on_policy_and_the_trainers_logprob_is_the_supports():
    model = _model()
    samples = _samples(model, 0.9, 20)
    for s in samples:
        s.advantage = 1.0 if int(s.id[1]) % 2 else -1.0
    trainer = Trainer(copy.deepcopy(model), micro_batch_tokens=4096, top_p=0.9, top_k=20)
    m = trainer.step(samples)
    assert m["logprob_diff"] <= 1e-6 and abs(m["ratio_p50"] - 1) < 1e-5 and m["tis_capped_frac"] == 0
    assert m["clip_frac"] == 0.0 and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    full = Trainer(copy.deepcopy(model), micro_batch_tokens=4096)  # the full distribution: the biased ratio
    assert full.step(copy.deepcopy(samples))["logprob_diff"] > 1e-2


def test_greedy_ignores_top_p_and_top_k_on_both_sides():
    from rollyard.config import load_config
    from rollyard.trainer.settings import trainer_kwargs

    kw = trainer_kwargs(load_config(None, ["rollout.temperature=0", "rollout.top_p=0.5", "rollout.top_k=3"]))
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (1.0, 1.0, 0)
    kw = trainer_kwargs(load_config(None, ["rollout.top_p=0.5", "rollout.top_k=3"]))
    assert (kw["top_p"], kw["top_k"]) == (0.5, 3)
    model = _model()
    samples = _samples(model, 0.5, 3, T=0.0)
    full, _ = _full_logprobs(model, samples[0], 1.0)
    want = full.gather(1, torch.tensor(samples[0].completion_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(samples[0].logprobs), want, atol=1e-4)
