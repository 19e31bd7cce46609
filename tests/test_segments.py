"""The prefix-shared layout's attention per segment (``model/segments.py``): the same outputs and gradients as the
dense masked attention it replaces, for uneven members, several prompts, a sliding window and GQA; the plan falls
back to the dense mask where it saves too little; the trainer and Gemma 3's fast forward run through it."""

import pytest
import torch

from rollyard.model import families, fast, segments
from rollyard.model.fast import attention_masks, grouped_causal_attention
from rollyard.trainer.packing import prefix_shared


def _layout(seed: int, prompt: int = 6, longest: int = 30, groups: int = 3, members: int = 4):
    """A micro-batch of prefix-shared rows: groups with prompts of different lengths (one sharing only a first
    turn), members of uneven lengths, and a lone sample."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(3, 50, (n,), generator=g).tolist()

    seqs, keys = [], []
    for k in range(groups):
        first = toks(prompt + k)
        for _ in range(members):
            tail = toks(int(torch.randint(0, 3, (1,), generator=g))) if k == 0 else []
            seqs.append((first + tail, toks(int(torch.randint(1, longest + 1, (1,), generator=g)))))
            keys.append(k)
    seqs.append((toks(4), toks(longest)))
    keys.append("alone")
    (mb,) = prefix_shared(seqs, keys, 10_000)
    return mb.segments, mb.position_ids


def _dense(q, k, v, seg, pos, window):
    full, near = attention_masks(seg.shape[1], pos, seg, window, "cpu")
    m = near if window else full
    return grouped_causal_attention(q, k, v, 0.3, torch.zeros(m.shape).masked_fill_(~m, float("-inf")))


@pytest.mark.parametrize("window,longest", [(None, 30), (5, 30), (None, 120), (5, 120)])
def test_segmented_attention_equals_the_dense_mask_forward_and_backward(monkeypatch, window, longest):
    """``longest=120``: members of very uneven lengths, in several blocks."""
    monkeypatch.setattr(segments, "MIN_SAVED_PAIRS_PER_POSITION", 0)
    seg, pos = _layout(0, longest=longest)
    B, T = seg.shape
    KVH, G, hd = 2, 3, 8
    plans = segments.segment_plans(seg, pos, window)
    assert plans is not None
    plan = plans[1]
    assert len(plan.blocks) == (2 if longest == 30 else 4) and plan.pairs < B * T * T
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(B, KVH, n, hd, generator=g, requires_grad=True) for n in (G * T, T, T)]
    real = (seg >= 0)[:, None, None, :].expand(B, KVH, G, T).reshape(B, KVH, G * T)
    w = torch.randn(B, KVH, G * T, hd, generator=g) * real[..., None]  # only real queries are read
    outs, grads = [], []
    for f in (lambda q, k, v: _dense(q, k, v, seg, pos, window),
              lambda q, k, v: segments.segmented_attention(q, k, v, 0.3, plan)):
        o = f(*leaves)
        (o * w).sum().backward()
        outs.append(o.detach())
        grads.append([t.grad.clone() for t in leaves])
        for t in leaves:
            t.grad = None
    dense, seg_out = outs
    assert torch.allclose(seg_out[real], dense[real], atol=1e-5)
    assert torch.all(seg_out[~real] == 0)  # pads attend to nothing
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_sliding_and_full_plans_differ_only_past_the_window(monkeypatch):
    monkeypatch.setattr(segments, "MIN_SAVED_PAIRS_PER_POSITION", 0)
    seg, pos = _layout(2, prompt=3, longest=40)
    full, near = segments.segment_plans(seg, pos, window=4)
    assert full.pairs == near.pairs and full.blocks[0].q is near.blocks[0].q
    assert bool((near.blocks[1].mask == float("-inf")).sum() > (full.blocks[1].mask == float("-inf")).sum())
    same, same_near = segments.segment_plans(seg, pos, window=None)
    assert same is same_near


def test_the_plan_keeps_the_dense_mask_where_it_saves_too_little():
    # 8 completions of 64 tokens after a 5-token prompt: 8x fewer pairs, gathered
    seqs = [([1, 2, 3, 4, 5], list(range(6, 70)))] * 8
    (mb,) = prefix_shared(seqs, [0] * 8, 10_000)
    plans = segments.segment_plans(mb.segments, mb.position_ids)
    B, T = mb.segments.shape
    assert plans is not None and plans[0].pairs * 7 < B * T * T
    # one 64-token member and seven of one token: padding every member to 64 computes more than the row
    seqs = [([1, 2, 3, 4, 5], list(range(6, 70)))] + [([1, 2, 3, 4, 5], [9])] * 7
    (mb,) = prefix_shared(seqs, [0] * 8, 10_000)
    assert segments.segment_plans(mb.segments, mb.position_ids) is None
    # short completions after a long prompt: the pairs saved do not pay for the gathers
    seqs = [(list(range(1, 46)), list(range(50, 50 + n))) for n in (8, 12, 16, 20, 24, 10, 14, 18)]
    (mb,) = prefix_shared(seqs, [0] * 8, 10_000)
    assert segments.segment_plans(mb.segments, mb.position_ids) is None


def test_the_training_forward_takes_the_plan_and_gives_the_dense_hidden_states(monkeypatch):
    from rollyard.model.loading import build_preset, char_tokenizer

    torch.manual_seed(3)
    model = build_preset("tiny", char_tokenizer())
    seg, pos = _layout(4, longest=20)
    ids = torch.randint(3, 40, seg.shape) * (seg >= 0)
    called = []
    real_attention = segments.segmented_attention

    def spy(*a):
        called.append(1)
        return real_attention(*a)

    monkeypatch.setattr(fast, "segmented_attention", spy)
    monkeypatch.setattr(segments, "MIN_SAVED_PAIRS_PER_POSITION", 0)
    got = families.train_hidden(model, ids, pos, seg)
    assert called
    monkeypatch.setattr(fast, "segment_plans", lambda *a: None)
    want = families.train_hidden(model, ids, pos, seg)
    real = seg >= 0
    assert torch.allclose(got[real], want[real], atol=1e-5)


def test_gemma3_sliding_layers_take_the_windowed_plan_against_the_models_own_forward(monkeypatch):
    """Gemma 3's QK-norm path (torch RoPE, not the fused kernel), window 4 on positions: each member's hidden states
    through the plan equal transformers' forward of its prompt and completion alone, past the window."""
    from gemma3_files import WINDOW, gemma_tokenizer, tiny_gemma3

    monkeypatch.setattr(segments, "MIN_SAVED_PAIRS_PER_POSITION", 0)
    model = tiny_gemma3(gemma_tokenizer()).eval()
    g = torch.Generator().manual_seed(6)
    prefix = torch.randint(3, 40, (3,), generator=g)
    tails = [torch.randint(3, 40, (n,), generator=g) for n in (9, 4, 7)]
    row = torch.cat([prefix, *tails])[None]
    pos = torch.cat([torch.arange(3)] + [torch.arange(3, 3 + len(t)) for t in tails])[None]
    seg = torch.cat([torch.zeros(3, dtype=torch.long)] + [torch.full((len(t),), k + 1) for k, t in enumerate(tails)])[None]
    plans = segments.segment_plans(seg, pos, WINDOW)
    assert plans is not None and plans[0] is not plans[1]
    with torch.no_grad():
        got = families.train_hidden(model, row, pos, seg)[0]
        at = 3
        for t in tails:
            alone = model.model(input_ids=torch.cat([prefix, t])[None]).last_hidden_state[0]
            assert torch.allclose(got[at:at + len(t)], alone[3:], atol=1e-4, rtol=1e-4)
            at += len(t)
        assert torch.allclose(got[:3], alone[:3], atol=1e-4, rtol=1e-4)


