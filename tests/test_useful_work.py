"""Useful work only: the trainer skips samples that cannot move the weights (zero advantage, no KL term)
and the update stays the one the unskipped step takes (fp32, every parameter's gradient)."""

import copy

import pytest
import torch

from rollyard.model import kernels
from rollyard.model.loading import attach_lora, build_preset, char_tokenizer
from rollyard.trainer import optim
from rollyard.trainer import trainer as trainer_mod
from rollyard.trainer.adamw_bf16 import AdamWBf16
from rollyard.trainer.streaming import StreamingStep
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample

TOK = char_tokenizer()
V = len(TOK)


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def _model(seed=0):
    return build_preset("tiny", TOK, seed=seed, max_position_embeddings=128)


def _groups(seed, groups=4, G=4, zero_groups=(1, 3), tools=False):
    """``groups`` groups of ``G`` samples sharing a prompt; the groups in ``zero_groups`` have all-equal
    rewards (advantage exactly 0). ``tools``: every other sample is multi-turn with a masked tool turn."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for q in range(groups):
        p = torch.randint(4, V, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for k in range(G):
            c = torch.randint(4, V, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
            mask = None
            if tools and k % 2 and len(c) > 4:
                mask = [1, 1] + [0] * (len(c) - 4) + [1, 1]  # a tool's reply in the middle: context only
            adv = 0.0 if q in zero_groups else float(torch.randn(1, generator=g))
            out.append(Sample(id=f"q{q}/{k}", request_id=f"q{q}", prompt_ids=p, completion_ids=c,
                              logprobs=(-torch.rand(len(c), generator=g)).tolist(), versions=[0] * len(c),
                              finish_reason="stop", advantage=adv, completion_mask=mask))
    return out


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _accumulated(model, samples, skip, **kw):
    t = Trainer(model, skip_zero_advantage=skip, **kw)
    t.optimizer.zero_grad(set_to_none=False)
    for p in t.params:
        p.grad = torch.zeros_like(p)
    acc = t.accumulate_gradients(samples)
    return acc, _grads(model)


def _same(a, b, tol=1e-6):
    assert a.keys() == b.keys()
    for n in a:
        assert torch.allclose(a[n], b[n], atol=tol, rtol=1e-5), (n, (a[n] - b[n]).abs().max())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
@pytest.mark.parametrize("mbt,tools", [(4096, False), (24, False), (24, True)])
def test_skipped_samples_leave_every_gradient_unchanged(agg, mbt, tools):
    model = _model(1)
    samples = _groups(2, tools=tools)
    kw = dict(loss_agg=agg, micro_batch_tokens=mbt, clip_high=0.28, tis_cap=1.5)
    full_acc, full = _accumulated(model, samples, skip=False, **kw)
    model.zero_grad(set_to_none=True)
    got_acc, got = _accumulated(model, samples, skip=True, **kw)
    _same(got, full)
    assert any(v.abs().sum() > 0 for v in got.values())
    assert float(got_acc["loss"]) == pytest.approx(float(full_acc["loss"]), abs=1e-6)
    # Half the groups are all-zero: half the sequences and their positions were never computed.
    assert got_acc["skipped_seqs"] == 8 and full_acc["skipped_seqs"] == 0
    assert got_acc["packed_tokens"] < full_acc["packed_tokens"]
    assert got_acc["tokens"] == full_acc["tokens"]  # the denominators are the whole batch's


def test_skipping_keeps_lora_gradients():
    peft = attach_lora(_model(5), r=2, alpha=4.0, targets=["q_proj", "v_proj"])
    samples = _groups(6)
    for p in peft.parameters():  # a nonzero B so every factor gets a gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    _, full = _accumulated(peft, samples, skip=False, micro_batch_tokens=30)
    peft.zero_grad(set_to_none=True)
    _, got = _accumulated(peft, samples, skip=True, micro_batch_tokens=30)
    assert got and all("lora" in n for n in got)
    _same(got, full)


@pytest.mark.parametrize("state", ["fp32", "bf16"])
def test_a_fully_zero_batch_still_steps_on_the_zero_gradient_without_a_forward(monkeypatch, state):
    """Adam's moments from the first step move the weights on the second, all-zero-advantage step: the
    skipping trainer must take that step too (no forward, no backward) and land on the same weights."""
    a, b = _model(7), _model(7)
    ta = Trainer(a, lr=1e-2, optimizer_state=state)
    tb = Trainer(b, lr=1e-2, skip_zero_advantage=False, optimizer_state=state)
    taken = []  # the skipping trainer's step on the zero gradient allocates none (where the kernels load)
    real = trainer_mod.step_on_zero_gradient
    monkeypatch.setattr(trainer_mod, "step_on_zero_gradient", lambda opt: taken.append(real(opt)) or taken[-1])
    first = _groups(8, zero_groups=())
    ma, mb = ta.step(copy.deepcopy(first)), tb.step(copy.deepcopy(first))
    assert ma["skipped_frac"] == 0.0 and ma["loss"] == pytest.approx(mb["loss"], abs=1e-6)
    after_first = copy.deepcopy(a.state_dict())
    zeros = _groups(9, zero_groups=range(4))
    ma, mb = ta.step(copy.deepcopy(zeros)), tb.step(copy.deepcopy(zeros))
    assert ma["micro_batches"] == 0 and ma["packed_tokens"] == 0 and mb["micro_batches"] > 0
    assert ma["skipped_frac"] == 1.0 and ma["skipped_positions_frac"] == 1.0 and mb["skipped_frac"] == 0.0
    assert ma["grad_norm"] == 0.0 and mb["grad_norm"] == 0.0 and ma["skipped"] == 0.0
    moved = max((v - after_first[k]).abs().max().item() for k, v in a.state_dict().items())
    assert moved > 1e-4  # the step on the zero gradient did move the weights (Adam's first moment)
    for k, v in b.state_dict().items():
        assert torch.allclose(a.state_dict()[k], v, atol=1e-6), k
    assert taken == [kernels.kernel() is not None]


@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_adamw_step_on_zero_gradient_equals_torch_adamw_on_zeros(decay):
    """optim.step_on_zero_gradient against torch.optim.AdamW's own fused step on zero-filled gradients (the kernel
    the trainer's AdamW runs): the same bits in weights and moments over three steps after three real ones, two
    parameter groups, the rate changed between steps as a schedule does; nothing done before the moments exist or
    with a gradient present."""
    if kernels.kernel() is None:
        pytest.skip("the CPU kernels are off here (ROLLYARD_CPU_KERNELS=0 or no compiler): the caller's fallback runs")
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (33, 70_001, 4 * 1024)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]

    def groups(xs):
        return [{"params": xs[:2]}, {"params": xs[2:], "weight_decay": 0.0}]
    want = torch.optim.AdamW(groups(ps), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=decay, fused=True)
    got = optim.adamw(groups(qs), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=decay)
    assert not optim.step_on_zero_gradient(got)  # no moments yet: the caller steps on zeros
    for _ in range(3):
        for p, q in zip(ps, qs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        want.step()
        got.step()
        want.zero_grad()
        got.zero_grad()
    qs[0].grad = torch.zeros_like(qs[0])
    assert not optim.step_on_zero_gradient(got)  # a gradient present: not this step's case
    qs[0].grad = None
    before = [q.detach().clone() for q in qs]
    for k in range(3):
        for o in (want, got):
            for g in o.param_groups:
                g["lr"] = 1e-2 * (0.5 + 0.2 * k)
        for p in ps:
            p.grad = torch.zeros_like(p)
        want.step()
        want.zero_grad()
        assert optim.step_on_zero_gradient(got)
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(want.state[p][name], got.state[q][name])
        assert float(got.state[q]["step"]) == 6.0
    assert max((q.detach() - b).abs().max().item() for q, b in zip(qs, before)) > 1e-3  # the moments moved them


def test_bf16_moments_step_on_zero_gradient_gives_the_bits_of_a_step_on_zero_filled_gradients():
    """AdamWBf16 on an exactly zero gradient without one (the kernel's g = None) against its own step on zero-filled
    gradients: the same bits in weights and moments (the same arithmetic and random bits), and the weights moved."""
    if kernels.kernel() is None:
        pytest.skip("the CPU kernels are off here (ROLLYARD_CPU_KERNELS=0 or no compiler): the caller's fallback runs")
    torch.manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (17, 70_001)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    want, got = (AdamWBf16(x, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.05) for x in (ps, qs))
    assert not optim.step_on_zero_gradient(got)  # no moments yet
    for p, q in zip(ps, qs):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    want.step()
    got.step()
    for x in (*ps, *qs):
        x.grad = None
    before = [q.detach().clone() for q in qs]
    for _ in range(2):
        for p in ps:
            p.grad = torch.zeros_like(p)
        want.step()
        for p in ps:
            p.grad = None
        assert optim.step_on_zero_gradient(got)
    for p, q, b in zip(ps, qs, before):
        assert torch.equal(p, q) and not torch.equal(q, b)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(want.state[p][name], got.state[q][name])


def test_skipped_share_is_in_the_step_metrics():
    t = Trainer(_model(3), micro_batch_tokens=40)
    samples = _groups(4, zero_groups=(0,))
    m = t.step(samples)
    positions = [len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples]
    skipped = sum(n for s, n in zip(samples, positions) if s.advantage == 0.0)
    assert m["skipped_frac"] == pytest.approx(4 / 16)
    assert m["skipped_positions_frac"] == pytest.approx(skipped / sum(positions))
    # Computed: each trained group's prompt once, then its completions but their last tokens (groups 1-3 here).
    trained = [samples[4 * q:4 * q + 4] for q in (1, 2, 3)]
    assert m["positions"] == sum(positions)
    assert m["computed_positions"] == sum(len(g[0].prompt_ids) + sum(len(s.completion_ids) - 1 for s in g)
                                          for g in trained)
    assert m["packed_tokens"] >= m["computed_positions"]  # the rows' pads besides
    # With a KL term every sample has a gradient: nothing is skipped.
    for s in samples:
        s.ref_logprobs = [x - 0.1 for x in s.logprobs]
    assert Trainer(_model(3), kl_coef=0.1).step(samples)["skipped_frac"] == 0.0


def test_streaming_step_skips_and_matches_the_unskipped_step():
    a, b = _model(11), _model(11)
    samples = _groups(12)
    stream = StreamingStep(Trainer(a, lr=1e-3, micro_batch_tokens=30), min_tokens=30)
    for q in range(4):
        stream.add(copy.deepcopy(samples[4 * q:4 * q + 4]))
    m = stream.finish()
    want = Trainer(b, lr=1e-3, micro_batch_tokens=30, skip_zero_advantage=False).step(copy.deepcopy(samples))
    assert m["skipped_frac"] == 0.5 and want["skipped_frac"] == 0.0
    assert m["loss"] == pytest.approx(want["loss"], abs=1e-6)
    assert m["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    # Adam's first step moves a weight by ~lr whatever its gradient's size, so a gradient of ~1e-9 summed in
    # another order (the stream's micro-batches) moves by a few 1e-6: the tolerance is lr / 50.
    for k, v in b.state_dict().items():
        assert torch.allclose(a.state_dict()[k], v, atol=2e-5), k


# -- each prompt once: the prefix-shared layout -----------------------------------------------------


def _multi_turn(seed, G=4):
    """One group whose prompts share a first turn and differ after it (a multi-turn conversation's later
    prompts), one whose prompts are identical, and one of a single sample."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(4, V, (n,), generator=g).tolist()

    first = toks(7)
    prompts = {"mt": [first + toks(int(torch.randint(0, 5, (1,), generator=g))) for _ in range(G)],
               "same": [toks(9)] * G, "alone": [toks(5)]}
    out = []
    for q, ps in prompts.items():
        for k, p in enumerate(ps):
            c = toks(int(torch.randint(1, 12, (1,), generator=g)))
            out.append(Sample(id=f"{q}/{k}", request_id=q, prompt_ids=list(p), completion_ids=c,
                              logprobs=(-torch.rand(len(c), generator=g)).tolist(), versions=[0] * len(c),
                              finish_reason="stop", advantage=float(torch.randn(1, generator=g))))
    return out


def _qwen3():
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(8)
    return AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=64))


