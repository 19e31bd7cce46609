"""The TRL oracle harness itself (tests/trl_oracle.py, issue 53 item 3): TRL 1.16's GRPOTrainer, built offline on a
tiny Qwen2, gives the loss and gradients an independent computation from the model's own logits gives, for every
loss type, importance-sampling level and vLLM importance-sampling mode, and the lr schedule TRL steps through."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

if importlib.util.find_spec("trl") is None:
    pytest.skip("trl==1.16.0 (the test extra) is the oracle", allow_module_level=True)
import trl_oracle as oracle

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")


@pytest.fixture(scope="module")
def tok():
    return oracle.tiny_tokenizer()


def make_batch(tok, advantages=(1.0, -1.0, 0.5, -0.5)) -> list[dict]:
    """4 sequences of different prompt and completion lengths (2 end with EOS, 2 are cut), 2 groups of 2."""
    prompt = tok("What is 3 plus 4? What is")["input_ids"]
    answer = tok(" The answer is 7. The answer is 7.")["input_ids"]
    eos = tok.eos_token_id
    shapes = [(len(prompt), 4, True), (len(prompt) - 2, 6, False), (len(prompt) - 1, 3, True), (len(prompt), 9, False)]
    return [{"prompt_ids": prompt[-p:], "completion_ids": answer[:n] + ([eos] if ended else []), "advantage": a}
            for (p, n, ended), a in zip(shapes, advantages, strict=True)]


def own_logps(model, batch, temperature=1.0) -> list[torch.Tensor]:
    """Each completion token's log-prob under ``model``: a plain HF forward per sequence (no padding) and
    ``log_softmax(logits / temperature)``, nothing of TRL's."""
    out = []
    for s in batch:
        ids = torch.tensor([s["prompt_ids"] + s["completion_ids"]])
        logits = model(input_ids=ids).logits[0, len(s["prompt_ids"]) - 1:-1] / temperature
        logp = torch.log_softmax(logits.float(), dim=-1)
        out.append(logp.gather(-1, torch.tensor(s["completion_ids"]).unsqueeze(-1)).squeeze(-1))
    return out


