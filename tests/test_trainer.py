"""The packed trainer against slow references: unpacked forwards, full logits, one big batch."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from rollyard.algo.loss import kl_k3
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.trainer.packing import layout_cost, pack, plan, plan_padded_bins
from rollyard.trainer.trainer import Trainer, chunked_token_logprobs
from rollyard.types import Sample

TOK = char_tokenizer()
V = len(TOK)


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def _model(seed=0):
    return build_preset("tiny", TOK, seed=seed, max_position_embeddings=128)


def _samples(seed, n=8, max_prompt=12, max_completion=14, groups=4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(4, V, (int(torch.randint(1, max_prompt + 1, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(4, V, (int(torch.randint(1, max_completion + 1, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(id=f"s{i}", request_id=f"r{i % groups}", prompt_ids=p, completion_ids=c,
                          logprobs=[0.0] * len(c), versions=[0] * len(c), finish_reason="stop",
                          advantage=float(torch.randn(1, generator=g))))
    return out


def _unpacked_logprobs(model, s: Sample, temperature=1.0, grad=False) -> torch.Tensor:
    """Slow reference: one sequence alone, full [T, V] logits, log_softmax, gather."""
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    with torch.set_grad_enabled(grad):
        logits = model(ids, use_cache=False).logits[0].float() / temperature
        lp = logits.log_softmax(-1)
    P = len(s.prompt_ids)
    return lp[P - 1:-1].gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]


# -- chunked log-softmax ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_logprobs_match_full_logits_values_and_grads(chunk):
    g = torch.Generator().manual_seed(chunk)
    N, H, Vb, T = 50, 16, 300, 0.7
    head = torch.nn.Linear(H, Vb, bias=True)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, Vb, (N,), generator=g)
    w = torch.randn(N, generator=g)  # a random downstream loss, so grads are not trivially uniform

    lp, ent = chunked_token_logprobs(hidden, head, targets, temperature=T, chunk=chunk, with_entropy=True)
    (lp * w).sum().backward()
    grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = None
    head.zero_grad()

    full = (head(hidden) / T).log_softmax(-1)
    ref = full.gather(-1, targets[:, None])[:, 0]
    ref_ent = -(full.exp() * full).sum(-1)
    (ref * w).sum().backward()
    assert torch.allclose(lp, ref, atol=1e-5)
    assert torch.allclose(ent, ref_ent.detach(), atol=1e-5) and not ent.requires_grad
    for got, want in zip(grads, [hidden.grad, head.weight.grad, head.bias.grad]):
        assert torch.allclose(got, want, atol=1e-5)


def test_chunked_logprobs_never_keep_full_logits(monkeypatch):
    """What autograd keeps for the backward pass is O(N x H), not O(N x V): logits are recomputed
    one chunk at a time in the backward instead of being saved."""
    import rollyard.trainer.logprobs as trainer_mod

    N, H, Vb, chunk = 256, 8, 512, 32
    head = torch.nn.Linear(H, Vb, bias=False)
    hidden = torch.randn(N, H, requires_grad=True)
    targets = torch.randint(0, Vb, (N,))

    def saved_numel():
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (seen.append(t.numel()), t)[1], lambda t: t):
            lp, _ = trainer_mod.chunked_token_logprobs(hidden, head, targets, chunk=chunk, with_entropy=True)
        lp.sum().backward()
        return sum(seen)

    assert saved_numel() < N * Vb / 16  # a plain head: trainer/head.py's own backward
    monkeypatch.setattr(trainer_mod.head_grad, "applies", lambda *a: False)
    assert saved_numel() < N * Vb / 16  # any other head: per-chunk checkpointing
    # Control: the same measure without per-chunk checkpointing sees every chunk's logits.
    monkeypatch.setattr(trainer_mod, "checkpoint", lambda fn, *args, **kw: fn(*args))
    assert saved_numel() > N * Vb


# -- packing ------------------------------------------------------------------------------------------


def test_pack_bins_respect_budget_and_keep_every_token():
    seqs = [([1] * p, [2] * c) for p, c in [(3, 4), (10, 1), (1, 30), (5, 0), (2, 2), (7, 7)]]
    mbs = pack(seqs, max_tokens=16)
    seen = sorted(i for mb in mbs for i in mb.members)
    assert seen == [0, 1, 2, 4, 5]  # the empty completion is left out
    for mb in mbs:
        assert mb.num_tokens <= 16 or len(mb.members) == 1  # an oversize sequence gets its own
        assert len(mb.rows) == len(mb.targets) == sum(mb.lengths)
        # Each member's tokens are in the row, and row r's target is the token after r.
        ids = mb.input_ids[0].tolist()
        for k, i in enumerate(mb.members):
            p, c = seqs[i]
            rows = mb.rows[mb.seq_index == k].tolist()
            start = rows[0] - (len(p) - 1)
            assert ids[start:start + len(p) + len(c) - 1] == p + c[:-1]
            assert mb.position_ids[0, start:start + len(p) + len(c) - 1].tolist() == list(range(len(p) + len(c) - 1))
            assert mb.targets[mb.seq_index == k].tolist() == c
            assert [ids[r + 1] for r in rows[:-1]] == c[:-1]
    with pytest.raises(ValueError, match="empty prompt"):
        pack([([], [1, 2])], 16)


def test_padded_plan_sorts_by_length_and_respects_budget():
    seqs = [([1] * p, [2] * c) for p, c in [(3, 4), (10, 1), (1, 30), (5, 0), (2, 2), (7, 7), (4, 4)]]
    mbs = plan(seqs, max_tokens=24, layout="padded")
    assert sorted(i for mb in mbs for i in mb.members) == [0, 1, 2, 4, 5, 6]
    for mb in mbs:
        assert mb.layout == "padded" and mb.position_ids is None
        B, T = mb.input_ids.shape
        assert B == len(mb.members) and (B * T <= 24 or B == 1)
        flat = mb.input_ids.reshape(-1).tolist()
        for k, i in enumerate(mb.members):
            p, c = seqs[i]
            assert flat[k * T:k * T + len(p) + len(c) - 1] == p + c[:-1]  # from position 0, right-padded
            rows = mb.rows[mb.seq_index == k].tolist()
            assert rows[0] == k * T + len(p) - 1 and mb.targets[mb.seq_index == k].tolist() == c
    firsts = [len(seqs[mb.members[0]][0]) + len(seqs[mb.members[0]][1]) for mb in mbs]
    assert firsts == sorted(firsts, reverse=True)  # longest first


def test_auto_layout_takes_the_cheaper_estimate():
    many_short = [([1] * 4, [2] * 60)] * 16  # 16 x 63: a packed row would pay 1008^2 attention pairs
    assert layout_cost([63] * 16, "padded", 0.01) < layout_cost([63] * 16, "packed", 0.01)
    assert {mb.layout for mb in plan(many_short, 2048, "auto", attn_weight=0.01)} == {"padded"}
    uneven = [([1] * 2, [2] * 200)] + [([1] * 2, [2] * 3)] * 5  # pads would dominate a padded batch
    assert {mb.layout for mb in plan(uneven, 4096, "auto", attn_weight=1e-5)} == {"packed"}
    with pytest.raises(ValueError, match="layout"):
        plan(many_short, 64, "diagonal")


def _all_cuts(lengths, max_tokens):
    """Every way to cut the longest-first order into consecutive groups that fit (brute force)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    for mask in range(1 << (n - 1)):
        groups, start = [], 0
        for k in range(1, n + 1):
            if k == n or mask >> (k - 1) & 1:
                groups.append(order[start:k])
                start = k
        if all(len(g) == 1 or len(g) * lengths[g[0]] <= max_tokens for g in groups):
            yield groups


