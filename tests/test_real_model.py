"""The real-model path without a download: a tiny Llama with the real architecture's features (grouped-query
attention, tied embeddings, a byte-level BPE trained here with a chat template) written as a GGUF file by the
``gguf`` package (``tests/gguf_files.py``), loaded back through ``model.name=<file>``, and trained by the CLI on
a chat dataset with the example's reward (``examples/real_model/sums.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import bpe_tokenizer, tiny_llama, write_gguf

from rollyard.cli import main
from rollyard.config import load_config
from rollyard.model import gguf as gguf_model
from rollyard.model import kv_budget
from rollyard.model.loading import load_policy
from rollyard.telemetry import rundir
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample

ROOT = Path(__file__).resolve().parents[1]
SUMS = ROOT / "examples" / "real_model" / "sums.py"
DENSE = ROOT / "tests" / "dense_reward.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, tokenizer, gguf path) with the conversion cache in a temporary directory."""
    tok = bpe_tokenizer()
    model = tiny_llama(tok)
    path = write_gguf(model, tok, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return model, tok, path


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.getbasetemp() / "gguf-cache"
    monkeypatch.setenv("ROLLYARD_GGUF_CACHE", str(cache))
    return cache


def _one_line_exit_2(capsys, args: list[str]) -> str:
    capsys.readouterr()
    with tempfile.TemporaryDirectory() as out:  # not the default runs/demo: another run there holds its lock
        if args[0] == "train" and not any(a.startswith("out_dir=") for a in args):
            args = [*args, f"out_dir={out}/run"]
        assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rollyard {args[0]}: error:") and "Traceback" not in err[0], err
    return err[0]


def _mapped_file(addr: int) -> str:
    """The file behind the mapping that holds address ``addr`` (Linux ``/proc/self/maps``); "" if anonymous."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            path = rest[4] if len(rest) > 4 else ""
            return "" if path.startswith("[") else path
    return ""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux memory maps")
def test_the_loaded_weights_are_not_in_the_files_mapping(tiny, gguf_cache):
    """``from_pretrained`` leaves the weights in the safetensors file's private mapping, where the trainer's first
    optimizer step would take a copy-on-write fault per page (``loading.own_memory``)."""
    _, _, path = tiny
    loaded, _ = load_policy(str(path))
    files = {n: _mapped_file(p.data_ptr()) for n, p in loaded.named_parameters()}
    assert files and all(f == "" for f in files.values()), {n: f for n, f in files.items() if f}
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still one tied parameter


def test_a_gguf_loads_back_as_the_model_it_was_written_from_and_is_cached(tiny, gguf_cache):
    model, tok, path = tiny
    loaded, ltok = load_policy(str(path))
    ids = torch.tensor([tok("What is 12+13? Answer with the number only.")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)  # F32 tensors, Q/K un-permuted: bit-equal
    cfg = loaded.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (4, 2, True)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    text = "What is 27+82? Answer with the number only. 109"
    assert ltok(text)["input_ids"] == tok(text)["input_ids"]
    assert ltok.eos_token == "<|im_end|>" and ltok.pad_token == "<|endoftext|>"
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert (ltok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))

    # cached by the file's hash: a second load reuses the directory (not rewritten), as does the folder holding it
    (out,) = [p for p in gguf_cache.iterdir() if (p / "config.json").exists()]
    assert out.name == gguf_model.file_hash(path)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert gguf_model.resolve(str(path)) == gguf_model.resolve(str(path.parent)) == str(out)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in gguf_cache.iterdir() if ".tmp" in p.name]


def test_a_gguf_trains_through_the_cli_on_chat_prompts(tiny, tmp_path):
    _, _, path = tiny
    sys.path.insert(0, str(SUMS.parent))
    try:
        import sums
    finally:
        sys.path.remove(str(SUMS.parent))
    train, held = sums.write(tmp_path / "data")
    run = tmp_path / "run"
    # trained on a reward a random model earns some of (tests/dense_reward.py); held out with the example's
    assert main(["train", f"model.name={path}", f"data.path={train}", f"data.eval_path={held}",
                 f"reward.hook={DENSE}:digits", f"eval.reward={SUMS}:last_integer_is_sum", "reward.num_workers=1",
                 "steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6",
                 "trainer.lr=1e-3", "progress=false", "log.plots=false", f"out_dir={run}",
                 "trainer.activation_checkpointing=true"]) == 0
    rows = list(rundir.read_jsonl(run / rundir.METRICS))
    assert len(rows) == 2 and all(r["tokens/generated"] > 0 for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows), [r["reward_std"] for r in rows]
    summary = json.loads((run / rundir.SUMMARY).read_text())
    assert summary["eval_before"] is not None and summary["eval_after"] is not None
    # the measured peaks (the plan's memory prediction is held against these): positive, below the machine's RAM
    peaks = summary["memory_peak_gb"]
    total_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    assert {"driver", "rollout", "trainer"} <= set(peaks) and all(0 < v < total_gb for v in peaks.values()), peaks
    assert peaks["driver"] >= max(peaks["rollout"], peaks["trainer"])
    assert all(f"memory/{k}_peak_gb" in rows[-1] for k in ("driver", "rollout", "trainer"))
    config = (run / "model" / "tokenizer_config.json").read_text() + (run / "model" / "chat_template.jinja").read_text()
    assert "<|im_start|>" in config  # the export keeps the GGUF's chat template


def test_a_gguf_without_a_chat_template_on_chat_prompts_is_one_line(tiny, tmp_path, capsys):
    model, tok, _ = tiny
    bare = write_gguf(model, tok, tmp_path / "bare.gguf", chat_template=None)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 1+2?"}], "answer": "3"}) + "\n")
    line = _one_line_exit_2(capsys, ["train", f"model.name={bare}", f"data.path={data}",
                                     f"reward.hook={SUMS}:last_integer_is_sum", "steps=1", "progress=false"])
    assert "chat template" in line and "data.chat_template" in line


def test_unreadable_ggufs_are_one_line_each(tiny, tmp_path, capsys):
    model, tok, _ = tiny
    f64 = write_gguf(model, tok, tmp_path / "f64.gguf", float_type=np.float64)
    line = _one_line_exit_2(capsys, ["train", f"model.name={f64}", "steps=1"])
    assert "F64" in line and "cannot be dequantized" in line and "Q8_0" in line

    other = write_gguf(model, tok, tmp_path / "arch.gguf", architecture="rwkv9")
    line = _one_line_exit_2(capsys, ["train", f"model.name={other}", "steps=1"])
    assert "'rwkv9'" in line and "transformers' GGUF loader" in line

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 not a gguf")
    line = _one_line_exit_2(capsys, ["train", f"model.name={junk}", "steps=1"])
    assert "not a GGUF file" in line

    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(f64.read_bytes()[:64])
    line = _one_line_exit_2(capsys, ["train", f"model.name={two}", "steps=1"])
    assert "holds 2 GGUF files" in line


def test_a_gguf_without_the_gguf_package_names_the_extra(tiny, tmp_path):
    """The ``gguf`` package made unimportable in a fresh interpreter (``sys.modules[...] = None``): the
    conversion's first need of it is one line naming ``rollyard[gguf]``."""
    _, _, path = tiny
    code = ("import sys; sys.modules['gguf'] = None\n"
            "from rollyard.cli import main\n"
            f"sys.exit(main(['train', 'model.name={path}', 'steps=1', 'out_dir={tmp_path / 'run'}']))")
    env = {**os.environ, "ROLLYARD_GGUF_CACHE": str(tmp_path / "empty-cache")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "pip install 'rollyard[gguf]'" in err[0], proc.stderr


def _samples(vocab: int, n: int = 6) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        p = torch.randint(3, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        c = torch.randint(3, vocab, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
        out.append(Sample(id=f"s{i}", request_id=f"r{i % 2}", prompt_ids=p, completion_ids=c, logprobs=[0.0] * len(c),
                          versions=[0] * len(c), finish_reason="stop", advantage=float(torch.randn(1, generator=g))))
    return out


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_activation_checkpointing_keeps_the_gradient_and_saves_less(layout):
    """The same micro-batches with and without ``activation_checkpointing``: equal gradients (the recomputed
    forward is the same math), and the tensors autograd keeps for the backward (counted by a saved-tensors
    hook) a fraction of the plain forward's."""
    tok = bpe_tokenizer()
    samples = _samples(len(tok))
    grads, saved = {}, {}
    for ckpt in (False, True):
        model = tiny_llama(tok)
        model.train()  # HF's decoder layers (the packed layout) checkpoint in train mode only; the fast path always
        trainer = Trainer(model, lr=1e-3, layout=layout, activation_checkpointing=ckpt)
        kept: list[int] = []

        def pack(t: torch.Tensor, kept=kept):
            kept.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.accumulate_gradients(samples)
        grads[ckpt] = torch.cat([p.grad.flatten() for p in model.parameters()])
        saved[ckpt] = sum(kept)
    assert torch.allclose(grads[True], grads[False], rtol=1e-4, atol=1e-6)
    assert saved[True] < 0.6 * saved[False], saved


def test_the_recompute_skips_each_layers_last_product_and_keeps_the_gradient(monkeypatch):
    """With activation checkpointing a Llama layer's ``down_proj`` product runs once, in the forward: the layer's
    recompute saves the product's input and weight (what the backward reads) and skips the product, whose value
    only the discarded recomputed output held (``model.gemm.linear``'s ``tail``). The gradient equals, bit for bit,
    the one of a recompute that computes it, and the plain backward's to float rounding."""
    import contextlib

    from transformers import AutoModelForCausalLM, LlamaConfig

    from rollyard.model import gemm

    monkeypatch.setenv("ROLLYARD_ONEDNN", "1")  # the oneDNN linear (its autograd Function) on any x86 CPU class
    if not gemm.enabled():
        pytest.skip("oneDNN's linear is not available in this torch build")
    tok = bpe_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id)
    samples = _samples(len(tok), n=12)
    calls, real_lp = [], gemm._lp

    def counting(x, w, b=None):
        calls.append(tuple(w.shape) == (128, 256) and w.is_contiguous())  # a down_proj product (gate|up's g @ w: w.t())
        return real_lp(x, w, b)

    monkeypatch.setattr(gemm, "_lp", counting)
    grads, downs = {}, {}
    for case in ("skip", "compute", "plain"):
        if case == "compute":  # the recompute without its context: every product computed again
            monkeypatch.setattr(gemm, "recompute_contexts", lambda: (contextlib.nullcontext(), contextlib.nullcontext()))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        trainer = Trainer(model, lr=1e-3, layout="padded", activation_checkpointing=case != "plain")
        assert trainer._use_fast(model)
        calls.clear()
        trainer.accumulate_gradients(samples)
        downs[case] = sum(calls)
        grads[case] = torch.cat([p.grad.flatten() for p in model.parameters()])
    rows = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    assert rows * 256 * 128 >= gemm.MIN_MACS  # the products took the oneDNN path the skip is on
    assert downs == {"skip": 3, "compute": 6, "plain": 3}, downs  # once per layer, twice where recomputed
    assert torch.equal(grads["skip"], grads["compute"])
    assert torch.allclose(grads["skip"], grads["plain"], rtol=1e-4, atol=1e-6)
    assert grads["skip"].abs().sum() > 0


def _saved_bytes(params: set[int]):
    """A saved-tensors hook pair that sums the distinct storages autograd keeps (parameters left out)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    return seen, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def test_auto_checkpointing_keeps_the_last_layers_where_the_gradients_to_come_have_room(monkeypatch):
    """``activation_checkpointing=auto``: a step's first micro-batch leaves its last layers un-recomputed as far as
    their activations fit in the gradients the backward has yet to allocate (less the LM head's transient); a later
    micro-batch (every gradient held) recomputes all. What the kept layers hold, measured by a saved-tensors hook, is
    within that room and within the per-layer bound the choice uses; the gradient is the one of recomputing every
    layer and of none; ``recomputed_positions`` counts what was recomputed."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rollyard.model import families, fast, gemm
    from rollyard.trainer import recompute

    tok = bpe_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id)
    samples = _samples(len(tok), n=12)
    # the per-layer bound against what a plain (unrecomputed) forward keeps, measured
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ids = torch.randint(3, len(tok), (3, 40))
    seen, hooks = _saved_bytes({p.untyped_storage().data_ptr() for p in model.parameters()})
    with hooks:
        families.train_hidden(model, ids)
    by_parts = gemm.by_parts(torch.float32, torch.device("cpu"))  # no concatenated weights kept: a tighter bound
    assert 0 < sum(seen.values()) / 6 <= recompute.layer_bytes(cfg, ids.numel(), 40, concatenated=not by_parts)

    real_checkpoint, calls = fast.checkpoint, []
    monkeypatch.setattr(fast, "checkpoint", lambda *a, **k: calls.append(1) or real_checkpoint(*a, **k))
    grads, runs = {}, {}
    for mode in (False, True, "auto"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        trainer = Trainer(model, lr=1e-3, layout="padded", micro_batch_tokens=96, activation_checkpointing=mode)
        kept, held, real_kept = [], [], trainer._kept_layers

        def kept_layers(mb, trainer=trainer, kept=kept, held=held, real_kept=real_kept):
            free = sum(p.numel() * p.element_size() for p in trainer.params if p.grad is None)
            held.append(free)
            kept.append(real_kept(mb))
            return kept[-1]

        trainer._kept_layers = kept_layers
        calls.clear()
        seen, hooks = _saved_bytes({p.untyped_storage().data_ptr() for p in model.parameters()})
        with hooks:
            acc = trainer.accumulate_gradients(samples)
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
        runs[mode] = (kept, held, len(calls), acc)
    kept, held, ncalls, acc = runs["auto"]
    mbs = acc["micro_batches"]
    assert mbs >= 2 and 0 < kept[0] <= 6 and kept[1:] == [0] * (mbs - 1), kept  # the first only: later ones hold grads
    assert held[0] == sum(p.numel() * 4 for p in model.parameters()) and held[1:] == [0] * (mbs - 1)
    assert ncalls == 6 * mbs - kept[0] and runs[True][2] == 6 * mbs and runs[False][2] == 0
    assert runs[True][0] == [0] * mbs and runs[False][0] == [0] * mbs  # only auto keeps any
    assert 0 < acc["recomputed_positions"] < runs[True][3]["recomputed_positions"] == acc["computed_positions"]
    assert runs[False][3]["recomputed_positions"] == 0
    assert torch.allclose(grads["auto"], grads[True], rtol=1e-5, atol=1e-7)
    assert torch.allclose(grads["auto"], grads[False], rtol=1e-5, atol=1e-7)
    # what the kept layers hold at the backward's start, measured: within the room they were kept in
    first = trainer.micro_batches(samples)[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    holds = {}
    for k in (0, kept[0]):
        seen, hooks = _saved_bytes(params)
        with hooks:
            trainer._forward(model, first, kept=k)
        holds[k] = sum(seen.values())
    head = model.get_output_embeddings().weight
    room = held[0] - 4 * head.numel() - 8 * min(trainer.logprob_chunk, int(first.rows.numel())) * head.shape[0]
    assert 0 < holds[kept[0]] - holds[0] <= room, (holds, room)


def test_the_kv_budget_is_memory_and_impossible_settings_are_refused_up_front(tiny, capsys):
    model, _, path = tiny
    c = model.config  # 2 layers x 2 KV heads x head_dim 16, fp32: K and V
    assert kv_budget.kv_bytes_per_token(c) == 2 * 2 * 2 * 16 * 4
    cfg = load_config(None, ["rollout.kv_memory_gb=0.001", "rollout.max_cache_tokens=1000000"])
    assert kv_budget.cache_tokens(cfg, model) == 1_000_000 // 512  # 1 MB over 512 B per token
    cfg = load_config(None, ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=24"])
    width = min(c.max_position_embeddings, kv_budget.PROMPT_ALLOWANCE + 24)  # 128: the context bounds a sequence
    assert kv_budget.kv_budget_bytes(cfg, c, available=10**12) == 32 * width * 512  # auto: one step's sequences
    assert kv_budget.kv_budget_bytes(cfg, c, available=8 * width * 512) == 2 * width * 512  # auto: <= 1/4 of available

    free_gb = kv_budget.available_bytes() / 1e9
    line = _one_line_exit_2(capsys, ["train", f"model.name={path}", f"rollout.kv_memory_gb={free_gb * 2:.0f}", "steps=1"])
    assert "rollout.kv_memory_gb=" in line and "available" in line
    # A micro-batch bound far above one step's batch means 'one micro-batch': priced as the batch, not refused.
    assert kv_budget.micro_batch_tokens(cfg.model_copy(update={"trainer": cfg.trainer.model_copy(
        update={"micro_batch_tokens": 2_000_000_000})}), c) == 32 * c.max_position_embeddings
    line = _one_line_exit_2(capsys, ["train", f"model.name={path}", "trainer.micro_batch_tokens=2000000000",
                                     "rollout.prompts_per_step=4096", "rollout.samples_per_prompt=64", "steps=1"])
    assert "micro-batch" in line and "trainer.activation_checkpointing=true" in line
