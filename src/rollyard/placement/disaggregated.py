"""Disaggregated placement (one step off): rollout workers (Ray actors) sample step k+1 while the
trainer trains step k.

Round k+1 is handed out before step k trains; the weights published after step k reach the
workers before they start round k+2 (a round meant for step b starts only on weights of version
``>= b - sync.every``). The trainer takes exactly round k at step k, so every sample lags by at
most ``sync.every`` versions (1 by default), checked where it is consumed.
"""

from __future__ import annotations

from pathlib import Path

from rollyard import signals
from rollyard.config import RunConfig
from rollyard.placement.pool import RolloutPool
from rollyard.placement.run import finish, start
from rollyard.placement.score import score
from rollyard.telemetry.report import StepProgress


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

                samples, trained = score(run, r, step, samples)
                trained_at = run.state.version
                with tel.span("train", step, requests=[q.id for q in requests]):
                    train_metrics = r.trainer.step(trained)
                ledger.trained([q.id for q in requests])
                if not train_metrics.get("skipped"):  # a skipped update is no new version: nothing to publish
                    run.state.version += 1
                    if run.state.version % cfg.sync.every == 0:
                        pool.publish(step, run.state.version)

                run.state.step = step + 1
                if cfg.eval_every and run.state.step % cfg.eval_every == 0 and run.state.step < cfg.steps:
                    run.eval_during(r, step)
                progress.update(run.end_step(step, r, requests, samples, train_metrics, trained_at=trained_at,
                                             extra=pool.metrics()))
                if run.state.step % cfg.checkpoint_every == 0 or run.state.step == cfg.steps or signals.stop_requested():
                    run.save_checkpoint(r)
                signals.raise_if_stopping(run.state.step)
    finally:
        pool.stop()
    return finish(run, r)