def test_padded_groups_minimise_estimated_cost_with_a_per_micro_batch_charge():
    lengths = [78, 20, 75, 44, 31, 70, 52, 25, 66, 40, 61]
    aw = 1e-3

    def cost(groups, charge):
        return sum(layout_cost([lengths[i] for i in g], "padded", aw) + charge for g in groups)

    for charge in (0.0, 50.0, 300.0, 1e6):
        got = plan_padded_bins(lengths, 400, aw, group_cost=charge)
        assert sorted(i for g in got for i in g) == list(range(len(lengths)))
        best = min(cost(c, charge) for c in _all_cuts(lengths, 400))
        assert cost(got, charge) == pytest.approx(best), charge
    assert len(plan_padded_bins(lengths, 400, aw, group_cost=0.0)) == len(lengths)  # free cuts: no pads at all
    fewest = min(len(c) for c in _all_cuts(lengths, 400))
    assert len(plan_padded_bins(lengths, 400, aw, group_cost=None)) == fewest
    assert len(plan_padded_bins(lengths, 10_000, aw, group_cost=1e6)) == 1


def test_trainer_splits_uneven_batches_and_keeps_even_ones_whole():
    model = build_preset("small", TOK, seed=0, max_position_embeddings=128)
    tr = Trainer(model, micro_batch_tokens=4096)
    rng = torch.Generator().manual_seed(0)
    uneven = [([1] * 16, [2] * int(n)) for n in torch.randint(20, 65, (32,), generator=rng)]
    even = [([1] * 16, [2] * 64)] * 32
    assert len(tr._pack(uneven)) > 1
    assert [tuple(mb.input_ids.shape) for mb in tr._pack(even)] == [(32, 79)]


