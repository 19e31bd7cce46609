"""The rollout engine against slow references: one-sequence-at-a-time greedy decoding, a full
forward's log-probs, separate prefills, the HF forward; plus streaming, abort, weight-update
policies, memory bounds, seeding. (The weight-update receiver is tested in test_sync.py.)"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from rollyard.model import gemm as cpu_gemm
from rollyard.model import kernels as cpu_kernels
from rollyard.model.llama import LlamaFast
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.rollout.engine import RolloutEngine
from rollyard.types import Request, WeightUpdate

TOK = char_tokenizer()
V = len(TOK)
CTX = 96
NO_EOS = -1  # an id the model can never sample: every completion runs to max_new_tokens


pytestmark = pytest.mark.usefixtures("one_thread")  # (conftest.py)


def _model(seed=0):
    return build_preset("tiny", TOK, seed=seed, max_position_embeddings=CTX).eval()


def _prompt(i, length):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(4, V, (length,), generator=g).tolist()


def _requests(lengths=(5, 9, 3, 12), n=2, max_new=12, prefix="r"):
    return [Request(id=f"{prefix}{i}", prompt_ids=_prompt(i, L), n=n, max_new_tokens=max_new, meta={"i": i})
            for i, L in enumerate(lengths)]


def _engine(model, **kw):
    kw.setdefault("eos_token_id", NO_EOS)
    return RolloutEngine(model, **kw)


@torch.no_grad()
def _naive_greedy(model, prompt, max_new, eos):
    """Reference: one sequence, full forward (no cache) per token, argmax."""
    ids = list(prompt)
    out = []
    for _ in range(max_new):
        t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(t)
        ids.append(t)
        if t == eos:
            break
    return out


@torch.no_grad()
def _recompute_logprobs(model, sample, T, top_p=1.0):
    """log softmax(logits / T) of the completion tokens; top_p < 1: renormalised over the top-p support (the
    smallest set of top tokens whose mass reaches top_p), the distribution the engine sampled from."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    logits = model(ids).logits[0, len(sample.prompt_ids) - 1:-1].float() / T
    if top_p < 1.0:
        p, order = torch.softmax(logits, -1).sort(-1, descending=True)
        cut = (p.cumsum(-1) - p) >= top_p
        logits = logits.scatter(-1, order, logits.gather(-1, order).masked_fill(cut, float("-inf")))
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(sample.completion_ids)[:, None]).squeeze(1)


# --- fast forward vs the HF forward ------------------------------------------------------------


def _qwen3(seed=0):
    """Qwen3: per-head q_norm / k_norm before RoPE, head_dim != hidden / heads (random norm weights)."""
    cfg = Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=24,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CTX)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (layer.self_attn.q_norm.weight, layer.self_attn.k_norm.weight):
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("arch", ["llama", "llama-packed", "llama-kernel", "qwen2", "qwen3"])
def test_fast_forward_equals_hf_forward(arch, monkeypatch):
    if arch == "llama":
        model = _model()
    elif arch in ("llama-packed", "llama-kernel"):  # wide enough that the projections are packed: for oneDNN
        monkeypatch.setenv("ROLLYARD_ONEDNN", "1")  # (cpu_gemm), or in the fp32 kernel's layout Q where it is built
        if arch == "llama-packed":
            monkeypatch.setattr(cpu_kernels, "f32_packs", lambda n, k: False)
        elif not cpu_kernels.f32_packs(64, 16):
            pytest.skip("no AVX2 + FMA in this build of the CPU kernels")
        model = build_preset("small", TOK, seed=0, max_position_embeddings=CTX).eval()
    elif arch == "qwen3":
        model = _qwen3()
    else:  # qkv bias, another family member
        cfg = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CTX)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj.bias, layer.self_attn.k_proj.bias):
                    p.normal_(0, 0.5)
    fwd = LlamaFast(model)
    assert fwd.layers[0]["wgu"].is_mkldnn == (arch == "llama-packed" and cpu_gemm._op_available())
    if arch in ("llama-packed", "llama-kernel"):
        assert cpu_kernels.is_packed_f32(fwd.layers[0]["wgu"]) == (arch == "llama-kernel")
    ids = torch.randint(0, V, (3, 14), generator=torch.Generator().manual_seed(0))
    kv = fwd.new_cache(5, 32)
    slots = torch.tensor([4, 0, 2])
    got = [fwd.prefill(ids[:, :6], kv, slots, torch.tensor([5, 5, 5]))]
    for t in range(6, 14):
        toks = torch.zeros(5, dtype=torch.long)
        pos = torch.zeros(5, dtype=torch.long)
        toks[slots], pos[slots] = ids[:, t], t
        got.append(fwd.decode(toks, pos, kv, t + 1)[slots])
    with torch.no_grad():
        ref = model(ids).logits[:, 5:]
    err = (torch.stack(got, 1) - ref).abs().max().item()
    assert err < 1e-4, f"fast forward must equal the HF forward: max |logit diff| {err:.2e} (tolerance 1e-4)"


