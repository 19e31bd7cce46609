"""Reward dispatcher: verifiers run in long-lived worker processes, each call under a timeout.

A verifier is one or more weighted hooks in any of the forms ``hooks.py`` accepts, each named by a
``"module:function"`` or ``"path/to/file.py:function"`` path. The dispatcher validates the hooks in
the parent when it is built (a hook that does not import is a :class:`HookError` before the first
step, not an hour in), decodes completions in the parent, and ships only strings and ``meta`` to
the workers; each worker imports the hooks itself by the same paths and calls every hook on a
sample. The sample's reward is the weighted sum (``hooks.combine``); its per-hook values are in
``sample.reward_parts``; ``reward is None`` when no hook scored it (TRL's ``None``).

Nothing a verifier does stops the run:
  - it raises: reward 0, ``reward_flag = "error: <ExcType>: <msg>"``;
  - it runs past ``timeout_s``: reward 0, ``reward_flag = "timeout"``; its worker (and anything the
    worker started) is killed and replaced, so the pool keeps its size;
  - its worker dies (segfault, ``os._exit``): reward 0, ``reward_flag = "error: worker died (...)"``,
    and a replacement starts;
  - it returns something that is not a finite number (in float32, the dtype advantages are computed
    in: 1e39 is not): reward 0, an ``error: TypeError/ValueError`` flag;
  - it times out on the first ``max(num_workers, 2)`` calls of a batch (at least two different
    prompts) without answering any: the batch's remaining queued samples are flagged ``timeout`` without
    running, so a hook that hangs on everything costs about one timeout per step, not one per
    sample (``score`` interleaves the prompts' samples so the first calls in flight are of different
    prompts); a hook that answers some calls (hangs on some inputs only) never trips this. The next
    batch tries again.
``stats`` counts them (``scored``, ``timeouts``, ``errors``, ``worker_restarts``).

Isolation (see :func:`rollyard.reward.worker.isolate`): each worker runs in its own session, in a
temporary working directory (removed by ``close``), with an address-space limit of ``memory_mb`` and
a CPU-time limit of ``cpu_s`` per call (past the memory limit the call fails with MemoryError; past
the CPU limit the worker is killed and the call flagged ``error: worker died (killed by SIGXCPU)``). Not isolated: the filesystem outside the working directory, the network,
processes the hook starts (they are killed with the worker's process group, but their CPU time is
not limited), and the parent's import of the hook at start-up (it validates the path).

Workers are started as ``python rollyard/reward/worker.py``: a fresh interpreter that imports the
standard library and the hook's module only (not torch, not the parent's ``__main__``), so start
cost is the interpreter start plus the hook's own imports. The processes, their pipes and their
restarts are ``pool.py``'s :class:`WorkerPool`; this module decides what each call scores, when it
has run too long and what its outcome is. A background thread feeds the pool, so ``submit`` returns
at once and verification overlaps whatever the caller does next.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rollyard.reward import hooks
from rollyard.reward.pool import Worker, WorkerPool, describe_exit
from rollyard.tasks.base import HookError

if TYPE_CHECKING:
    from rollyard.types import Sample


def load_hook(path: str) -> Callable:
    """Resolve ``"module:function"`` or ``"path/to/file.py:function"`` to the callable; :class:`HookError` otherwise."""
    return hooks.load(path)[0]


UNSCORED = "no reward hook scored it (every hook returned None)"


def split_unscored(samples: list["Sample"]) -> tuple[list["Sample"], list["Sample"]]:
    """``(scored, unscored)``: a sample no hook scored (``reward is None``) is left out of the loss."""
    return [s for s in samples if s.reward is not None], [s for s in samples if s.reward is None]


# --------------------------------------------------------------------------------------- dispatcher
@dataclass
class _Job:
    """One call to a worker: the samples it scores (one, or a GRPO group when a hook is batched)."""

    seqs: list[int]
    samples: list[Any]
    items: list[hooks.Item]  # (completion, prompt, meta, completion_ids) per sample: what the worker gets
    state: dict = field(default_factory=dict)  # the trainer state TRL functions get (global_step, max_steps)

    @property
    def seq(self) -> int:
        return self.seqs[0]


def _finite_f32(x: float) -> bool:
    """Finite and within float32 range (advantages are computed in float32)."""
    return isinstance(x, (int, float)) and abs(float(x)) <= 3.4028234663852886e38


def _within_f32(outcome: tuple) -> tuple:
    """A scored ``(reward, flag, parts)`` whose reward is not finite in float32 becomes an error (reward 0)."""
    reward, flag, parts = outcome
    if flag is None and reward is not None and not _finite_f32(reward):
        return 0.0, (f"error: ValueError: reward {reward!r} is not finite in float32 (|reward| must be "
                     f"< 3.4e38)"), parts
    return outcome


def _interleave(samples: list) -> list:
    """Round-robin over request ids: the first samples sent are of different prompts."""
    groups: dict[Any, list] = {}
    for s in samples:
        groups.setdefault(getattr(s, "request_id", None), []).append(s)
    out, lists = [], list(groups.values())
    for i in range(max((len(g) for g in lists), default=0)):
        out += [g[i] for g in lists if i < len(g)]
    return out


def _percentile(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return 0.0
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


class RewardDispatcher:
    """Score samples with ``hook`` in ``num_workers`` worker processes, ``timeout_s`` per call.

    ``decode(ids) -> str`` turns ``completion_ids`` (trailing ``eos_token_id`` removed when given)
    into the completion text, in the parent; the prompt text is ``meta["prompt"]`` when present,
    else ``decode(prompt_ids)``. ``submit`` queues a sample, ``results`` yields finished samples as
    they complete, ``score`` does both for a list and returns it in input order. Samples are
    updated in place (``reward``, ``reward_flag``, ``reward_parts``, ``reward_extras``). Use as a
    context manager or call ``close``.

    ``columns`` (``data.fields``: rollyard name -> dataset column) puts a renamed column back under
    its own name too, so one dataset serves both forms: ``{ground_truth: answer}`` gives
    ``compute_score`` its ground truth and TRL functions still get ``answer``. ``trainer_state``
    (``global_step``, ``max_steps``) is what TRL functions get as ``trainer_state``; the run sets it.
    """

    def __init__(self, hook: str | list[str], *, num_workers: int = 2, timeout_s: float = 5.0,
                 decode: Callable[[list[int]], str], eos_token_id: int | list[int] | None = None,
                 start_timeout_s: float = 60.0, weights: list[float] | None = None, memory_mb: int = 0,
                 cpu_s: float = 0.0, timeout_policy: Any = None, columns: dict[str, str] | None = None):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        paths = [hook] if isinstance(hook, str) else list(hook)
        self.weights = [1.0] * len(paths) if weights is None else [float(w) for w in weights]
        if not paths or len(self.weights) != len(paths):
            raise ValueError(f"{len(paths)} reward hooks and {len(self.weights)} weights: give one weight per hook")
        self.hook = hook if isinstance(hook, str) else ", ".join(paths)
        self.names = hooks.names_of(paths)
        loaded = [hooks.load(p) for p in paths]  # HookError here, in the parent, before any worker starts
        self.forms = [form for _, _, form in loaded]
        self._spec = [(spec, form) for _, spec, form in loaded]
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        # Optional adaptive per-call timeout (reward/timeout.py): .timeout(meta) -> s, .observe(meta, s).
        self.timeout_policy = timeout_policy
        self._workdir = tempfile.mkdtemp(prefix="rollyard-reward-")  # each worker gets a subdirectory
        self._hung: list | None = []  # request ids of this batch's timeouts while no call answered; None: one did
        self._decode = decode
        self._restore = {name: col for name, col in (columns or {}).items()
                         if name not in ("prompt", "id", "demo") and "." not in col and col != name}
        self.trainer_state: dict[str, int] = {"global_step": 0, "max_steps": 0}
        self._eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        self._stats: dict[str, float] = {
            "scored": 0, "timeouts": 0, "errors": 0, "latency_p50_s": 0.0, "latency_p99_s": 0.0, "verify_p50_s": 0.0,
        }
        self._cond = threading.Condition()
        self._pending: deque[_Job] = deque()
        self._done: OrderedDict[int, Any] = OrderedDict()
        self._outstanding = 0
        self._seq = 0
        self._latencies: list[float] = []
        self._verify: list[float] = []
        self._stop = False
        self._closed = False
        self._crash: BaseException | None = None
        weakref.finalize(self, shutil.rmtree, self._workdir, True)
        init = {"hooks": self._spec, "sys_path": [p or os.getcwd() for p in sys.path], "workdir": self._workdir,
                "memory_mb": int(memory_mb), "cpu_s": float(cpu_s)}
        try:  # HookError when a worker cannot import the hooks
            self._pool = WorkerPool(init, num_workers, start_timeout_s=start_timeout_s,
                                    label=f"reward hook {self.hook!r}")
        except BaseException:
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise
        self._thread = threading.Thread(target=self._loop, name="rollyard-reward-dispatcher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------ public API
    @property
    def stats(self) -> dict[str, float]:
        """``scored``, ``timeouts``, ``errors``, ``worker_restarts``, ``worker_start_s`` and the last batch's
        latency percentiles (``latency_p50_s``, ``latency_p99_s``, ``verify_p50_s``)."""
        return {**self._stats, "worker_restarts": self._pool.restarts, "worker_start_s": self._pool.start_s}

    @property
    def _workers(self) -> list[Worker]:
        return self._pool.workers

    def submit(self, sample: "Sample") -> None:
        """Queue ``sample`` for scoring; returns at once."""
        self._submit([sample])

    def results(self) -> Iterator["Sample"]:
        """Yield submitted samples as they finish (any order) until none is outstanding."""
        while True:
            with self._cond:
                while not self._done and self._outstanding > 0:
                    self._wait()
                if not self._done:
                    self._batch_stats()
                    return
                _, sample = self._done.popitem(last=False)
                self._outstanding -= 1
            yield sample

    def poll(self) -> list[Sample]:
        """The submitted samples finished since the last call (any order); never blocks."""
        with self._cond:
            self._raise_if_crashed()
            out = list(self._done.values())
            self._done.clear()
            self._outstanding -= len(out)
        return out

    def score(self, samples: list["Sample"]) -> list["Sample"]:
        """Score ``samples`` and return them (the same objects, rewards set) in input order.

        With a TRL-form (batched) hook, the whole list is one call, as TRL calls its reward functions
        once per step (its timeout is ``timeout_s`` per GRPO group it holds); otherwise each sample is
        its own call (its own timeout), the prompts' samples interleaved so that the first calls in
        flight are of different prompts.
        """
        batches = ([samples] if samples else []) if "trl" in self.forms else [[s] for s in _interleave(samples)]
        seqs = [seq for batch in batches for seq in self._submit(batch)]
        with self._cond:
            for seq in seqs:
                while seq not in self._done:
                    self._wait()
            for seq in seqs:
                del self._done[seq]
            self._outstanding -= len(seqs)
            self._batch_stats()
        return samples

    def dry_run(self, prompt: str, meta: dict, prompt_ids: list[int] | None = None) -> None:
        """Call every hook once on a sample of this prompt with an empty completion, before training.

        :class:`HookError` (one line) when a call cannot work on any sample: the signature does not
        take the keywords its form passes (TRL: prompts, completions, completion_ids, trainer_state
        and the dataset's columns), ``compute_score`` gets no ground truth, or a TRL function does not
        return one value per completion. Anything else (a raise, a value that is not a number) may
        depend on the input: it is flagged per call during the run, as always.
        """
        from rollyard.types import Sample

        probe = Sample(id="dry-run#0", request_id="dry-run", prompt_ids=list(prompt_ids or []), completion_ids=[],
                       logprobs=[], versions=[0], finish_reason="stop", meta={**meta, "prompt": prompt})
        [s] = self.score([probe])
        flag = s.reward_flag or ""
        fatal = ("SignatureError: ", "MissingGroundTruth: ", "TypeError: a TRL-style reward function must return ")
        if any(f in flag for f in fatal):
            self.close()
            raise HookError(f"reward function {self.hook!r} fails on the first dataset sample before training: "
                            f"{flag.removeprefix('error: ')}")

    def close(self) -> None:
        """Stop the feeder thread and the workers (idempotent). Unfinished submissions are flagged."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._stop = True
            self._pool.stopping = True
        self._pool.wake()
        if getattr(self, "_thread", None) is not None:
            self._thread.join(timeout=10)
        with self._cond:
            leftovers = list(self._pending) + [w.job for w in self._workers if w.job is not None]
            self._pending.clear()
        for job in leftovers:
            self._finish(job, 0.0, "error: dispatcher closed before this sample was scored", "error")
        for w in self._workers:
            w.job = None
        self._pool.close()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> "RewardDispatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------- submission
    def _submit(self, samples: list) -> list[int]:
        """Queue ``samples`` as one call; a sample that cannot be decoded is flagged at once instead."""
        if self._closed:
            raise RuntimeError("RewardDispatcher is closed")
        with self._cond:
            self._raise_if_crashed()
            if self._outstanding == 0:
                self._hung = []  # a new batch: a hook that hung on the last one gets tried again
            seqs = list(range(self._seq, self._seq + len(samples)))
            self._seq += len(samples)
            self._outstanding += len(samples)
        job = _Job([], [], [], dict(self.trainer_state))
        for seq, sample in zip(seqs, samples):
            try:
                item = self._item(sample)
            except Exception as e:  # noqa: BLE001 - a sample that cannot be decoded is flagged, not fatal
                self._finish(_Job([seq], [sample], []), 0.0, f"error: decode: {type(e).__name__}: {e}", "error")
                continue
            job.seqs.append(seq)
            job.samples.append(sample)
            job.items.append(item)
        if not job.seqs:
            return seqs
        with self._cond:
            broken = self._pool.broken
            if not broken:
                self._pending.append(job)
        if broken:
            self._finish(job, 0.0, f"error: {broken}", "error")
        else:
            self._pool.wake()
        return seqs

    def _item(self, sample) -> hooks.Item:
        """``(completion, prompt, meta, completion_ids)``: the completion without its trailing EOS ids."""
        ids = list(sample.completion_ids)
        while ids and ids[-1] in self._eos:
            ids.pop()
        completion = self._decode(ids)
        prompt = sample.meta.get("prompt") if isinstance(sample.meta, dict) else None
        if not isinstance(prompt, str):
            prompt = self._decode(list(sample.prompt_ids))
        meta = dict(sample.meta or {})
        for name, col in self._restore.items():
            if name in meta and col not in meta:
                meta[col] = meta[name]
        return completion, prompt, meta, ids

    def _wait(self) -> None:
        """Wait on the condition (caller holds it), surfacing a crashed feeder thread instead of hanging."""
        self._raise_if_crashed()
        if self._closed:
            raise RuntimeError("RewardDispatcher was closed while samples were outstanding")
        self._cond.wait(timeout=1.0)
        self._raise_if_crashed()

    def _raise_if_crashed(self) -> None:
        if self._crash is not None:
            raise RuntimeError(f"reward dispatcher thread crashed: {type(self._crash).__name__}: {self._crash}") \
                from self._crash

    def _batch_stats(self) -> None:
        """Latency percentiles of the calls finished since the last batch (caller holds the lock)."""
        if self._latencies:
            lat, ver = sorted(self._latencies), sorted(self._verify)
            self._stats["latency_p50_s"] = _percentile(lat, 0.5)
            self._stats["latency_p99_s"] = _percentile(lat, 0.99)
            self._stats["verify_p50_s"] = _percentile(ver, 0.5)
            self._latencies.clear()
            self._verify.clear()

    def _finish(self, job: _Job, reward: float | None, flag: str | None, kind: str | None,
                latency: float | None = None, verify_s: float | None = None,
                outcomes: list[tuple[float | None, str | None, list]] | None = None,
                extras: list[dict[str, float]] | None = None) -> None:
        """Settle every sample of ``job``: each with its own ``(reward, flag, parts)`` from ``outcomes``
        (a worker's reply), or all with ``reward`` and ``flag`` (a timeout, a dead worker, ...)."""
        outcomes = outcomes or [(reward, flag, [])] * len(job.samples)
        outcomes = [_within_f32(o) for o in outcomes]
        extras_of = extras or [{}] * len(job.samples)
        with self._cond:
            for seq, sample, (r, f, parts), extras in zip(job.seqs, job.samples, outcomes, extras_of):
                sample.reward, sample.reward_flag, sample.reward_parts = None if r is None else float(r), f, parts
                sample.reward_extras = extras
                self._stats["scored"] += 1
                k = kind or ("error" if f else None)
                if k == "timeout":
                    self._stats["timeouts"] += 1
                elif k == "error":
                    self._stats["errors"] += 1
                self._done[seq] = sample
            if latency is not None:
                self._latencies.append(latency)
            if verify_s is not None:
                self._verify.append(verify_s)
            self._cond.notify_all()

    # ---------------------------------------------------------------------------- feeder loop
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stop:
                        return
                self._assign()
                deadlines = [w.deadline for w in self._workers if w.job is not None]
                for w, frames in self._pool.wait(min(deadlines) if deadlines else None):
                    if w in self._workers:
                        self._on_frames(w, frames)
                self._flush_if_broken()
                now = time.monotonic()
                for w in list(self._workers):
                    if w.job is not None and now >= w.deadline:
                        job, w.job = w.job, None
                        self._replace(w)  # first, so stats and pool are settled when the caller sees the flag
                        self._finish(job, 0.0, "timeout", "timeout", latency=now - w.sent_at)
                        if self._hung is not None:
                            self._hung.append(getattr(job.samples[0], "request_id", job.seqs[0]) if job.samples else None)
                        if self._hung and len(self._hung) >= max(self.num_workers, 2) and len(set(self._hung)) >= 2:
                            self._give_up_batch()
        except BaseException as e:  # noqa: BLE001 - surfaced to every waiter instead of a silent hang
            with self._cond:
                self._crash = e
                self._cond.notify_all()

    def _replace(self, w: Worker) -> None:
        """A fresh worker in ``w``'s place (the pool's job); the queue is flagged if the pool is broken."""
        self._pool.replace(w)
        self._flush_if_broken()

    def _flush_if_broken(self) -> None:
        """No worker can start: flag the queued calls instead of leaving them waiting."""
        if not self._pool.broken:
            return
        with self._cond:
            jobs = list(self._pending)
            self._pending.clear()
        for job in jobs:
            self._finish(job, 0.0, f"error: {self._pool.broken}", "error")

    def _give_up_batch(self) -> None:
        """Every worker timed out in a row: flag this batch's queued samples ``timeout`` without running them."""
        with self._cond:
            jobs = list(self._pending)
            self._pending.clear()
        if jobs:
            print(f"rollyard: reward hook {self.hook!r} timed out on {len(self._hung)} calls in a row (every worker); "
                  f"the {len(jobs)} samples still queued in this batch are flagged timeout without running",
                  file=sys.stderr, flush=True)
        for job in jobs:
            self._finish(job, 0.0, "timeout", "timeout")

    def _assign(self) -> None:
        while True:
            idle = self._pool.idle()
            if not idle:
                return
            with self._cond:
                if not self._pending:
                    return
                job = self._pending.popleft()
            w = idle[0]
            try:
                frame = (job.seq, job.items, job.state)
                pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # noqa: BLE001
                self._finish(job, 0.0, f"error: meta is not picklable: {type(e).__name__}: {e}", "error")
                continue
            w.sent_at = time.monotonic()
            if self._pool.send(w, frame):
                limit = self.timeout_s if self.timeout_policy is None else self.timeout_policy.timeout(job.samples[0].meta)
                limit *= len({getattr(s, "request_id", None) for s in job.samples}) or 1  # a batched call: per group
                w.job, w.state, w.deadline = job, "busy", w.sent_at + limit
            else:  # the worker died while idle: not this job's fault, requeue it
                with self._cond:
                    self._pending.appendleft(job)
                self._replace(w)

    def _extras(self, parts: list[tuple]) -> dict[str, float]:
        """``{"<hook name>/<key>": value}`` from the verl dict results among one sample's parts."""
        return {f"{self.names[i]}/{k}": v for i, p in enumerate(parts) if len(p) > 2 and p[0] == "ok"
                for k, v in p[2].items()}

    def _on_frames(self, w: Worker, frames: list | None) -> None:
        """A started worker's replies, or its death (``frames`` None)."""
        if frames is None:
            job, w.job = w.job, None
            self._replace(w)
            if job is not None:
                self._finish(job, 0.0, f"error: worker died ({describe_exit(w.proc.returncode)})", "error",
                             latency=time.monotonic() - w.sent_at)
            return
        now = time.monotonic()
        for fr in frames:
            seq, status, value, verify_s = fr
            job = w.job
            if job is None or seq != job.seq:
                continue  # a stale reply (cannot happen with one job in flight per worker)
            w.job, w.state, self._hung = None, "idle", None
            if self.timeout_policy is not None:
                self.timeout_policy.observe(job.samples[0].meta, now - w.sent_at)
            if status == "ok":  # value: per sample, one part per hook
                self._finish(job, 0.0, None, None, latency=now - w.sent_at, verify_s=verify_s,
                             outcomes=[hooks.combine(parts, self.weights) for parts in value],
                             extras=[self._extras(parts) for parts in value])
            else:
                self._finish(job, 0.0, f"error: {value}"[:500], "error", latency=now - w.sent_at, verify_s=verify_s)
