"""Atomic checkpoints: model, optimizer, RNG states, step, weight version, dataset cursor.

A checkpoint is written into ``step_NNNNNN.tmp`` and renamed to ``step_NNNNNN`` only when every
file is on disk, so a crash mid-write leaves the previous checkpoint as the latest valid one (a
``.tmp`` directory is never read and is cleaned up by the next save). Saving is two parts:
:func:`snapshot` (the state in memory, on the caller's thread) and :func:`write` (the files, their
fsync, the rename, the pruning); ``checkpoint_writer.Writer`` runs the second in the background.

Every checkpoint carries ``manifest.json`` (size and SHA-256 of each file), written last. On
resume :func:`latest` checks the newest checkpoint against it; a corrupt or incomplete one (a
truncated model, optimizer or state file, a missing manifest) is reported and the previous valid
checkpoint is used instead.

A checkpoint is data, never code: the model is safetensors, the state JSON, and the optimizer and
RNG files (tensors, numbers, strings and containers of them) are read with torch's ``weights_only``
unpickler, which refuses any other object before constructing it. The manifest has no key, so it
guards against damage, not against a planted file; the safe loader is what makes a planted
``optimizer.pt`` or ``rng.pt`` harmless (:class:`UnsafeCheckpoint`, one line, nothing runs).
Checkpoints written by older rollyard versions hold the same plain types and load unchanged.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
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


class UnsafeCheckpoint(ConfigError):
    """A checkpoint file holds an object the safe loader refuses to construct (it could run code)."""


def _load_data(path: Path) -> Any:
    """A ``.pt`` file of tensors and plain containers, read with torch's weights-only unpickler: a
    file naming any other class or function (``os.system`` in a planted ``__reduce__``) is refused
    before anything is called. UnsafeCheckpoint (one line) when refused or unreadable."""
    try:
        return torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        what = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[-1] if lines else type(e).__name__)
        raise UnsafeCheckpoint(
            f"refused to load {path}: it holds more than tensors and plain data ({what.rstrip('.')}), and loading it "
            f"could run code; nothing from it was run. Resume only from checkpoints rollyard wrote (delete this "
            f"checkpoint directory to fall back to an earlier one, or start the run again)") from None


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a read-only or full disk); the message names the fix (the
    CLI prints it as one line, exit 2)."""


@dataclass
class Snapshot:
    """One checkpoint held in memory, ready for :func:`write`. Taken with ``copy=True`` it shares no storage with
    the live model and optimizer: an optimizer step taken while it is written cannot reach the files."""

    step: int
    state_json: str                # state.json's text, as the state was when the snapshot was taken
    model: dict[str, torch.Tensor]  # CPU tensors, each with its own storage (safetensors refuses shared ones)
    optim: dict                    # optimizer.state_dict() (its tensors copied to CPU with copy=True)
    rng: dict                      # _rng_state() and the driver's "extra" generators
    need: int                      # bytes it takes on disk: its tensors plus 1 MB (an estimate)


def snapshot(state: TrainState, model, optimizer, extra_rng: dict[str, torch.Tensor] | None = None,
             copy: bool = False) -> Snapshot:
    """Checkpoint ``state.step`` in memory: the model's tensors on CPU, each cloned once (:func:`model_tensors`),
    the optimizer state, the RNG states now and state.json's text. ``copy``: the optimizer state's tensors copied
    to CPU too (a background write: the model and optimizer state held twice in memory while it runs);
    without it they are the optimizer's own, written before the next step."""
    optim = optimizer.state_dict()  # once: with trainer.dp > 1 it is gathered from the ranks
    if copy:
        optim = _cpu_copy(optim)
    tensors = model_tensors(model, copy=copy)
    rng = {**_rng_state(), "extra": _cpu_copy(extra_rng or {}) if copy else (extra_rng or {})}
    need = _tensor_bytes(tensors) + _tensor_bytes(optim) + _tensor_bytes(rng["extra"]) + (1 << 20)
    return Snapshot(state.step, json.dumps(asdict(state), indent=1), tensors, optim, rng, need)


def tied_aliases(model) -> set[str]:
    """Names in ``model.state_dict()`` that are the very tensor of an earlier name and that :func:`load` restores
    by tying (an LM head tied to the input embedding: the model's ``_tied_weights_keys``, or ``lm_head.*``)."""
    tied = getattr(model, "_tied_weights_keys", None) or ()
    seen, out = {}, set()
    for k, v in model.state_dict(keep_vars=True).items():
        key = (v.data_ptr(), v.dtype, tuple(v.shape), v.stride()) if v.numel() else None
        if key is not None and key in seen and (k in tied or k.startswith("lm_head.")):
            out.add(k)
        elif key is not None:
            seen.setdefault(key, k)
    return out