def test_uniform_position_decode_equals_general_decode():
    """The uniform-position shortcut (slice writes, no mask) gives the general path's logits and cache."""
    model = _model()
    fwd = LlamaFast(model)
    ids = torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(3))
    caches, outs = [], []
    for uniform in (False, True):
        kv = fwd.new_cache(4, 16)
        fwd.prefill(ids[:, :5], kv, torch.arange(4), torch.tensor([4] * 4))
        got = []
        for t in range(5, 9):
            pos = torch.full((4,), t)
            got.append(fwd.decode(ids[:, t], pos, kv, t + 1, same_pos=t if uniform else None))
        caches.append(kv)
        outs.append(torch.stack(got))
    assert torch.allclose(outs[0], outs[1], atol=1e-6) and torch.equal(caches[0], caches[1])


def _greedy_with_early_stops(model, backend: str, moved: list | None = None) -> list[list[int]]:
    eng = _engine(model, temperature=0.0, max_concurrent=24)
    eng._use_backend(backend)
    eng._length_cap = lambda sid: 20 if sid.endswith(("#0", "#7")) else 3
    if moved is not None:
        real, kv = eng.backend._compact, eng.backend

        def spy(active):
            moved.append(kv.kv)
            real(active)

        eng.backend._compact = spy
    samples = eng.generate(_requests(lengths=(4, 6, 5), n=8, max_new=20))[0]
    if moved is not None:
        assert moved and all(t is eng.backend.kv for t in moved)  # compacted, same cache tensor
    return [s.completion_ids for s in samples]


def test_compaction_moves_survivors_in_place_and_keeps_their_tokens():
    """Most samples stop early (length caps): survivors are compacted to low slots mid-decode, in
    the same cache, and their greedy tokens still equal the HF backend's (which never compacts)."""
    model = _model()
    assert _greedy_with_early_stops(model, "fast", moved=[]) == _greedy_with_early_stops(model, "hf")


def test_samples_at_one_position_decode_unmasked_across_holes():
    """Equal-length prompts whose samples stop at different lengths: decode steps with finished
    samples' holes among the slots still take the unmasked shared-position path (the holes ride
    along and write into free slots), compaction happens, and every sample's logprobs equal a full
    forward's, so no hole's write reached a live sequence."""
    model = _model()
    eng = _engine(model, temperature=1.0, max_concurrent=16, seed=6)
    caps = {"#1": 2, "#2": 5, "#4": 9, "#5": 3, "#6": 7}
    eng._length_cap = lambda sid: caps.get(sid[-2:], 14)
    seen, real = [], eng.backend.fwd.decode

    def spy(tokens, pos, kv, width, same_pos=None, share=None):
        seen.append((same_pos, tokens.shape[0], len(eng._active)))
        return real(tokens, pos, kv, width, same_pos=same_pos, share=share)

    eng.backend.fwd.decode = spy
    samples, _ = eng.generate(_requests(lengths=(6, 6), n=8, max_new=14))
    assert sorted({len(s.completion_ids) for s in samples}) == [2, 3, 5, 7, 9, 14]
    assert any(sp is not None and rows > active for sp, rows, active in seen), seen  # holes, no mask
    assert any(rows < prev for (_, rows, _), (_, prev, _) in zip(seen[1:], seen)), seen  # compacted
    for s in samples:
        err = (torch.tensor(s.logprobs) - _recompute_logprobs(model, s, 1.0)).abs().max().item()
        assert err < 1e-4, (s.id, err)


