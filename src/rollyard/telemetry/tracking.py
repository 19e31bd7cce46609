"""Experiment trackers: TensorBoard event files and Weights & Biases, fed from the step metrics.

``Tracking.log(step, row)`` is called once per step by :class:`Telemetry` with the same row that
goes to ``metrics.jsonl``. Names a TRL user knows are used where rollyard has the same quantity
(``train/reward``, ``train/reward_std``, ``train/rewards/<fn>/mean``, ``train/completions/mean_length``,
``train/learning_rate``, ``train/frac_reward_zero_std``, ...; HF Trainer's ``train/`` prefix); every
other metric keeps its rollyard name (``time/rollout``, ``staleness/max``, ...).

TensorBoard writes ``RUN_DIR/tensorboard/events.out.tfevents.*``. W&B runs offline unless
``WANDB_MODE`` says otherwise (no login, no network); its files go to ``RUN_DIR/wandb/`` and
``wandb sync`` uploads them later. Both are optional packages (``rollyard[tracking]``): asking for
one that is not installed is a config error at start-up.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any

from rollyard.config import LogConfig, require_package

TENSORBOARD_DIR = "tensorboard"

# rollyard metric -> TRL GRPOTrainer name (logged under HF Trainer's "train/" prefix).
TRL_NAMES = {
    "reward/mean": "reward",
    "reward/std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "length/mean": "completions/mean_length",
    "length/min": "completions/min_length",
    "length/max": "completions/max_length",
    "length/clipped_frac": "completions/clipped_ratio",
    "train/kl": "kl",
    "train/entropy": "entropy",
    "train/grad_norm": "grad_norm",
    "train/loss": "loss",
    "train/lr": "learning_rate",
    "train/clip_frac": "clip_ratio/region_mean",
}


def tracked_name(key: str) -> str:
    """The name ``key`` is logged under: TRL's where one exists (per-hook rewards included), else its own."""
    if key in TRL_NAMES:
        return "train/" + TRL_NAMES[key]
    if key.startswith("reward/") and key.count("/") == 2 and key.rsplit("/", 1)[1] in ("mean", "std"):
        return "train/rewards/" + key.split("/", 1)[1]  # reward/<fn>/mean -> train/rewards/<fn>/mean
    return key


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in row.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[tracked_name(key)] = float(value)
    return out


class Tracking:
    """The trackers ``log`` asks for; ``log(step, row)`` per step, ``close()`` at the end."""

    def __init__(self, run_dir: str | Path, log: LogConfig, config: dict[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self._tb = self._wandb = None
        if log.tensorboard:
            require_package("tensorboard", "tracking", "log.tensorboard=true")
            tb = require_package("torch.utils.tensorboard", "tracking", "log.tensorboard=true")
            self._tb = tb.SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR))
        if log.wandb:
            wandb = require_package("wandb", "tracking", "log.wandb=true")
            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(project=log.wandb_project, dir=str(self.run_dir), name=self.run_dir.name,
                                     config=config or {}, resume="allow", id=_wandb_id(self.run_dir))

    @property
    def active(self) -> bool:
        return self._tb is not None or self._wandb is not None

    def log(self, step: int, row: dict[str, Any]) -> None:
        values = _numbers(row)
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def completions(self, step: int, records: list[dict[str, Any]]) -> None:
        """Sampled completions as a table (TRL's ``log_completions``): TensorBoard text, a W&B Table."""
        columns = ["step", "prompt", "completion", "reward"]
        rows = [[r["step"], r["prompt"], r["completion"], r["reward"]] for r in records]
        if self._tb is not None:
            cell = lambda x: str(x).replace("|", "\\|").replace("\n", "\\n")  # noqa: E731 - markdown table cell
            table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            table += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
            self._tb.add_text("completions", "\n".join(table), global_step=step)
        if self._wandb is not None:
            import wandb
            self._wandb.log({"completions": wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _wandb_id(run_dir: Path) -> str:
    """A stable W&B run id per run directory, so a resumed run continues the same W&B run."""
    return hashlib.blake2b(str(run_dir.resolve()).encode(), digest_size=8).hexdigest()


def completion_records(step: int, samples: list, tokenizer) -> list[dict[str, Any]]:
    """One ``completions.jsonl`` record per sample: prompt, completion, reward (and per hook), version."""
    return [{"step": step, "id": s.id, "prompt": (s.meta or {}).get("prompt"),
             "completion": tokenizer.decode(s.completion_ids, skip_special_tokens=True),
             "reward": s.reward, "rewards": list(s.reward_parts), "version": s.version,
             "finish_reason": s.finish_reason} for s in samples]