def hand_grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(trl, hand):
    assert trl.keys() == hand.keys()
    for name in trl:
        torch.testing.assert_close(trl[name], hand[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_dapo_on_policy_loss_and_grads_equal_a_hand_computation(tok, temperature):
    batch = make_batch(tok)
    trainer = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, loss_type="dapo", temperature=temperature)
    loss, grads, metrics = oracle.trl_loss_and_grads(trainer, batch)

    model = oracle.tiny_model(tokenizer=tok).train()  # the same weights, never seen by TRL
    logps = own_logps(model, batch, temperature)
    n = sum(len(lp) for lp in logps)
    hand = sum(-s["advantage"] * torch.exp(lp - lp.detach()).sum() for s, lp in zip(batch, logps, strict=True)) / n
    assert loss == pytest.approx(hand.item(), rel=1e-6)
    assert loss == pytest.approx(-sum(s["advantage"] * len(s["completion_ids"]) for s in batch) / n, rel=1e-6)
    assert_grads_equal(grads, hand_grads(model, hand))
    assert all(g.abs().sum() > 0 for g in grads.values())
    with torch.no_grad():  # TRL's entropy metric: the token mean of the (temperature-scaled) distributions' entropy
        ent = []
        for s in batch:
            ids = torch.tensor([s["prompt_ids"] + s["completion_ids"]])
            logits = model(input_ids=ids).logits[0, len(s["prompt_ids"]) - 1:-1] / temperature
            ent.append(torch.distributions.Categorical(logits=logits).entropy())
    assert metrics["entropy"] == pytest.approx(torch.cat(ent).mean().item(), rel=1e-5)


def test_off_policy_old_logps_clip_as_a_hand_computation_does(tok):
    batch = make_batch(tok)
    model = oracle.tiny_model(tokenizer=tok).train()
    logps = own_logps(model, batch)
    gen = torch.Generator().manual_seed(1)
    for s, lp in zip(batch, logps, strict=True):  # pi_old off by up to +-0.5 nats: some ratios leave [0.8, 1.28]
        s["old_per_token_logps"] = (lp.detach() + (torch.rand(len(lp), generator=gen) - 0.5)).tolist()
    trainer = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, loss_type="dapo", epsilon=0.2,
                                       epsilon_high=0.28)
    loss, grads, metrics = oracle.trl_loss_and_grads(trainer, batch)
    on_policy, _, _ = oracle.trl_loss_and_grads(trainer, make_batch(tok))
    assert loss != pytest.approx(on_policy, rel=1e-3)
    assert 0 < metrics["clip_ratio/region_mean"] < 1

    terms, n = [], sum(len(lp) for lp in logps)
    for s, lp in zip(batch, logps, strict=True):
        ratio = torch.exp(lp - torch.tensor(s["old_per_token_logps"]))
        a = s["advantage"]
        terms.append(-torch.min(ratio * a, ratio.clamp(0.8, 1.28) * a).sum())
    hand = sum(terms) / n
    assert loss == pytest.approx(hand.item(), rel=1e-5)
    assert_grads_equal(grads, hand_grads(model, hand))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_and_level_gives_a_finite_loss_that_old_logps_change(tok, loss_type, level):
    batch = make_batch(tok)
    trainer = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, loss_type=loss_type,
                                       importance_sampling_level=level, epsilon_high=5.0 if loss_type == "cispo" else None)
    on_loss, on_grads, _ = oracle.trl_loss_and_grads(trainer, batch)
    for i, s in enumerate(batch):
        s["old_per_token_logps"] = [-6.0 + 0.3 * ((i + t) % 3) for t in range(len(s["completion_ids"]))]
    off_loss, off_grads, _ = oracle.trl_loss_and_grads(trainer, batch)
    assert math.isfinite(on_loss) and math.isfinite(off_loss)
    assert all(torch.isfinite(g).all() for g in off_grads.values())
    assert any(g.abs().sum() > 0 for g in on_grads.values())
    changed = off_loss != pytest.approx(on_loss, rel=1e-4, abs=1e-7) or any(
        not torch.allclose(off_grads[k], on_grads[k], rtol=1e-3, atol=1e-7) for k in on_grads)
    assert changed, f"{loss_type}/{level}: off-policy old log-probs changed neither loss nor gradients"


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_vllm_importance_sampling_ratio_is_trls_for_each_mode(tok, mode):
    batch = make_batch(tok)
    model = oracle.tiny_model(tokenizer=tok)
    with torch.no_grad():
        logps = own_logps(model, batch)
    gen = torch.Generator().manual_seed(2)
    for s, lp in zip(batch, logps, strict=True):  # the rollout engine's log-probs, off by up to +-1 nat
        s["sampling_per_token_logps"] = (lp + 2 * (torch.rand(len(lp), generator=gen) - 0.5)).tolist()
    clip_min, clip_max = 0.5, 2.0
    trainer = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, loss_type="dapo", use_vllm=True,
                                       vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                                       vllm_importance_sampling_clip_max=clip_max)
    inputs = oracle.trl_inputs(trainer, batch)
    ratio = inputs["importance_sampling_ratio"]

    rows = []  # independent: exp(pi_old - pi_sampler), old = the model now (TRL's own no-grad pass)
    for s, lp in zip(batch, logps, strict=True):
        diff = lp - torch.tensor(s["sampling_per_token_logps"])
        r = torch.exp(diff.sum().reshape(1)) if mode.startswith("sequence") else torch.exp(diff)
        if mode.endswith("truncate"):
            r = r.clamp(clip_min, clip_max)
        else:
            r = torch.where((r < clip_min) | (r > clip_max), torch.zeros_like(r), r)
        rows.append(r)
    if mode.startswith("sequence"):
        assert ratio.shape == (len(batch), 1)
        torch.testing.assert_close(ratio[:, 0], torch.cat(rows), rtol=1e-5, atol=1e-6)
    else:
        assert ratio.shape == inputs["completion_ids"].shape
        for i, r in enumerate(rows):
            torch.testing.assert_close(ratio[i, :len(r)], r, rtol=1e-5, atol=1e-6)
    assert ((ratio != 1.0) & (ratio != 0.0)).any()

    loss, _, metrics = oracle.trl_loss_and_grads(trainer, batch)
    assert "sampling/importance_sampling_ratio/mean" in metrics
    plain = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, loss_type="dapo")
    assert loss != pytest.approx(oracle.trl_loss_and_grads(plain, batch)[0], rel=1e-4)
    for s in batch:  # given pi_old: the ratio is exp(given old - sampling)
        s["old_per_token_logps"] = s["sampling_per_token_logps"]
    assert torch.allclose(oracle.trl_inputs(trainer, batch)["importance_sampling_ratio"], torch.tensor(1.0))


def test_rewards_become_trls_group_advantages_and_tool_masks_drop_tokens(tok):
    batch = make_batch(tok)
    for s, r in zip(batch, [1.0, 0.0, 0.2, 0.6], strict=True):
        del s["advantage"]
        s["reward"] = r
    trainer = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, loss_type="dapo")
    inputs = oracle.trl_inputs(trainer, batch)
    # group of 2: (r - mean) / (std + 1e-4), std unbiased: |r1 - r2| / sqrt(2)
    expected = []
    for a, b in [(1.0, 0.0), (0.2, 0.6)]:
        std = abs(a - b) / math.sqrt(2)
        expected += [(a - (a + b) / 2) / (std + 1e-4), (b - (a + b) / 2) / (std + 1e-4)]
    torch.testing.assert_close(inputs["advantages"], torch.tensor(expected))
    n = sum(len(s["completion_ids"]) for s in batch)
    assert inputs["num_items_in_batch"].item() == n
    batch[0]["tool_mask"] = [1] * (len(batch[0]["completion_ids"]) - 2) + [0, 0]
    for s in batch[1:]:
        s["tool_mask"] = [1] * len(s["completion_ids"])
    inputs = oracle.trl_inputs(trainer, batch)
    assert inputs["num_items_in_batch"].item() == n - 2
    assert inputs["tool_mask"][0, :len(batch[0]["completion_ids"])].tolist()[-2:] == [0, 0]


