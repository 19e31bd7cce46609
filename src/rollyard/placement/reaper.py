"""Nothing a run started outlives it: a watcher process for the local Ray session.

A local Ray session is a tree of processes under the driver (GCS, raylet, and the raylet's agents
and workers). ``ray.shutdown()`` stops them on a normal exit, but a driver killed with SIGKILL runs
no exit handler, and some of them (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) then stay up
with no parent, ignoring SIGTERM.

``watch()`` (``cluster.connect`` calls it before ``ray.init``) starts this file as its own process
(its own session, so a signal to the driver's process group does not reach it) with a pipe from the
driver. While the pipe is open it records the driver's descendants every ``POLL_S`` (pid and start
time, so a reused pid is never touched). When the pipe closes (the driver exited, however it
died) it waits ``GRACE_S`` for Ray's own shutdown, then SIGKILLs every recorded process still alive
(and their children), and exits. It imports only the standard library and ``psutil`` (a Ray
dependency).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

POLL_S = 1.0
GRACE_S = 3.0


def watch() -> subprocess.Popen:
    """Start the watcher for this process; keep the returned handle (its stdin is the pipe) alive."""
    return subprocess.Popen([sys.executable, __file__, str(os.getpid())], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)


def _descendants(pid: int, me: int) -> dict[int, float]:
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for p in kids:
        try:
            if p.pid != me:
                out[p.pid] = p.create_time()
        except psutil.Error:
            pass
    return out


def _kill(seen: dict[int, float]) -> None:
    import psutil

    procs = []
    for pid, born in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == born:
                procs += [p, *p.children(recursive=True)]
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def main(driver: int) -> None:
    me, seen = os.getpid(), {}
    fd = sys.stdin.fileno()
    while True:
        seen.update(_descendants(driver, me))
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready and not os.read(fd, 4096):  # EOF: the driver is gone
            break
    deadline = time.time() + GRACE_S
    while time.time() < deadline and any(_alive(pid, born) for pid, born in seen.items()):
        time.sleep(0.2)
    _kill(seen)


def _alive(pid: int, born: float) -> bool:
    import psutil

    try:
        return psutil.Process(pid).create_time() == born
    except psutil.Error:
        return False


if __name__ == "__main__":
    main(int(sys.argv[1]))