def test_sampler_draws_from_softmax_of_logits_over_t():
    """The inverse-CDF draw: token frequencies match softmax(logits / T) (20k draws, 5 sigma); a
    token of zero probability (top-p cut) is never drawn."""
    eng = _engine(_model(), temperature=0.8, seed=4)
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]]).expand(20000, 5)
    toks, lps = eng._sample(logits)
    p = torch.softmax(logits[0] / 0.8, -1)
    freq = torch.bincount(torch.tensor(toks), minlength=5).float() / 20000
    assert ((freq - p).abs() < 5 * (p * (1 - p) / 20000).sqrt()).all(), (freq, p)
    assert torch.allclose(torch.tensor(lps), p.log()[torch.tensor(toks)], atol=1e-5)
    eng = _engine(_model(), temperature=1.0, top_p=0.7, seed=5)  # keeps tokens 2 and 1 (mass 0.77)
    toks, _ = eng._sample(torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]]).expand(20000, 5))
    freq = torch.bincount(torch.tensor(toks), minlength=5).float() / 20000
    q = torch.softmax(torch.tensor([1.0, 2.0]), -1)  # renormalised over the kept tokens
    assert freq[[0, 3, 4]].sum() == 0 and ((freq[[1, 2]] - q).abs() < 5 * (q * (1 - q) / 20000).sqrt()).all(), freq


# --- correctness against references ------------------------------------------------------------


def test_greedy_equals_naive_reference_and_hf_path():
    model = _model()
    reqs = _requests(n=2, max_new=12)
    # choose an EOS the greedy path actually emits mid-way for one prompt, so "stop" is exercised
    eos = _naive_greedy(model, reqs[1].prompt_ids, 12, NO_EOS)[4]
    # max_concurrent=3 < 8 samples: continuous batching, partial group admission, stashed prompt KV
    for backend in ("fast", "hf", "hf-perseq"):
        eng = _engine(model, eos_token_id=eos, temperature=0.0, max_concurrent=3)
        eng._use_backend(backend)
        samples, rejected = eng.generate(reqs)
        assert rejected == []
        assert [s.id for s in samples] == [f"r{i}#{k}" for i in range(4) for k in range(2)]
        for s in samples:
            ref = _naive_greedy(model, s.prompt_ids, 12, eos)
            assert s.completion_ids == ref, f"{backend}: greedy tokens of {s.id} differ from the naive reference"
            assert s.finish_reason == ("stop" if ref[-1] == eos else "length")
            assert s.meta == {"i": int(s.request_id[1:])} and s.versions == [0] * len(ref)
        assert any(s.finish_reason == "stop" for s in samples)
        assert eng.num_active == 0 and eng.num_queued == 0


