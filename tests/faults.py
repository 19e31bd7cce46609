"""Fault injection for tests/test_reliability.py: every fault the suite drives, by name, in one place.

No core loop knows about these. Each fault enters through an interface a real failure would use:

- ``verify_then(...)`` hooks: reward hooks (loaded by file path in the reward workers, like any
  user hook) that score like the built-in arithmetic verifier and, at the Nth call of the run
  (counted in a file, so it is exact with ``reward.num_workers=1``), inject a fault from outside
  the trainer: ``kill_trainer`` sends SIGKILL to the training process (the worker's parent),
  ``term_trainer`` SIGTERM, ``int_trainer`` SIGINT, ``kill_dp_rank`` SIGKILLs a data-parallel trainer
  rank (the training process's spawned child). Set ``ROLLYARD_FAULT_DIR`` and
  ``ROLLYARD_FAULT_AT`` in the environment of the run; without them the hooks only score.
- reward hooks that misbehave on every call: ``always_raise``, ``returns_none``, ``hangs``,
  ``overflow_f32`` (1e39: finite in float64, infinite in float32), ``huge`` (1e308), ``exit_on_import``
  is a separate file (``hook_exits_on_import.py``) because it fails at import.
- ``kill_reward_worker()``: SIGKILL one live reward worker process of this process (found in /proc).
- ``truncate(path)`` / ``corrupt(path)``: damage a checkpoint or record file on disk.
- ``nan_in_training(dir)``: a model directory whose training forward is NaN (rollout unaffected).
- ``dying_worker(moment, marker)``: a rollout actor class (the Ray placements' ``worker`` test
  hook) that kill -9s its own process at a named moment: decoding, mid-sync, between syncs, or
  at every start (a crash loop).
- ``stalling_worker(marker, spin_s)``: a rollout actor class whose loop stops inside a decode step: once
  computing for ``spin_s`` seconds (a long prefill: a core busy) and going on, then, after another sync,
  blocked for good (a deadlock: its process idle).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from rollyard.reward.verifiers import arithmetic

HERE = Path(__file__).resolve().parent
HOOKS = str(HERE / "faults.py")


# ------------------------------------------------------------------ faults at the Nth reward call
def _nth_call() -> int | None:
    """Count this call in $ROLLYARD_FAULT_DIR/calls; return the count, or None when no fault is armed."""
    folder = os.environ.get("ROLLYARD_FAULT_DIR")
    if not folder:
        return None
    fd = os.open(os.path.join(folder, "calls"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b".")
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _signal_parent_at(signum: int) -> None:
    n = _nth_call()
    if n is not None and n == int(os.environ["ROLLYARD_FAULT_AT"]):
        os.kill(os.getppid(), signum)
        if signum == signal.SIGKILL:
            time.sleep(2)  # the worker goes with its parent; never answer this call


def kill_trainer(completion, prompt, meta):
    _signal_parent_at(signal.SIGKILL)
    return arithmetic(completion, prompt, meta)


def term_trainer(completion, prompt, meta):
    _signal_parent_at(signal.SIGTERM)
    return arithmetic(completion, prompt, meta)


def int_trainer(completion, prompt, meta):
    _signal_parent_at(signal.SIGINT)
    return arithmetic(completion, prompt, meta)


# ---------------------------------------------------------------- hooks that fail on every call
def _sibling_dp_rank(parent: int) -> int | None:
    """A data-parallel trainer rank started by ``parent`` (a spawned multiprocessing child), from /proc."""
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"multiprocessing.spawn" in cmd:
            return int(entry)
    return None


def kill_dp_rank(completion, prompt, meta):
    """At the Nth call, SIGKILL a dp trainer rank of the training process (this worker's parent)."""
    n = _nth_call()
    if n is not None and n == int(os.environ["ROLLYARD_FAULT_AT"]):
        os.kill(_sibling_dp_rank(os.getppid()), signal.SIGKILL)
    return arithmetic(completion, prompt, meta)


def always_raise(completion, prompt, meta):
    raise RuntimeError("verifier exploded")


def returns_none(completion, prompt, meta):
    return None


def hangs(completion, prompt, meta):
    time.sleep(60)
    return 1.0


def overflow_f32(completion, prompt, meta):
    return 1e39 if len(completion) % 2 else 0.0


def huge(completion, prompt, meta):
    return 1e308


def allocate_gb(completion, prompt, meta):
    block = bytearray(1 << 30)  # past reward.memory_mb: MemoryError in the worker
    return float(len(block) > 0)


def spin(completion, prompt, meta):
    while True:
        pass


def writes_cwd(completion, prompt, meta):
    Path("scratch.txt").write_text("a hook's files land in its private working directory")
    return 1.0 if Path.cwd().name.startswith("worker-") else 0.0


# ------------------------------------------------------------------------ faults from outside
def reward_worker_pids() -> list[int]:
    """Live reward worker processes whose parent is this process (from /proc)."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and b"reward/worker.py" in cmd:
            out.append(int(entry))
    return out


def kill_reward_worker(spare: set[int] = frozenset()) -> int:
    """SIGKILL one reward worker of this process that is not in ``spare``; return its pid."""
    pid = next(p for p in reward_worker_pids() if p not in spare)
    os.kill(pid, signal.SIGKILL)
    return pid


def truncate(path: str | Path, keep: float = 0.5) -> None:
    """Cut ``path`` to ``keep`` of its size (a crash mid-write, a full disk)."""
    p = Path(path)
    with open(p, "r+b") as f:
        f.truncate(int(p.stat().st_size * keep))


def corrupt(path: str | Path, offset: int = 200) -> None:
    """Flip bytes in the middle of ``path`` without changing its size (bit rot, a bad copy)."""
    p = Path(path)
    data = bytearray(p.read_bytes())
    for i in range(offset, min(offset + 16, len(data))):
        data[i] ^= 0xFF
    p.write_bytes(bytes(data))


def slow(completion, prompt, meta):
    time.sleep(1.0)
    return 1.0


def nan_in_training(path: str | Path) -> Path:
    """A tiny-preset model directory whose *training* forward is NaN and whose rollout is fine.

    Its config.json sets ``final_logit_softcapping`` to NaN: the trainer applies that soft cap to
    its logits (Gemma-2 style), the rollout engine and the Llama architecture do not. Every
    optimizer step of a run on it sees a NaN loss.
    """
    from rollyard.model.loading import build_preset, char_tokenizer, export

    tok = char_tokenizer()
    out = export(build_preset("tiny", tok, max_position_embeddings=48), tok, path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["final_logit_softcapping"] = float("nan")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# ------------------------------------------------------------------ rollout actors that die (kill -9)
MOMENTS = ("decoding", "mid_sync", "between_syncs", "always")


def dying_worker(moment: str, marker: str | Path, from_version: int = 2) -> type:
    """A rollout actor class (the placements' ``worker`` test hook) that SIGKILLs its own process
    once weights of version ``>= from_version`` are involved, at ``moment``:

    - ``decoding``: right after a decode step, with sequences in flight;
    - ``mid_sync``: with an update half-received: over ``dist`` after the broadcast's size prefix
      (the trainer is mid-broadcast), over ``ray`` after the object arrived, before the swap;
    - ``between_syncs``: idle, holding the weights of the last sync, nothing decoding;
    - ``always``: while decoding, every time (a crash loop).

    It dies once per run: the first to die writes ``marker``; the replacement (same class) sees it.
    """
    from rollyard.placement.rollout_actor import RolloutWorker

    if moment not in MOMENTS:
        raise ValueError(f"moment must be one of {MOMENTS}, got {moment!r}")
    marker = str(marker)

    def die(self) -> None:
        if moment != "always":
            if os.path.exists(marker):
                return
            Path(marker).write_text(json.dumps({"pid": os.getpid(), "version": self.engine.version,
                                                "active": self.engine.num_active}))
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)

    class Dying(RolloutWorker):
        def poll(self):
            super().poll()
            if self.engine.version < from_version:
                return
            if moment in ("decoding", "always") and self.engine.num_active:
                die(self)
            if moment == "between_syncs" and not self.engine.num_active and not self.engine.num_queued:
                die(self)

        def pull(self, *args):
            if moment == "mid_sync" and self.engine.version + 1 >= from_version and not os.path.exists(marker):
                import torch
                self.link.group.broadcast(torch.zeros(2, dtype=torch.int64), 0)  # the size prefix, then die
                die(self)
            return super().pull(*args)

        def _apply(self, u):
            if moment == "mid_sync" and u.version >= from_version:
                die(self)
            super()._apply(u)

    Dying.__name__ = Dying.__qualname__ = f"RolloutWorker_dies_{moment}"
    return Dying


def corrupting_worker(from_version: int = 2) -> type:
    """A rollout actor class (the placements' ``worker`` test hook) whose engine weights go bad right
    after it applies the update of version ``from_version``: one weight tensor is nudged by 1e-3, as a
    silently failed load or a bit flip would leave it. It keeps sampling. Silently: the engine's guard against
    in-place edits (its stamp of the parameters' version counters) is re-stamped, as a bit flip would not
    move those counters; else that guard stops the worker first, at a time that races the weight check. The
    corruption is part of applying that version: the weight check's checksum (a control thread, which waits for
    the engine to report the version) waits for it too, else it could hash the weights in the moment between the
    engine taking the version and the nudge (seen once on a loaded machine: the run ended unchecked)."""
    import time

    from rollyard.placement.rollout_actor import RolloutWorker

    class Corrupting(RolloutWorker):
        def _apply(self, u):
            super()._apply(u)
            if self.engine.version == from_version and not getattr(self, "_corrupted", False):
                import torch
                with torch.no_grad():
                    next(self.engine.model.parameters()).add_(1e-3)
                self.engine._stamp = self.engine._param_versions()
                self._corrupted = True

        def checksum(self, version: int, timeout_s: float = 120.0):
            deadline = time.time() + timeout_s
            while version >= from_version and not getattr(self, "_corrupted", False) and time.time() < deadline:
                time.sleep(0.005)
            return super().checksum(version, timeout_s)

    Corrupting.__name__ = Corrupting.__qualname__ = f"RolloutWorker_corrupts_v{from_version}"
    return Corrupting


def stale_worker(from_version: int = 1) -> type:
    """A rollout actor class that stops taking weights at ``from_version``: it reports every later
    version as applied but keeps sampling from the weights it held (the failure other frameworks'
    users report most: an engine silently sampling from old weights while the run exits 0)."""
    from rollyard.placement.rollout_actor import RolloutWorker

    class Stale(RolloutWorker):
        def _apply(self, u):
            if u.version < from_version:
                return super()._apply(u)
            self.engine.version = max(self.engine.version, u.version)  # claims it, loads nothing

    Stale.__name__ = Stale.__qualname__ = f"RolloutWorker_stale_from_v{from_version}"
    return Stale


# ------------------------------------------------------------------------------ a disk that fills
def slow_checkpoint_writes(seconds: float) -> None:
    """Every background checkpoint write of this process starts ``seconds`` late (a slow disk): a fault that
    lands meanwhile finds the write in flight. For a ``rollyard train`` subprocess (``python -c``)."""
    from rollyard import checkpoint_writer
    run = checkpoint_writer.Writer._run

    def late(self, *args):
        time.sleep(seconds)
        run(self, *args)

    checkpoint_writer.Writer._run = late


def disk_fills_after(monkeypatch, saves: int) -> None:
    """The disk fills after ``saves`` calls of ``torch.save``: every later call writes into ``/dev/full``,
    so the kernel answers ENOSPC and torch raises what it raises on a real full disk (a RuntimeError
    that does not name ENOSPC), and ``shutil.disk_usage`` reports 4096 bytes free. Entered through
    the two library calls a real full disk goes through; ``monkeypatch.undo()`` frees the space."""
    import shutil

    import torch

    real_save, real_usage, calls = torch.save, shutil.disk_usage, []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        return real_save(obj, "/dev/full" if len(calls) > saves else f, *args, **kwargs)

    def usage(path):
        total, used, _ = real_usage(path)
        return shutil._ntuple_diskusage(total, used, 4096) if len(calls) > saves else real_usage(path)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(shutil, "disk_usage", usage)


def stalling_worker(marker: str | Path, spin_s: float, spin_at: int = 1, block_at: int = 2) -> type:
    """A rollout actor class whose loop stalls inside a decode step with sequences in flight: once on weights of
    version ``>= spin_at`` computing for ``spin_s`` seconds (a core busy, as a long prefill) and going on, then on
    weights of version ``>= block_at`` blocked for good (sleeping: its process spends no CPU, as a deadlock).
    ``marker`` records each stall: ``{"spun": {version, active}, "blocked": {...}}``."""
    from rollyard.placement.rollout_actor import RolloutWorker

    marker = str(marker)

    def blocked() -> None:  # defined here: Ray ships the class by value, and the actor cannot import this module
        """Never returns, spending no CPU (a wait on a lock nobody releases, as a deadlock would)."""
        while True:
            time.sleep(1.0)

    def record(what: str, engine) -> None:
        seen = json.loads(Path(marker).read_text()) if os.path.exists(marker) else {}
        Path(marker).write_text(json.dumps({**seen, what: {"version": engine.version, "active": engine.num_active}}))

    class Stalling(RolloutWorker):
        spun = False

        def _step(self):
            v, active = self.engine.version, self.engine.num_active
            if active and v >= block_at:
                record("blocked", self.engine)
                blocked()
            if active and v >= spin_at and not self.spun:
                self.spun = True
                record("spun", self.engine)
                end = time.monotonic() + spin_s
                while time.monotonic() < end:
                    sum(i * i for i in range(10_000))
            super()._step()

    Stalling.__name__ = Stalling.__qualname__ = "RolloutWorker_stalls"
    return Stalling
