"""Each algorithm function against a slow, obvious loop reference on random inputs."""

import math
import statistics

import pytest
import torch

from rollyard.algo.advantages import grpo_advantages
from rollyard.algo.loss import aggregate, kl_k3, ppo_clip_loss, tis_weights


def _ref_advantages(rewards, groups, normalize_std, eps):
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        if len(members) < 2 or max(members) == min(members):
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        a = r - mean
        if normalize_std:
            a /= statistics.stdev(members) + eps
        out.append(a)
    return out


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_grpo_advantages_unequal_groups(seed, normalize_std):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 7, (8,), generator=g).tolist()
    labels = torch.randperm(100, generator=g)[:8].tolist()  # arbitrary, non-contiguous labels
    groups = [lab for lab, n in zip(labels, sizes) for _ in range(n)]
    perm = torch.randperm(len(groups), generator=g).tolist()  # interleaved, not contiguous
    groups = [groups[i] for i in perm]
    rewards = torch.randn(len(groups), generator=g)
    rewards[: len(groups) // 3] = torch.randint(0, 2, (len(groups) // 3,), generator=g).float()  # ties
    got = grpo_advantages(rewards, torch.tensor(groups), normalize_std=normalize_std)
    want = _ref_advantages(rewards.double().tolist(), groups, normalize_std, 1e-6)
    assert got.dtype == rewards.dtype and got.shape == rewards.shape
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5)


def test_grpo_advantages_degenerate_groups_are_exactly_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, 5.0, 1.0, 0.0, 0.3])
    groups = torch.tensor([0, 0, 0, 1, 2, 2, 2])
    a = grpo_advantages(rewards, groups)
    assert torch.equal(a[:4], torch.zeros(4))  # all-equal group and a group of one
    assert a[4] > 0 and a[5] < 0
    assert not torch.isnan(a).any()
    assert grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0


def _random_batch(seed, S=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (S,), generator=g).tolist()
    seq_index = torch.tensor([s for s, n in enumerate(lengths) for _ in range(n)])
    T = len(seq_index)
    logp = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(T, generator=g, dtype=torch.float64) * 0.4  # ratios well outside the clip range
    adv_seq = torch.randn(S, generator=g, dtype=torch.float64)
    adv = adv_seq[seq_index]
    tis = torch.rand(T, generator=g, dtype=torch.float64) * 2
    return logp, old, adv, seq_index, tis


def _ref_ppo(logp, old, adv, seq_index, cl, ch, agg, tis):
    per_seq: dict[int, list[float]] = {}
    per_tok = []
    clipped = 0
    for t in range(len(logp)):
        r = math.exp(logp[t] - old[t])
        a = adv[t]
        term = -min(r * a, min(max(r, 1 - cl), 1 + ch) * a)
        if tis is not None:
            term *= tis[t]
        clipped += (r > 1 + ch and a > 0) or (r < 1 - cl and a < 0)
        per_tok.append(term)
        per_seq.setdefault(int(seq_index[t]), []).append(term)
    if agg == "token-mean":
        loss = sum(per_tok) / len(per_tok)
    else:
        loss = sum(sum(v) / len(v) for v in per_seq.values()) / len(per_seq)
    return loss, clipped / len(per_tok)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
@pytest.mark.parametrize("use_tis", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_ppo_clip_loss_matches_loop(seed, agg, use_tis):
    logp, old, adv, seq_index, tis = _random_batch(seed)
    cl, ch = 0.2, 0.28  # asymmetric (DAPO clip-higher)
    logp = logp.clone().requires_grad_(True)
    loss, stats = ppo_clip_loss(logp, old, adv, seq_index, clip_low=cl, clip_high=ch, agg=agg,
                                tis_weight=tis if use_tis else None)
    want, want_frac = _ref_ppo(logp.tolist(), old.tolist(), adv.tolist(), seq_index.tolist(), cl, ch, agg,
                               tis.tolist() if use_tis else None)
    assert abs(loss.item() - want) < 1e-10
    assert abs(stats["clip_frac"].item() - want_frac) < 1e-6
    assert 0 < want_frac < 1  # the random batch exercises both branches
    # Gradient: zero exactly on clipped tokens, -A * r * w / denominator elsewhere (token-mean).
    loss.backward()
    r = torch.exp(logp.detach() - old)
    active = ((r > 1 + ch) & (adv > 0)) | ((r < 1 - cl) & (adv < 0))
    assert torch.all(logp.grad[active] == 0)
    if agg == "token-mean":
        w = tis if use_tis else torch.ones_like(r)
        expect = -(adv * r * w) / len(r)
        assert torch.allclose(logp.grad[~active], expect[~active], atol=1e-12)


def test_asymmetric_clip_bounds():
    logp = torch.log(torch.tensor([1.25, 1.25, 0.75, 0.85]))
    old = torch.zeros(4)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    seq = torch.arange(4)
    _, st = ppo_clip_loss(logp, old, adv, seq, clip_low=0.2, clip_high=0.28)
    assert st["clipped_tokens"].item() == 1  # 1.25 < 1.28 not clipped; 0.75 < 0.8 clipped; 0.85 not
    _, st = ppo_clip_loss(logp, old, adv, seq, clip_low=0.2, clip_high=0.2)
    assert st["clipped_tokens"].item() == 3


def test_aggregate_with_external_denominators_splits_exactly():
    """Summing per-part aggregates with the whole batch's denominators == aggregating the whole."""
    logp, old, adv, seq_index, tis = _random_batch(11, S=9)
    for agg in ("token-mean", "seq-mean"):
        whole = aggregate(logp, seq_index, agg)
        cut = int((seq_index < 4).sum())  # a sequence boundary
        parts = aggregate(logp[:cut], seq_index[:cut], agg, num_tokens=len(logp), num_seqs=9) + \
            aggregate(logp[cut:], seq_index[cut:] - 4, agg, num_tokens=len(logp), num_seqs=9)
        assert torch.allclose(whole, parts, atol=1e-12), agg
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(logp, seq_index, "sum")


def test_kl_k3_matches_loop_and_is_nonnegative():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(200, generator=g, dtype=torch.float64) * 5
    ref = -torch.rand(200, generator=g, dtype=torch.float64) * 5
    got = kl_k3(logp, ref)
    want = [math.exp(r - lp) - (r - lp) - 1 for lp, r in zip(logp.tolist(), ref.tolist())]
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert (got >= 0).all()
    assert torch.equal(kl_k3(logp, logp), torch.zeros_like(logp))
    # k3 is an unbiased estimator of KL(pi || ref) for tokens sampled from pi.
    p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), 0)
    exact = (p * (p / q).log()).sum()
    expected_k3 = (p * kl_k3(p.log(), q.log())).sum()
    assert torch.allclose(exact, expected_k3, atol=1e-12)


def test_tis_weights_matches_loop_and_is_detached():
    g = torch.Generator().manual_seed(1)
    old = (-torch.rand(300, generator=g) * 4).requires_grad_(True)
    mu = old.detach() + torch.randn(300, generator=g)
    mu[0] = old[0].item() - 50.0  # huge ratio: capped, not inf
    cap = 2.0
    got = tis_weights(old, mu, cap)
    want = [min(math.exp(o - m), cap) for o, m in zip(old.tolist(), mu.tolist())]
    assert torch.allclose(got, torch.tensor(want), rtol=1e-5)
    assert not got.requires_grad
    assert got.max() == cap and 0 < (got == cap).float().mean() < 1
