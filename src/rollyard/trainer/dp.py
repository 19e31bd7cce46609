"""``trainer.dp = k``: k data-parallel trainer ranks behind the Trainer's interface.

Rank 0 is the calling (driver) process; rollyard starts ranks 1..k-1 itself (spawned processes)
and joins them in one torch.distributed group: gloo on CPU, NCCL on GPU. Rank 0 scatters each
rank its share of a step's samples (balanced by completion tokens). Every rank then

1. all-reduces the step's loss denominators (completion tokens, sequences): 16 bytes, so each
   rank's loss is its tokens' sum over the *whole step's* count;
2. runs forward/backward over its share (:meth:`Trainer.accumulate_gradients`);
3. all-reduces (sums) its gradients, one flat buffer per 64 MB bucket (fsdp: the layers are
   reduce-scattered by FSDP2 instead, see fsdp.py; the replicated rest is all-reduced here);
4. takes the same clipped optimizer step on the same summed gradient.

So the update equals the single-rank one up to float summation order (tests/test_dp.py).

The gradient edge is measured where it crosses: the bytes this rank's process wrote to its
sockets (``wchar`` in ``/proc/self/io``) during steps 2-3. Only the collectives write in that
window (a terminal progress bar's refresh may add a few hundred bytes). On NCCL the bytes do
not pass through sockets; there the count is derived from the message handed to the
collectives (ring: 2(k-1)/k x message) and marked ``measured: false``.

Checkpoints: without sharding every rank holds the same weights and optimizer state, so the
checkpoint is rank 0's, in the single-rank format: it resumes on any k (dp=1 included). With
fsdp the optimizer state is one shard per rank and resumes only on the same k (a clear error
otherwise). ``logprobs`` runs on rank 0 alone (reference and pi_old scoring have no gradients).
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from rollyard import checkpoint, signals
from rollyard.config import ConfigError, RunConfig
from rollyard.model.loading import policy
from rollyard.sync.group import RENDEZVOUS_S, admit, listening_store, new_secret, open_to
from rollyard.telemetry import rundir
from rollyard.trainer import fsdp
from rollyard.trainer.settings import trainer_kwargs
from rollyard.trainer.trainer import Trainer
from rollyard.types import Sample

BUCKET_BYTES = 64 << 20
STUCK_LOG = "dp_rank{rank}.stacks"  # in the run directory: where a rank stuck in the rendezvous waited
RANK_LOG = "dp_rank{rank}.log"  # in the run directory: a spawned rank's own error, with its traceback
SHARDED_KEY = "rollyard_fsdp_ranks"  # optimizer.pt of an fsdp run: {SHARDED_KEY: [rank 0 state, rank 1 state, ...]}
# A collective's bound: ranks 1..k-1 wait in one between steps while rank 0 samples a whole step's rollout.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
SAY_AFTER_S = 30.0  # a rendezvous that takes longer says what it waits for
WATCH_GRACE_S = 30.0  # a dead rank rank 0 has not reported by then (blocked outside a collective) ends the driver


class RankDied(RuntimeError):
    """A data-parallel trainer rank died mid-run; the message names the rank, the step and the resume command."""


class RendezvousFailed(RankDied):
    """The ranks did not all join the process group within the rendezvous bound (one line: who, how long, fix)."""


def check_backend(cfg: RunConfig) -> None:
    """``trainer.dp > 1`` with an in-process vLLM engine (colocated) is refused: vLLM builds its own
    torch.distributed world from the process's default group, which is the trainer's data-parallel group
    here, and would wait for the other ranks to join its groups (a hang). The Ray placements run vLLM in
    actors of their own."""
    if cfg.trainer.dp > 1 and cfg.rollout.backend == "vllm" and cfg.placement == "colocated":
        raise ConfigError(f"trainer.dp={cfg.trainer.dp} with rollout.backend=vllm needs vLLM out of the trainer's "
                          f"process (placement=colocated runs it inside, where it would take the trainer's process "
                          f"group for its own); set placement=disaggregated or placement=async, or trainer.dp=1, or "
                          f"rollout.backend=native")


def sent_bytes() -> int | None:
    """Bytes written through write-family syscalls (sockets included) by this process's threads but its Python
    threads beside the main one, or None where /proc cannot tell. The gloo collectives write from the main thread
    and gloo's own native threads; a Python thread writes files, not gradients (the background checkpoint writer
    saving the previous step while this one all-reduces, a TensorBoard writer), so it is left out."""
    skip = {t.native_id for t in threading.enumerate() if t is not threading.main_thread()}
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        if int(tid) in skip:
            continue
        try:
            with open(f"/proc/self/task/{tid}/io") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
        except (OSError, StopIteration):
            if tid == str(threading.main_thread().native_id):
                return None  # (another thread may have just ended: its bytes are not the collective's)
    return total


def available_ranks(device: str) -> int:
    if device.startswith("cuda"):
        return torch.cuda.device_count()
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_ranks(k: int, device: str) -> None:
    have = available_ranks(device)
    if k > have:
        what = "GPUs" if device.startswith("cuda") else "CPU cores"
        raise ConfigError(f"trainer.dp={k} ranks but only {have} {what} are available to this process; "
                          f"set trainer.dp={have} or less")


def split(samples: list[Sample], k: int) -> list[list[int]]:
    """Sample indices per rank: longest first onto the least-loaded rank (by completion tokens), in order."""
    load = [0] * k
    out: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(samples)), key=lambda i: -len(samples[i].completion_ids)):
        r = min(range(k), key=lambda r: (load[r], len(out[r])))
        out[r].append(i)
        load[r] += len(samples[i].completion_ids) + 1
    return [sorted(ix) for ix in out]


def _buckets(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    out: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        if out[-1] and size + p.numel() * p.element_size() > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel() * p.element_size()
    return [b for b in out if b]


@torch.no_grad()
def allreduce_gradients(params: list[torch.Tensor]) -> int:
    """Sum ``params``' gradients over the group (a missing gradient counts as zeros); return message bytes."""
    message = 0
    for bucket in _buckets(params):
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        message += flat.numel() * flat.element_size()
        for p, part in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad = part.view_as(p).clone()
    return message


