"""Disaggregated placement (one step off): rollout workers (Ray actors) sample step k+1 while the
trainer trains step k.

Round k+1 is handed out before step k trains; the weights published after step k reach the
workers before they start round k+2 (a round meant for step b starts only on weights of version
``>= b - sync.every``). The trainer takes exactly round k at step k, so every sample lags by at
most ``sync.every`` versions (1 by default), checked where it is consumed.
"""

from __future__ import annotations

from pathlib import Path

from rollyard.config import RunConfig
from rollyard.placement.pool import RolloutPool
from rollyard.placement.run import evaluate, finish, start
from rollyard.placement.score import score
from rollyard.telemetry.report import StepProgress, fmt_accuracy


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False) -> dict:
    run, r, _ = start(cfg, run_dir, resume)
    bound = cfg.sync.every
    tel, ledger = run.telemetry, r.feed.ledger
    pool = RolloutPool(cfg, run, r, bound)
    try:
        run.begin()
        with StepProgress(cfg.steps, run.state.step, cfg.progress) as progress:
            for step in range(run.state.step, cfg.steps):
                pool.fill(horizon=step + 1, step=step)
                requests, samples = pool.take(cfg.rollout.prompts_per_step, run.state.version, round_=step)

                samples = score(run, r, step, samples)
                with tel.span("train", step, requests=[q.id for q in requests]):
                    train_metrics = r.trainer.step(samples)
                ledger.trained([q.id for q in requests])
                run.state.version += 1
                if run.state.version % cfg.sync.every == 0:
                    pool.publish(step, run.state.version)

                run.state.step = step + 1
                progress.update(run.end_step(step, r, requests, samples, train_metrics, trained_at=run.state.version - 1,
                                             extra=pool.metrics()))
                if run.state.step % cfg.checkpoint_every == 0 or run.state.step == cfg.steps:
                    run.save_checkpoint(r)
                if cfg.eval_every and run.state.step % cfg.eval_every == 0 and run.state.step < cfg.steps:
                    run.log(f"step {run.state.step}: held-out greedy accuracy {fmt_accuracy(evaluate(run, r))}")
    finally:
        pool.stop()
    return finish(run, r)
