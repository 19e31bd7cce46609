"""Reward worker process: imports one hook, then scores ``(completion, prompt, meta)`` jobs forever.

Started by :class:`rollyard.reward.dispatcher.RewardDispatcher` as ``python .../worker.py`` (run by
file path, so starting one imports neither torch nor rollyard: the start cost is the interpreter
plus the hook's own imports). Standard library only.

Protocol on stdin/stdout, frames of a 4-byte big-endian length and a pickle:
  parent -> worker: first ``{"hook": spec, "sys_path": [...]}``, then ``(job_id, completion, prompt, meta)``
  worker -> parent: ``("ready", pid)`` or ``("init_error", message)``, then
                    ``(job_id, "ok", reward, seconds)`` or ``(job_id, "error", "ExcType: message", seconds)``
EOF on stdin means exit. Anything the hook prints goes to stderr, never into the protocol.
The worker exits quietly (no traceback) when its parent goes away: a watcher thread notices within
a second (not ``PR_SET_PDEATHSIG``: that fires when the spawning *thread* exits, and the dispatcher
spawns replacements from its feeder thread), and a broken pipe ends it without a word.

Before importing the hook, :func:`isolate` applies the init frame's limits: a private working
directory, ``memory_mb`` (address space) and ``cpu_s`` (CPU seconds per call; 0 = no limit).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import pickle
import resource
import struct
import sys
import threading
import time

_HEADER = struct.Struct(">I")


def parse_hook(path: str) -> tuple[str, str, str]:
    """``"module:function"`` or ``"path/to/file.py:function"`` -> ``(kind, target, attr)``; ValueError if malformed.

    ``kind`` is ``"file"`` (target an absolute path) or ``"module"``.
    """
    if not isinstance(path, str) or ":" not in path:
        raise ValueError("expected 'module:function' or 'path/to/file.py:function'")
    target, attr = path.rsplit(":", 1)
    if not target or not attr:
        raise ValueError("expected 'module:function' or 'path/to/file.py:function'")
    if target.endswith(".py") or "/" in target or os.sep in target:
        return "file", os.path.abspath(target), attr
    return "module", target, attr


def import_target(kind: str, target: str):
    """Import the hook's module (by name, or from a file path: its folder is appended to ``sys.path``)."""
    if kind == "module":
        return importlib.import_module(target)
    if not os.path.isfile(target):
        raise FileNotFoundError(f"no such file: {target}")
    name = "rollyard_hook_" + "".join(c if c.isalnum() else "_" for c in target)
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(target)
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def get_attr(module, attr: str):
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def check_reward(value) -> float:
    """The hook's return value as a finite float, or TypeError/ValueError saying what it was."""
    if not isinstance(value, (int, float)):
        item = getattr(value, "item", None)  # numpy / torch scalars
        if callable(item):
            try:
                value = item()
            except Exception:  # noqa: BLE001
                pass
    if not isinstance(value, (int, float)):
        raise TypeError(f"reward hook returned {type(value).__name__} {repr(value)[:40]}, expected a float")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"reward hook returned {value}, expected a finite float")
    return value


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
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


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
        kind, target, attr = init["hook"]
        fn = get_attr(import_target(kind, target), attr)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        _write_frame(proto_out, ("init_error", f"{type(e).__name__}: {e}"))
        return
    _write_frame(proto_out, ("ready", os.getpid()))
    while True:
        job = _read_frame(stdin)
        if job is None:
            return
        job_id, completion, prompt, meta = job
        limit_cpu(float(init.get("cpu_s") or 0.0))
        t0 = time.perf_counter()
        try:
            reward = check_reward(fn(completion, prompt, meta))
            reply = (job_id, "ok", reward, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from a hook are its errors too
            reply = (job_id, "error", f"{type(e).__name__}: {e}", time.perf_counter() - t0)
        _write_frame(proto_out, reply)


if __name__ == "__main__":
    main()