def model_tensors(model, copy: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict as CPU tensors, no two sharing storage (safetensors refuses shared ones), a tied alias
    (:func:`tied_aliases`) left out: :func:`load` ties it back. Gemma 3's 262,144 x 640 head is its embedding: cloned
    twice it was 0.67 GB more in the snapshot (1.74 instead of 1.07 GB of model tensors, held beside the live state
    while a background write runs) and on disk. ``copy``: each cloned into its own storage (a background write);
    without it a contiguous CPU tensor alone on its storage is the live tensor itself (a write that ends before the
    model changes: :func:`save`), any other copied."""
    skip, out, seen = tied_aliases(model), {}, set()
    for k, v in model.state_dict().items():
        if k in skip:
            continue
        v = v.detach()
        own = (not copy and v.device.type == "cpu" and v.is_contiguous() and v.storage_offset() == 0
               and v.untyped_storage().nbytes() == v.nelement() * v.element_size()
               and v.untyped_storage().data_ptr() not in seen)
        out[k] = v if own else v.to("cpu", copy=True).contiguous()
        seen.add(out[k].untyped_storage().data_ptr())
    return out


def _cpu_copy(obj: Any) -> Any:
    """``obj`` with every tensor copied to CPU memory and every container rebuilt (numbers, strings kept)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def save(run_dir: str | Path, state: TrainState, model, optimizer, keep: int = 2,
         extra_rng: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoint ``state.step`` atomically, now (:func:`snapshot` then :func:`write`); return its path."""
    return write(run_dir, snapshot(state, model, optimizer, extra_rng), keep)


def write(run_dir: str | Path, snap: Snapshot, keep: int = 2) -> Path:
    """Write ``snap`` atomically; keep the newest ``keep`` (pruned only once the new one is published); return
    its path. Any thread may call it (the background writer does), one write at a time per run directory.

    CheckpointWriteError when the disk refuses it: a full disk (torch.save says so as a RuntimeError,
    safetensors as its own error, plain writes as ENOSPC) names the directory, the bytes the checkpoint
    needs and the bytes free. Whatever failed, ``step_N.tmp`` is removed and the previous checkpoint
    stays the latest valid one."""
    root = Path(run_dir) / rundir.CHECKPOINTS
    tmp = root / f"step_{snap.step:06d}.tmp"
    try:
        return _write(root, tmp, snap, keep)
    except Exception as e:  # any write failure is classified below, anything else re-raised
        written = _tree_bytes(tmp)
        free = _free_bytes(root)  # before the partial write is removed: what was left when it failed
        shutil.rmtree(tmp, ignore_errors=True)
        full = _is_disk_full(e) or (free is not None and free < snap.need - written)
        if not full and not isinstance(e, OSError):
            raise
        raise CheckpointWriteError(_write_error_line(run_dir, root, snap.step, e, full, snap.need)) from None


def write_failed(run_dir: str | Path, step: int, err: BaseException) -> CheckpointWriteError:
    """The one-line error for a write of checkpoint ``step`` that failed with ``err`` (no disk error: a bug, a
    library's own error), naming the checkpoint to resume from."""
    root = Path(run_dir) / rundir.CHECKPOINTS
    shutil.rmtree(root / f"step_{step:06d}.tmp", ignore_errors=True)
    return CheckpointWriteError(_write_error_line(run_dir, root, step, OSError(f"{type(err).__name__}: {err}"),
                                                  False, 0))


def _write_error_line(run_dir, root: Path, step: int, err: BaseException, full: bool, need: int) -> str:
    prev = latest(run_dir, log=lambda m: None) if root.is_dir() else None
    resume = (f"then resume from {prev.name} with --resume {run_dir}" if prev is not None
              else "then start the run again")
    if full:
        free = _free_bytes(root)
        return (f"the disk is full: checkpoint step {step} needs about {_mb(need)} under {root}, "
                f"{_mb(free) if free is not None else 'an unknown amount'} is free; free space there (or set "
                f"keep_checkpoints lower, or out_dir on a larger disk), {resume}")
    e = err if isinstance(err, OSError) else OSError(str(err))
    return (f"cannot write checkpoint step {step} under {root} "
            f"({e.strerror or e}{f': {e.filename}' if e.filename else ''}); make the run "
            f"directory writable (permissions, free space), {resume}")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB ({n} bytes)"


def _is_disk_full(e: BaseException) -> bool:
    """ENOSPC / EDQUOT, or a library that wraps it in its own error text (safetensors' "No space left")."""
    return ((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
            or "No space left on device" in str(e) or "Disk quota exceeded" in str(e))


def _free_bytes(path: Path) -> int | None:
    """Bytes free to this process under ``path`` (its nearest existing ancestor), None if unknown."""
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def _tensor_bytes(obj: Any) -> int:
    if torch.is_tensor(obj):
        return obj.nelement() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _write(root: Path, tmp: Path, snap: Snapshot, keep: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / tmp.name.removesuffix(".tmp")
    for stale in root.glob("step_*.tmp"):  # left by a process killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    save_file(snap.model, str(tmp / MODEL))
    snap.model = {}  # a background write's copies let go of as each file is written, not after the hashing and fsync
    torch.save(snap.optim, tmp / OPTIM)
    snap.optim = {}
    torch.save(snap.rng, tmp / RNG)
    (tmp / STATE).write_text(snap.state_json)
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


def resume_hint(run_dir: str | Path) -> str:
    """``"the latest checkpoint is step_000004: resume with rollyard train --resume RUN_DIR"``. Said once the run's
    checkpoint write in flight has settled (``RunRecord.settle_checkpoint``), or it names the one before."""
    ckpt = latest(run_dir, log=lambda m: None)
    where = f"the latest checkpoint is {ckpt.name}" if ckpt else "no checkpoint was written yet (the run restarts)"
    return f"{where}: resume with rollyard train --resume {run_dir}"


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
    optim = _load_data(p / OPTIM)
    shards = optim.get("rollyard_fsdp_ranks") if isinstance(optim, dict) else None  # trainer/dp.py SHARDED_KEY
    if shards is not None and not getattr(optimizer, "loads_sharded", False):
        raise ConfigError(f"checkpoint {p} holds optimizer state sharded over {len(shards)} FSDP ranks; resume with "
                          f"trainer.dp={len(shards)} trainer.sharding=fsdp")
    optimizer.load_state_dict(optim)
    rng = _load_data(p / RNG)
    _set_rng_state(rng)
    return state, rng.get("extra", {})