def test_a_bf16_cpu_trainer_cuts_fewer_micro_batches_each_one_recasts_the_weights():
    """Under bf16 autocast every micro-batch casts the weights and their gradients (AUTOCAST_POSITIONS_PER_MICRO_BATCH):
    the uneven batch that an fp32 trainer of a 14M-parameter model cuts into several groups stays in one or two."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    lengths = torch.randint(3, 25, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    batch = [([1] * (44 + i % 4), [2] * n) for i, n in enumerate(lengths)]  # the real-model example's shape
    groups = {p: len(Trainer(model, micro_batch_tokens=4096, precision=p)._pack(batch)) for p in ("fp32", "bf16")}
    assert groups["fp32"] >= 3 and groups["bf16"] <= 2, groups


# (layout, fast functional forward for padded rows): every way a micro-batch can be computed
LAYOUTS = [("packed", False), ("padded", False), ("padded", True), ("auto", False), ("auto", True)]


@pytest.mark.parametrize("layout,fast", LAYOUTS)
def test_packed_logprobs_equal_unpacked(layout, fast):
    model = _model()
    samples = _samples(0, n=10)
    for mbt in (4096, 40):  # one micro-batch; several
        trainer = Trainer(model, micro_batch_tokens=mbt, temperature=0.7, logprob_chunk=5, layout=layout,
                          fast_forward=fast)
        assert trainer._use_fast(model) is fast
        assert {mb.layout for mb in trainer._pack([(s.prompt_ids, s.completion_ids) for s in samples])} <= (
            {layout} if layout != "auto" else {"packed", "padded"})
        got = trainer.logprobs(samples)
        for s, lp in zip(samples, got):
            ref = _unpacked_logprobs(model, s, temperature=0.7)
            assert lp.shape == (len(s.completion_ids),)
            assert (lp - ref).abs().max() < 1e-5, (mbt, s.id)
    assert len(pack([(s.prompt_ids, s.completion_ids) for s in samples], 40)) > 1


@pytest.mark.parametrize("layout,fast", [lf for lf in LAYOUTS if lf[0] != "auto"])
def test_no_attention_across_sequence_boundaries(layout, fast):
    """Editing every other sequence of a micro-batch leaves a sequence's logprobs unchanged."""
    model = _model()
    samples = _samples(1, n=5)
    trainer = Trainer(model, micro_batch_tokens=4096, layout=layout, fast_forward=fast)
    mbs = trainer._pack([(s.prompt_ids, s.completion_ids) for s in samples])
    assert len(mbs) == 1 and mbs[0].layout == layout  # all in one micro-batch
    base = trainer.logprobs(samples)
    g = torch.Generator().manual_seed(7)
    for k in range(len(samples)):
        edited = copy.deepcopy(samples)
        for j, s in enumerate(edited):
            if j != k:
                s.prompt_ids = torch.randint(4, V, (len(s.prompt_ids),), generator=g).tolist()
                s.completion_ids = torch.randint(4, V, (len(s.completion_ids),), generator=g).tolist()
        after = trainer.logprobs(edited)
        assert (after[k] - base[k]).abs().max() < 1e-6, k
        assert any((after[j] - base[j]).abs().max() > 1e-3 for j in range(len(samples)) if j != k)

    # Control: the same row with non-restarting positions *does* leak, so the check above has teeth.
    a, b = samples[0], samples[1]
    row = lambda x: torch.tensor([x.prompt_ids + x.completion_ids + b.prompt_ids + b.completion_ids])  # noqa: E731
    a2 = copy.deepcopy(a)
    a2.prompt_ids = [(t + 1 - 4) % (V - 4) + 4 for t in a.prompt_ids]
    with torch.no_grad():
        l1 = model(row(a), use_cache=False).logits[0, -1]
        l2 = model(row(a2), use_cache=False).logits[0, -1]
    assert (l1 - l2).abs().max() > 1e-3


def _family(arch):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    if arch == "llama":
        return _model(8)
    kw = {"vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    torch.manual_seed(8)
    model = AutoModelForCausalLM.from_config(Qwen3Config(head_dim=24, **kw) if arch == "qwen3" else Qwen2Config(**kw))
    with torch.no_grad():  # non-trivial biases / per-head norms
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape))
    return model