@pytest.mark.parametrize("arch,checkpointing,mbt,segmented", [
    ("llama", False, 4096, False), ("llama", True, 4096, False), ("llama", False, 24, False),
    ("qwen3", False, 4096, False), ("llama", True, 4096, True), ("qwen3", False, 4096, True)])
def test_prefix_shared_logprobs_and_gradients_equal_unshared(monkeypatch, arch, checkpointing, mbt, segmented):
    """The tiny preset has GQA (4 query heads over 2 K/V heads) and tied embeddings; Qwen3's per-head q/k
    norms take torch's RoPE instead of the compiled kernel; ``mbt=24`` cuts a group into several rows;
    ``segmented``: the attention computed per segment (``model/segments.py``) wherever it saves any pair."""
    from rollyard.model import fast, segments

    used = []
    if segmented:
        monkeypatch.setattr(segments, "MIN_SAVED_PAIRS_PER_POSITION", 0)
        monkeypatch.setattr(fast, "segmented_attention", lambda *a: used.append(1) or segments.segmented_attention(*a))
    model = _model(13) if arch == "llama" else _qwen3()
    samples = _multi_turn(14) + _groups(15, groups=2, zero_groups=())
    kw = dict(micro_batch_tokens=mbt, activation_checkpointing=checkpointing, clip_high=0.28)
    shared, unshared = Trainer(model, **kw), Trainer(model, share_prompts=False, **kw)
    mbs = shared.micro_batches(samples)
    assert {mb.layout for mb in mbs} == {"shared"}
    assert {mb.layout for mb in unshared.micro_batches(samples)} <= {"padded", "packed"}
    # The computed positions fall by the repeated prompts (a unit's rows are padded to the longest).
    real = sum(int((mb.segments >= 0).sum()) for mb in mbs)
    unshared_positions = sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
    assert real < unshared_positions - 20

    lp_s, lp_u = shared.logprobs(samples), unshared.logprobs(samples)
    for s, a, b in zip(samples, lp_s, lp_u):
        assert a.shape == (len(s.completion_ids),)
        assert torch.allclose(a, b, atol=2e-5), s.id
    grads = []
    for t in (shared, unshared):
        model.zero_grad(set_to_none=True)
        acc = t.accumulate_gradients(copy.deepcopy(samples))
        grads.append((float(acc["loss"]), _grads(model)))
    (ls, gs), (lu, gu) = grads
    assert ls == pytest.approx(lu, abs=1e-6)
    assert gs.keys() == gu.keys() and gs
    for n in gu:  # relative to the gradient's scale (fp32 rounding)
        assert (gs[n] - gu[n]).abs().max() <= 2e-5 * gu[n].abs().max().clamp_min(1e-3), n
    assert bool(used) == segmented


