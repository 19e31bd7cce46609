"""TRL's side of bench/vs_trl.py, run in bench/.venv-trl (never imported by rollyard's code).

Also home of the bench's reward, ``digits``: rollyard's reward workers import it by path
(``reward.hook=bench/_trl_side.py:digits``), so this module's top level imports nothing beyond the
standard library; torch / transformers / trl are imported inside ``main``.

Usage (vs_trl.py builds the arguments): ``python bench/_trl_side.py --model DIR --prompts FILE
--steps N --threads T --out result.json``. Runs TRL's ``GRPOTrainer`` for ``N`` optimizer steps
(the first one is the warm-up and is not timed) and writes one JSON object to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def digits(completion: str, prompt: str, meta: dict) -> float:
    """Fraction of the completion's characters that are digits (deterministic; 0 for an empty one)."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


REWARD_MEANS: list[float] = []  # mean reward of every scored batch (one per optimizer step here)


def digits_trl(completions, prompts=None, **kwargs) -> list[float]:
    """The same reward in TRL's reward-function signature (records each batch's mean)."""
    prompts = prompts if prompts is not None else [""] * len(completions)
    out = [digits(c, p, {}) for c, p in zip(completions, prompts)]
    REWARD_MEANS.append(sum(out) / max(len(out), 1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory (vs_trl.py exports it)")
    ap.add_argument("--prompts", required=True, help="JSONL file with a 'prompt' column")
    ap.add_argument("--steps", type=int, required=True, help="optimizer steps in all, warm-up included")
    ap.add_argument("--warmup", type=int, default=1, help="leading steps left out of the timing")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--samples-per-prompt", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision (TRL's own default; fp32 otherwise)")
    ap.add_argument("--out", required=True, help="where the JSON result goes")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()

    with open(args.prompts) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    dataset = datasets.Dataset.from_dict({"prompt": prompts})

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    n_completions = args.prompts_per_step * args.samples_per_prompt

    config = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl-out"),
        # One optimizer step = one generation batch = prompts_per_step x samples_per_prompt completions.
        per_device_train_batch_size=n_completions,
        gradient_accumulation_steps=1,
        num_generations=args.samples_per_prompt,
        num_iterations=1,
        max_steps=args.steps,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        # Same algorithm knobs as rollyard's defaults: no KL/reference model, clip 0.2/0.28,
        # group-std scaled advantages, constant lr, AdamW, grad-norm clip 1.0.
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="group",
        loss_type="dapo",  # token-mean over the batch, as rollyard's loss_agg=token-mean
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        use_vllm=False,
        use_cpu=True,
        bf16=args.bf16,  # CPU: transformers/accelerate autocast the model's forward to bf16
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
    )

    marks: list[float] = []          # wall clock at the end of every optimizer step
    gen_seconds: list[float] = []    # time inside transformers' generate, per step
    gen_tokens: list[int] = []       # completion tokens actually generated (up to and incl. EOS), per step

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*a, **k)
            gen_seconds.append(time.perf_counter() - t0)
            gen_tokens.append(sum(len(c) for c in completion_ids))
            return completion_ids, logprobs

    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[digits_trl],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    print(f"[trl] torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"{torch.get_num_threads()} threads; {args.steps} steps ({args.warmup} warm-up)", flush=True)
    trainer.train()

    step_seconds = [b - a for a, b in zip(marks, marks[1:])]
    if len(step_seconds) != args.steps or len(gen_tokens) != args.steps:
        print(f"[trl] expected {args.steps} steps, saw {len(step_seconds)} step ends and {len(gen_tokens)} "
              f"generation batches", file=sys.stderr)
        return 1
    result = {
        "side": "trl",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "threads": torch.get_num_threads(),
        "completions_per_step": n_completions,
        "step_seconds": step_seconds,
        "generate_seconds": gen_seconds,
        "generated_tokens": gen_tokens,
        "reward_means": REWARD_MEANS[:args.steps],
        "warmup": args.warmup,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