@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fast_train_forward_equals_hf_decoder_values_and_grads(arch, onednn, monkeypatch):
    from rollyard.model import gemm as cpu_gemm
    from rollyard.model.families import train_forward_matches
    from rollyard.model.llama import train_hidden

    calls = []
    if onednn:  # every projection through cpu_gemm's oneDNN Function, however small
        if not cpu_gemm._op_available():
            pytest.skip("torch built without oneDNN")
        monkeypatch.setenv("ROLLYARD_ONEDNN", "1")
        monkeypatch.setattr(cpu_gemm, "MIN_MACS", 0)
        for fn in (cpu_gemm._Linear, cpu_gemm._PartsLinear):  # q|k|v and gate|up by parts where MKL takes them
            monkeypatch.setattr(fn, "apply", lambda *a, apply=fn.apply: calls.append(1) or apply(*a))
    else:
        monkeypatch.setenv("ROLLYARD_ONEDNN", "0")
    model = _family(arch)
    assert train_forward_matches(model)
    ids = torch.randint(0, V, (3, 11), generator=torch.Generator().manual_seed(1))
    w = torch.randn(3, 11, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    grads = []
    for fwd in (lambda: train_hidden(model, ids), lambda: model.model(input_ids=ids, use_cache=False).last_hidden_state):
        model.zero_grad(set_to_none=True)
        out = fwd()
        (out * w).sum().backward()
        grads.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (got, g1), (want, g2) = grads
    assert len(calls) == (4 * model.config.num_hidden_layers if onednn else 0)  # qkv, o, gate|up, down
    assert torch.allclose(got, want, atol=1e-5)
    assert g1.keys() == g2.keys()
    for n in g2:  # relative to the gradient's scale (fp32 rounding)
        assert (g1[n] - g2[n]).abs().max() <= 1e-5 * g2[n].abs().max().clamp_min(1.0), n



@pytest.mark.parametrize("H,KVH,T", [(4, 4, 9), (4, 2, 9), (6, 2, 1), (8, 4, 33)])
def test_cpu_grouped_causal_attention_equals_sdpa_values_and_grads(H, KVH, T):
    """The trainer's CPU attention (query heads stacked per K/V head, additive causal mask, fp32
    softmax) against SDPA's causal GQA kernel: outputs and the gradients of q, k and v."""
    from rollyard.model.fast import causal_attention

    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(3, h, T, 16, generator=g, requires_grad=True) for h in (H, KVH, KVH))
    w = torch.randn(3, H, T, 16, generator=g)
    got_grads, outs = [], []
    for fn in (lambda: causal_attention(q, k, v, 0.25),
               lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=KVH != H)):
        for x in (q, k, v):
            x.grad = None
        o = fn()
        (o * w).sum().backward()
        outs.append(o.detach())
        got_grads.append([x.grad.clone() for x in (q, k, v)])
    assert (outs[0] - outs[1]).abs().max() < 1e-5
    for a, b in zip(*got_grads):
        assert (a - b).abs().max() < 1e-5


def test_fast_forward_is_refused_where_it_would_bypass_module_calls():
    """train_hidden reads projection weights directly: an adapter or a forward hook (FSDP's
    all-gather) would be skipped silently, so those models keep the HF decoder, and a LoRA
    policy's adapter factors get their gradient."""
    from rollyard.model.families import train_forward_matches, train_unsupported_reason
    from rollyard.model.loading import attach_lora

    peft = attach_lora(_model(5), r=2, alpha=4.0, targets=["q_proj", "v_proj"])
    inner = peft.base_model.model  # the Llama module with PEFT's Linear wrappers in place
    assert "not a plain torch.nn.Linear" in train_unsupported_reason(inner)
    assert not train_forward_matches(inner)  # even though lora_B = 0 makes the outputs equal
    t = Trainer(inner, micro_batch_tokens=4096, layout="padded")
    assert not t._use_fast(inner)
    t.optimizer.zero_grad(set_to_none=True)
    t.accumulate_gradients(_samples(5, n=4))
    lora_b = [p for n, p in inner.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_b)

    hooked = _model(6)
    hooked.model.layers[1].mlp.register_forward_pre_hook(lambda m, a: None)
    assert "forward hooks" in train_unsupported_reason(hooked)
    ckpt = _model(6)
    ckpt.gradient_checkpointing_enable()  # honoured by train_hidden (per-layer recompute; tests/test_real_model.py)
    assert train_unsupported_reason(ckpt) is None
    assert train_unsupported_reason(_model(6)) is None and train_forward_matches(_model(6))

# -- the RL step ----------------------------------------------------------------------------------


def _reference_loss(model, samples, old, agg, cl, ch, kl_coef, tis_cap, temperature):
    """Slow, obvious: per sequence full logits, per token loops, one big batch."""
    seq_terms = []
    for s, o in zip(samples, old):
        lp = _unpacked_logprobs(model, s, temperature, grad=True)
        terms = []
        for t in range(len(lp)):
            r = torch.exp(lp[t] - o[t])
            w = min(math.exp(float(o[t]) - s.logprobs[t]), tis_cap)
            a = s.advantage
            term = -torch.minimum(r * a, r.clamp(1 - cl, 1 + ch) * a) * w
            if kl_coef:
                d = s.ref_logprobs[t] - lp[t]
                term = term + kl_coef * (torch.exp(d) - d - 1)
            terms.append(term)
        seq_terms.append(terms)
    if agg == "token-mean":
        return sum(t for ts in seq_terms for t in ts) / sum(len(ts) for ts in seq_terms)
    return sum(sum(ts) / len(ts) for ts in seq_terms) / len(seq_terms)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout,fast", LAYOUTS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean"])