def test_qwen3_model_dir_takes_the_fast_path_and_samples_match_the_hf_forward(tmp_path):
    """A Qwen3 directory loaded as a user would: fast path chosen, and its samples' logprobs (and
    greedy tokens) match the HF forward and the HF-backend engine."""
    _qwen3(1).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    eng = _engine(model, temperature=1.0, max_concurrent=4, seed=2)
    assert eng.backend.name == "fast"
    samples, _ = eng.generate(_requests(n=3, max_new=10))
    for s in samples:
        err = (torch.tensor(s.logprobs) - _recompute_logprobs(model, s, 1.0)).abs().max().item()
        assert err < 1e-4, (s.id, err)
    greedy = {}
    for backend in ("fast", "hf"):
        e = _engine(model, temperature=0.0, max_concurrent=3)
        e._use_backend(backend)
        greedy[backend] = [s.completion_ids for s in e.generate(_requests(n=2, max_new=10))[0]]
    assert greedy["fast"] == greedy["hf"]


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.3, 0.8), (0.0, 1.0)])
def test_sampling_logprobs_match_full_forward(temperature, top_p):
    model = _model()
    eng = _engine(model, temperature=temperature, top_p=top_p, max_concurrent=5, seed=3)
    samples, _ = eng.generate(_requests(n=3, max_new=15))
    T = temperature or 1.0
    for s in samples:
        assert len(s.logprobs) == len(s.completion_ids) == 15
        ref = _recompute_logprobs(model, s, T, top_p if temperature else 1.0)
        err = (torch.tensor(s.logprobs) - ref).abs().max().item()
        assert err < 1e-4, f"sampling-time logprobs of {s.id} differ from the sampled distribution's by {err:.2e}"



@pytest.mark.parametrize("hidden", [96, 256])
def test_bf16_weights_on_cpu_decode_and_match_the_forward(hidden):
    """bf16 weights on CPU: the decode attention computes in fp32 (bf16 batched matmuls over the cache's strided views
    are ~2x slower there). A model of hidden >= 256 keeps its weight matmuls in bf16 and, with the compiled attention
    kernel, its KV cache in bf16 (logprobs agree with the bf16 HF forward to bf16 rounding); a narrower one computes
    in fp32 over its bf16 weights with an fp32 cache (logprobs equal an fp32 forward of those same weights). Both the
    uniform-position and the masked (mixed prompt lengths) decode."""
    import copy

    from rollyard.model.llama import CPU_BF16_MIN_HIDDEN

    preset = "tiny" if hidden == 96 else "small"
    model = build_preset(preset, TOK, seed=0, max_position_embeddings=CTX).eval().to(torch.bfloat16)
    assert model.config.hidden_size == hidden
    wide = hidden >= CPU_BF16_MIN_HIDDEN
    eng = _engine(model, temperature=1.0, max_concurrent=6, seed=4)
    fwd = eng.backend.fwd
    kv_dtype = torch.bfloat16 if wide and fwd.attn_kernel else torch.float32
    assert eng.backend.name == "fast" and fwd.weight_dtype == torch.bfloat16 and fwd.kv_dtype == kv_dtype
    assert fwd.layers[0]["wqkv"].dtype == (torch.bfloat16 if wide else torch.float32)
    ref = model if wide else copy.deepcopy(model).float()  # the same (bf16) values, fp32 arithmetic
    for lengths in ((6, 6, 6), (5, 9, 3, 12)):
        samples, _ = eng.generate(_requests(lengths, n=2, max_new=12))
        assert eng.backend.kv.dtype == kv_dtype
        errs = torch.cat([(torch.tensor(s.logprobs) - _recompute_logprobs(ref, s, 1.0)).abs() for s in samples])
        if wide:
            assert errs.max() < 0.1 and errs.mean() < 0.02, (lengths, errs.max(), errs.mean())
        else:
            assert errs.max() < 1e-4, (lengths, errs.max())

