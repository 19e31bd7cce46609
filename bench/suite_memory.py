"""Peak memory of a pytest run: the whole process tree (pytest, its reward workers, dp ranks, Ray's
daemons, workers and actors, vLLM engines), sampled while the tests run.

    .venv/bin/python bench/suite_memory.py                          # the whole suite (as make test runs it)
    .venv/bin/python bench/suite_memory.py tests/test_sync_grid.py  # any pytest arguments
    .venv/bin/python bench/suite_memory.py --hold-gb 8 ...          # with another process holding 8 GB

Every ``--every`` seconds it finds the processes started under the pytest process (its descendants,
by parent pid, and every process of its session: Ray's daemons detach from the parent but not from
the session) and sums their PSS (``/proc/PID/smaps_rollup``: shared pages split between the
processes that map them, so torch's libraries and Ray's shared-memory object store count once) and
their RSS (shared pages counted in every process: an upper bound). It prints the peak of each, the
test running at the peak (from pytest's ``-v`` lines), and the machine's used memory
(``MemTotal - MemAvailable``) at the peak, which includes every other process on the machine.

``--hold-gb N`` first starts a process that allocates and touches N GB and holds it for the whole run
(the issue's "other processes hold 8 GB" condition; its memory is not in the tree's sums); on a shared
machine it lets go at once if the machine's available memory falls under ``--floor-gb`` (and says so).
Sampling misses a peak shorter than ``--every``; the numbers are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _stat(pid: str) -> tuple[int, int] | None:
    """(parent pid, session id) of ``pid``, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[3])


def tree(root: int) -> list[int]:
    """``root``, its descendants and the other processes of its session."""
    parent: dict[int, int] = {}
    session: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(entry)) is not None:
            parent[int(entry)], session[int(entry)] = st
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return sorted(found | {pid for pid, sid in session.items() if sid == root})


def memory_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of ``pid`` in kB; (0, 0) when it is gone or unreadable."""
    pss = rss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
            elif line.startswith("Rss:"):
                rss = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return pss, rss


def _meminfo() -> dict[str, int]:
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}


def used_kb() -> int:
    info = _meminfo()
    return info["MemTotal"] - info["MemAvailable"]


def available_kb() -> int:
    return _meminfo()["MemAvailable"]


def hold(gb: float) -> subprocess.Popen:
    """A process that allocates and touches ``gb`` GB, then sleeps holding it."""
    code = ("import sys, time\nb = bytearray(int(float(sys.argv[1]) * (1 << 30)))\n"
            "for i in range(0, len(b), 4096): b[i] = 1\nprint('held', flush=True)\ntime.sleep(1e9)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(gb)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--every", type=float, default=0.25, help="seconds between samples")
    ap.add_argument("--hold-gb", type=float, default=0.0, help="hold this many GB in another process meanwhile")
    ap.add_argument("--floor-gb", type=float, default=2.0,
                    help="release the held memory at once if the machine's available memory falls under this")
    args, pytest_args = ap.parse_known_args(argv)
    holder = hold(args.hold_gb) if args.hold_gb > 0 else None
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *pytest_args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.time() - t0, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak = {"pss": (0, 0.0, 0, 0), "rss": (0, 0.0, 0, 0)}  # kB, seconds, processes, machine used kB
    released = None
    while proc.poll() is None:
        if holder is not None and available_kb() < args.floor_gb * 2**20:  # the machine is shared: never starve it
            holder.kill()
            holder, released = None, time.time() - t0
        pids = tree(proc.pid)
        mem = [memory_kb(p) for p in pids]
        pss, rss, now = sum(m[0] for m in mem), sum(m[1] for m in mem), time.time() - t0
        if pss > peak["pss"][0]:
            peak["pss"] = (pss, now, len(pids), used_kb())
        if rss > peak["rss"][0]:
            peak["rss"] = (rss, now, len(pids), used_kb())
        time.sleep(args.every)
    reader.join(timeout=5)
    if holder is not None:
        holder.kill()
    wall = time.time() - t0
    tail = [text for _, text in lines if text.startswith(("FAILED", "ERROR"))] + [lines[-1][1] if lines else ""]
    print("\n".join(tail))
    for kind, (kb, at, n, used) in peak.items():
        # pytest -v writes a test's line when it ends: the first line after the peak is the test it was in
        running = next((text.split(" ")[0] for t, text in lines if t >= at and "::" in text), "?")
        print(f"peak {kind.upper()} {kb / 2**20:.2f} GiB at {at:.0f}s of {wall:.0f}s ({n} processes; machine used "
              f"{used / 2**20:.1f} GiB incl. everything else{f', {args.hold_gb:g} GB held' if holder else ''}); "
              f"during {running}")
    if args.hold_gb > 0:
        print(f"{args.hold_gb:g} GB held " + (f"until {released:.0f}s (released: the machine fell under "
                                                 f"{args.floor_gb:g} GB available)" if released else "throughout"))
    print(f"pytest exit code {proc.returncode}, wall {wall:.0f}s")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
