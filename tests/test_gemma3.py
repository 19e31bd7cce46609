"""Gemma 3 on the fast path (``model/gemma3.py``): a tiny Gemma-3-shaped model (sliding window 4, so the tests'
sequences cross it; QK-norm, GeGLU, RMSNorm on 1 + w, scaled embeddings, tied head), written as a GGUF by the
``gguf`` package (``tests/gemma3_files.py``) and loaded by rollyard, against transformers' own Gemma 3 forward
(fp32): the engine's prefill and decode logits, its greedy decode and sampling logprobs, the trainer's logprobs and
gradients (padded and prefix-shared rows), the canary, and a CLI run."""

from __future__ import annotations

import warnings

import pytest
import torch
from gemma3_files import WINDOW, gemma_tokenizer, tiny_gemma3, write_gemma3_gguf

from rollyard.cli import main
from rollyard.model import families, gemma3
from rollyard.model.loading import load_policy
from rollyard.rollout import native
from rollyard.rollout.engine import RolloutEngine
from rollyard.sync import canary
from rollyard.telemetry import rundir
from rollyard.trainer.trainer import Trainer
from rollyard.types import Request, Sample

TOL = 1e-4  # relative, fp32 (the engine's own start-up check uses the same)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(original model, tokenizer, gguf path, model loaded back by rollyard)."""
    tok = gemma_tokenizer()
    model = tiny_gemma3(tok)
    path = write_gemma3_gguf(model, tok, tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf")
    mp = pytest.MonkeyPatch()
    mp.setenv("ROLLYARD_GGUF_CACHE", str(tmp_path_factory.mktemp("gguf-cache")))
    loaded, _ = load_policy(str(path))
    yield model, tok, path, loaded.eval()
    mp.undo()


def _ids(n: int, T: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (n, T), generator=torch.Generator().manual_seed(seed))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def test_the_gguf_loads_back_as_a_gemma3_on_the_fast_path(tiny):
    model, tok, path, loaded = tiny
    cfg = loaded.config
    assert cfg.model_type == "gemma3_text" and cfg.sliding_window == WINDOW
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # tied
    _, ltok = load_policy(str(path))  # the cached conversion: the file's add_bos_token is kept (Gemma needs <bos>)
    assert type(ltok).__name__ == "GemmaTokenizer" and ltok("4 - 1 =")["input_ids"][0] == ltok.bos_token_id
    assert ltok.decode(ltok("4 - 1 =")["input_ids"], skip_special_tokens=True) == "4 - 1 ="
    ids = _ids(2, 12, cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)  # F32 tensors, norms stored as 1 + w: bit-equal
    assert families.unsupported_reason(loaded) is None and families.train_unsupported_reason(loaded) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: the engine takes the fast path
        eng = RolloutEngine(loaded, eos_token_id=tok.eos_token_id, max_concurrent=8, max_cache_tokens=512)
    assert eng.backend.name == "fast" and isinstance(eng.backend.fwd, gemma3.Gemma3Fast)


def test_prefill_and_decode_logits_equal_transformers_across_the_window(tiny):
    _, _, _, m = tiny
    V = m.config.vocab_size
    ids = _ids(3, 14, V, seed=1)
    with torch.no_grad():
        ref = m(input_ids=ids).logits
    fwd = gemma3.Gemma3Fast(m)
    # every row at one position (the sliding layers read a slice of the cache)
    kv = fwd.new_cache(3, 16)
    got = [fwd.prefill(ids[:, :6], kv, torch.tensor([0, 1, 2]), torch.tensor([5, 5, 5]))]
    got += [fwd.decode(ids[:, t], None, kv, t + 1, same_pos=t) for t in range(6, 14)]
    assert _rel(torch.stack(got, 1), ref[:, 5:]) < TOL
    # rows at different positions (a mask hides the keys past the window), in other slots
    kv = fwd.new_cache(4, 16)
    lens = [2, 7, 4]
    rows = torch.stack([torch.cat([ids[i, :n], torch.zeros(7 - n, dtype=ids.dtype)]) for i, n in enumerate(lens)])
    slots = torch.tensor([3, 0, 1])
    first = fwd.prefill(rows, kv, slots, torch.tensor(lens) - 1)
    assert max(_rel(first[i], ref[i, n - 1]) for i, n in enumerate(lens)) < TOL
    pos = torch.tensor(lens)
    for _ in range(6):
        toks = torch.zeros(4, dtype=ids.dtype)
        at = torch.zeros(4, dtype=torch.long)
        for i, s in enumerate(slots.tolist()):
            toks[s], at[s] = ids[i, pos[i]], pos[i]
        out = fwd.decode(toks, at, kv, int(pos.max()) + 1)
        assert max(_rel(out[s], ref[i, pos[i]]) for i, s in enumerate(slots.tolist())) < TOL
        pos = pos + 1
    # a prompt longer than the window: the prefill's sliding mask
    kv = fwd.new_cache(1, 16)
    assert _rel(fwd.prefill(ids[:1, :11], kv, torch.tensor([0]), torch.tensor([10]))[0], ref[0, 10]) < TOL
    assert native.fast_path_matches(m, native.NativeBackend(m, 8, 512)) < TOL


def test_a_shared_prefix_prefilled_once_gives_each_rows_logits_and_cache_across_the_window(tiny):
    """The native backend's shared prefix (``rollout/native.py``): the prefix run once in one slot, copied, and each
    row's rest prefilled after it (``FastForward.prefill(start=)``), past the sliding window: the logits and every
    cached K/V equal one prefill per row."""
    _, _, _, m = tiny
    V = m.config.vocab_size
    prefix = _ids(1, 9, V, seed=3)[0].tolist()
    assert len(prefix) > 2 * WINDOW and len(prefix) >= native.SHARED_PREFIX
    prompts = [prefix + t.tolist()[:n] for t, n in zip(_ids(3, 6, V, seed=4), (1, 6, 3))]
    with torch.no_grad():
        refs = [m(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts]
        b = native.NativeBackend(m, 8, 512)
        b.reserve([], [24] * 3)
        calls = []
        orig = b.fwd.prefill
        b.fwd.prefill = lambda toks, *a, **k: (calls.append((tuple(toks.shape), k.get("start", 0))), orig(toks, *a, **k))[1]
        got = b.prefill(prompts, [2, 0, 1])
        assert calls == [((1, 9), 0), ((3, 6), 9)], calls
        assert max(_rel(got[i], refs[i]) for i in range(3)) < TOL
        alone = native.NativeBackend(m, 8, 512)
        alone.reserve([], [24] * 3)
        for p, slot in zip(prompts, [2, 0, 1]):
            alone.prefill([p], [slot])
        for p, slot in zip(prompts, [2, 0, 1]):
            assert torch.allclose(b.kv[:, :, slot, :, :len(p)], alone.kv[:, :, slot, :, :len(p)], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_engine_decode_and_logprobs_equal_transformers(tiny):
    _, tok, _, m = tiny
    V = m.config.vocab_size
    prompts = [_ids(1, n, V, seed=10 + n)[0].tolist() for n in (3, 6, 9)]
    eng = RolloutEngine(m, eos_token_id=-1, temperature=0.0, max_concurrent=8, max_cache_tokens=512)
    samples, _ = eng.generate([Request(id=f"p{i}", prompt_ids=p, n=1, max_new_tokens=8) for i, p in enumerate(prompts)])
    by_id = {s.request_id: s for s in samples}
    for i, p in enumerate(prompts):
        s = by_id[f"p{i}"]
        assert s.completion_ids == _greedy(m, p, 8)  # the positions run past the window (4)
        full = torch.tensor([p + s.completion_ids])
        with torch.no_grad():
            lp = torch.log_softmax(m(full).logits[0, len(p) - 1:-1].float(), -1)
        want = lp.gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        assert float((torch.tensor(s.logprobs) - want).abs().max()) < TOL


def _samples(vocab: int) -> list[Sample]:
    out = []
    for i, (P, C) in enumerate([(3, 9), (6, 4), (2, 11), (7, 7)]):
        ids = _ids(1, P + C, vocab, seed=40 + i)[0].tolist()
        out.append(Sample(id=f"s{i}", request_id=f"r{i}", prompt_ids=ids[:P], completion_ids=ids[P:],
                          logprobs=[0.0] * C, versions=[0] * C, finish_reason="length", advantage=(-1.0) ** i))
    return out


def test_trainer_logprobs_and_gradients_equal_transformers(tiny):
    _, _, _, loaded = tiny
    m = tiny_gemma3(gemma_tokenizer(), seed=3)  # its own copy: this test trains
    samples = _samples(m.config.vocab_size)
    tr = Trainer(m, lr=1e-3, micro_batch_tokens=4096, layout="padded", precision="fp32")
    assert tr._use_fast(m)  # train_forward_matches: gemma3.train_hidden stands in for the HF decoder
    got = tr.logprobs(samples)
    with torch.no_grad():
        for s, lp in zip(samples, got):
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            ref = torch.log_softmax(m(ids).logits[0].float(), -1)[len(s.prompt_ids) - 1:-1]
            want = ref.gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0]
            assert float((lp - want).abs().max()) < TOL
    # gradients of the fast forward against the HF module's
    ids = _ids(3, 13, m.config.vocab_size, seed=5)
    m.zero_grad()
    gemma3.train_hidden(m, ids).square().mean().backward()
    fast = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    m.model(input_ids=ids, use_cache=False).last_hidden_state.square().mean().backward()
    assert max(_rel(fast[n], p.grad) for n, p in m.named_parameters()) < TOL
    # the prefix-shared layout: one copy of a prompt and two suffixes in a row, the window on positions
    prefix, a, b = ids[0, :3], ids[1, 3:10], ids[2, 3:9]
    row = torch.cat([prefix, a, b])[None]
    pos = torch.cat([torch.arange(3), torch.arange(3, 10), torch.arange(3, 9)])[None]
    seg = torch.tensor([[0] * 3 + [1] * 7 + [2] * 6])
    with torch.no_grad():
        shared = gemma3.train_hidden(m, row, pos, seg)[0]
        alone_a = m.model(input_ids=torch.cat([prefix, a])[None]).last_hidden_state[0]
        alone_b = m.model(input_ids=torch.cat([prefix, b])[None]).last_hidden_state[0]
    assert _rel(shared[:10], alone_a) < TOL and _rel(shared[10:], alone_b[3:]) < TOL


def test_the_canary_reads_the_fast_copy(tiny):
    _, _, _, m = tiny
    eng = RolloutEngine(m, eos_token_id=-1, max_concurrent=8, max_cache_tokens=512)
    probe = canary.probe(m.config.vocab_size, int(m.config.max_position_embeddings))
    ours, ref = canary.answer(eng, probe), canary.score(m, probe)
    assert ours is not None and max(abs(x - y) for x, y in zip(ours, ref)) < TOL
    with torch.no_grad():  # a copy that missed a weight change shows
        m.model.layers[0].post_feedforward_layernorm.weight.add_(0.5)
        try:
            stale = canary.answer(eng, probe)
            assert max(abs(x - y) for x, y in zip(stale, canary.score(m, probe))) > 1e-3
        finally:
            m.model.layers[0].post_feedforward_layernorm.weight.sub_(0.5)


def test_a_gemma3_gguf_trains_through_the_cli_with_the_canary_on(tiny, tmp_path, monkeypatch):
    _, _, path, _ = tiny
    monkeypatch.setenv("ROLLYARD_GGUF_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert main(["train", f"model.name={path}", "data.task=reasoning_gym:chain_sum",
                 "data.task_options={min_terms: 2, max_terms: 2, max_digits: 1}", "data.train_size=8",
                 "data.eval_size=2", "reward.timeout_s=30", "reward.num_workers=1", "sft.auto=false", "steps=2",
                 "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6",
                 "progress=false", "log.plots=false", f"out_dir={run}"]) == 0
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    assert len(rows) == 2 and all(r["tokens/generated"] > 0 for r in rows)
    assert all(r["canary/logprob_gap"] < TOL for r in rows), [r.get("canary/logprob_gap") for r in rows]
