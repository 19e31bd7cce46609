"""A group's samples read one copy of their prompt's K / V in decode attention (``share``): the attention kernel
reads a row's first positions from the slot it was forked from, with the numbers of reading its own copy; the
native backend notes which slots hold such copies (fork, a shared system prefix, a restored stash) and drops a note
when either slot is freed or slots move, so every sample's tokens and log-probs equal a run without notes, bit for
bit, on the per-op path and on the fused decode layer."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollyard.model import kernels as cpu_kernels
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.rollout.engine import RolloutEngine
from rollyard.types import Request

TOK = char_tokenizer()
V = len(TOK)

pytestmark = [pytest.mark.usefixtures("one_thread"),  # (conftest.py)
              pytest.mark.skipif(cpu_kernels.kernel() is None, reason="the attention kernel reads the shared copy")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_reads_its_prefix_from_the_shared_copy_with_the_same_numbers(dtype):
    g = torch.Generator().manual_seed(0)
    B, KVH, G, hd, W = 6, 2, 3, 64, 40
    K = torch.randn(B, KVH, W, hd, generator=g).to(dtype)
    V_ = torch.randn(B, KVH, W, hd, generator=g).to(dtype)
    P = 25
    for d in (1, 2, 4):  # rows 1, 2 forked from 0, row 4 from 3: their first P positions are copies
        src = 0 if d < 3 else 3
        K[d, :, :P], V_[d, :, :P] = K[src, :, :P], V_[src, :, :P]
    q = torch.randn(B, KVH * G, hd, generator=g)
    lens = torch.tensor([40, 33, 26, 40, 31, 12])
    share = torch.tensor([[0, 0], [0, P], [0, P], [3, 0], [3, P], [5, 0]])
    own = cpu_kernels.attend(q, K, V_, lens)
    assert torch.equal(cpu_kernels.attend(q, K, V_, lens, share), own)
    want = cpu_kernels.reference(q, K.float(), V_.float(), lens)
    torch.testing.assert_close(own, want, rtol=1e-5, atol=1e-5)
    K[1, :, :P] += 1.0  # row 1's own copy changed: with the note it reads row 0's, without it its own
    V_[4, :, 3] -= 2.0
    noted = cpu_kernels.attend(q, K, V_, lens, share)
    assert torch.equal(noted, own)
    alone = cpu_kernels.attend(q, K, V_, lens)
    assert not torch.equal(alone[1], own[1]) and not torch.equal(alone[4], own[4])
    assert torch.equal(alone[[0, 2, 3, 5]], own[[0, 2, 3, 5]])


def _fused_model():
    """A Llama the fused decode layer takes (head_dim 64, matmul blocks whole)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _prompts() -> list[list[int]]:
    """Three prompts after a shared 12-token system prefix, of different lengths (fork copies the longest's)."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(4, V, (12,), generator=g).tolist()
    return [system + torch.randint(4, V, (n,), generator=g).tolist() for n in (9, 3, 14)]


# Two ways through the slots. "restore": 3 x 8 samples through 12 slots (later samples admitted from a stashed
# prompt), samples stopping at different lengths (sources finish before the samples forked from them). "compact": 2 x
# 8 samples in 16 slots, six of the first prompt's stop at once while its slots 0 and 3 go on: the survivors move down
# (slot 3's next occupant is the second prompt's sample, whose prompt slot 0 does not hold).
SCENARIOS = {"restore": (12, 3, lambda sid: {"#0": 3, "#1": 11, "#2": 2, "#3": 6, "#5": 1, "#6": 9}.get(sid[-2:], 14)),
             "compact": (16, 2, lambda sid: 1 if sid.startswith("p0") and sid[-2:] not in ("#0", "#3") else 14)}


def _run(model, notes: bool, scenario: str = "restore") -> tuple[dict, list[torch.Tensor], bool]:
    slots, prompts, cap = SCENARIOS[scenario]
    eng = RolloutEngine(model, eos_token_id=-1, pad_token_id=0, temperature=1.0, top_p=1.0, max_concurrent=slots,
                        max_cache_tokens=slots * 64, seed=5)
    backend = eng.backend
    if not notes:
        backend._note = lambda *a: None
    seen, real = [], backend.fwd.decode

    def spy(*a, share=None, **kw):
        if share is not None:
            seen.append(share.clone())
        return real(*a, share=share, **kw)

    backend.fwd.decode = spy
    eng._length_cap = cap
    reqs = [Request(id=f"p{i}", prompt_ids=p, n=8, max_new_tokens=14) for i, p in enumerate(_prompts()[:prompts])]
    samples, rejected = eng.generate(reqs)
    assert not rejected
    return ({s.id: (s.completion_ids, s.logprobs) for s in samples}, seen,
            getattr(backend.fwd, "fused_layers", False))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("fused", [False, True])
def test_samples_equal_a_run_without_notes_bit_for_bit(fused, scenario):
    model = _fused_model() if fused else build_preset("tiny", TOK, seed=0, max_position_embeddings=128).eval()
    with_notes, seen, is_fused = _run(model, True, scenario)
    alone, none_seen, _ = _run(model, False, scenario)
    assert is_fused == fused
    assert with_notes == alone and len(with_notes) == 8 * SCENARIOS[scenario][1]
    assert not none_seen
    # notes were used: rows reading another slot's copy, for the system prefix (12) and for whole prompts
    shared = torch.cat(seen)
    rows = torch.cat([torch.arange(s.shape[0]) for s in seen])
    lengths = {int(P) for (src, P), r in zip(shared.tolist(), rows.tolist()) if src != r}
    assert 12 in lengths and {21, 15, 26} & lengths, lengths  # (the second prompt is the shortest: 15)
    assert all(P == 0 for (src, P), r in zip(shared.tolist(), rows.tolist()) if src == r)


def test_a_note_goes_with_either_slot(monkeypatch):
    model = build_preset("tiny", TOK, seed=0, max_position_embeddings=128).eval()
    eng = RolloutEngine(model, eos_token_id=-1, pad_token_id=0, temperature=1.0, max_concurrent=8,
                        max_cache_tokens=8 * 64, seed=1)
    b = eng.backend
    b._note(3, 0, 10)
    b._note(4, 0, 10)
    b._note(5, 4, 7)
    b._note(6, 6, 9)  # its own copy: no note
    assert b._share == {3: (0, 10), 4: (0, 10), 5: (4, 7)}
    assert b._share_for(6).tolist() == [[0, 0], [1, 0], [2, 0], [0, 10], [0, 10], [4, 7]]
    b.release(4)  # a source and a reader: both notes go
    assert b._share == {3: (0, 10)} and b._share_for(6)[5].tolist() == [5, 0]
    b.release(0)
    assert b._share == {} and b._share_for(6) is None
