"""rollout.backend: native vs vLLM tokens/s on the same HF Llama, and the vLLM backend's overhead over bare
``LLM.generate`` on the same work (same engine instance, same prompts, same lengths).

    PYTHONPATH=src python bench/vllm_backend.py [--prompts 32] [--samples 8] [--tokens 32] [--sizes 3M,19M] [--repeat 3] [--grpo-steps 8]

Needs vllm (``make setup VLLM=1``). EOS is off (the model has none), so every sample runs to its length cap:
``uniform`` caps every sample at --tokens, ``long-tailed`` draws each request's cap from a Pareto tail
(most short, a few at --tokens). fp32, one process; the numbers are ratios measured side by side.
Not named ``vllm.py``: run as a script, a file of that name would shadow the vllm package.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from rollyard.rollout.engine import RolloutEngine
from rollyard.rollout.vllm import VllmEngine
from rollyard.types import Request

SIZES = {  # head_dim 64 (vLLM's CPU attention)
    "3M": dict(hidden_size=256, intermediate_size=640, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    "19M": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4),
    "76M": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8),
}


def model_of(size: str):
    cfg = LlamaConfig(vocab_size=128, max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=None,
                      bos_token_id=None, pad_token_id=0, **SIZES[size])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().requires_grad_(False)


def work(prompts: int, samples: int, tokens: int, tail: bool) -> list[Request]:
    rng = random.Random(0)
    out = []
    for i in range(prompts):
        cap = min(tokens, max(1, int(4 * rng.paretovariate(1.2)))) if tail else tokens
        out.append(Request(f"p{i}", [rng.randrange(1, 128) for _ in range(12)], n=samples, max_new_tokens=cap))
    return out


def timed(engine, reqs: list[Request]) -> tuple[float, int]:
    t = time.perf_counter()
    samples, _ = engine.generate(reqs)
    return time.perf_counter() - t, sum(len(s.completion_ids) for s in samples)


def bare(llm, reqs: list[Request]) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, params = [], []
    for q in reqs:
        for _ in range(q.n):
            prompts.append(TokensPrompt(prompt_token_ids=list(q.prompt_ids)))
            params.append(SamplingParams(n=1, temperature=1.0, max_tokens=q.max_new_tokens, logprobs=0, detokenize=False))
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)


def grpo_steps(backend: str, steps: int, out: str) -> tuple[float, float]:
    """(steps/s, rollout share of the step) of a colocated GRPO run on tiny64 (full sync, the digits reward),
    step 0 (engine warm-up) left out."""
    import json
    from pathlib import Path

    from rollyard.cli import main as cli

    hook = Path(__file__).parent.parent / "tests" / "dense_reward.py"
    args = ["train", "model.name=tiny64", "model.context=64", "data.train_size=256", "data.eval_size=4",
            "rollout.prompts_per_step=8", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=16", "sft.auto=false",
            "progress=false", "reward.num_workers=1", "eval_every=0", f"reward.hook={hook}:digits", "sync.mode=full",
            f"steps={steps}", f"rollout.backend={backend}", f"out_dir={out}/{backend}", "log.plots=false"]
    assert cli(args) == 0
    rows = [json.loads(x) for x in open(f"{out}/{backend}/metrics.jsonl")][1:]
    total = sum(r["time/step"] for r in rows)
    return len(rows) / total, sum(r["time/rollout"] for r in rows) / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--sizes", default="3M,19M")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--grpo-steps", type=int, default=8, help="end-to-end colocated GRPO steps per backend; 0: skip")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    print(f"{a.prompts} prompts x {a.samples} samples, <= {a.tokens} new tokens, fp32, torch threads {torch.get_num_threads()}")
    print(f"{'size':>5} {'lengths':>11} {'native tok/s':>13} {'vllm tok/s':>11} {'native/vllm':>12} "
          f"{'bare LLM.generate tok/s':>24} {'backend overhead':>17}")
    for size in a.sizes.split(","):
        model = model_of(size)
        kw = dict(eos_token_id=[], temperature=1.0, max_concurrent=a.prompts * a.samples, max_cache_tokens=1 << 16, seed=0)
        native = RolloutEngine(model, **kw)
        v = VllmEngine(model, **kw)
        for tail in (False, True):
            reqs = work(a.prompts, a.samples, a.tokens, tail)
            timed(native, work(2, 2, 4, False))  # warm-up
            timed(v, [Request(f"w{tail}", [1, 2, 3], n=2, max_new_tokens=4)])
            # best of --repeat, interleaved: the machine is shared, the fastest run is the least disturbed
            tn = tv = tb = float("inf")
            for r in range(a.repeat):
                t, nn = timed(native, reqs)
                tn = min(tn, t)
                t, nv = timed(v, [Request(f"{q.id}-{tail}-{r}", q.prompt_ids, q.n, q.max_new_tokens) for q in reqs])
                tv = min(tv, t)
                t, nb = bare(v.llm, reqs)
                tb = min(tb, t)
            print(f"{size:>5} {'long-tailed' if tail else 'uniform':>11} {nn / tn:>13.0f} {nv / tv:>11.0f} "
                  f"{(nn / tn) / (nv / tv):>11.2f}x {nb / tb:>24.0f} {tv / tb - 1:>16.1%}")
        v.close()
    if a.grpo_steps:
        import tempfile
        with tempfile.TemporaryDirectory() as out:
            res = {b: grpo_steps(b, a.grpo_steps + 1, out) for b in ("native", "vllm")}
        print("colocated GRPO step (tiny64, 8x8 samples, <= 16 tokens, full sync): " + ", ".join(
            f"{b} {sps:.2f} steps/s (rollout {share:.0%})" for b, (sps, share) in res.items())
            + f"; native/vllm {res['native'][0] / res['vllm'][0]:.2f}x")


if __name__ == "__main__":
    main()
