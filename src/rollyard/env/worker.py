"""Tool worker process: imports the run's tools (and environment class), then runs calls forever.

Started by :class:`rollyard.env.executor.ToolExecutor` as ``python .../env/worker.py`` through the
reward pool (``reward/pool.py``), so it speaks the reward worker's framing and start protocol and
applies the same isolation: it loads ``reward/worker.py`` by file path and reuses its frame I/O,
``isolate`` (private working directory, address-space limit) and ``limit_cpu`` (CPU seconds per
call). Standard library only: starting one imports neither torch nor rollyard.

Protocol (4-byte big-endian length + pickle frames):
  parent -> worker: ``{"tools": [(kind, target, attr), ...], "env": (kind, target, attr) | None,
                    "sys_path": [...], "workdir", "memory_mb", "cpu_s", "max_output_bytes"}``, then jobs
                    ``(job_id, op, sid, name, args)`` with ``op``:
                    ``"call"``  run tool ``name(**args)`` (on sample ``sid``'s environment, if any);
                    ``"reset"`` a fresh environment for ``sid``, ``reset(**args)``;
                    ``"reward"`` ``get_reward()`` of ``sid``'s environment, which is then dropped;
                    ``"drop"``  forget ``sid``'s environment.
  worker -> parent: ``("ready", pid)`` or ``("init_error", message)``, then
                    ``(job_id, "ok" | "error", value, seconds, info)``: a call's value is its output as
                    TRL sends it (``str(value)``, a list of content blocks as is; an async tool's
                    awaited), a reset's the string it returned (or None), a reward's a float;
                    ``"error"``'s value is ``"ExcType: message"`` (a tool's exception, an unknown
                    tool or bad arguments: all the model's or the tool's, never the run's).
                    ``info``: ``{"bytes": the output's UTF-8 size before the cut, "cut": bool,
                    "printed_bytes": what the call printed, "printed": its first PRINT_KEEP bytes}``.

Bounded: an output over ``max_output_bytes`` is cut here, before it crosses the pipe, and says so
at its end (:func:`cut_bytes`); a call's print (``print``, ``sys.stderr``, and what C code or a
child process writes to fd 1 and 2) is captured per call into the reply, never the run's console.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import math
import os
import sys
import tempfile
import threading
import time

PRINT_KEEP = 4096  # bytes of a call's print kept in its reply


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_HERE = os.path.dirname(os.path.abspath(__file__))
rw = _load("_rollyard_reward_worker", os.path.join(_HERE, "..", "reward", "worker.py"))


def _run(op: str, sid: str, name: str, args: dict, tools: dict, env_cls, envs: dict):
    if op == "reset":
        env = envs[sid] = env_cls()
        out = env.reset(**args)
        return None if out is None else str(out)
    if op == "drop":
        envs.pop(sid, None)
        return None
    if op == "reward":
        env = envs.pop(sid, None)
        if env is None:
            raise LookupError(f"no environment for sample {sid} (lost with a replaced worker)")
        value = env.get_reward()
        value = float(asyncio.run(value) if inspect.iscoroutine(value) else value)
        if not math.isfinite(value):
            raise ValueError(f"get_reward() returned {value}, expected a finite number")
        return value
    if env_cls is not None:
        env = envs.get(sid)
        if env is None:
            raise LookupError(f"no environment for sample {sid} (lost with a replaced worker)")
        if name.startswith("_") or name in ("reset", "get_reward") or name not in tools:
            raise LookupError(f"unknown tool {name!r}; the tools are {sorted(tools)}")
        fn = getattr(env, name)
    else:
        fn = tools.get(name)
        if fn is None:
            raise LookupError(f"unknown tool {name!r}; the tools are {sorted(tools)}")
    out = fn(**args)
    if inspect.iscoroutine(out):  # an async tool (TRL takes both)
        out = asyncio.run(out)
    return out if isinstance(out, list) else str(out)  # as TRL sends it: str(value), content blocks as they are


def cut_note(total: int, kept: int) -> str:
    return f"\n[tool output cut: {total} bytes, the first {kept} kept]"


def cut_bytes(value, limit: int):
    """``(value within limit UTF-8 bytes, its size before, cut?)``; a str is cut at a character boundary
    and ends with :func:`cut_note`; in a list of content blocks each text block shares the budget in order."""
    if limit <= 0:
        return value, _size(value), False
    if isinstance(value, list):
        total, left, out = _size(value), limit, []
        for block in value:
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                text, _, _ = cut_bytes(block["text"], max(left, 1)) if left > 0 else ("", 0, True)
                left -= len(block["text"].encode("utf-8", "replace"))
                block = {**block, "text": text}
            out.append(block)
        return out, total, total > limit
    raw = str(value).encode("utf-8", "replace")
    if len(raw) <= limit:
        return value, len(raw), False
    return raw[:limit].decode("utf-8", "ignore") + cut_note(len(raw), limit), len(raw), True


def _size(value) -> int:
    if isinstance(value, list):
        return sum(len(b["text"].encode("utf-8", "replace")) for b in value
                   if isinstance(b, dict) and isinstance(b.get("text"), str))
    return len(str(value).encode("utf-8", "replace"))


class _Bounded:
    """A text stream for ``sys.stdout``/``sys.stderr`` during a call: counts every byte, keeps the first ``keep``."""

    def __init__(self, keep: int):
        self.keep, self.n, self.head = keep, 0, []

    def write(self, s: str) -> int:
        b = s.encode("utf-8", "replace")
        if self.n < self.keep:
            self.head.append(b[:self.keep - self.n])
        self.n += len(b)
        return len(s)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _captured(scratch):
    """Capture a call's print: Python's streams into a bounded buffer, fds 1 and 2 into ``scratch`` (a file,
    emptied first). Yields a dict filled on exit with ``printed_bytes`` and ``printed``."""
    got: dict = {}
    py = _Bounded(PRINT_KEEP)
    scratch.seek(0)
    scratch.truncate()
    saved = os.dup(1), os.dup(2)
    old = sys.stdout, sys.stderr
    os.dup2(scratch.fileno(), 1)
    os.dup2(scratch.fileno(), 2)
    sys.stdout = sys.stderr = py
    try:
        yield got
    finally:
        sys.stdout, sys.stderr = old
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        size = os.fstat(scratch.fileno()).st_size
        scratch.seek(0)
        fd_head = scratch.read(max(0, PRINT_KEEP - min(py.n, PRINT_KEEP)))
        got["printed_bytes"] = py.n + size
        got["printed"] = (b"".join(py.head) + fd_head).decode("utf-8", "replace")


def _serve() -> None:
    proto_out = os.dup(1)
    os.dup2(2, 1)  # nothing but the protocol on proto_out; a call's print is captured (_captured)
    stdin = sys.stdin.buffer
    threading.Thread(target=rw._watch_parent, args=(os.getppid(),), daemon=True).start()
    init = rw._read_frame(stdin)
    if init is None:
        return
    sys.path[:] = init["sys_path"]
    try:
        rw.isolate(init)
        hooks = rw._load_hooks_module()
        env_cls = None
        if init.get("env"):
            kind, target, attr = init["env"]
            env_cls = hooks.get_attr(hooks.import_target(kind, target), attr)
            tools = {t[2].rsplit(".", 1)[-1]: None for t in init["tools"]}
        else:
            tools = {t[2].rsplit(".", 1)[-1]: hooks.get_attr(hooks.import_target(t[0], t[1]), t[2])
                     for t in init["tools"]}
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        rw._write_frame(proto_out, ("init_error", f"{type(e).__name__}: {e}"))
        return
    rw._write_frame(proto_out, ("ready", os.getpid()))
    envs: dict = {}
    limit = int(init.get("max_output_bytes") or 0)
    scratch = tempfile.TemporaryFile()  # in the private working directory's file system; emptied per call
    while True:
        job = rw._read_frame(stdin)
        if job is None:
            return
        job_id, op, sid, name, args = job
        rw.limit_cpu(float(init.get("cpu_s") or 0.0))
        t0 = time.perf_counter()
        with _captured(scratch) as info:
            try:
                status, value = "ok", _run(op, sid, name, args, tools, env_cls, envs)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - a tool's failure (sys.exit too) is the model's feedback
                status, value = "error", f"{type(e).__name__}: {e}"[:1000]
        seconds = time.perf_counter() - t0
        if status == "ok" and op == "call":
            value, info["bytes"], info["cut"] = cut_bytes(value, limit)
        rw._write_frame(proto_out, (job_id, status, value, seconds, info))


def main() -> None:
    try:
        _serve()
    except (BrokenPipeError, KeyboardInterrupt):  # the parent went away or is stopping: leave quietly
        os._exit(0)


if __name__ == "__main__":
    main()