def test_bf16_compute_over_an_fp32_module_samples_from_bf16_copies_and_follows_weight_loads():
    """rollout.precision=bf16 over the trainer's fp32 module (sync.mode=inprocess): the fused copies are the
    module's weights cast to bf16 at every refresh, the module itself stays fp32, the cache bf16 with the compiled
    attention kernel (else fp32). The sampled
    logprobs are a bf16 forward's (close to the bf16-cast module's HF forward, measurably off the fp32 one), and
    after the module changes in place and a load_weights, they follow the new weights."""
    model = build_preset("small", TOK, seed=0, max_position_embeddings=CTX).eval()
    eng = _engine(model, temperature=1.0, max_concurrent=6, seed=4, compute_dtype=torch.bfloat16)
    fwd = eng.backend.fwd
    assert eng.backend.name == "fast" and fwd.mm_dtype == torch.bfloat16 and fwd.weight_dtype == torch.float32
    assert fwd.layers[0]["wqkv"].dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32

    def errors(ref, samples):
        return torch.cat([(torch.tensor(s.logprobs) - _recompute_logprobs(ref, s, 1.0)).abs() for s in samples])

    samples, _ = eng.generate(_requests((5, 9, 3, 12), n=2, max_new=12))
    assert eng.backend.kv.dtype == (torch.bfloat16 if fwd.attn_kernel else torch.float32)
    bf16, fp32 = errors(copy.deepcopy(model).to(torch.bfloat16), samples), errors(model, samples)
    assert bf16.max() < 0.1 and bf16.mean() < 0.02, (bf16.max(), bf16.mean())
    assert fp32.mean() > 1e-4, fp32.mean()  # an fp32 forward would be ~1e-6 off: the copies really are bf16
    with torch.no_grad():
        for n, t in _perturbed(model).items():
            dict(model.named_parameters())[n].copy_(t)
    eng.load_weights(WeightUpdate(version=3, mode="inprocess"))
    samples, _ = eng.generate(_requests((6, 6), n=2, max_new=10, prefix="after"))
    new = errors(copy.deepcopy(model).to(torch.bfloat16), samples)
    assert all(s.versions == [3] * 10 for s in samples) and new.max() < 0.1 and new.mean() < 0.02, new.max()


def test_shared_prefill_equals_separate_prefills():
    model = _model()
    prompt = _prompt(0, 7)
    runs = {}
    for name, reqs in {"shared": [Request("a", prompt, n=4, max_new_tokens=10)],
                       "separate": [Request(f"a{k}", prompt, n=1, max_new_tokens=10) for k in range(4)]}.items():
        eng = _engine(model, temperature=1.0, seed=11)
        prefilled = []
        orig = eng.backend.prefill
        eng.backend.prefill = lambda prompts, slots, prefilled=prefilled, orig=orig: (
            prefilled.extend(prompts), orig(prompts, slots))[1]
        samples, _ = eng.generate(reqs)
        runs[name] = (samples, len(prefilled))
    (shared, n_shared), (separate, n_sep) = runs["shared"], runs["separate"]
    assert (n_shared, n_sep) == (1, 4), "a group's prompt must be prefilled once, separate requests once each"
    for a, b in zip(shared, separate):
        assert a.completion_ids == b.completion_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@torch.no_grad()
def test_groups_whose_prompts_share_a_prefix_prefill_it_once_and_sample_as_without(monkeypatch):
    """Three groups' prompts behind one 12-token prefix (a chat template's system prompt): the prefix is prefilled
    once and copied to the other groups' slots; the samples equal those of one prefill per prompt."""
    from rollyard.rollout import native

    model = _model()
    prefix = _prompt(7, 12)
    reqs = [Request(f"g{i}", prefix + _prompt(i, n), n=3, max_new_tokens=8) for i, n in enumerate((2, 5, 1))]
    runs = {}
    for name, least in {"shared": native.SHARED_PREFIX, "separate": 10 ** 9}.items():
        monkeypatch.setattr(native, "SHARED_PREFIX", least)
        eng = _engine(model, temperature=1.0, seed=5)
        rows = []
        orig = eng.backend.fwd.prefill
        eng.backend.fwd.prefill = lambda toks, *a, orig=orig, rows=rows, **k: (rows.append(toks.numel()), orig(toks, *a, **k))[1]
        samples, _ = eng.generate(copy.deepcopy(reqs))
        runs[name] = (sorted(samples, key=lambda s: s.id), rows)
    (shared, rows_shared), (separate, rows_sep) = runs["shared"], runs["separate"]
    assert rows_sep == [3 * 17] and rows_shared == [12, 3 * 5], (rows_shared, rows_sep)
    for a, b in zip(shared, separate, strict=True):
        assert a.id == b.id and a.completion_ids == b.completion_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_seed_reproducible():
    model = _model()

    def run(seed):
        return [(s.completion_ids, s.logprobs) for s in
                _engine(model, temperature=1.0, seed=seed, max_concurrent=4).generate(_requests(n=3))[0]]

    assert run(5) == run(5)
    assert run(5) != run(6)


