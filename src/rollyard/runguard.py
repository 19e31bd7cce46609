"""Opening a run directory safely, before any role is built (fresh start or resume).

``open_run`` checks what can be checked without building anything, and changes nothing on disk
until every check passed:

- ``out_dir`` (and, for a warm start, ``sft.cache_dir``) is a writable directory;
- one process per run directory (``rundir.lock``);
- a fresh start does not write over a run; a resume finds a valid checkpoint (``checkpoint.latest``
  reports corrupt ones and falls back) and does not touch a finished run (:class:`RunFinished`);
- on resume, every record file is cut back to the checkpoint's step (torn lines repaired), so the
  resumed session appends each step exactly once: by :func:`cut_back`, which the driver calls only
  once the checkpoint has loaded into the run's model and optimizer. A checkpoint that does not
  load (another model's, a sharded optimizer on other ranks) is refused with the records untouched.

``config.yaml`` is written by the driver only after start-up succeeded, so a failed ``--resume
RUN key=value`` leaves the saved config as it was.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from rollyard import checkpoint
from rollyard.config import ConfigError, RunConfig
from rollyard.model.loading import PRESETS
from rollyard.telemetry import rundir


class RunFinished(Exception):
    """``--resume`` of a run that already ran all its steps: nothing to do, nothing changed."""


def writable_dir(path: str | Path, key: str) -> Path:
    """Create ``path`` if needed and prove a file can be written in it; ConfigError naming ``key`` otherwise."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{key}={p} is a file; expected a directory (choose another {key})")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".rollyard-probe-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{key}={p} is not writable ({e.strerror or e}); choose a directory you can write to") from None
    return p


def open_run(cfg: RunConfig, run_dir: str | Path, resume: bool, log=print) -> Path | None:
    """Check, lock and (on resume) repair ``run_dir``; return the checkpoint to resume from (None: fresh)."""
    run = writable_dir(run_dir, "out_dir")
    if not resume and cfg.sft.auto and cfg.model.name in PRESETS:
        writable_dir(cfg.sft.cache_dir, "sft.cache_dir")  # before the warm start, not after it
    rundir.lock(run)
    try:
        return _open_locked(cfg, run, resume, log)
    except BaseException:
        rundir.unlock(run)
        raise


def _open_locked(cfg: RunConfig, run: Path, resume: bool, log) -> Path | None:
    if not resume:
        if (run / rundir.METRICS).exists() and (run / rundir.METRICS).stat().st_size > 0:
            raise ConfigError(f"run directory {run} already holds a run; pass --resume {run} to continue it, "
                              f"or choose another out_dir")
        return None
    ckpt = checkpoint.latest(run, log=log)
    if ckpt is None:
        raise ConfigError(f"cannot resume {run}: no valid checkpoint under {run / rundir.CHECKPOINTS}; start it "
                          f"again in a new out_dir")
    step = json.loads((ckpt / checkpoint.STATE).read_text())["step"]
    if step >= cfg.steps and (run / rundir.SUMMARY).exists():
        raise RunFinished(f"run {run} is finished ({step} of steps={cfg.steps} done, summary.json written); "
                          f"nothing changed. To train further, resume with a larger steps=N")
    return ckpt


def cut_back(run: Path, ckpt: Path, log=print) -> None:
    """Cut every record file back to checkpoint ``ckpt``'s step (torn lines dropped). Called after the
    checkpoint loaded: a resume that is refused never costs a record."""
    step = json.loads((ckpt / checkpoint.STATE).read_text())["step"]
    dropped = rundir.truncate_records(run, step)
    if dropped:
        log(f"resuming at step {step}: removed records of steps after the checkpoint (or torn lines): "
            + ", ".join(f"{name} {n}" for name, n in dropped.items()))
