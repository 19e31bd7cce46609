"""Every wait has a bound and a word, every signal is heard, and the stores' secret stays secret.

Real processes throughout: a rendezvous store listed and written by another local process, a peer
that never arrives at a rendezvous, a CPU-kernel build killed with -9 while it holds the build lock,
a process waiting on a live build stopped by SIGTERM, a cached kernel library overwritten on disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rollyard.model import kernels
from rollyard.sync.group import (
    SECRET_KEY,
    StoreTampered,
    SyncGroup,
    admit,
    listening_store,
    new_secret,
    open_to,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                               reason="no C++ compiler on this machine: the kernels cannot be built")

# Another local process that finds the store's port: lists every key with its value, then writes over
# each key it listed and plants the plain names a rendezvous would use.
ATTACKER = """
import json, sys
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=5))
keys = s.list_keys()
print(json.dumps({k: s.get(k).hex() for k in keys}))
for k in keys:
    s.set(k, b"127.0.0.1:1")
s.set("rollyard/admitted", b"1")
s.set("sync/0", b"127.0.0.1:1")
"""


def test_a_store_listed_by_another_process_shows_no_secret_and_takes_no_value_from_it():
    secret = new_secret()
    store = listening_store("127.0.0.1", 2, timedelta(seconds=10))
    host = open_to(store, secret, f"127.0.0.1:{store.port}")
    host.set("sync/0", b"10.1.2.3:4567")  # what a rank publishes at a rendezvous
    out = subprocess.run([sys.executable, "-c", ATTACKER, str(store.port)], env=ENV, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    listed = json.loads(out)
    assert len(listed) == 2, listed  # the admission key and the rank's address: under names it cannot read
    for name, value in listed.items():
        assert re.fullmatch(r"[0-9a-f]{64}", name), name
        assert secret not in name and secret.encode().hex() not in value
        assert not any(word in name for word in ("admitted", "sync", "rollyard"))
    # what it wrote over the group's keys fails authentication, in one line; what it planted is not read
    with pytest.raises(StoreTampered, match="fails its authentication: a process without this run's secret") as e:
        host.get("sync/0")
    assert "\n" not in str(e.value)
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    with pytest.raises(StoreTampered):
        admit(client, secret, f"127.0.0.1:{store.port}")
    # a joiner without the secret (another run's) is refused in one line, even with the plain key planted
    assert client.check([SECRET_KEY])
    with pytest.raises(ValueError, match="does not hold this group's secret"):
        admit(client, new_secret(), f"127.0.0.1:{store.port}")


# Another local process that lists a live store as often as it can until the store goes away: one JSON line per
# listing (key -> value hex); it only reads. It imports torch while the run starts, then tries the ports it is handed
# on stdin (the run's new listening ports as they appear), each again until one answers as a store. It says "ready"
# once torch is imported, so the run starts only then (a short run's store is gone before a slow import ends).
LISTER = """
import json, os, select, sys, time
from datetime import timedelta
import torch.distributed as dist
print("ready", flush=True)
ports, buf = [], b""
while True:
    if select.select([0], [], [], 0)[0]:
        chunk = os.read(0, 4096)
        if not chunk:
            break  # the run is over
        buf += chunk
        *lines, buf = buf.split(b"\\n")
        ports += [int(x) for x in lines if x]
    for port in list(ports):
        try:
            s = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
            keys = s.list_keys()
        except Exception:
            continue  # not a store (gloo's sockets refuse it), or not answering yet: tried again
        while True:
            got = {}
            for k in keys:
                try:
                    got[k] = s.get(k).hex()
                except Exception:
                    pass
            print(json.dumps(got), flush=True)
            time.sleep(0.1)
            try:
                keys = s.list_keys()
            except Exception:
                sys.exit(0)
    time.sleep(0.1)
