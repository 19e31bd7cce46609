"""The trainer's step in fp32 vs bf16 autocast on this CPU, per model width: the rule behind ``trainer.precision=auto``.

    .venv/bin/python bench/precision.py                 # widths 96 (tiny), 256 (small), 576 (SmolLM2's), 896
    .venv/bin/python bench/precision.py --widths 256 576 --rounds 3

Each width is a random-init Llama (30 layers as SmolLM2-135M, intermediate 8/3 x hidden, 8 heads / 4 KV heads, SmolLM2's
49152-token vocabulary, tied embeddings); one GRPO batch of 32 samples x (40 prompt + 24 completion) tokens,
as the real-model example's. Per width and precision: the median ``Trainer.step`` wall time over the rounds,
the two precisions alternating so that drifting load hits both alike, and the bf16 / fp32 ratio. The CPU's
native bf16 (AVX512-BF16 or AMX) is printed: without it bf16 autocast is emulated and slower.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from rollyard.model.gemm import cpu_has_native_bf16
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample


def model_of(width: int, layers: int, vocab: int = 49152):
    heads = 8
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=(8 * width // 3 + 63) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                      head_dim=width // heads, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def batch(vocab: int, n: int = 32, prompt: int = 40, completion: int = 24) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (prompt + completion,), generator=g).tolist()
        out.append(Sample(id=f"s{i}", request_id=f"r{i // 8}", prompt_ids=ids[:prompt], completion_ids=ids[prompt:],
                          logprobs=[-3.0] * completion, versions=[0] * completion, finish_reason="length",
                          advantage=float(i % 3 - 1)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[96, 256, 576, 896])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"native bf16 on this CPU (AVX512-BF16 or AMX): {cpu_has_native_bf16()}; {a.threads} threads")
    print(f"{'width':>6} {'fp32 s':>8} {'bf16 s':>8} {'bf16/fp32':>10}")
    for width in a.widths:
        trainers = {p: Trainer(model_of(width, a.layers), lr=1e-6, precision=p) for p in ("fp32", "bf16")}
        samples = batch(49152)
        times: dict[str, list[float]] = {p: [] for p in trainers}
        for r in range(a.rounds + 1):  # the first round warms up (oneDNN primitives, allocator)
            for p in (("fp32", "bf16") if r % 2 else ("bf16", "fp32")):
                t0 = time.perf_counter()
                trainers[p].step(samples)
                if r:
                    times[p].append(time.perf_counter() - t0)
        f, b = statistics.median(times["fp32"]), statistics.median(times["bf16"])
        print(f"{width:>6} {f:8.3f} {b:8.3f} {b / f:10.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