def _brute_blocks(queries, keys):
    """The cheapest cut of sorted members into consecutive blocks, by trying every set of cut points."""
    import itertools

    n, best = len(queries), None
    for k in range(n):
        for inner in itertools.combinations(range(1, n), k):
            edges = [0, *inner, n]
            cost = sum((b - a) * queries[b - 1] * max(keys[a:b]) + segments.BLOCK_PAIRS
                       for a, b in zip(edges, edges[1:]))
            best = cost if best is None or cost < best else best
    return best


def test_members_of_very_different_lengths_go_into_the_cheapest_blocks():
    g = torch.Generator().manual_seed(9)
    for _ in range(20):
        n = int(torch.randint(1, 9, (1,), generator=g))
        queries = sorted(torch.randint(1, 200, (n,), generator=g).tolist())
        keys = [q + int(torch.randint(5, 60, (1,), generator=g)) for q in queries]
        cuts = segments.length_blocks(queries, keys)
        assert [a for a, _, _ in cuts] == [0] + [b for _, b, _ in cuts[:-1]] and cuts[-1][1] == n
        assert sum(c for _, _, c in cuts) == _brute_blocks(queries, keys)
    # equal lengths: one block; one long member among short ones: a block of its own
    assert len(segments.length_blocks([50] * 8, [60] * 8)) == 1
    assert [(a, b) for a, b, _ in segments.length_blocks([10] * 7 + [400], [15] * 7 + [405])] == [(0, 7), (7, 8)]
    # a bounded search over many members still covers them all, in order
    many = segments.length_blocks(list(range(1, 301)), list(range(11, 311)))
    assert many[0][0] == 0 and many[-1][1] == 300 and all(x[1] == y[0] for x, y in zip(many, many[1:]))