"""


def test_a_live_dp2_runs_store_lists_nothing_usable_to_another_process(tmp_path, monkeypatch):
    """A live ``trainer.dp=2`` run's rendezvous store, listed by another local process while the run goes on (its
    port handed to the lister the moment the store listens, before the ranks are spawned): only opaque 64-hex names
    (it saw the secret as every key's prefix before), and the run trains regardless."""
    from rollyard.cli import main
    from rollyard.trainer import dp

    lister = subprocess.Popen([sys.executable, "-c", LISTER], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert lister.stdout.readline().strip() == "ready"
    found, host = {}, dp._host_store

    def host_and_tell(k, bound_s):  # the port only, as a process watching the machine's listening sockets would find it
        store = host(k, bound_s)
        found.setdefault("ports", []).append(store.port)
        lister.stdin.write(f"{store.port}\n")
        lister.stdin.flush()
        return store

    monkeypatch.setattr(dp, "_host_store", host_and_tell)
    try:
        assert main(["train", "model.context=48", "data.train_size=32", "data.eval_size=4",
                     "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
                     "sft.auto=false", "progress=false", "reward.num_workers=1", "log.plots=false", "steps=2",
                     "trainer.dp=2", "trainer.micro_batch_tokens=64", f"out_dir={tmp_path / 'run'}"]) == 0
    finally:
        out, _ = lister.communicate(timeout=60)  # stdin closed: it ends once no store is left to list
    listings = [json.loads(line) for line in out.splitlines() if line.strip()]
    names = {k for listing in listings for k in listing}
    assert listings and len(names) >= 2, (found, listings)  # it listed the live store: the admission key, the group's
    for name in names:  # HMAC names: no rollyard, gloo or torch key readable (no "/", no word), no secret prefix
        assert re.fullmatch(r"[0-9a-f]{64}", name), name


def test_a_sync_group_rendezvous_and_broadcast_run_through_the_secret_store():
    address, make = SyncGroup.host(2, timeout_s=20)
    joined: list = []
    t = threading.Thread(target=lambda: joined.append(SyncGroup.join(address, 1, 2, timeout_s=20)))
    t.start()
    host = make()
    t.join(timeout=30)
    x = torch.arange(5.0)
    y = torch.zeros(5)
    t = threading.Thread(target=lambda: joined[0].broadcast(y, 0))
    t.start()
    host.broadcast(x, 0)
    t.join(timeout=30)
    assert torch.equal(x, y)


def test_a_peer_that_never_joins_is_an_error_within_the_bound_not_a_long_hang():
    address, make = SyncGroup.host(2, timeout_s=2)  # rank 1 never comes
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        make()
    assert time.monotonic() - t0 < 30
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------- the build lock

HOLD = """
import sys, time
from pathlib import Path
from rollyard.model import kernels
root = kernels.cache_dir()
with kernels.build_lock(root):
    (root / kernels.TORCH_LOCK).write_text("")  # as cpp_extension's build does, mid-way
    print("held", flush=True)
    time.sleep(120)
"""

LOAD = """
import sys
from rollyard import signals
from rollyard.model import kernels
with signals.graceful():
    print("ready", flush=True)
    try:
        lib = kernels.kernel()
    except signals.Stopped as e:
        print(f"stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
print("loaded" if lib is not None else "fallback", flush=True)
"""

# The same wait reached through the engine's fast path, whose fallback catches every Exception.
ENGINE = """
import sys
from rollyard import signals
from rollyard.model.loading import build_preset, char_tokenizer
from rollyard.rollout.engine import RolloutEngine
model = build_preset("small", char_tokenizer(), seed=0, max_position_embeddings=64).eval()
with signals.graceful():
    print("ready", flush=True)
    try:
        RolloutEngine(model, eos_token_id=-1)
    except signals.Stopped as e:
        print(f"stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
print("built", flush=True)
"""


def _cache(tmp_path: Path) -> dict:
    """An environment whose kernel cache is a copy of this machine's (no rebuild when it is there)."""
    env = {**ENV, "XDG_CACHE_HOME": str(tmp_path / "cache"), "ROLLYARD_CPU_KERNELS": "auto"}
    src = kernels.cache_dir()
    if src.is_dir():
        shutil.copytree(src, tmp_path / "cache" / "rollyard" / "kernels" / src.name, symlinks=True)
    return env


def _hold(env: dict) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD], env=env, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@needs_cxx
def test_a_build_killed_with_9_leaves_a_lock_the_next_run_breaks_and_says_so(tmp_path):
    env = _cache(tmp_path)
    holder = _hold(env)
    holder.kill()  # kill -9 mid-build: cpp_extension's lock file stays behind
    holder.wait()
    root = tmp_path / "cache" / "rollyard" / "kernels" / kernels.cache_dir().name
    assert (root / kernels.TORCH_LOCK).exists()
    proc = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["ready", "loaded"], proc.stderr
    assert f"removed a stale CPU-kernel build lock {root / kernels.TORCH_LOCK}" in proc.stderr
    assert "waiting" not in proc.stderr and not (root / kernels.TORCH_LOCK).exists()


@needs_cxx
def test_a_wait_on_a_live_build_hears_sigterm_through_the_engines_fallback(tmp_path):
    env = _cache(tmp_path)
    holder = _hold(env)
    try:
        waiter = subprocess.Popen([sys.executable, "-c", ENGINE], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert waiter.stdout.readline().strip() == "ready"  # its handlers are in place; the wait follows at once
        time.sleep(1.0)
        waiter.send_signal(signal.SIGTERM)
        out, err = waiter.communicate(timeout=30)
        assert waiter.returncode == 143, (out, err)
        assert "stopped by SIGTERM: it was waiting for the CPU-kernel build" in err and "Traceback" not in err
        assert "fast path failed" not in err and "built" not in out  # no fallback swallowed the stop
    finally:
        holder.kill()
        holder.wait()


def test_a_wait_on_a_build_lock_says_whose_it_is_and_is_bounded(tmp_path, capsys):
    env = _cache(tmp_path)
    holder = _hold(env)
    try:
        root = tmp_path / "cache" / "rollyard" / "kernels" / kernels.cache_dir().name
        t0 = time.monotonic()
        with pytest.raises(kernels.BuildWaitTimeout, match=f"waited 2 s for pid {holder.pid}'s build"):
            with kernels.build_lock(root, wait_s=2.0, say_after_s=0.5):
                pass
        assert time.monotonic() - t0 < 10
        said = capsys.readouterr().err.strip().splitlines()
        assert said == [f"[rollyard] waiting for pid {holder.pid}'s build of the CPU kernels in {root} (at most 2 s)"]
    finally:
        holder.kill()
        holder.wait()


@needs_cxx
def test_a_corrupt_cached_library_is_rebuilt_once_and_said(tmp_path):
    env = _cache(tmp_path)
    root = tmp_path / "cache" / "rollyard" / "kernels" / kernels.cache_dir().name
    lib = root / "rollyard_cpu_kernels.so"  # the name a fresh process loads
    if not lib.exists():  # this machine has no cached build to copy yet
        subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300, check=True)
    lib.write_bytes(b"\x7fELF" + b"\0" * 64)  # a truncated, overwritten library: ninja thinks it is up to date
    proc = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["ready", "loaded"], proc.stderr
    assert "does not load" in proc.stderr and "rebuilding it" in proc.stderr, proc.stderr
    assert "not used" not in proc.stderr and str(root) in proc.stderr  # rebuilt where XDG_CACHE_HOME puts the cache
    stamp = lib.stat().st_mtime_ns
    proc = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["ready", "loaded"] and proc.stderr == "", proc.stderr  # healed: the next run says nothing
    assert lib.stat().st_mtime_ns == stamp and len(list(root.glob("*.so"))) == 1  # and reuses it: built once


def test_a_failing_compiler_is_not_called_missing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(kernels, "_STATE", {})
    monkeypatch.setenv("CXX", "false")  # there, but every build fails
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("ROLLYARD_CPU_KERNELS", "auto")
    assert kernels.kernel() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not used" in err[0] and "install" not in err[0], err
    monkeypatch.setenv("ROLLYARD_CPU_KERNELS", "1")
    with pytest.raises(kernels.KernelsRequired) as e:
        kernels.kernel()
    assert "install a C++ compiler" not in str(e.value)
    monkeypatch.setattr(kernels, "_STATE", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(kernels.KernelsRequired, match="install a C\\+\\+ compiler"):
        kernels.kernel()


# ---------------------------------------------------------------------------------------- dp ranks

WATCHED = """
import sys, time
from rollyard import roles
from rollyard.config import load_config
from rollyard.trainer.dp import DataParallelTrainer

if __name__ == "__main__":
    cfg = load_config(None, ["trainer.dp=2", "model.context=64", "trainer.micro_batch_tokens=64",
                             f"out_dir={sys.argv[1]}"])
    model, _, _ = roles.policy(cfg, "cpu")
    dp = DataParallelTrainer(cfg, model, "cpu", watch_grace_s=2)
    print(dp.procs[0].pid, flush=True)
    time.sleep(120)  # rank 0 blocked where no collective fails (as in a group another library builds)
"""


def test_a_rank_killed_while_rank_0_waits_outside_a_collective_ends_the_driver_in_one_line(tmp_path):
    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), proc.communicate(timeout=60)  # the driver's stderr when it ended early
        rank = int(line)
        t0 = time.monotonic()
        os.kill(rank, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1 and time.monotonic() - t0 < 30, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"rollyard train: error: data-parallel trainer rank 1 (pid {rank}) killed by SIGKILL "
                               f"during step 0; rank 0 was blocked where no collective would fail"), lines[0]


def test_a_rank_that_never_joins_is_one_line_within_the_bound_and_sigterm_ends_the_wait(tmp_path):
    from rollyard import signals
    from rollyard.trainer.dp import RendezvousFailed, join_watching

    ctx = torch.multiprocessing.get_context("spawn")
    never = ctx.Process(target=time.sleep, args=(60,), daemon=True, name="rollyard-dp-rank1")  # alive, never joins
    never.start()
    try:
        store = listening_store("127.0.0.1", 2, timedelta(seconds=2))
        t0 = time.monotonic()
        with pytest.raises(RendezvousFailed, match="ranks 1..1 did not all join the process group within 2 s") as e:
            join_watching([never], open_to(store, new_secret(), "here", 2.0), store.port, "cpu", 2.0)
        assert "\n" not in str(e.value) and time.monotonic() - t0 < 20
        assert not dist.is_initialized()
        store = listening_store("127.0.0.1", 2, timedelta(seconds=4))
        with signals.graceful():
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
            t0 = time.monotonic()
            with pytest.raises(signals.Stopped, match="it was waiting for the data-parallel ranks to join"):
                join_watching([never], open_to(store, new_secret(), "here", 4.0), store.port, "cpu", 4.0)
            assert time.monotonic() - t0 < 4
    finally:
        never.kill()
        never.join()
    deadline = time.monotonic() + 15  # the abandoned join ends at its bound: nothing left behind
    while any(t.name == "rollyard-dp-join" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(t.name == "rollyard-dp-join" for t in threading.enumerate()) and not dist.is_initialized()
    # the two abandoned joins left torch's default-group counter advanced in this process: a real dp run after them
    # must still find its ranks (it once waited under group name "2" for ranks writing under "0", to the bound)
    from rollyard.cli import main
    run = tmp_path / "run"
    t0 = time.monotonic()
    assert main(["train", "model.context=48", "data.train_size=16", "data.eval_size=4", "rollout.prompts_per_step=2",
                 "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4", "sft.auto=false", "progress=false", "steps=1",
                 "trainer.dp=2",
                 "trainer.micro_batch_tokens=64", f"out_dir={run}"]) == 0
    assert time.monotonic() - t0 < 100 and not list(run.glob("dp_rank*"))


def test_colocated_vllm_with_data_parallel_ranks_is_refused_at_start_up_in_one_line(tmp_path, capsys):
    from rollyard.cli import main

    assert main(["train", "rollout.backend=vllm", "trainer.dp=2", f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("rollyard train: error: trainer.dp=2 with rollout.backend=vllm needs vLLM out of the "
                             "trainer's process") and "set placement=disaggregated" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
def test_a_rollout_actor_that_never_answers_its_join_is_one_line_within_the_bound():
    import ray

    from rollyard.sync.transport_dist import DistSender, SyncBroken

    @ray.remote(num_cpus=0)
    class Silent:  # a rollout actor stuck before it joins the sync group
        def join(self, *args) -> None:
            time.sleep(600)

    silent = Silent.remote()
    try:
        sender = DistSender(1 << 20, timeout_s=2.0)
        t0 = time.monotonic()
        with pytest.raises(SyncBroken, match="sync group g1: not every one of the 1 rollout worker") as e:
            sender.connect({"w0": silent})
        assert "\n" not in str(e.value) and time.monotonic() - t0 < 30
    finally:
        ray.kill(silent)


def _mute_actor():
    """A real Ray actor whose every method blocks and never answers (a process stuck in C++, a swapped-out one)."""
    import ray

    @ray.remote(num_cpus=0, max_concurrency=4)
    class Mute:
        def info(self) -> dict:
            time.sleep(3600)
            return {}

        def checksum(self, version: int) -> tuple:
            time.sleep(3600)
            return version, ""

    return Mute.remote()


def _ends_within(fn, seconds: float):
    """``fn()`` in a thread of its own: what it raised (or returned) once it ends; fails the test, rather than
    hanging it, when it is still waiting after ``seconds`` (an unbounded ray.get)."""
    out: list = []

    def call() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=call, daemon=True, name="rollyard-test-wait")
    t.start()
    t.join(timeout=seconds)
    assert not t.is_alive(), f"the wait did not end within {seconds} s: unbounded"
    return out[0]


@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
def test_a_ray_actor_that_never_answers_is_one_line_within_the_bound_said_and_heard(capsys):
    import ray

    from rollyard import signals, waits
    from rollyard.placement.rollout_actor import handshake, held_checksums

    mute = _mute_actor()
    try:
        # start-up: the driver's handshake with a rollout worker that never finishes building
        t0 = time.monotonic()
        err = _ends_within(lambda: handshake(mute, "rollout-0", "0" * 64, bound_s=2.0), 30)
        assert isinstance(err, waits.NoAnswer), err
        assert str(err).startswith("rollout worker rollout-0 did not answer its start-up (scheduling, model copy, "
                                   "engine) within 2 s (an answer was expected within 2 s, none came in 2 s);")
        assert "ray status" in str(err) and "\n" not in str(err) and time.monotonic() - t0 < 30
        # the weight check: bounded too, and the driver keeps draining its queue while it waits
        drained: list[int] = []
        err = _ends_within(lambda: held_checksums({"rollout-1": mute}, 3, lambda: drained.append(1), bound_s=2.0), 30)
        assert isinstance(err, waits.NoAnswer) and str(err).startswith(
            "rollout worker rollout-1 did not answer the weight check at version 3"), err
        assert "\n" not in str(err) and len(drained) > 5
        # the word after say_after_s, and a stop signal ends the wait (after its grace), not the bound
        capsys.readouterr()
        with signals.graceful():
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
            t0 = time.monotonic()
            with pytest.raises(signals.Stopped, match="it was waiting for rollout worker rollout-2 to answer a clock "
                                                      "round trip; nothing was lost"):
                waits.get(mute.info.remote(), "rollout worker rollout-2", "a clock round trip", 120.0, "fix",
                          say_after_s=1.0)
            assert time.monotonic() - t0 < waits.STOP_GRACE_S + 10
        said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rollyard: waiting for")]
        assert said == [said[0]] and said[0].startswith(
            "rollyard: waiting for rollout worker rollout-2 to answer a clock round trip ("), said
        assert said[0].endswith("s so far, at most 120 s without an answer)")
        # a rollout worker's loop inside such a wait is not blocked for the driver's look (it ends at its bound)
        from rollyard.placement.rollout_actor import in_bounded_wait, where
        def fetch():
            with pytest.raises(waits.NoAnswer):
                waits.get(mute.info.remote(), "rollout worker rollout-3", "a weight fetch", 3.0, "fix")

        threads = [threading.Thread(target=fetch), threading.Thread(target=time.sleep, args=(3.0,))]
        for t in threads:
            t.start()
        time.sleep(1.0)
        frames = [sys._current_frames()[t.ident] for t in threads]
        assert in_bounded_wait(frames[0]) and not in_bounded_wait(frames[1])
        assert where(frames[0]).startswith("wait_for (waits.py:"), where(frames[0])
        for t in threads:
            t.join()
    finally:
        ray.kill(mute)


def test_a_wait_on_a_stream_is_bounded_by_its_silence_and_a_step_keeps_the_first_signals_promise():
    """``waits.Wait`` as the driver's wait for finished groups uses it: each answer restarts the bound; a wait
    that is part of a step (``stop_grace_s=None``) goes on at a first signal (the step finishes, then the run
    stops), one outside a step ends after its grace."""
    from rollyard import signals, waits

    wait = waits.Wait("the step's request for 4 finished group(s)", 0.6, "fix it", stop_grace_s=None)
    t0 = time.monotonic()
    with signals.graceful():
        os.kill(os.getpid(), signal.SIGTERM)  # heard by the handler: stop_requested() from here on
        while time.monotonic() - t0 < 1.5:  # answers every 0.2 s: never silent for 0.6 s, and the signal is kept
            wait.tick("rollout workers rollout-0")
            time.sleep(0.2)
            wait.heard()
        with pytest.raises(waits.NoAnswer, match="^rollout workers rollout-0 did not answer the step's request for "
                                                 "4 finished group\\(s\\) within 1 s .*; fix it$"):
            while True:
                wait.tick("rollout workers rollout-0")
                time.sleep(0.05)
        outside = waits.Wait("its start-up", 60.0, "fix it", stop_grace_s=0.2)
        with pytest.raises(signals.Stopped, match="it was waiting for rollout-1 to answer its start-up"):
            while True:
                outside.tick("rollout-1")
                time.sleep(0.05)


def test_an_unanswered_wait_ends_the_command_in_one_line_exit_1(monkeypatch, capsys):
    """The CLI reports ``waits.NoAnswer`` as it reports a failed rendezvous: its line after ``error:``, exit 1."""
    from rollyard import cli, waits

    line = ("rollout worker rollout-0 did not answer its start-up (scheduling, model copy, engine) within 1200 s (an "
            "answer was expected within 1200 s, none came in 1200 s); see its error above or in the Ray logs")

    def mute(argv: list[str]) -> int:
        raise waits.NoAnswer(line)

    monkeypatch.setattr(cli, "cmd_train", mute)
    assert cli.main(["train"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"rollyard train: error: {line}"]


@pytest.mark.ray
@pytest.mark.usefixtures("ray_session")
def test_an_actors_own_unanswered_wait_reaches_the_driver_as_its_line():
    """A rollout worker's wait that ends in NoAnswer (its queue put) ends its loop; the driver's ``ray.get`` of that
    loop gets a Ray error that is also a NoAnswer, whose cause is the worker's one line (pool._check_workers)."""
    import ray

    from rollyard import waits

    @ray.remote(num_cpus=0)
    def worker_loop() -> None:
        raise waits.NoAnswer("the run's sample queue did not answer a put within 1 s")

    with pytest.raises(waits.NoAnswer) as e:
        ray.get(worker_loop.remote(), timeout=60)
    assert str(e.value.cause) == "the run's sample queue did not answer a put within 1 s"


# ---------------------------------------------------------------------------------------- caches sweep

def test_a_warm_start_copy_left_by_a_kill_9_is_swept_by_the_next_warm_start(tmp_path):
    from rollyard.config import load_config
    from rollyard.sft import warm_start

    cache = tmp_path / "sft"
    cache.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time; from pathlib import Path; d = Path(sys.argv[1]) / f'0123abcd.tmp{os.getpid()}'; "
        "d.mkdir(); (d / 'model.safetensors').write_bytes(bytes(4096)); print('written', flush=True); time.sleep(60)"),
        str(cache)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "written"
    writer.kill()  # kill -9 mid-write: no cleanup runs
    writer.wait()
    (left,) = cache.glob("*.tmp*")
    live = cache / f"4567cdef.tmp{os.getpid()}"  # a live writer's copy (this process) stays
    live.mkdir()
    cfg = load_config(None, [f"sft.cache_dir={cache}"])
    model, info = warm_start(None, None, [], [], None, cfg, 0, "cpu", log=lambda m: None)
    assert info == {"sft_skipped": "no demonstrations"}
    assert not left.exists() and live.exists()


# ---------------------------------------------------------------------------------------- signals

BLOCKED = """
import sys
from datetime import timedelta
import torch.distributed as dist
from rollyard import signals
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=120))
with signals.graceful():
    print("ready", flush=True)
    try:
        store.wait(["never"])  # blocked in C++, as in a gloo collective: no Python handler runs
    except signals.Stopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
"""

IN_PYTHON = """
import sys, time
from rollyard import signals
with signals.graceful():
    print("ready", flush=True)
    try:
        while True:
            time.sleep(0.05)
    except signals.Stopped as e:
        time.sleep(1.0)  # a short cleanup after the stop
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
"""


def _two_signals(script: str, gap_s: float = 0.5) -> tuple[subprocess.CompletedProcess, float]:
    proc = subprocess.Popen([sys.executable, "-c", script], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(gap_s)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - t0


def test_a_second_sigterm_ends_a_process_blocked_in_cpp_at_once():
    from rollyard.signals import HARD_STOP_S

    proc, took = _two_signals(BLOCKED, gap_s=3.0)
    assert proc.returncode == 143 and took < HARD_STOP_S + 10, (proc.returncode, took, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line]
    assert len(lines) == 2, lines  # the Python handler never ran (blocked): the watcher says both
    assert lines[0] == ("rollyard: SIGTERM received while blocked outside Python: the run stops when that wait ends; "
                        "send it again to stop at once")
    assert lines[1].startswith("rollyard: SIGTERM received twice while blocked outside Python: stopping at once")


def test_a_second_sigterm_heard_in_python_stops_through_its_handler_alone():
    proc, _ = _two_signals(IN_PYTHON)
    assert proc.returncode == 143, proc.stderr
    assert "the step in progress was abandoned" in proc.stderr and "received twice" not in proc.stderr