def test_prefix_shared_rows_share_only_the_identical_prefix():
    from rollyard.trainer.packing import prefix_shared

    samples = _multi_turn(16)
    pairs = [(s.prompt_ids, s.completion_ids) for s in samples]
    (mb,) = prefix_shared(pairs, [s.request_id for s in samples], 4096)
    first = 7  # the multi-turn group's common first turn (its later turns may still agree by chance)
    for b in range(mb.input_ids.shape[0]):
        seg, pos, ids = mb.segments[b], mb.position_ids[b], mb.input_ids[b]
        S = int((seg == 0).sum())
        members = [i for i in mb.members if samples[i].prompt_ids[:S] == ids[:S].tolist()]
        assert members and S >= min(first, min(len(samples[i].prompt_ids) for i in members))
        for k in range(1, int(seg.max()) + 1):  # each suffix continues the positions from the prefix
            at = (seg == k).nonzero()[:, 0]
            assert pos[at].tolist() == list(range(S, S + len(at)))


def test_a_model_on_the_hf_fallback_keeps_unshared_packing_and_says_so_once():
    peft = attach_lora(_model(5), r=2, alpha=4.0, targets=["q_proj", "v_proj"])
    t = Trainer(peft)
    samples = _groups(17, zero_groups=())
    with pytest.warns(UserWarning, match="once per sample, not once per group") as seen:
        t.logprobs(samples)
        t.step(samples)
    assert len([w for w in seen if "once per group" in str(w.message)]) == 1
    assert all(mb.layout != "shared" for mb in t.micro_batches(samples))


