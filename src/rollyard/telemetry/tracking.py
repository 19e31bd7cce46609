"""Experiment trackers: TensorBoard event files and Weights & Biases, fed from the step metrics.

``Tracking.log(step, row)`` is called once per step by :class:`Telemetry` with the same row that
goes to ``metrics.jsonl``, under the same names: one set everywhere (metrics.jsonl, the console,
TensorBoard, W&B). Where TRL's GRPOTrainer logs the same quantity the name is TRL's (``reward``,
``reward_std``, ``rewards/<fn>/mean``, ``completions/mean_length``, ``learning_rate``, ``kl``, ...);
every other metric has rollyard's (``time/rollout``, ``staleness/max``, ``train/logprob_diff``, ...).
:data:`RENAMED` maps the names rollyard used before to these (``rollyard report`` reads old runs).

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

# The trainer's own metrics under TRL's names; the rest of them are logged as train/<name>.
TRAINER_TRL = {"loss": "loss", "kl": "kl", "entropy": "entropy", "grad_norm": "grad_norm",
               "clip_frac": "clip_ratio/region_mean", "lr": "learning_rate"}

# Compatibility: the names metrics.jsonl used before they became TRL's (per-hook: reward/<fn>/... ->
# rewards/<fn>/...). TensorBoard / W&B logged the new names with HF Trainer's "train/" prefix.
RENAMED = {
    "reward/mean": "reward", "reward/std": "reward_std",
    "length/mean": "completions/mean_length", "length/min": "completions/min_length",
    "length/max": "completions/max_length", "length/clipped_frac": "completions/clipped_ratio",
    "train/lr": "learning_rate", **{f"train/{k}": v for k, v in TRAINER_TRL.items()},
}
KEPT = ("reward/accuracy", "reward/timeouts", "reward/errors", "reward/failed_frac")  # rollyard's, not per hook


def trainer_names(metrics: dict[str, Any]) -> dict[str, Any]:
    """The trainer's step metrics under their logged names (TRL's where it has one, else ``train/<k>``)."""
    return {TRAINER_TRL.get(k, f"train/{k}"): v for k, v in metrics.items()}


def current_names(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row written before the rename, under today's names (a new row is unchanged)."""
    out = {}
    for key, value in row.items():
        if key in RENAMED:
            key = RENAMED[key]
        elif key.startswith("reward/") and key not in KEPT and key.count("/") == 2:
            key = "rewards/" + key.split("/", 1)[1]
        out.setdefault(key, value)
    return out


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in row.items():
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
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
