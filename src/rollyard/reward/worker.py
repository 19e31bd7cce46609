"""Reward worker process: imports the run's hooks, then scores ``(completion, prompt, meta)`` jobs forever.

Started by :class:`rollyard.reward.dispatcher.RewardDispatcher` as ``python .../worker.py`` (run by
file path, so starting one imports neither torch nor rollyard: the start cost is the interpreter
plus the hooks' own imports). Standard library only; loading and calling hooks (the three forms)
is ``hooks.py``, loaded by file path.

Protocol on stdin/stdout, frames of a 4-byte big-endian length and a pickle:
  parent -> worker: first ``{"hooks": [((kind, target, attr), form), ...], "sys_path": [...]}``,
                    then ``(job_id, [(completion, prompt, meta, completion_ids), ...], state)`` (one
                    call: a sample, or the step's batch when a hook is batched; ``state``: the
                    trainer state TRL functions get, ``{"global_step": .., "max_steps": ..}``)
  worker -> parent: ``("ready", pid)`` or ``("init_error", message)``, then
                    ``(job_id, "ok", parts, seconds)``: per sample, one part per hook: ``("ok", float)``
                    (``("ok", float, {key: float})`` with a verl dict's extras),
                    ``("none", None)`` (not scored) or ``("error", "ExcType: message")``
EOF on stdin means exit. Anything the hook prints goes to stderr, never into the protocol.
The worker exits quietly (no traceback) when its parent goes away: a watcher thread notices within
a second (not ``PR_SET_PDEATHSIG``: that fires when the spawning *thread* exits, and the dispatcher
spawns replacements from its feeder thread), and a broken pipe ends it without a word.

Before importing the hook, :func:`isolate` applies the init frame's limits: a private working
directory, ``memory_mb`` (address space) and ``cpu_s`` (CPU seconds per call; 0 = no limit).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import resource
import struct
import sys
import threading
import time

_HEADER = struct.Struct(">I")


def _load_hooks_module():
    """``hooks.py`` next to this file, loaded by path under a private name (a user module named
    ``hooks`` must not shadow it, and importing the ``rollyard`` package would import torch)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hooks.py")
    spec = importlib.util.spec_from_file_location("_rollyard_reward_hooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read_frame(f):
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    body = f.read(n)
    if len(body) < n:
        return None
    return pickle.loads(body)


def _write_frame(fd: int, obj) -> None:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    data = _HEADER.pack(len(body)) + body
    while data:
        data = data[os.write(fd, data):]


def _watch_parent(ppid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(0)


def isolate(init: dict) -> None:
    """Private working directory and resource limits for this worker (from the init frame)."""
    workdir = init.get("workdir")
    if workdir:
        mine = os.path.join(workdir, f"worker-{os.getpid()}")
        os.makedirs(mine, exist_ok=True)
        os.chdir(mine)
    memory_mb = int(init.get("memory_mb") or 0)
    if memory_mb > 0:
        # never above the limits this process inherited (a run under ``ulimit -v`` lower than memory_mb: raising
        # them is refused, and the lower one is the stricter cap anyway)
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        inf = resource.RLIM_INFINITY
        hard = memory_mb << 20 if hard == inf else min(memory_mb << 20, hard)
        soft = hard if soft == inf else min(soft, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def limit_cpu(cpu_s: float) -> None:
    """Let the next call use at most ``cpu_s`` more CPU seconds (SIGXCPU kills the worker past it)."""
    if cpu_s > 0:
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime + cpu_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))


def main() -> None:
    try:
        _serve()
    except (BrokenPipeError, KeyboardInterrupt):  # the parent went away or is stopping: leave quietly
        os._exit(0)


def _serve() -> None:
    proto_out = os.dup(1)
    os.dup2(2, 1)  # the hook's print() goes to stderr, not into the protocol
    stdin = sys.stdin.buffer
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    init = _read_frame(stdin)
    if init is None:
        return
    sys.path[:] = init["sys_path"]
    try:
        isolate(init)
        hooks = _load_hooks_module()
        fns = [(form, hooks.get_attr(hooks.import_target(spec[0], spec[1]), spec[2])) for spec, form in init["hooks"]]
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        _write_frame(proto_out, ("init_error", f"{type(e).__name__}: {e}"))
        return
    _write_frame(proto_out, ("ready", os.getpid()))
    while True:
        job = _read_frame(stdin)
        if job is None:
            return
        job_id, items, state = job
        limit_cpu(float(init.get("cpu_s") or 0.0))
        t0 = time.perf_counter()
        per_hook = [hooks.call_batch(form, fn, items, state) for form, fn in fns]
        parts = [list(p) for p in zip(*per_hook)] if per_hook else [[] for _ in items]
        _write_frame(proto_out, (job_id, "ok", parts, time.perf_counter() - t0))


if __name__ == "__main__":
    main()
