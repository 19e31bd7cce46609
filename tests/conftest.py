"""Suite-wide settings: one intra-op thread (tiny models are overhead-bound, and on a busy 2-core
machine a second thread costs more in contention than it gains), Ray without auth or dashboard, and every
test leaving its worker process as it found it (``leaves_no_trace``)."""

import contextlib
import os
import sys
import threading
import time

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Memory: the suite's peak is measured with bench/suite_memory.py (docs/benchmarks.md, beside its time). Ray sizes its
# shared-memory object store from the machine (30% of the available memory) and its memory monitor kills
# workers once the machine passes 95% used, whoever holds the rest. The suite's objects are a few MB (tiny
# models' weights): a 512 MB store bounds what Ray may take whatever the machine, leaving the monitor's
# headroom to other processes (the suite passes with another process holding 8 GB of 24).
os.environ.setdefault("RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES", str(512 << 20))
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def toy_defaults():
    """In-process configs get the toy lr / max_new_tokens the suite was written for (tests/toy_defaults.py)."""
    from toy_defaults import defaults
    with defaults():
        yield


# Leaks. `make test` runs whole files one after another in each pytest-xdist worker, and which files share a worker
# depends on timing: a test that leaves a default torch.distributed process group (vLLM in process makes one of world
# size 1), a Ray session, a child process or a non-daemon thread behind breaks a later file on the same worker, one run
# in several ("trying to initialize the default process group twice!"). So every test is checked after its teardown,
# and every module after its module-scoped fixtures' teardown: what it left is named in one line (an error at its
# teardown), then cleaned up, so the next test starts clean. Allowed: what an active session fixture named
# `ray_session` holds (the Ray session and the processes ray.init started), and the helpers a process keeps for its
# life (multiprocessing's resource tracker and forkserver, the reaper rollyard's Ray session starts).
_RAY_OWNED: dict = {"gcs": None, "pids": set()}  # the ray_session fixture's Ray session (its GCS address), its processes


def _children() -> dict[int, str]:
    """This process's live child processes (not zombies): pid -> a short command line."""
    import psutil

    out = {}
    for p in psutil.Process().children():
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = " ".join(p.cmdline()) or p.name()  # whole: a long venv path must not hide "ray"
        except psutil.Error:  # gone meanwhile
            pass
    return out


def _lifelong_helpers() -> set[int]:
    pids = set()
    mp_tracker = sys.modules.get("multiprocessing.resource_tracker")
    pids.add(getattr(getattr(mp_tracker, "_resource_tracker", None), "_pid", None))
    mp_fork = sys.modules.get("multiprocessing.forkserver")
    pids.add(getattr(getattr(mp_fork, "_forkserver", None), "_forkserver_pid", None))
    watcher = getattr(sys.modules.get("rollyard.placement.cluster"), "_watcher", None)
    pids.add(getattr(watcher, "pid", None))
    compile_pool = _inductor_pools()[1]  # torch.compile's process pool (vLLM compiles): kept for the process's life
    pids.add(getattr(getattr(compile_pool, "process", None), "pid", None))
    pids.update(getattr(compile_pool, "_processes", None) or ())
    return {p for p in pids if p is not None}


def _inductor_pools() -> tuple:
    """torch.compile's compile pools (a thread pool, a process pool) if this process made them: each is made once,
    on a cold compile cache (as on a fresh machine), and kept for the process's life."""
    ac = sys.modules.get("torch._inductor.async_compile")
    if ac is None:
        return None, None
    made = [getattr(ac.AsyncCompile, name) for name in ("pool", "process_pool")]
    return tuple(f() if f.cache_info().currsize else None for f in made)


def _lifelong_threads() -> set:
    threads = getattr(_inductor_pools()[0], "_threads", None)
    return set(threads or ())


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _gcs() -> str | None:
    return sys.modules["ray"].get_runtime_context().gcs_address if _ray_connected() else None


def _state() -> dict:
    return {"pg": torch.distributed.is_available() and torch.distributed.is_initialized(), "ray": _gcs(),
            "children": _children(),
            "threads": {t for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()}
            - _lifelong_threads()}


GRACE_S = 5.0  # what is on its way out gets this long: an executor shut down with wait=False (transformers'
# weight loading), a pool's worker being reaped; on a busy machine that takes a moment, and a test's result may not
# depend on the machine's load. What still runs after it is a leak.


def _owned() -> set[int]:
    """The child processes no test owns: the ray_session fixture's Ray processes (while its session is the one
    connected) and the helpers a process keeps for its life."""
    fixture_ray = _ray_connected() and _RAY_OWNED["gcs"] == _gcs()
    return (_RAY_OWNED["pids"] if fixture_ray else set()) | _lifelong_helpers()


def _new_children(before: dict) -> dict[int, str]:
    return {pid: cmd for pid, cmd in _children().items() if pid not in before["children"] and pid not in _owned()
            and "wandb-core" not in cmd}  # W&B's service: one per process, kept for its life (wandb.teardown)


def _settle(before: dict) -> None:
    """Wait (at most ``GRACE_S`` in all) for the new threads to end and the new child processes to exit."""
    import psutil

    deadline = time.monotonic() + GRACE_S
    for t in _state()["threads"] - before["threads"]:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    procs = []
    for pid in _new_children(before):
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    psutil.wait_procs(procs, timeout=max(0.0, deadline - time.monotonic()))


