"""Rollout engine vs transformers ``model.generate``: generated tokens/s, bubble, physical limit.

    .venv/bin/python bench/engine.py                         # tiny + small, uniform + long-tailed, n=8
    .venv/bin/python bench/engine.py --presets tiny --threads 2 --json bench/out/engine.json
    .venv/bin/python bench/engine.py --presets tiny small --arch gpt2       # the batched HF backend

Both sides get the same model (a preset, fp32, CPU), the same prompts (random 8-16 character
prompts, fixed seed), n samples per prompt, temperature 1, top-p 1 (HF: top_k=0, so no top-k
either), and the same per-sample response lengths from a *length oracle*: EOS is disabled on both
sides and each sample ``(prompt i, sample k)`` ends after exactly ``L[i, k]`` tokens, drawn once
per case from a seeded generator:

- ``uniform``: every L = ``--uniform-len`` (64).
- ``longtail``: L ~ U[12, 20] (mean 16) with probability 1 - ``--tail-frac`` (6%); otherwise
  16 x U[8, 16] (8-16x longer: 128-256 tokens).

The engine applies the oracle through its ``_length_cap`` hook (a per-sample cap on completion
length, read at admission); HF through a ``StoppingCriteria`` that marks row (i, k) done at its
length (HF then keeps computing the finished row, padded, until its batch's longest is done).
HF runs *static batches* of ``--batch`` sequences (``batch / n`` prompts each, in prompt order),
the engine runs with ``max_concurrent = --batch``: the same number of sequences in flight.

Columns: ``tok/s`` = oracle tokens generated / wall seconds; ``ratio`` = engine / HF;
``bubble`` = 1 - useful tokens / computed decode positions (HF: batch x steps of each static
batch; engine: the slots each decode step computes, plus one position per sample for the first
token, which comes from the shared prefill); ``% limit`` = tok/s over the physical limit, which
is matmul FLOP/s measured in this run (a 1024^3 fp32 matmul, same threads, the faster of MKL and oneDNN) divided by the model's
FLOPs per generated token (2 x matmul parameters incl. LM head + attention at the case's mean
context). Each side runs ``--repeats`` times, interleaved, and its best time is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from rollyard.model import cpu
from rollyard.model import gemm as cpu_gemm
from rollyard.model.loading import PRESETS, build_preset, char_tokenizer, num_params
from rollyard.rollout.engine import RolloutEngine
from rollyard.types import Request


def draw_lengths(case: str, prompts: int, n: int, seed: int, uniform_len: int, tail_frac: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if case == "uniform":
        return torch.full((prompts, n), uniform_len, dtype=torch.long)
    short = torch.randint(12, 21, (prompts, n), generator=g)
    long = 16 * torch.randint(8, 17, (prompts, n), generator=g)
    return torch.where(torch.rand(prompts, n, generator=g) < tail_frac, long, short)


class OracleStop(StoppingCriteria):
    """Row r of the batch is done once it has generated ``lengths[r]`` tokens."""

    def __init__(self, prompt_len: int, lengths: torch.Tensor):
        self.prompt_len, self.lengths = prompt_len, lengths

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids.shape[1] - self.prompt_len) >= self.lengths


@torch.no_grad()
def run_hf(model, prompts, lengths, n, batch, pad_id, seed):
    per = batch // n
    torch.manual_seed(seed)
    # EOS off: generate merges the model's generation_config (eos 2) into ours otherwise
    model.generation_config.eos_token_id = None
    tokens = positions = 0
    t0 = time.perf_counter()
    for b in range(0, len(prompts), per):
        chunk, L = prompts[b:b + per], lengths[b:b + per].reshape(-1)
        P = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (P - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in chunk])
        cfg = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=n,
                               max_new_tokens=int(L.max()), pad_token_id=pad_id, eos_token_id=None)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg,
                             stopping_criteria=StoppingCriteriaList([OracleStop(P, L)]))
        steps = out.shape[1] - P
        assert steps == int(L.max()), (steps, int(L.max()))
        tokens += int(L.sum())
        positions += out.shape[0] * steps
    return tokens, positions, time.perf_counter() - t0


def run_engine(model, prompts, lengths, n, batch, pad_id, seed):
    eng = RolloutEngine(model, eos_token_id=-1, pad_token_id=pad_id, temperature=1.0, top_p=1.0,
                        max_concurrent=batch, seed=seed)
    caps = {f"p{i}#{k}": int(lengths[i, k]) for i in range(len(prompts)) for k in range(n)}
    eng._length_cap = caps.__getitem__
    computed = [0]
    decode = eng.backend.decode

    def counted(seqs):
        computed[0] += max(s.slot for s in seqs) + 1 if eng.backend.name == "fast" else len(seqs)
        return decode(seqs)

    eng.backend.decode = counted
    reqs = [Request(f"p{i}", p, n=n, max_new_tokens=int(lengths[i].max())) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    samples, rejected = eng.generate(reqs)
    dt = time.perf_counter() - t0
    assert not rejected, rejected
    tokens = sum(len(s.completion_ids) for s in samples)
    assert tokens == int(lengths.sum()), (tokens, int(lengths.sum()))
    return tokens, computed[0] + len(samples), dt


def matmul_flops(seconds: float = 0.5, dtype: torch.dtype = torch.float32, size: int = 1024) -> float:
    """FLOP/s of a 1024^3 matmul in ``dtype`` on the current threads (the physical limit reported
    against): the faster of torch's default kernel (``a @ b``; MKL in fp32 on x86) and oneDNN's
    (``rollyard.model.gemm``, which rollyard uses where it is the faster one; on this project's AMD
    EPYC ~2.2x MKL in fp32), so a limit is never one kernel's shortfall."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    kernels = [lambda: a @ b]
    # oneDNN only where the product would call it for this dtype (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT:
    # on an AVX2-only CPU oneDNN refuses to create the primitive)
    if cpu_gemm._op_available() and (dtype == torch.float32 or cpu.onednn_bf16()):
        bt = b.t().contiguous()
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, bt, None, "none", [], ""))
    best = 0.0
    for k in kernels:
        try:
            k()
        except RuntimeError as e:  # a kernel this CPU cannot run is not a limit: said, then skipped
            print(f"matmul limit: {getattr(k, '__name__', 'kernel')} skipped on this CPU ({str(e).splitlines()[0][:120]})")
            continue
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / len(kernels):
            k()
            reps += 1
        best = max(best, 2 * size ** 3 * reps / (time.perf_counter() - t0))
    return best