# --- streaming, abort, weight updates -----------------------------------------------------------


def test_streaming_yields_short_sample_before_long_one_finishes():
    model = _model()
    eng = _engine(model, temperature=1.0)
    eng.submit([Request("long", _prompt(0, 4), n=1, max_new_tokens=40),
                Request("short", _prompt(1, 4), n=1, max_new_tokens=3)])
    it = eng.results()
    first = next(it)
    assert first.id == "short#0" and len(first.completion_ids) == 3
    assert eng.num_active == 1, "the long sample must still be decoding when the short one is yielded"
    rest = list(it)
    assert [s.id for s in rest] == ["long#0"] and len(rest[0].completion_ids) == 40


def test_abort_returns_partials_and_frees_slots():
    model = _model()
    eng = _engine(model, temperature=1.0, max_concurrent=4)
    eng.submit([Request("short", _prompt(0, 4), n=1, max_new_tokens=5),
                Request("big", _prompt(1, 4), n=3, max_new_tokens=60),
                Request("queued", _prompt(2, 4), n=2, max_new_tokens=60)])
    it = eng.results()
    assert next(it).id == "short#0"  # 5 tokens in: big#0..2 and queued#0 are decoding, queued#1 waits
    aborted = eng.abort(["big", "queued#1"])
    assert sorted(s.id for s in aborted) == ["big#0", "big#1", "big#2", "queued#1"]
    for s in aborted:
        assert s.finish_reason == "abort"
        assert len(s.completion_ids) == len(s.logprobs) == len(s.versions)
        assert len(s.completion_ids) == (0 if s.id == "queued#1" else 5)
    rest = list(it)
    assert [s.id for s in rest] == ["queued#0"] and len(rest[0].completion_ids) == 60
    assert eng.abort(["queued"]) == []  # already finished: nothing to abort


def test_a_group_completes_at_keep_samples_and_the_engine_aborts_the_rest():
    """``submit(keep=2)``: a group of 4 returns its first 2 finished samples; the others stop at once (an aborted
    partial) or, finished in the same step as the 2nd, never come out: both are ``surplus()``. A group of n <= keep
    runs whole."""
    eng = _engine(_model(), temperature=1.0, max_concurrent=8)
    caps = {"g#0": 3, "g#1": 3, "g#2": 3, "g#3": 20, "h#0": 5, "h#1": 9}
    eng._length_cap = caps.__getitem__  # the length oracle (test hook)
    assert eng.submit([Request("g", _prompt(0, 4), n=4, max_new_tokens=30),
                       Request("h", _prompt(1, 4), n=2, max_new_tokens=30)], keep=2) == []
    assert eng.busy and not eng.idle
    first = eng.step() + eng.step() + eng.step()  # 3 tokens in: g#0..2 finish together
    assert [s.id for s in first] == ["g#0", "g#1"] and all(len(s.completion_ids) == 3 for s in first)
    assert eng.num_active == 2  # h#0, h#1: g#3 stopped with its group
    cut = {s.id: s for s in eng.surplus()}
    assert sorted(cut) == ["g#2", "g#3"] and eng.surplus() == []
    assert cut["g#2"].finish_reason == "length" and len(cut["g#2"].completion_ids) == 3  # finished, dropped
    assert cut["g#3"].finish_reason == "abort" and len(cut["g#3"].completion_ids) == 3  # stopped mid-way
    rest = list(eng.results())
    assert sorted(s.id for s in rest) == ["h#0", "h#1"] and eng.surplus() == []
    assert not eng.busy and eng.idle
    assert eng.submit([Request("g", _prompt(0, 4), n=4, max_new_tokens=30)], keep=2) == []  # nothing held of g