def test_accumulated_gradient_is_independent_of_micro_batching_and_matches_reference(agg, layout, fast):
    model = _model(3)
    samples = _samples(3, n=9)
    g = torch.Generator().manual_seed(5)
    ref_model = _model(4)
    scorer = Trainer(model, micro_batch_tokens=4096)
    on_policy = scorer.logprobs(samples)
    refs = scorer.logprobs(samples, model=ref_model)
    old = [lp + 0.3 * torch.randn(lp.shape, generator=g) for lp in on_policy]  # ratios beyond the clip
    for s, lp, r in zip(samples, on_policy, refs):
        s.logprobs = (lp + 0.5 * torch.randn(lp.shape, generator=g)).tolist()  # rollout mu: some TIS capped
        s.ref_logprobs = r.tolist()

    kw = dict(loss_agg=agg, clip_low=0.2, clip_high=0.28, kl_coef=0.1, tis_cap=1.5, temperature=0.9, logprob_chunk=4)
    results = []
    for mbt in (4096, 30, 1):  # one micro-batch; several; one sequence each
        trainer = Trainer(model, micro_batch_tokens=mbt, layout=layout, fast_forward=fast, **kw)
        trainer.optimizer.zero_grad(set_to_none=True)
        acc = trainer.accumulate_gradients(samples, old)
        results.append((acc["micro_batches"], float(acc["loss"]), _grads(model)))
    model.zero_grad(set_to_none=True)
    loss = _reference_loss(model, samples, old, agg, 0.2, 0.28, 0.1, 1.5, 0.9)
    loss.backward()
    want = _grads(model)
    assert [r[0] for r in results][0] == 1 and results[1][0] > 2 and results[2][0] == len(samples)
    for n_mb, got_loss, got in results:
        assert abs(got_loss - loss.item()) < 1e-5, n_mb
        for name in want:
            assert torch.allclose(got[name], want[name], atol=1e-6, rtol=1e-4), (n_mb, name)


def test_step_metrics_canaries():
    model = _model(5)
    samples = _samples(6, n=8)
    trainer = Trainer(model, micro_batch_tokens=32, tis_cap=2.0)
    lp = trainer.logprobs(samples)
    g = torch.Generator().manual_seed(0)
    deltas = [0.4 * torch.randn(x.shape, generator=g) for x in lp]
    for s, x, d in zip(samples, lp, deltas):
        s.logprobs = (x - d).tolist()  # old - mu = d
    for s in samples:
        s.ref_logprobs = [v + 0.1 for v in s.logprobs]
    m = trainer.step(samples)
    d = torch.cat(deltas)
    assert m["tokens"] == sum(len(s.completion_ids) for s in samples) and m["micro_batches"] > 1
    assert abs(m["logprob_diff"] - d.abs().mean().item()) < 1e-5
    assert abs(m["logprob_diff_max"] - d.abs().max().item()) < 1e-5
    assert abs(m["tis_capped_frac"] - (d > math.log(2.0)).float().mean().item()) < 1e-6
    for q, key in [(0.05, "ratio_p05"), (0.5, "ratio_p50"), (0.95, "ratio_p95")]:
        assert abs(m[key] - torch.quantile(d.exp(), q).item()) < 1e-4
    want_kl = kl_k3(torch.cat(lp), torch.cat([torch.tensor(s.ref_logprobs) for s in samples])).mean().item()
    assert abs(m["kl"] - want_kl) < 1e-4  # reported whenever ref_logprobs are present
    assert m["clip_frac"] == 0.0  # single update: ratio pi/pi_old == 1 exactly
    assert m["entropy"] > 0 and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert all(isinstance(v, float) for v in m.values())

    # On-policy (mu == trainer's logprobs): the gap canaries read zero and the ratio is 1.
    lp = trainer.logprobs(samples)
    for s, x in zip(samples, lp):
        s.logprobs = x.tolist()
        s.ref_logprobs = None
    m = trainer.step(samples)
    assert m["logprob_diff"] < 1e-6 and abs(m["ratio_p50"] - 1) < 1e-5 and m["tis_capped_frac"] == 0
    assert "kl" not in m


def test_step_none_old_logprobs_equals_explicit_on_policy_old():
    model = _model(8)
    samples = _samples(8)
    t = Trainer(model, micro_batch_tokens=40)
    old = t.logprobs(samples)
    t.accumulate_gradients(samples, None)
    a = _grads(model)
    model.zero_grad(set_to_none=True)
    t.accumulate_gradients(samples, old)
    b = _grads(model)
    assert all(torch.allclose(a[n], b[n], atol=1e-6) for n in a)