# -- the plan prices the positions computed; review holds a run to it ----------------------------------


def test_plan_prices_the_positions_the_trainer_computes():
    from rollyard.plan import hardware as H
    from rollyard.plan.inputs import load_plan
    from rollyard.plan.review import shape_differences

    base = ["rollout.prompts=2", "rollout.samples=4", "rollout.prompt_tokens=10", "rollout.avg_tokens=5",
            "tail.max_tokens=64"]
    every = load_plan(None, base)  # the defaults (the runbook's model): every sample's prompt, nothing skipped
    shared = load_plan(None, [*base, "trainer.prefix_shared=true"])
    half = load_plan(None, [*base, "trainer.prefix_shared=true", "trainer.zero_advantage_share=0.5"])
    assert H.train_tokens(every) == 8 * (10 + 5)  # each of 8 samples carries its prompt
    assert H.train_tokens(shared) == 2 * 10 + 8 * 5  # 2 prompts once, 8 responses
    assert H.train_tokens(half) == (2 * 10 + 8 * 5) / 2
    assert H.train_tokens(half, skipping=False) == 2 * 10 + 8 * 5  # a reference forward scores every sample
    assert H.train_s(every, 1) == pytest.approx(4 * H.train_s(half, 1))
    assert H.reference_s(half, 1) == H.reference_s(shared, 1)

    # A plan priced on shared prompts does not describe a run that computed every position.
    info = {"prompts_per_step": 2, "samples_per_prompt": 4}
    assert shape_differences(info, shared, useful_work=True) == []
    assert shape_differences(info, shared, useful_work=False) == [
        "trainer.useful_work: run false vs plan trainer.prefix_shared = true"]
    assert shape_differences(info, every, useful_work=True) == [
        "trainer.useful_work: run true vs plan trainer.prefix_shared = false"]