def _perturbed(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["finish", "abort", "continue"])
def test_load_weights_policies(policy):
    model = _model()
    base = _engine(copy.deepcopy(model), temperature=0.0).generate(
        [Request("long", _prompt(0, 4), n=2, max_new_tokens=30)])[0]
    eng = _engine(model, temperature=0.0)
    eng.submit([Request("short", _prompt(1, 4), n=1, max_new_tokens=6),
                Request("long", _prompt(0, 4), n=2, max_new_tokens=30)])
    it = eng.results()
    assert next(it).id == "short#0"
    new = _perturbed(model)
    aborted = eng.load_weights(WeightUpdate(version=1, mode="full", tensors=new), inflight=policy)
    assert eng.version == 1
    rest = list(it)
    if policy == "abort":
        assert rest == [] and [s.finish_reason for s in aborted] == ["abort", "abort"]
        assert all(s.versions == [0] * 6 for s in aborted)
    else:
        assert aborted == [] and [s.id for s in rest] == ["long#0", "long#1"]
    if policy == "finish":  # completed entirely on the old weights
        for s, b in zip(rest, base):
            assert s.versions == [0] * 30 and s.completion_ids == b.completion_ids
    if policy == "continue":  # 6 tokens sampled under v0, the rest under v1, and they differ from v0's
        for s, b in zip(rest, base):
            assert s.versions == [0] * 6 + [1] * 24
            assert s.completion_ids[:6] == b.completion_ids[:6] and s.completion_ids != b.completion_ids
    # whatever the policy, new work runs under the new weights, matching a fresh reference
    s = eng.generate([Request("after", _prompt(2, 5), n=1, max_new_tokens=8)])[0][0]
    assert s.versions == [1] * 8 and s.completion_ids == _naive_greedy(model, s.prompt_ids, 8, NO_EOS)


@pytest.mark.parametrize("packed", [False, True])
def test_inprocess_update_refreshes_fused_weights_and_stale_weights_are_caught(packed, monkeypatch):
    if packed:  # the fused copies are oneDNN-packed: a refresh must repack them
        monkeypatch.setenv("ROLLYARD_ONEDNN", "1")
        model = build_preset("small", TOK, seed=0, max_position_embeddings=CTX).eval()
    else:
        model = _model()
    eng = _engine(model, temperature=0.0)
    eng.generate(_requests(n=1, max_new=4))
    with torch.no_grad():
        for n, t in _perturbed(model).items():
            dict(model.named_parameters())[n].copy_(t)
    with pytest.raises(RuntimeError, match="load_weights"):
        eng.generate(_requests(n=1, max_new=4, prefix="x"))
    eng.abort([f"x{i}" for i in range(4)])
    eng.load_weights(WeightUpdate(version=7, mode="inprocess"))
    s = eng.generate([Request("y", _prompt(3, 6), n=1, max_new_tokens=10)])[0][0]
    assert s.versions == [7] * 10 and s.completion_ids == _naive_greedy(model, s.prompt_ids, 10, NO_EOS)