def test_step_rejects_inconsistent_inputs():
    model = _model()
    samples = _samples(0, n=2)
    t = Trainer(model)
    samples[0].logprobs = samples[0].logprobs[:-1]
    with pytest.raises(ValueError, match="rollout logprobs"):
        t.step(samples)
    samples = _samples(0, n=2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        Trainer(model, kl_coef=0.1).step(samples)
    with pytest.raises(ValueError, match="loss_agg"):
        Trainer(model, loss_agg="sum")


def test_empty_batch_is_a_no_op():
    model = _model()
    before = copy.deepcopy(model.state_dict())
    s = _samples(0, n=1)[0]
    s.completion_ids, s.logprobs, s.versions = [], [], []
    m = Trainer(model).step([s])
    assert m["tokens"] == 0 and m["micro_batches"] == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_rl_steps_move_policy_toward_positive_advantage():
    """Completions ending in 'a' get +1, in 'b' get -1: P('a' after the prompt) must rise."""
    torch.manual_seed(0)
    model = _model(9)
    t = Trainer(model, lr=3e-3, micro_batch_tokens=64)
    a, b = TOK.convert_tokens_to_ids("a"), TOK.convert_tokens_to_ids("b")
    prompts = [[TOK.bos_token_id] + TOK("x=", add_special_tokens=False)["input_ids"],
               [TOK.bos_token_id] + TOK("y:", add_special_tokens=False)["input_ids"]]

    def make():
        return [Sample(id=f"{i}/{last}", request_id=str(i), prompt_ids=p, completion_ids=[last], logprobs=[0.0],
                       versions=[0], finish_reason="stop", advantage=1.0 if last == a else -1.0)
                for i, p in enumerate(prompts) for last in (a, b)]

    def p_a_minus_p_b():
        lp = t.logprobs(make())
        return sum(float(lp[k][0] - lp[k + 1][0]) for k in (0, 2))

    start = p_a_minus_p_b()
    for _ in range(5):
        samples = make()
        for s, lp in zip(samples, t.logprobs(samples)):
            s.logprobs = lp.tolist()
        t.step(samples)
    assert p_a_minus_p_b() > start + 1.0


def test_sft_step_lowers_nll():
    torch.manual_seed(0)
    model = _model(10)
    t = Trainer(model, lr=3e-3, micro_batch_tokens=48)
    ids = lambda text: TOK(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    pairs = [([TOK.bos_token_id] + ids(f"{i}+{i}="), ids(str(2 * i)) + [TOK.eos_token_id]) for i in range(8)]
    first = t.sft_step(pairs)
    assert first["micro_batches"] > 1 and first["tokens"] == sum(len(c) for _, c in pairs)
    # The reported loss is the mean completion NLL before the step.
    samples = [Sample(id=str(i), request_id=str(i), prompt_ids=p, completion_ids=c, logprobs=[0.0] * len(c),
                      versions=[0] * len(c), finish_reason="stop") for i, (p, c) in enumerate(pairs)]
    for _ in range(15):
        last = t.sft_step(pairs)
    nll = -torch.cat(t.logprobs(samples)).mean().item()
    assert last["loss"] < first["loss"] * 0.7
    assert nll < last["loss"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_autocast_matches_fp32_cpu():
    cpu_model = _model(11)
    gpu_model = copy.deepcopy(cpu_model)
    samples = _samples(11, n=8)
    want = Trainer(cpu_model).logprobs(samples)
    t = Trainer(gpu_model, device="cuda", micro_batch_tokens=40)
    got = t.logprobs(samples)
    assert all(g.device.type == "cpu" for g in got)
    assert max((g - w).abs().max().item() for g, w in zip(got, want)) < 0.1  # bf16 forward
    for s, lp in zip(samples, got):
        s.logprobs = lp.tolist()
    m = t.step(samples)
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["logprob_diff"] < 0.02
    assert all(p.dtype == torch.float32 for p in gpu_model.parameters())  # fp32 master weights


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_cpu_bf16_precision_matches_fp32_reference_and_keeps_fp32_state(layout):
    """precision="bf16" on CPU: autocast matmuls (padded rows through the fast forward); logprobs and the gradient of a
    step agree with the fp32 reference (slow unpacked path) to bf16 accuracy, weights and Adam
    state stay fp32."""
    model = _model(12)
    samples = _samples(12, n=8)
    want_lp = [_unpacked_logprobs(model, s) for s in samples]
    t = Trainer(model, micro_batch_tokens=4096, layout=layout, precision="bf16")
    assert t.precision == "bf16" and Trainer(_model(0)).precision == "fp32"  # auto, tiny preset on CPU: fp32
    got_lp = t.logprobs(samples)
    # The fast forward's start-up check runs outside the caller's autocast (under it, bf16
    # rounding alone failed the fp32 tolerance and silently switched the fast path off).
    assert t._use_fast(model)
    err = max((g - w).abs().max().item() for g, w in zip(got_lp, want_lp))
    assert 1e-6 < err < 0.1, err  # bf16 really ran (not bit-equal to fp32) and stayed close
    for s, lp in zip(samples, want_lp):
        s.logprobs = lp.tolist()
    model.zero_grad(set_to_none=True)
    _reference_loss(model, samples, [lp.detach() for lp in want_lp], "token-mean", 0.2, 0.2, 0.0, 2.0, 1.0).backward()
    want = torch.cat([g.flatten() for g in _grads(model).values()])
    model.zero_grad(set_to_none=True)
    t.optimizer.zero_grad(set_to_none=True)
    t.accumulate_gradients(samples)
    got = torch.cat([g.flatten() for g in _grads(model).values()])
    cos = torch.nn.functional.cosine_similarity(got, want, dim=0).item()
    assert cos > 0.99 and abs(got.norm() / want.norm() - 1) < 0.05, (cos, (got.norm() / want.norm()).item())
    t._optimizer_step()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(v.dtype == torch.float32 for st in t.optimizer.state.values() for v in st.values() if v.dim())
    with pytest.raises(ValueError, match="precision='fp16'"):
        Trainer(model, precision="fp16")


def test_model_that_leaks_across_pack_boundaries_is_detected_and_not_packed(monkeypatch):
    import rollyard.trainer.layout as layout

    model = _model()
    assert layout.packing_is_isolated(model)
    real = layout.decoder_of

    def leaky(m):  # a 2D all-ones mask switches transformers' packed-sequence detection off
        dec = real(m)
        return lambda input_ids, **kw: dec(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kw)

    monkeypatch.setattr(layout, "decoder_of", leaky)
    assert not layout.packing_is_isolated(model)
    with pytest.warns(UserWarning, match="attend across boundaries"):
        t = Trainer(model, micro_batch_tokens=4096)
    samples = _samples(2, n=4)
    assert {mb.layout for mb in t._pack([(s.prompt_ids, s.completion_ids) for s in samples])} == {"padded"}
    got = t.logprobs(samples)  # still correct: padded rows need only causal attention
    assert all((lp - _unpacked_logprobs(model, s)).abs().max() < 1e-5 for s, lp in zip(samples, got))
    assert math.isfinite(t.step([_with_logprobs(s, lp) for s, lp in zip(samples, got)])["loss"])


def _with_logprobs(s, lp):
    s.logprobs = lp.tolist()
    return s


def test_adamw_is_fused_on_plain_parameters_and_keeps_its_own_kernel_on_load():
    from rollyard.trainer.optim import adamw

    tr = Trainer(_model(), lr=1e-3)
    assert tr.optimizer.defaults["fused"] is True
    tr.step(_samples(0))
    # An optimizer state saved by a per-op (unfused) AdamW, as older checkpoints were.
    plain = torch.optim.AdamW(tr.params, lr=1e-3)
    for p in tr.params:
        p.grad = torch.zeros_like(p)
    plain.step()
    saved = plain.state_dict()
    assert all(not g["fused"] for g in saved["param_groups"]) and saved["state"]
    tr.optimizer.load_state_dict(saved)
    assert all(g["fused"] is True for g in tr.optimizer.param_groups)
    # Parameters the fused kernel does not take (here: not on CPU/CUDA) get the per-op loop, and
    # a fused run's state does not switch it on.
    meta = [torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in tr.params]
    other = adamw(meta, lr=1e-3)
    assert other.defaults["fused"] is None
    other.load_state_dict(tr.optimizer.state_dict())
    assert all(g["fused"] is None for g in other.param_groups)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_precision_is_bf16_on_a_native_bf16_cpu_only_for_a_real_size_decoder(native_bf16, monkeypatch):
    """SmolLM2-135M's shape (30 layers x 576, ~106M decoder matrix parameters) trains in bf16 where the CPU
    multiplies bf16 natively; the tiny presets and any model on a CPU without it stay fp32; a GPU is bf16."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rollyard.model import gemm
    from rollyard.trainer.precision import auto_precision, decoder_matmul_params

    monkeypatch.setattr(gemm, "cpu_has_native_bf16", lambda: native_bf16)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    with torch.device("meta"):
        smol = AutoModelForCausalLM.from_config(cfg)
    assert 100e6 < decoder_matmul_params(smol) < 110e6  # 30 x (576 x 576 x 2 + 576 x 192 x 2 + 3 x 576 x 1536)
    cpu = torch.device("cpu")
    assert auto_precision(smol, cpu) == ("bf16" if native_bf16 else "fp32")
    assert auto_precision(_model(0), cpu) == "fp32" and auto_precision(smol, torch.device("cuda")) == "bf16"
    # rollout.precision=auto: the same rule for the native engine's compute; otherwise the rollout copy's dtype
    from rollyard.trainer.precision import rollout_precision
    chosen, why = rollout_precision("auto", smol, cpu)
    assert chosen == ("bf16" if native_bf16 else None) and why.startswith("auto: ")
    assert rollout_precision("auto", _model(0), cpu)[0] is None
    assert "rollout copy's dtype" in rollout_precision("auto", _model(0), cpu)[1]
    assert rollout_precision("auto", smol, torch.device("cuda"))[0] is None
    chosen, why = rollout_precision("bf16", _model(0), cpu)
    assert chosen == "bf16" and "rollout.precision=bf16" in why
    from rollyard.model import kernels as cpu_kernels
    widened = "widen the bf16 weights to fp32 in registers"
    if native_bf16:
        assert "emulated" not in why and widened not in why
    else:  # the compiled kernels' widening matmul where it is built here, else torch's emulation (and its warning)
        kernel = cpu_kernels.bf16_packs(64, 32)
        assert (widened in why) == kernel and ("emulated" in why) != kernel
        monkeypatch.setattr(cpu_kernels, "bf16_packs", lambda n, k: False)
        why = rollout_precision("bf16", _model(0), cpu)[1]
        assert "emulated and slower than fp32" in why and widened not in why


@pytest.mark.parametrize("max_norm", [1e-4, 1e6])
def test_the_optimizer_sees_gradients_clipped_to_max_grad_norm_and_the_step_reports_the_unclipped_norm(max_norm):
    """trainer.max_grad_norm as transformers' Trainer applies it (clip_grad_norm_): the optimizer steps on the
    gradients times min(1, max_norm / (norm + 1e-6)), the norm taken over every gradient before clipping and
    reported as grad_norm; a norm under the bound leaves the gradients exactly as the backward left them."""
    seen = {}
    for name, bound in (("free", float("inf")), ("bounded", max_norm)):
        t = Trainer(_model(5), lr=1e-3, max_grad_norm=bound)
        t.optimizer.step = lambda *a, _n=name, _t=t, **k: seen.__setitem__(_n, [p.grad.clone() for p in _t.params])
        seen[name + "/norm"] = t.step(_samples(3))["grad_norm"]
    free, bounded = seen["free"], seen["bounded"]
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in free))
    assert seen["bounded/norm"] == pytest.approx(norm, rel=1e-5) and seen["free/norm"] == pytest.approx(norm, rel=1e-5)
    factor = min(1.0, max_norm / (norm + 1e-6))
    assert (factor < 1e-2) == (max_norm == 1e-4)  # the two cases: clipped hard, and not at all
    for a, b in zip(free, bounded):
        if factor == 1.0:
            assert torch.equal(a, b)
        else:
            assert torch.allclose(b, a * factor, rtol=1e-5, atol=1e-12)


# -- a tied embedding's lookup gradient as its rows --------------------------------------------------


def test_rows_gradient_of_the_lookup_is_the_dense_gradient_bit_for_bit():
    """fast.RowsGradLookup against F.embedding's dense gradient: many repeated ids and the padding id; alone (its
    rows scattered into zeros) and added to a dense gradient, as autograd adds it to a tied head's."""
    from rollyard.model.fast import RowsGradLookup

    g = torch.Generator().manual_seed(0)
    for V_, D, N, pad in ((300, 40, 5000, 0), (50, 8, 3, None), (1000, 64, 777, 5)):
        ids = torch.randint(0, min(V_, 60), (N // 3 + 1, 3), generator=g)
        if pad is not None:
            ids[::4, 1] = pad
        grad = torch.randn(*ids.shape, D, generator=g)
        dense_w = torch.randn(V_, D, generator=g, requires_grad=True)
        F.embedding(ids, dense_w, pad).backward(grad)
        w = dense_w.detach().clone().requires_grad_(True)
        out = RowsGradLookup.apply(ids, w, pad)
        assert torch.equal(out, F.embedding(ids, w, pad))
        (rows,) = torch.autograd.grad(out, w, grad)
        assert rows.is_sparse and rows.is_coalesced()
        assert torch.equal(rows.to_dense(), dense_w.grad)
        head = torch.randn(V_, D, generator=g)
        assert torch.equal(head + rows, head + dense_w.grad)


@pytest.mark.parametrize("precision,micro_batch_tokens", [("fp32", 64), ("bf16", 4096)])
def test_tied_embedding_trains_the_same_steps_with_its_rows_gradient(monkeypatch, precision, micro_batch_tokens):
    """The trainer on a tied model (the tiny preset: one embedding and head tensor, padding id 0, padded rows) with
    the lookup's gradient as rows and with the dense one: the same weights, bit for bit, after three steps; several
    micro-batches (fp32: the head's in-place gradient path) and bf16 autocast; .grad stays dense."""
    import rollyard.model.fast as fast
    import rollyard.trainer.trainer as trainer_mod

    used = []
    real_apply = fast.RowsGradLookup.apply
    monkeypatch.setattr(fast.RowsGradLookup, "apply", lambda *a: used.append(1) or real_apply(*a))
    batches = [_samples(s, n=12) for s in range(3)]
    weights, tied = {}, trainer_mod.tied_head
    for mode in ("rows", "dense"):
        monkeypatch.setattr(trainer_mod, "tied_head", tied if mode == "rows" else (lambda m: False))
        model = _model(1)
        tr = Trainer(model, lr=1e-2, precision=precision, micro_batch_tokens=micro_batch_tokens)
        n = len(used)
        for b in batches:
            tr.step(copy.deepcopy(b))
            assert all(p.grad is None or not p.grad.is_sparse for p in model.parameters())
        assert (len(used) > n) == (mode == "rows"), (mode, len(used), n)
        weights[mode] = {k: v.clone() for k, v in model.state_dict().items()}
    assert tied(model)
    moved = [k for k in weights["rows"] if not torch.equal(weights["rows"][k], _model(1).state_dict()[k])]
    assert "model.embed_tokens.weight" in moved
    for k, v in weights["rows"].items():
        assert torch.equal(v, weights["dense"][k]), k