class RankTrainer(Trainer):
    """One rank's Trainer: its accumulate_gradients reduces denominators, gradients and metrics.

    :meth:`Trainer.step` is unchanged: it sees the whole step's accumulators and summed
    gradients, so every rank takes the same step. ``units``: this model's FSDP units (fsdp.py).
    """

    def __init__(self, model, *, units: list | None = None, **kwargs):
        self.units = units or []
        super().__init__(model, **kwargs)
        fsdp.reshard(self.units)  # the constructor's packing check gathered the layers
        self.wire: dict[str, float] = {}

    def accumulate_gradients(self, samples, old_logprobs=None, denominators=None, entropy_masks=None) -> dict:
        """This rank's share, with the whole step's denominators (``denominators`` is ignored: they
        are all-reduced here); gradients summed over ranks; accumulators reduced (``_reduce_metrics``)."""
        counts = torch.tensor([sum(sum(s.loss_mask) for s in samples), sum(1 for s in samples if s.completion_ids)],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        n_micro = len(self.micro_batches([samples[i] for i in self.trained_indices(samples)]))
        before, t0 = sent_bytes(), time.perf_counter()
        with fsdp.one_sync_per_step(self.model, self.units, max(n_micro, 1)) if self.units else contextlib.nullcontext():
            acc = super().accumulate_gradients(samples, old_logprobs, denominators=(int(counts[0]), int(counts[1])),
                                               entropy_masks=entropy_masks)
            if self.units and n_micro == 0:
                fsdp.idle_backward(self.model)
        acc["tokens"], acc["seqs"] = int(counts[0]), int(counts[1])  # metrics are per step, not per rank
        t1 = time.perf_counter()
        dist.barrier()  # so allreduce_s is the transfer, not the wait for a slower rank (wait_s)
        t2 = time.perf_counter()
        plain = [p for p in self.params if not isinstance(p, DTensor)]
        message = allreduce_gradients(plain)
        after, t3 = sent_bytes(), time.perf_counter()
        measured = before is not None and dist.get_backend() == "gloo"
        layer_bytes = sum(p.numel() * p.element_size() for p in self.params) - message  # fsdp: the sharded layers
        k = dist.get_world_size()
        derived = 2 * (k - 1) / k * (message + layer_bytes)  # NCCL ring: all-reduce, or all-gather + reduce-scatter
        self.wire = {"gradient_bytes": float(after - before) if measured else derived, "measured": float(measured),
                     "message_bytes": float(message + layer_bytes), "allreduce_s": t3 - t2, "wait_s": t2 - t1,
                     "backward_s": t1 - t0}
        _reduce_metrics(acc, self.device)
        return acc

    def _optimizer_step(self, loss: float = 0.0) -> tuple[float, bool]:
        """fsdp: the Trainer's clip/skip/step with a norm over sharded and replicated gradients."""
        if not self.units:
            return super()._optimizer_step(loss)
        norm = float(fsdp.global_grad_norm(self.params))
        skipped = self.skips.check(loss, norm)  # same loss and norm on every rank: the same decision
        if not skipped:
            fsdp.clip_(self.params, self.max_grad_norm, norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, skipped


_COUNTS = ("computed_tokens", "skipped_seqs", "positions", "skipped_positions", "computed_positions",
           "recomputed_positions")


def _reduce_metrics(acc: dict, device) -> None:
    """Sum (max for diff_max) the accumulators over ranks; gather the log ratios for the quantiles."""
    names = ["loss", "pg_loss", "kl_sum", "entropy_sum", "clipped", "capped", "diff_sum", "distill_kl_sum",
             "gkd_jsd_sum"]
    vec = torch.stack([acc[n].detach().double().reshape(()) for n in names]
                      + [torch.tensor(float(acc["micro_batches"]), dtype=torch.float64, device=device),
                         torch.tensor(float(acc["packed_tokens"]), dtype=torch.float64, device=device)]
                      + [torch.tensor(float(acc[n]), dtype=torch.float64, device=device) for n in _COUNTS])
    dist.all_reduce(vec)
    for i, n in enumerate(names):
        acc[n] = vec[i].float()
    acc["micro_batches"], acc["packed_tokens"] = int(vec[len(names)]), int(vec[len(names) + 1])
    for i, n in enumerate(_COUNTS):  # the skipped share (Trainer.moves_weights), summed over ranks
        acc[n] = float(vec[len(names) + 2 + i]) if n == "recomputed_positions" else int(vec[len(names) + 2 + i])
    top = torch.stack([acc["diff_max"].detach().float().reshape(()),
                       torch.tensor(float(acc["want_kl"]), device=device)])
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    acc["diff_max"], acc["want_kl"] = top[0], bool(top[1] > 0)
    mine = torch.cat(acc["log_ratio"]).float().cpu() if acc["log_ratio"] else torch.zeros(0)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    acc["log_ratio"] = [t for t in every if t.numel()]


class Rank:
    """What every rank (0..k-1) does for a command from rank 0; each method is collective."""

    def __init__(self, cfg: RunConfig, model, device: str):
        self.cfg, self.model, self.device = cfg, model, device
        self.sharded = cfg.trainer.sharding == "fsdp"
        self.trainer: RankTrainer | None = None

    def init(self, optim_state) -> None:
        """Same weights everywhere (rank 0's), shard if asked, build the trainer, load optimizer state."""
        with torch.no_grad():
            for t in self.model.state_dict().values():
                dist.broadcast(t, src=0)
        train_model = self.model
        units: list = []
        if self.sharded:
            train_model = copy.deepcopy(self.model) if dist.get_rank() == 0 else self.model
            units = fsdp.shard(train_model)
        self.trainer = RankTrainer(train_model, units=units, **trainer_kwargs(self.cfg), device=self.device)
        self.load_optimizer(optim_state)

    def load_optimizer(self, state) -> None:
        if state is None:
            return
        if self.sharded:
            fsdp.load_local_optimizer_state(self.trainer.optimizer, self.trainer.params, state)
        else:
            self.trainer.optimizer.load_state_dict(state)

    def optimizer_state(self, _=None):
        mine = fsdp.local_optimizer_state(self.trainer.optimizer) if self.sharded else None
        every: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, every, dst=0)
        return every

    def step(self, share) -> dict:
        samples, old = share
        return self.trainer.step(samples, old)

    def gather(self, _=None) -> None:
        fsdp.gather_into(self.trainer.model, self.model if dist.get_rank() == 0 else None)


def _receive(payloads: list | None = None):
    """Rank 0 sends one payload per rank (scatter); every rank returns its own."""
    out: list = [None]
    dist.scatter_object_list(out, payloads, src=0)
    return out[0]


def rendezvous_bound(device: str) -> float:
    """How long a rank waits on the rendezvous store for the others. gloo connects every pair at
    ``init_process_group``, so the store is only the rendezvous: bounded (``RENDEZVOUS_S``). NCCL builds its
    communicators at the first collective, which ranks 1..k-1 reach a whole rollout before rank 0: the
    collective's bound."""
    return COLLECTIVE_TIMEOUT.total_seconds() if device.startswith("cuda") else RENDEZVOUS_S


def _host_store(k: int, bound_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening from now on a port the OS picked (a port found free and
    closed again until the ranks start can be taken meanwhile: EADDRINUSE), on 127.0.0.1 only (the
    ranks are this machine's processes; sync/group.py: TCPStore alone would listen on every interface)."""
    return listening_store("127.0.0.1", k, timedelta(seconds=bound_s))


def _join_group(rank: int, k: int, port: int, device: str, store: dist.Store | None = None,
                secret: str = "", bound_s: float = RENDEZVOUS_S) -> None:
    """Join the dp group through the run's ``secret`` (sync/group.py's SecretStore: checked first by ranks
    1..k-1); every wait on the store is bounded by ``bound_s``."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if store is None:  # ranks 1..k-1 join rank 0's store
        store = admit(dist.TCPStore("127.0.0.1", port, k, False, timeout=timedelta(seconds=bound_s)), secret,
                      f"127.0.0.1:{port}", bound_s)
    fresh_world()
    dist.init_process_group(backend, store=store, rank=rank, world_size=k, timeout=COLLECTIVE_TIMEOUT)


def fresh_world() -> None:
    """Make this process name its next default group as a fresh process does (``"0"``), when it has none.

    torch.distributed names the default group by a per-process counter and keys every rendezvous value under
    that name; only destroying a default group resets the counter. A ``init_process_group`` that never
    finished (a rendezvous past its bound, a stop signal during it) leaves it advanced, and the next dp run in
    the same process would wait under name "1" for ranks writing under "0", until the bound: every later
    ``trainer.dp`` run of a long-lived process (a notebook, a sweep, a test worker) would fail that way."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if not dist.is_initialized() and world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def join_watching(procs: list, store: dist.Store, port: int, device: str, bound_s: float) -> None:
    """Rank 0 joins the group. Bounded and said: a rank that dies before joining is an error at once, a
    rendezvous past ``SAY_AFTER_S`` says what it waits for, one past ``bound_s`` is one line
    (:class:`RendezvousFailed`), and a stop signal ends the wait (:class:`signals.Stopped`)."""
    joined: list[BaseException | None] = []
    k = len(procs) + 1

    def join() -> None:
        try:
            _join_group(0, k, port, device, store, bound_s=bound_s)
            joined.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
            joined.append(e)

    t = threading.Thread(target=join, daemon=True, name="rollyard-dp-join")
    t.start()
    t0, said = time.monotonic(), False
    while t.is_alive():
        t.join(timeout=0.5)
        waited = time.monotonic() - t0
        dead = [p for p in procs if p.exitcode is not None]
        if dead and t.is_alive():
            raise RendezvousFailed(f"data-parallel trainer rank process {dead[0].name} exited with code "
                                   f"{dead[0].exitcode} before joining the process group; its error is printed above")
        if t.is_alive() and signals.stop_requested():
            raise signals.Stopped(signals.requested(), None, waiting="the data-parallel ranks to join")
        if t.is_alive() and not said and waited > SAY_AFTER_S:
            said = True
            print(f"rollyard: waiting for data-parallel trainer ranks 1..{k - 1} to join the process group "
                  f"({waited:.0f} s so far, at most {bound_s:.0f} s)", file=sys.stderr, flush=True)
        if t.is_alive() and waited > bound_s + 10:
            break
    if not joined or joined[0] is not None:
        why = f"{type(joined[0]).__name__}: {(str(joined[0]).strip().splitlines() or [''])[0]}" if joined else "no answer"
        raise RendezvousFailed(f"data-parallel trainer ranks 1..{k - 1} did not all join the process group within "
                               f"{bound_s:.0f} s ({why[:300]}); each rank is a process of this machine started "
                               f"for the run: check that none is stopped or swapped out, then start the run again")


def _in_collective(e: BaseException) -> bool:
    """``e`` was raised inside torch.distributed: a peer (rank 0 or another rank) went away mid-collective."""
    return isinstance(e, dist.DistError) or any(
        "torch/distributed" in f.filename.replace(os.sep, "/") for f in traceback.extract_tb(e.__traceback__))


@contextlib.contextmanager
def _stacks_if_stuck(path: Path, after_s: float):
    """Every thread's stack written to ``path`` if the block is still running after ``after_s`` (a rendezvous
    that does not finish: where this rank waits, for the one line rank 0 prints)."""
    import faulthandler

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        faulthandler.dump_traceback_later(after_s, repeat=False, file=f)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    if path.stat().st_size == 0:
        path.unlink()


def rank_main(rank: int, k: int, port: int, cfg_data: dict, device: str, secret: str) -> None:
    """A spawned rank (1..k-1): join the group, build the policy, serve rank 0's commands until 'stop'.

    It never prints a traceback: a collective that fails because a peer died exits quietly (rank 0
    names the dead rank, or rank 0 itself is gone: a driver kill -9 leaves nothing to tell); its own
    error is one line on stderr, the traceback in ``RUN_DIR/dp_rank<r>.log``."""
    parent = os.getppid()
    try:
        torch.set_num_threads(max(1, available_ranks("cpu") // k))
        cfg = RunConfig.model_validate(cfg_data)
        dev = f"cuda:{rank % torch.cuda.device_count()}" if device.startswith("cuda") else device
        bound = rendezvous_bound(device)
        with _stacks_if_stuck(Path(cfg.out_dir) / STUCK_LOG.format(rank=rank), bound * 0.8):
            _join_group(rank, k, port, device, secret=secret, bound_s=bound)
        model, _, _ = policy(cfg, dev)
        me = Rank(cfg, model, dev)
        while True:
            op, payload = _receive()
            if op == "stop":
                break
            getattr(me, op)(payload)
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - any failure: say why (one line), exit; rank 0's collective then fails
        if os.getppid() == parent and not _in_collective(e):
            log = Path(cfg_data.get("out_dir", ".")) / RANK_LOG.format(rank=rank)
            with contextlib.suppress(OSError):
                log.write_text(traceback.format_exc())
            first = (str(e).strip().splitlines() or [""])[0]
            print(f"rollyard: data-parallel trainer rank {rank}: {type(e).__name__}: {first} (traceback in {log})",
                  file=sys.stderr, flush=True)
        os._exit(1)


class _Optimizer:
    """``trainer.optimizer`` for checkpoint.py: state_dict / load_state_dict across the ranks."""

    loads_sharded = True

    def __init__(self, handle: DataParallelTrainer):
        self.handle = handle

    @property
    def param_groups(self) -> list[dict]:
        """Rank 0's (every rank has the same hyper-parameters); read-only: a change here reaches rank 0 only."""
        self.handle.start()
        return self.handle.rank.trainer.optimizer.param_groups

    def state_dict(self) -> dict:
        h = self.handle
        h.start()
        if not h.sharded:
            return h.rank.trainer.optimizer.state_dict()
        h.command("optimizer_state")
        return {SHARDED_KEY: h.rank.optimizer_state()}

    def load_state_dict(self, state: dict) -> None:
        h = self.handle
        shards = state.get(SHARDED_KEY) if isinstance(state, dict) else None
        if h.sharded and shards is None:
            raise ConfigError("the checkpoint's optimizer state is unsharded (trainer.sharding=none); resume with "
                              "trainer.sharding=none")
        if not h.sharded and shards is not None:
            raise ConfigError(f"the checkpoint's optimizer state is sharded over {len(shards)} FSDP ranks; resume "
                              f"with trainer.sharding=fsdp trainer.dp={len(shards)}")
        if shards is not None and len(shards) != h.k:
            raise ConfigError(f"the checkpoint's optimizer state is sharded over {len(shards)} FSDP ranks, this run "
                              f"has trainer.dp={h.k}; resume with trainer.dp={len(shards)} (resharding is not supported)")
        if h.started:
            payloads = shards if shards is not None else [state] * h.k
            h.command("load_optimizer", payloads)
            h.rank.load_optimizer(payloads[0])
        else:
            h.pending_optimizer = shards if shards is not None else [state] * h.k


class DataParallelTrainer:
    """The trainer handle for ``trainer.dp = k > 1``: ``logprobs``, ``step``, ``optimizer``, ``gather``, ``close``.

    ``model`` (this process's, the one the colocated engine reads) is rank 0's replica; with fsdp
    it is the full copy that :meth:`gather` refreshes after every step (rank 0 trains a sharded
    copy). Ranks get rank 0's weights and optimizer state at the first call that needs them
    (after a checkpoint was loaded into ``model``).
    """

    def __init__(self, cfg: RunConfig, model, device: str, watch_grace_s: float = WATCH_GRACE_S):
        self.k, self.sharded = cfg.trainer.dp, cfg.trainer.sharding == "fsdp"
        check_ranks(self.k, device)
        self.run_dir = Path(cfg.out_dir)
        self.model, self.device = model, device
        bound = rendezvous_bound(device)
        self.store = _host_store(self.k, bound)
        port, secret = self.store.port, new_secret()  # the secret goes to the ranks by spawn's pipe, not argv
        scoped = open_to(self.store, secret, f"127.0.0.1:{port}", bound)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=rank_main, args=(r, self.k, port, cfg.model_dump(), device, secret),
                                  daemon=True, name=f"rollyard-dp-rank{r}") for r in range(1, self.k)]
        for p in self.procs:
            p.start()
        try:
            join_watching(self.procs, scoped, port, device, bound)
        except RendezvousFailed as e:
            self._kill_ranks()
            stuck = sorted(str(p) for p in self.run_dir.glob(STUCK_LOG.format(rank="*")))
            raise RendezvousFailed(f"{e} (where the ranks waited: {', '.join(stuck)})" if stuck else str(e)) from None
        except BaseException:
            self._kill_ranks()
            raise
        self.closing = False
        self.watchdog = threading.Thread(target=self._watch_ranks, args=(watch_grace_s,), daemon=True,
                                         name="rollyard-dp-watchdog")
        self.watchdog.start()
        self.rank = Rank(cfg, model, device)
        self.optimizer = _Optimizer(self)
        self.pending_optimizer: list | None = None
        self.started = False
        self.wire: dict[str, float] = {}

    def command(self, op: str, payloads: list | None = None) -> None:
        with self.watch():
            _receive([(op, None if payloads is None else payloads[r]) for r in range(self.k)])

    @contextlib.contextmanager
    def watch(self):
        """A collective that fails because a rank process died raises :class:`RankDied` (one line: the rank,
        how it died, the step, the resume command) instead of gloo's / NCCL's peer-reset traceback."""
        try:
            yield
        except RankDied:
            raise
        except Exception as e:  # only a collective's failure with a dead rank behind it is translated
            dead = _first_dead(self.procs, wait_s=5.0) if _in_collective(e) else None
            if dead is None:
                raise
            self._kill_ranks()  # the survivors' collectives fail too; they have nothing more to do
            raise RankDied(died_line(self.run_dir, dead, e)) from None

    def _kill_ranks(self) -> None:
        procs, self.procs = self.procs, []
        for p in procs:
            if p.exitcode is None:
                p.kill()

    def _watch_ranks(self, grace_s: float) -> None:
        """The driver's last resort: a rank dead for ``grace_s`` that rank 0 has not reported (:meth:`watch`
        reports one within seconds when a collective fails) means rank 0 is blocked where no collective will
        fail, e.g. a group another library builds on the default one. One line, then the driver exits 1: a
        run that cannot go on never waits out a 10-minute timeout."""
        dead_since: float | None = None
        while not self.closing and self.procs:  # none left: reported and killed, or closed
            time.sleep(0.5)
            procs = list(self.procs)
            dead = next((p for p in procs if p.exitcode is not None), None)
            if dead is None or self.closing:
                dead_since = None
                continue
            dead_since = dead_since or time.monotonic()
            if time.monotonic() - dead_since < grace_s:
                continue
            line = f"{died_line(self.run_dir, dead, None)}; {checkpoint.resume_hint(self.run_dir)}"
            self._kill_ranks()  # a write in flight is abandoned by the exit: the hint names the one before
            print(f"rollyard train: error: {line}", file=sys.stderr, flush=True)
            os._exit(1)

    def start(self) -> None:
        if self.started:
            return
        states = self.pending_optimizer or [None] * self.k
        self.command("init", states)
        with self.watch():
            self.rank.init(states[0])
        self.started, self.pending_optimizer = True, None

    def logprobs(self, samples: list[Sample], model=None) -> list[torch.Tensor]:
        self.start()
        return self.rank.trainer.logprobs(samples, model=self.model if model is None else model)

    def top_k_logprobs(self, samples: list[Sample], model, k: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """A GKD teacher's scores (``Trainer.top_k_logprobs``), on rank 0 alone like :meth:`logprobs`."""
        self.start()
        return self.rank.trainer.top_k_logprobs(samples, model, k)

    def step(self, samples: list[Sample], old_logprobs: list[torch.Tensor] | None = None) -> dict[str, float]:
        self.start()
        shares = [(([samples[i] for i in ix]), (None if old_logprobs is None else [old_logprobs[i] for i in ix]))
                  for ix in split(samples, self.k)]
        before, t0 = sent_bytes(), time.perf_counter()
        self.command("step", shares)  # the other ranks' shares, pickled, over the group
        scatter_s, after = time.perf_counter() - t0, sent_bytes()
        with self.watch():
            metrics = self.rank.step(shares[0])
        self.wire = dict(self.rank.trainer.wire)
        self.wire.update(scatter_s=scatter_s, scatter_bytes=float(after - before) if before is not None else 0.0)
        metrics.update({f"dp_{k}": v for k, v in self.wire.items()})
        return metrics

    def gather(self) -> int:
        """fsdp: all-gather the layers into ``model`` (what a sync publishes); return bytes sent. 0 unsharded."""
        if not self.sharded:
            return 0
        self.start()
        self.command("gather")
        before = sent_bytes()
        with self.watch():
            self.rank.gather()
        after = sent_bytes()
        return (after - before) if before is not None else 0

    def close(self) -> None:
        self.closing = True  # the ranks exit from here on: the watchdog stops
        if self.started or self.procs:
            self.command("stop")
        for p in self.procs:
            p.join(timeout=30)  # a rank exits at once on "stop"; one that does not is killed below
        self._kill_ranks()
        if self.watchdog.is_alive():
            self.watchdog.join(timeout=2)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None  # the rendezvous store stops listening with its last reference


def _first_dead(procs: list, wait_s: float):
    """The first rank process that has exited, waiting up to ``wait_s`` for the OS to report it (the peer's
    socket closes before its exit status is reaped); None when every rank lives."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [p for p in procs if p.exitcode is not None]
        if dead or time.monotonic() > deadline:
            return dead[0] if dead else None
        time.sleep(0.05)


def died_line(run_dir: Path, proc, err: BaseException | None) -> str:
    """One line: which rank died and how, the step in progress, what rank 0 saw. The checkpoint to resume from is
    said by whoever ends the run, once the checkpoint write in flight has settled (``checkpoint.resume_hint``)."""
    code = proc.exitcode
    how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):
            how = f"killed by {signal.Signals(-code).name}"
    rows = list(rundir.read_jsonl(run_dir / rundir.METRICS)) if (run_dir / rundir.METRICS).exists() else []
    step = rows[-1]["step"] + 1 if rows and isinstance(rows[-1].get("step"), int) else 0
    own = "; its own error is the line above" if code > 0 else ""
    return (f"data-parallel trainer rank {proc.name.rsplit('rank', 1)[-1]} (pid {proc.pid}) {how} during step "
            f"{step}{own}; " + (f"rank 0 saw {type(err).__name__} in a collective" if err is not None else
                                 "rank 0 was blocked where no collective would fail, so the driver stops"))


def after_step(tel, step: int, trainer) -> None:
    """Record a dp trainer's collectives in ``step`` (the gradients edge); with fsdp, gather the full
    parameters for the sync to publish (a span and a ledger edge of their own). Nothing for dp=1."""
    if not isinstance(trainer, DataParallelTrainer):
        return
    tel.traffic(step, "gradients", int(trainer.wire.get("gradient_bytes", 0)))
    if trainer.sharded:
        with tel.span("gather", step, dp=trainer.k):
            nbytes = trainer.gather()
        tel.traffic(step, "gather", nbytes)