def test_sleep_frees_cache_and_fused_weights_and_the_engine_resumes_exactly():
    """Colocated trainer turn: sleep frees the KV cache and fused copies; after a skipped step (module unchanged)
    the next round rebuilds them and samples what an engine that never slept samples; after a real change the
    weights must come through load_weights, else the stale-weights error."""
    model = _model()
    awake, napper = (_engine(model, temperature=1.0, seed=3, max_concurrent=4) for _ in range(2))
    first = [(s.completion_ids, s.logprobs) for s in awake.generate(_requests(n=3))[0]]
    assert [(s.completion_ids, s.logprobs) for s in napper.generate(_requests(n=3))[0]] == first
    napper.sleep()
    napper.wake_up()
    assert napper.backend.kv is None and napper.backend.fwd.layers == [] and napper.backend.asleep
    again = [(s.completion_ids, s.logprobs) for s in napper.generate(_requests(n=3, prefix="b"))[0]]
    assert again == [(s.completion_ids, s.logprobs) for s in awake.generate(_requests(n=3, prefix="b"))[0]]
    napper.sleep()
    with torch.no_grad():
        for n, t in _perturbed(model).items():
            dict(model.named_parameters())[n].copy_(t)
    with pytest.raises(RuntimeError, match="load_weights"):
        napper.generate(_requests(n=1, max_new=4, prefix="x"))
    napper.abort([f"x{i}" for i in range(4)])
    napper.sleep()
    napper.load_weights(WeightUpdate(version=2, mode="inprocess"))
    s = napper.generate([Request("y", _prompt(3, 6), n=1, max_new_tokens=10)])[0][0]
    assert s.versions == [2] * 10  # and sampled from the changed module's weights:
    assert (torch.tensor(s.logprobs) - _recompute_logprobs(model, s, 1.0)).abs().max() < 1e-4


# --- bounds --------------------------------------------------------------------------------------


def test_oversize_requests_rejected_with_reason():
    eng = _engine(_model(), max_cache_tokens=80)
    ok = Request("ok", _prompt(0, 10), n=2, max_new_tokens=20)
    too_long = Request("ctx", _prompt(1, 50), n=1, max_new_tokens=50)  # 100 > context 96
    too_big = Request("kv", _prompt(2, 40), n=1, max_new_tokens=45)  # 85 > max_cache_tokens 80
    empty = Request("empty", [], n=1)
    rejected = {r.id: why for r, why in eng.submit([ok, too_long, too_big, empty])}
    assert set(rejected) == {"ctx", "kv", "empty"}
    assert "context of 96" in rejected["ctx"] and "max_cache_tokens=80" in rejected["kv"]
    assert [s.id for s in eng.results()] == ["ok#0", "ok#1"]


def test_kv_cache_holds_the_admitted_sequences_not_the_whole_budget():
    """A budget is an upper bound: 12 sequences under a 100k-token budget get 16 slots (the next power of two),
    not budget // width; more sequences later grow the layout, and all of them finish."""
    eng = _engine(_model(), temperature=1.0, max_concurrent=256, max_cache_tokens=100_000)
    out = eng.generate([Request("a", _prompt(0, 6), n=12, max_new_tokens=8)])[0]
    b = eng.backend
    assert len(out) == 12 and b.R == 16 and b.R * b.W < 100_000 // 10
    out = eng.generate([Request(f"b{i}", _prompt(i, 6), n=10, max_new_tokens=8) for i in range(4)])[0]
    assert len(out) == 40 and b.R == 64


def test_kv_cache_stays_within_budget():
    model = _model()
    budget = 200
    eng = _engine(model, temperature=1.0, max_concurrent=16, max_cache_tokens=budget)
    reqs = [Request(f"q{i}", _prompt(i, 6), n=3, max_new_tokens=30 + 10 * (i % 3)) for i in range(5)]
    seen = 0
    for _ in eng.results() if not eng.submit(reqs) else []:
        seen += 1
        b = eng.backend
        assert b.R * b.W <= budget, f"KV cache {b.R}x{b.W} exceeds max_cache_tokens={budget}"
        assert eng.num_active <= budget // 36
    assert seen == 15
