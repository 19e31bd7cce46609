"""Reward worker process: imports the run's hooks, then scores ``(completion, prompt, meta)`` jobs forever.

Started by :class:`rollyard.reward.dispatcher.RewardDispatcher` as ``python .../worker.py`` (run by
file path, so starting one imports neither torch nor rollyard: the start cost is the interpreter
plus the hooks' own imports). Standard library only; loading and calling hooks (the three forms)
is ``hooks.py``, loaded by file path.

Protocol on stdin/stdout, frames of a 4-byte big-endian length and a pickle:
  parent -> worker: first ``{"hooks": [((kind, target, attr), form), ...], "sys_path": [...]}``,
                    then ``(job_id, [(completion, prompt, meta, completion_ids), ...])`` (one call: a
                    sample, or a GRPO group when a hook is batched)
  worker -> parent: ``("ready", pid)`` or ``("init_error", message)``, then
                    ``(job_id, "ok", parts, seconds)``: per sample, one part per hook: ``("ok", float)``,
                    ``("none", None)`` (not scored) or ``("error", "ExcType: message")``
EOF on stdin means exit. Anything the hook prints goes to stderr, never into the protocol.
The worker also exits if its parent process goes away.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
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


def main() -> None:
    proto_out = os.dup(1)
    os.dup2(2, 1)  # the hook's print() goes to stderr, not into the protocol
    stdin = sys.stdin.buffer
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    init = _read_frame(stdin)
    if init is None:
        return
    sys.path[:] = init["sys_path"]
    try:
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
        job_id, items = job
        t0 = time.perf_counter()
        per_hook = [hooks.call_batch(form, fn, items) for form, fn in fns]
        parts = [list(p) for p in zip(*per_hook)] if per_hook else [[] for _ in items]
        _write_frame(proto_out, (job_id, "ok", parts, time.perf_counter() - t0))


if __name__ == "__main__":
    main()
