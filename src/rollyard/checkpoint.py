"""Atomic checkpoints: model, optimizer, RNG states, step, weight version, dataset cursor.

A checkpoint is written into ``step_NNNNNN.tmp`` and renamed to ``step_NNNNNN`` only when every
file is on disk, so a crash mid-write leaves the previous checkpoint as the latest valid one (a
``.tmp`` directory is never read and is cleaned up by the next save).

Every checkpoint carries ``manifest.json`` (size and SHA-256 of each file), written last. On
resume :func:`latest` checks the newest checkpoint against it; a corrupt or incomplete one (a
truncated model, optimizer or state file, a missing manifest) is reported and the previous valid
checkpoint is used instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rollyard.config import ConfigError
from rollyard.telemetry import rundir

STATE = "state.json"
MODEL = "model.safetensors"
OPTIM = "optimizer.pt"
RNG = "rng.pt"
MANIFEST = "manifest.json"


@dataclass
class TrainState:
    """What besides tensors a resume needs: where the loop was and what it had handed out."""

    step: int = 0                      # next step to run
    version: int = 0                   # weight version of the policy after `step` steps
    cursor: dict[str, Any] = field(default_factory=dict)  # the prompt stream's position
    eval_before: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a read-only or full disk); the message names the fix (the
    CLI prints it as one line, exit 2)."""


def save(run_dir: str | Path, state: TrainState, model, optimizer, keep: int = 2,
         extra_rng: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoint ``state.step`` atomically; keep the newest ``keep``; return its path.
    CheckpointWriteError when the disk refuses it (the previous checkpoint stays the latest valid one)."""
    try:
        return _save(run_dir, state, model, optimizer, keep, extra_rng)
    except OSError as e:
        root = Path(run_dir) / rundir.CHECKPOINTS
        prev = latest(run_dir, log=lambda m: None) if root.is_dir() else None
        resume = (f"then resume from {prev.name} with --resume {run_dir}" if prev is not None
                  else "then start the run again")
        raise CheckpointWriteError(f"cannot write checkpoint step {state.step} under {root} "
                                   f"({e.strerror or e}{f': {e.filename}' if e.filename else ''}); make the run "
                                   f"directory writable (permissions, free space), {resume}") from None


def _save(run_dir: str | Path, state: TrainState, model, optimizer, keep: int,
          extra_rng: dict[str, torch.Tensor] | None) -> Path:
    root = Path(run_dir) / rundir.CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step:06d}"
    tmp = root / f"step_{state.step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    # Tied embeddings share storage; safetensors refuses shared tensors, so clone them apart.
    save_file({k: v.clone() for k, v in tensors.items()}, str(tmp / MODEL))
    torch.save(optimizer.state_dict(), tmp / OPTIM)
    torch.save({**_rng_state(), "extra": extra_rng or {}}, tmp / RNG)
    (tmp / STATE).write_text(json.dumps(asdict(state), indent=1))
    (tmp / MANIFEST).write_text(json.dumps({f.name: _fingerprint(f) for f in sorted(tmp.iterdir())}, indent=1))
    for f in tmp.iterdir():  # make the files durable before the rename publishes them
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(p for p in root.iterdir() if p.name.startswith("step_"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fingerprint(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def verify(path: str | Path) -> str | None:
    """None when checkpoint ``path`` matches its manifest; otherwise what is wrong with it."""
    p = Path(path)
    try:
        manifest = json.loads((p / MANIFEST).read_text())
    except FileNotFoundError:
        return f"{MANIFEST} is missing (the checkpoint is incomplete)"
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name in (STATE, MODEL, OPTIM, RNG):
        if name not in manifest:
            return f"{MANIFEST} does not list {name}"
    for name, want in manifest.items():
        f = p / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {want.get('bytes')} (truncated or overwritten)"
        if _fingerprint(f)["sha256"] != want.get("sha256"):
            return f"{name} does not match its SHA-256 in the manifest (corrupt)"
    return None


def latest(run_dir: str | Path, log=None) -> Path | None:
    """Newest checkpoint that matches its manifest, or None; each newer, invalid one is reported."""
    root = Path(run_dir) / rundir.CHECKPOINTS
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir() if p.name.startswith("step_") and not p.name.endswith(".tmp"))
    for p in reversed(done):
        problem = verify(p)
        if problem is None:
            return p
        msg = f"checkpoint {p} is not usable: {problem}; falling back to the previous checkpoint"
        (log or (lambda m: print(m, file=sys.stderr)))(msg)
    return None


def load(path: str | Path, model, optimizer) -> tuple[TrainState, dict]:
    """Restore model, optimizer and RNG from ``path``; return the TrainState and extra RNG states."""
    p = Path(path)
    state = TrainState(**json.loads((p / STATE).read_text()))
    tensors = load_file(str(p / MODEL))
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # shapes differ: the run's model settings were overridden
        first = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e).splitlines()[0])
        raise ConfigError(f"checkpoint {p} does not match the model ({first}); resume with the run's own model "
                          f"settings (drop model.* overrides)") from None
    missing = [k for k in missing if k not in getattr(model, "_tied_weights_keys", {}) and "lm_head" not in k]
    if missing or unexpected:
        raise ConfigError(f"checkpoint {p} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                          f"resume with the run's own model settings (drop model.* overrides)")
    if "lm_head.weight" not in tensors and hasattr(model, "tie_weights"):
        model.tie_weights()
    optim = torch.load(p / OPTIM, weights_only=False)
    shards = optim.get("rollyard_fsdp_ranks") if isinstance(optim, dict) else None  # trainer/dp.py SHARDED_KEY
    if shards is not None and not getattr(optimizer, "loads_sharded", False):
        raise ConfigError(f"checkpoint {p} holds optimizer state sharded over {len(shards)} FSDP ranks; resume with "
                          f"trainer.dp={len(shards)} trainer.sharding=fsdp")
    optimizer.load_state_dict(optim)
    rng = torch.load(p / RNG, weights_only=False)
    _set_rng_state(rng)
    return state, rng.get("extra", {})