def _leaks(before: dict) -> tuple[list[str], dict]:
    """What the process holds now that it did not hold in ``before`` (and no ray_session holds), once what is on
    its way out has had ``GRACE_S``: one phrase per kind, and what to clean up."""
    _settle(before)
    now, said = _state(), []
    fixture_ray = now["ray"] is not None and _RAY_OWNED["gcs"] == now["ray"]
    pg = now["pg"] and not before["pg"]
    if pg:
        said.append(f"a default torch.distributed process group ({torch.distributed.get_backend()}, world size "
                    f"{torch.distributed.get_world_size()})")
    ray = now["ray"] is not None and now["ray"] != before["ray"] and not fixture_ray
    if ray:
        said.append("a Ray session it connected (not the ray_session fixture's)")
    kids = _new_children(before)
    if kids:
        said.append(f"{len(kids)} child process{'es' * (len(kids) > 1)} alive ("
                    + "; ".join(f"pid {pid}: {cmd[:100]}" for pid, cmd in sorted(kids.items())) + ")")
    threads = [t for t in now["threads"] - before["threads"] if t.is_alive()]
    if threads:
        said.append(f"{len(threads)} non-daemon thread{'s' * (len(threads) > 1)} running ("
                    + ", ".join(sorted(t.name for t in threads)) + ")")
    return said, {"pg": pg, "ray": ray, "children": kids, "threads": threads}


def _clean(what: dict) -> None:
    import psutil

    if what["pg"]:
        state = sys.modules.get("vllm.distributed.parallel_state")
        if state is not None:  # vLLM's groups over the default one: its own teardown, which destroys that too
            state.destroy_model_parallel()
            state.destroy_distributed_environment()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if what["ray"]:
        sys.modules["ray"].shutdown()
    procs = []
    for pid in what["children"]:
        try:
            p = psutil.Process(pid)
            procs += [*p.children(recursive=True), p]
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    for t in what["threads"]:
        t.join(timeout=2)  # a thread cannot be stopped from outside; one still running is at least not named twice


def _check(before: dict, who: str) -> None:
    said, what = _leaks(before)
    if said:
        _clean(what)
        pytest.fail(f"{who} left behind: {'; '.join(said)}. Close it in the test or its fixture (cleaned up now, for "
                    f"the next test)", pytrace=False)


@pytest.fixture(autouse=True)
def leaves_no_trace(request):
    """Fails (at teardown) the test that leaves a process group, a Ray session, a child process or a non-daemon
    thread behind, naming it; set up before and torn down after the test's own function-scoped fixtures."""
    before = _state()
    yield
    _check(before, request.node.nodeid)


@pytest.fixture(autouse=True, scope="module")
def module_leaves_no_trace(request):
    """The same for a module's module-scoped fixtures (an engine shared by a file's tests)."""
    before = _state()
    yield
    _check(before, f"{request.node.nodeid} (its module-scoped fixtures)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """A test that asks for ``ray_session`` lets its Ray session and Ray's processes outlive it (a session-scoped
    fixture's own setup hooks are not called for this conftest, which is not at the root: the test's are)."""
    result = yield
    if "ray_session" in item.fixturenames and _ray_connected():
        _RAY_OWNED["gcs"] = _gcs()
        _RAY_OWNED["pids"] = {pid for pid, cmd in _children().items() if "/ray/" in cmd}
    return result


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray session per test process (tests marked ``ray`` use it): one for the run, or one per
    pytest-xdist worker under ``make test`` (TEST_WORKERS, each worker a whole file at a time)."""
    import ray

    from rollyard.placement import cluster

    cluster.connect()
    # Owned from here, also when a test asks for it by request.getfixturevalue (not in its fixturenames: the
    # setup hook above does not see it), so a file run alone passes as it does after another Ray file
    _RAY_OWNED["gcs"] = _gcs()
    _RAY_OWNED["pids"] = {pid for pid, cmd in _children().items() if "/ray/" in cmd}
    yield ray
    ray.shutdown()


# The files whose Ray / subprocess tests take longest, started first: `make test` runs whole files on two
# pytest-xdist workers, handed out in collection order, so a long file collected last would run alone at the
# end while the other worker idles (longest first: the last file to start is a short one). Order only: every
# file still runs every test. The list: the files' summed times in `pytest --durations=0` (2026-11-30; before,
# test_waits.py's ~2 min of build and signal tests, collected last by name, ran alone at the end of `make test`).
LONGEST_FIRST = ("test_sync_grid.py", "test_waits.py", "test_restarts.py", "test_placements.py", "test_vllm.py",
                 "test_reliability.py", "test_gkd.py", "test_dp.py", "test_two_nodes.py", "test_tools.py",
                 "test_distill.py", "test_one_lines.py", "test_trl_script.py", "test_dp_faults.py", "test_reference.py",
                 "test_tail_ray.py", "test_cpu_kernels.py", "test_security.py", "test_recipe_loop.py",
                 "test_review_runs.py", "test_warmstart.py", "test_sync.py", "test_orphans.py", "test_determinism.py",
                 "test_ray_dp.py", "test_restart_booking.py", "test_weight_check.py", "test_trainer.py",
                 "test_support_learning.py", "test_memory_peaks.py", "test_output.py", "test_plan.py")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ROLLYARD_TEST_ORDER") == "as-given":  # .ci/run's second pass: the files in its own order
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    their matmuls gain nothing from threads, and on a busy 2-core machine OpenMP's barriers made such files up to
    10x slower with 2 threads than with 1."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