def flops_per_token(model, mean_ctx: float) -> float:
    cfg = model.config
    head = model.get_output_embeddings().weight
    lookups = sum(m.weight.numel() for m in model.modules()
                  if isinstance(m, torch.nn.Embedding) and m.weight is not head)
    # embedding lookups (tokens; GPT-2's learned positions) are free; a tied LM head is a matmul
    # with the embedding's V x D parameters
    matmul = num_params(model) - lookups
    hd = cfg.hidden_size // cfg.num_attention_heads
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * hd * mean_ctx
    return 2 * matmul + attn


def arch_config(arch: str, dims: dict, vocab: int, ctx: int):
    """A config of ``arch`` with the preset's dimensions (``arch`` != llama: the engine's fast path covers
    qwen3; gpt2, gemma2 and phi3 take the batched HF backend)."""
    import transformers as tf

    layers, hidden, heads = dims["num_hidden_layers"], dims["hidden_size"], dims["num_attention_heads"]
    common = dict(vocab_size=vocab, max_position_embeddings=ctx, tie_word_embeddings=False, **dims)
    if arch == "qwen3":
        return tf.Qwen3Config(head_dim=hidden // heads, **common)
    if arch == "gpt2":  # learned positions, LayerNorm, GELU MLP of 4 x hidden, fused qkv
        return tf.GPT2Config(vocab_size=vocab, n_positions=ctx, n_embd=hidden, n_layer=layers, n_head=heads)
    if arch == "gemma2":  # hybrid: every other layer a sliding window (half the context), soft-capping
        return tf.Gemma2Config(head_dim=hidden // heads, sliding_window=ctx // 2, **common)
    if arch == "phi3":
        return tf.Phi3Config(pad_token_id=0, **common)
    raise ValueError(arch)


def build_model(preset: str, arch: str, tok, seed: int, ctx: int = 512):
    """The preset's Llama model, or a model of another ``arch`` with the preset's dimensions, saved
    to a directory and loaded back with ``AutoModelForCausalLM`` as a user would."""
    if arch == "llama":
        return build_preset(preset, tok, seed=seed, max_position_embeddings=ctx).eval()
    import tempfile

    from transformers import AutoModelForCausalLM

    cfg = arch_config(arch, PRESETS[preset], len(tok), ctx)
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as d:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
        return AutoModelForCausalLM.from_pretrained(d).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=sorted(PRESETS))
    ap.add_argument("--arch", choices=["llama", "qwen3", "gpt2", "gemma2", "phi3"], default="llama",
                    help="llama: the presets as built; else a config of that architecture with the preset's "
                         "dimensions, via a model dir (gpt2 / gemma2 / phi3: the engine's batched HF backend)")
    ap.add_argument("--cases", nargs="+", default=["uniform", "longtail"], choices=["uniform", "longtail"])
    ap.add_argument("--prompts", type=int, default=32, help="prompts per case (x n samples)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="HF static batch = engine max_concurrent (sequences)")
    ap.add_argument("--uniform-len", type=int, default=64)
    ap.add_argument("--tail-frac", type=float, default=0.06)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="model weights (and compute) on both sides; bf16: the limit is then the bf16 matmul peak")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs per side; the best is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from rollyard.config import env_error

    if why := env_error():  # a bad ROLLYARD_* setting: one line, exit 2
        ap.exit(2, f"{ap.prog}: error: {why}\n")
    assert args.batch % args.n == 0, "--batch must be a multiple of --n"
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    tok = char_tokenizer()
    g = torch.Generator().manual_seed(args.seed)
    chars = len(tok)
    prompts = [torch.randint(4, chars, (int(torch.randint(8, 17, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    peak = matmul_flops(dtype=dtype)
    print(f"threads {args.threads}; matmul {peak / 1e9:.1f} GFLOP/s (1024^3 {args.dtype}); {args.prompts} prompts x n={args.n}, "
          f"batch {args.batch}; temperature 1, top-p 1; length oracle (EOS off)")
    rows = []
    head = f"{'preset':6} {'case':9} {'tokens':>7} | {'HF tok/s':>9} {'bubble':>6} {'%lim':>5} | " \
           f"{'eng tok/s':>9} {'bubble':>6} {'%lim':>5} | {'ratio':>5}"
    print(head)
    print("-" * len(head))
    for preset in args.presets:
        model = build_model(preset, args.arch, tok, args.seed).to(dtype)
        # warm-up both sides (first-call allocations, lazy init)
        wl = torch.full((args.batch // args.n, args.n), 4, dtype=torch.long)
        run_hf(model, prompts[:args.batch // args.n], wl, args.n, args.batch, tok.pad_token_id, 0)
        run_engine(model, prompts[:args.batch // args.n], wl, args.n, args.batch, tok.pad_token_id, 0)
        for case in args.cases:
            L = draw_lengths(case, args.prompts, args.n, args.seed + 1, args.uniform_len, args.tail_frac)
            mean_ctx = sum(len(p) for p in prompts) / len(prompts) + float(L.float().mean()) / 2
            limit = peak / flops_per_token(model, mean_ctx)
            h_dt = e_dt = float("inf")
            for _ in range(args.repeats):  # interleaved; best of each side (a shared machine drifts)
                h_tok, h_pos, dt = run_hf(model, prompts, L, args.n, args.batch, tok.pad_token_id, args.seed)
                h_dt = min(h_dt, dt)
                e_tok, e_pos, dt = run_engine(model, prompts, L, args.n, args.batch, tok.pad_token_id, args.seed)
                e_dt = min(e_dt, dt)
            r = dict(preset=preset, case=case, tokens=e_tok, hf_tok_s=h_tok / h_dt, hf_bubble=1 - h_tok / h_pos,
                     eng_tok_s=e_tok / e_dt, eng_bubble=1 - e_tok / e_pos, limit_tok_s=limit,
                     ratio=(e_tok / e_dt) / (h_tok / h_dt), hf_s=h_dt, eng_s=e_dt, params=num_params(model),
                     threads=args.threads, longest=int(L.max()), mean_len=float(L.float().mean()))
            rows.append(r)
            print(f"{preset:6} {case:9} {e_tok:7d} | {r['hf_tok_s']:9.0f} {r['hf_bubble']:6.1%} "
                  f"{r['hf_tok_s'] / limit:5.1%} | {r['eng_tok_s']:9.0f} {r['eng_bubble']:6.1%} "
                  f"{r['eng_tok_s'] / limit:5.1%} | {r['ratio']:4.2f}x", flush=True)
        backend = RolloutEngine(model, eos_token_id=-1).backend.name
        print(f"  {preset} ({model.config.model_type}, engine backend {backend!r}): {num_params(model) / 1e6:.2f}M params, limit {limit:.0f} tok/s "
              f"({flops_per_token(model, mean_ctx) / 1e6:.1f} MFLOP/token at the last case's mean context)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
