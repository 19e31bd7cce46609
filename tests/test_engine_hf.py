"""The rollout engine on architectures the fast path does not cover (GPT-2, Gemma2, Gemma3, Mistral
with a sliding window, Phi3): the batched HF backend against transformers' own ``generate`` and full
forward, continuous batching (rows joining and leaving), the memory budget, abort and weight
updates, and the per-sequence fallback for a model the batched backend cannot reproduce."""

import copy
import functools
import tempfile
import warnings
from types import SimpleNamespace

import pytest
import torch
from test_engine import NO_EOS, TOK, V, _engine, _naive_greedy, _perturbed, _prompt, _recompute_logprobs
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    Phi3Config,
)

from rollyard.model.families import unsupported_reason
from rollyard.rollout.hf import BatchedHFBackend
from rollyard.types import Request, WeightUpdate

CTX = 128
IDS = dict(bos_token_id=TOK.bos_token_id, eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
DIMS = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=CTX, **IDS)
CONFIGS = {
    # learned absolute positions: position ids must count valid tokens, not cache columns
    "gpt2": lambda: GPT2Config(vocab_size=V, n_layer=2, n_embd=64, n_head=4, n_positions=CTX, **IDS),
    # hybrid sliding (window 4) / full layers, logit soft-capping, eager attention
    "gemma2": lambda: Gemma2Config(head_dim=16, sliding_window=4, **DIMS),
    # every layer a sliding window of 5: far shorter than the sequences here
    "mistral": lambda: MistralConfig(sliding_window=5, **DIMS),
    "phi3": lambda: Phi3Config(**DIMS),
}
# Gemma 3 (sliding layers with their own RoPE base, q/k norms) has a fast path of its own (model/gemma3.py):
# tests/test_gemma3.py holds it equal to transformers' forward; these are the architectures left to HF's.
ARCHS = list(CONFIGS)


@functools.cache
def _model_dir(arch: str) -> str:
    """A random-init model of ``arch`` saved as a model directory (kept for the session)."""
    d = tempfile.mkdtemp(prefix=f"rollyard-{arch}-")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[arch]()).save_pretrained(d)
    return d


def _load(arch: str):
    model = AutoModelForCausalLM.from_pretrained(_model_dir(arch)).eval()
    model.generation_config.eos_token_id = None  # generate stops only at the eos a test passes it
    return model


def _generate_greedy(model, prompt, max_new, eos):
    """Reference: transformers' own greedy ``generate`` on the prompt alone."""
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                         eos_token_id=eos, pad_token_id=TOK.pad_token_id)
    return out[0, len(prompt):].tolist()


def _requests(n, max_new, lengths=(3, 9, 5, 12)):
    return [Request(f"r{i}", _prompt(i, L), n=n, max_new_tokens=max_new) for i, L in enumerate(lengths)]


def _watch_rows(eng) -> dict:
    """Count rows joining a live cache and rows dropped from it; check after every re-layout that
    the cache is exactly as wide as its longest row (padding-only columns trimmed)."""
    b, seen = eng.backend, {"joined_live": 0, "dropped": 0}
    sync, append = b._sync, b._append_rows

    def append_spy(new, keys, values):
        seen["joined_live"] += len(new) if keys else 0
        return append(new, keys, values)

    def sync_spy():
        seen["dropped"] += sum(not r.live for r in b.rows)
        sync()
        assert all(r.live for r in b.rows)
        if b.cache is not None:
            assert b.cache.layers[0].keys.shape[-2] == int(b.n.max()), "leading padding-only columns not trimmed"

    b._sync, b._append_rows = sync_spy, append_spy
    return seen


@pytest.mark.parametrize("arch", ARCHS)
def test_picks_batched_hf_backend_and_greedy_equals_generate(arch):
    """Loaded from a directory as a user would: the batched HF backend is chosen (and says why), and
    greedy samples equal ``model.generate`` token for token with prompts of different lengths, n > 1,
    max_concurrent < samples (rows join mid-flight and leave) and an EOS some samples hit."""
    model = _load(arch)
    reqs = _requests(n=3, max_new=14)
    eos = _generate_greedy(model, reqs[1].prompt_ids, 14, None)[4]  # emitted mid-way: "stop" exercised
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = _engine(model, eos_token_id=eos, temperature=0.0, max_concurrent=4)
    assert eng.backend.name == "hf"
    msg = " ".join(str(w.message) for w in caught)
    assert "batched HF backend" in msg and unsupported_reason(model) in msg  # which backend, and why
    seen = _watch_rows(eng)
    samples, rejected = eng.generate(reqs)
    assert rejected == [] and len(samples) == 12
    for s in samples:
        ref = _generate_greedy(model, s.prompt_ids, 14, eos)
        assert s.completion_ids == ref, f"{arch}: greedy tokens of {s.id} differ from model.generate"
        assert s.finish_reason == ("stop" if ref[-1] == eos else "length")
    assert any(s.finish_reason == "stop" for s in samples)
    assert seen["joined_live"] > 0 and seen["dropped"] > 0, seen
    assert eng.num_active == 0 and eng.backend.cache is None


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_logprobs_match_full_hf_forward(arch):
    """Sampled (T=1) samples of staggered lengths, rows joining and leaving throughout: every
    per-token logprob equals log_softmax of one full HF forward over prompt + completion."""
    model = _load(arch)
    eng = _engine(model, eos_token_id=TOK.eos_token_id, temperature=1.0, max_concurrent=5, seed=7)
    eng._length_cap = lambda sid: 2 + 5 * int(sid.rsplit("#", 1)[1]) + int(sid[1:].split("#")[0])
    seen = _watch_rows(eng)
    samples, _ = eng.generate(_requests(n=3, max_new=20))
    assert len({len(s.completion_ids) for s in samples}) > 5, "lengths must be staggered"
    for s in samples:
        err = (torch.tensor(s.logprobs) - _recompute_logprobs(model, s, 1.0)).abs().max().item()
        assert err < 1e-4, f"{arch}: logprobs of {s.id} differ from the full forward by {err:.2e}"
    assert seen["joined_live"] > 0 and seen["dropped"] > 0, seen