def test_micro_batches_dapo_is_split_invariant_and_bnpo_normalises_per_micro_batch(tok):
    batch = make_batch(tok, advantages=(1.0, -0.3, 0.5, -0.5))
    for loss_type, invariant in [("dapo", True), ("bnpo", False)]:
        one = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, loss_type=loss_type)
        two = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, loss_type=loss_type,
                                       gradient_accumulation_steps=2)
        loss1, grads1, _ = oracle.trl_loss_and_grads(one, batch)
        loss2, grads2, _ = oracle.trl_loss_and_grads(two, batch)  # 2 micro-batches of 2, as grad_accum=2
        same = abs(loss1 - loss2) < 1e-6 and all(torch.allclose(grads1[k], grads2[k], atol=1e-7) for k in grads1)
        assert same == invariant, loss_type


def test_kl_term_reads_trls_reference_copy_or_the_given_ref_logps(tok):
    batch = make_batch(tok)
    trainer = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, loss_type="dapo", beta=0.1)
    assert trainer.ref_model is not None
    loss, _, metrics = oracle.trl_loss_and_grads(trainer, batch)  # reference = the same weights: KL 0
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)
    for s in batch:
        s["ref_per_token_logps"] = [-5.0] * len(s["completion_ids"])
    loss_ref, _, metrics = oracle.trl_loss_and_grads(trainer, batch)
    assert metrics["kl"] > 0.01 and loss_ref > loss


def test_lr_schedule_is_trls_linear_default_and_cosine_with_warmup():
    lrs = oracle.trl_lr_schedule({"learning_rate": 5e-6}, 20)  # TRL's default: linear decay to 0, no warm-up
    assert lrs[0] == pytest.approx(5e-6) and lrs[17] == pytest.approx(7.5e-7)  # logged at global_step 1 and 18
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))
    lrs = oracle.trl_lr_schedule({"learning_rate": 1e-5, "lr_scheduler_type": "cosine", "warmup_ratio": 0.2}, 10)
    assert lrs[0] == 0.0 and lrs[2] > lrs[1] > 0 and max(lrs) == pytest.approx(1e-5) and lrs.index(max(lrs)) == 2
    assert lrs[-1] < lrs[3]


def off_policy_batch(tok) -> list[dict]:
    batch = make_batch(tok)
    gen = torch.Generator().manual_seed(3)
    for s in batch:  # pi_old and the rollout engine's log-probs both well away from the model's (~-5.7)
        n = len(s["completion_ids"])
        s["old_per_token_logps"] = (-5.7 + (torch.rand(n, generator=gen) - 0.5)).tolist()
        s["sampling_per_token_logps"] = (-4.0 + (torch.rand(n, generator=gen) - 0.5)).tolist()
    return batch


@pytest.mark.parametrize("knob", [{"entropy_coef": 0.1}, {"top_entropy_quantile": 0.5}, {"delta": 1.05},
                                  {"off_policy_mask_threshold": 0.1}, {"mask_truncated_completions": True},
                                  {"epsilon_high": 0.1}])
def test_each_knob_reaches_trls_loss(tok, knob):
    batch = off_policy_batch(tok)
    base = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, loss_type="dapo", epsilon_high=0.28)
    with_knob = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, **{"loss_type": "dapo",
                                                                                   "epsilon_high": 0.28, **knob})
    base_loss, base_grads, _ = oracle.trl_loss_and_grads(base, batch)
    loss, grads, _ = oracle.trl_loss_and_grads(with_knob, batch)
    assert loss != pytest.approx(base_loss, rel=1e-5) or any(
        not torch.allclose(grads[k], base_grads[k], rtol=1e-4, atol=1e-8) for k in grads), knob


def test_adaptive_entropy_applies_no_bonus_until_an_optimizer_step_has_measured_the_entropy(tok):
    batch = make_batch(tok)
    plain = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, loss_type="dapo")
    trainer = oracle.build_trl_trainer(oracle.tiny_model(tokenizer=tok), tok, loss_type="dapo",
                                       use_adaptive_entropy=True, entropy_coef=0.1, entropy_target=100.0)
    base = oracle.trl_loss_and_grads(plain, batch)[0]
    first, _, metrics = oracle.trl_loss_and_grads(trainer, batch)  # _last_world_entropy starts at inf: no bonus
    assert first == pytest.approx(base, rel=1e-6)
    assert trainer._last_world_entropy == pytest.approx(metrics["entropy"], rel=1e-5)
    assert trainer.entropy_coef == pytest.approx(0.1 + 0.005)  # entropy <= target: coefficient up one delta
    second, _, _ = oracle.trl_loss_and_grads(trainer, batch)
    assert second == pytest.approx(base - 0.105 * metrics["entropy"], rel=1e-5)