def test_cache_stays_within_budget():
    """rows x width <= max_cache_tokens at every step, and every request still completes."""
    model = _load("gpt2")
    budget = 150
    eng = _engine(model, temperature=1.0, max_concurrent=16, max_cache_tokens=budget)
    assert not eng.submit([Request(f"q{i}", _prompt(i, 4 + i), n=3, max_new_tokens=20 + 10 * (i % 3))
                           for i in range(5)])
    done = widest = 0
    while not eng.idle:
        done += len(eng.step())
        c = eng.backend.cache
        if c is not None:
            R, _, C, _ = c.layers[0].keys.shape
            assert R * C <= budget, f"KV cache {R}x{C} exceeds max_cache_tokens={budget}"
            widest = max(widest, R * C)
    assert done == 15 and widest > budget // 2


def test_abort_returns_partials_and_frees_rows():
    model = _load("gemma2")
    eng = _engine(model, temperature=1.0, max_concurrent=4)
    eng.submit([Request("short", _prompt(0, 4), n=1, max_new_tokens=5),
                Request("big", _prompt(1, 7), n=3, max_new_tokens=40),
                Request("queued", _prompt(2, 3), n=2, max_new_tokens=40)])
    it = eng.results()
    assert next(it).id == "short#0"
    aborted = eng.abort(["big", "queued#1"])
    assert sorted(s.id for s in aborted) == ["big#0", "big#1", "big#2", "queued#1"]
    assert all(len(s.completion_ids) == (0 if s.id == "queued#1" else 5) for s in aborted)
    rest = list(it)
    assert [s.id for s in rest] == ["queued#0"] and len(rest[0].completion_ids) == 40
    err = (torch.tensor(rest[0].logprobs) - _recompute_logprobs(model, rest[0], 1.0)).abs().max().item()
    assert err < 1e-4, "the surviving row's logprobs must be unaffected by the aborted rows"


@pytest.mark.parametrize("policy", ["finish", "abort", "continue"])
def test_load_weights_policies(policy):
    model = _load("gpt2")
    base = [_generate_greedy(copy.deepcopy(model), _prompt(0, 4), 30, None)] * 2
    eng = _engine(model, temperature=0.0)
    eng.submit([Request("short", _prompt(1, 6), n=1, max_new_tokens=6),
                Request("long", _prompt(0, 4), n=2, max_new_tokens=30)])
    it = eng.results()
    assert next(it).id == "short#0"
    aborted = eng.load_weights(WeightUpdate(version=1, mode="full", tensors=_perturbed(model)), inflight=policy)
    rest = list(it)
    if policy == "abort":
        assert rest == [] and [s.finish_reason for s in aborted] == ["abort", "abort"]
    else:
        assert aborted == [] and [s.id for s in rest] == ["long#0", "long#1"]
    if policy == "finish":
        assert all(s.versions == [0] * 30 and s.completion_ids == b for s, b in zip(rest, base))
    if policy == "continue":
        for s, b in zip(rest, base):
            assert s.versions == [0] * 6 + [1] * 24
            assert s.completion_ids[:6] == b[:6] and s.completion_ids != b
    s = eng.generate([Request("after", _prompt(2, 5), n=1, max_new_tokens=8)])[0][0]
    assert s.versions == [1] * 8 and s.completion_ids == _generate_greedy(model, s.prompt_ids, 8, None)


class _MaskBlindGPT2(GPT2LMHeadModel):
    """Ignores the attention mask: left padding leaks into attention, so a batched cache with padded
    rows gives wrong logits (one unpadded sequence is still right)."""

    def forward(self, *args, attention_mask=None, **kwargs):
        return super().forward(*args, **kwargs)


def test_model_the_batched_backend_cannot_reproduce_falls_back_to_per_sequence():
    torch.manual_seed(0)
    model = _MaskBlindGPT2(CONFIGS["gpt2"]()).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = _engine(model, temperature=0.0, max_concurrent=3)
    assert eng.backend.name == "hf-perseq"
    msg = " ".join(str(w.message) for w in caught)
    assert "per-sequence HF backend" in msg and "batched HF forward differs from the plain forward" in msg
    for s in eng.generate(_requests(n=2, max_new=8))[0]:
        assert s.completion_ids == _naive_greedy(model, s.prompt_ids, 8, NO_EOS)


def test_decode_returns_logits_in_the_order_of_the_sequences_given():
    """The engine passes rows in cache order; any other order gets its logits in that order too."""
    model = _load("phi3")
    prompts = [_prompt(0, 6), _prompt(1, 3), _prompt(2, 4)]
    out = []
    for order in ([0, 1, 2], [2, 0, 1]):
        b = BatchedHFBackend(model, 3, 1000)
        rows = b.reserve([], [10, 10, 10])
        b.prefill(prompts, rows)
        seqs = [SimpleNamespace(slot=rows[i], tokens=[7 + i]) for i in order]
        out.append(dict(zip(order, b.decode(seqs))))
    for i in range(3):
        assert torch.equal(out[0][i], out[1][i])
