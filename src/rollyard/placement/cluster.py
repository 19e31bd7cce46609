"""Ray for the multi-process placements: join ``RAY_ADDRESS`` or start a local Ray sized to the machine.

No dashboard, no auth on a local session, nothing to start by hand. Workers get this process's
``PYTHONPATH`` (so they import the same ``rollyard``) and one intra-op thread each. A local
session is watched by ``reaper.py``: if this process dies (even by SIGKILL), nothing Ray started
for it is left running.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import rollyard
from rollyard.placement import reaper

_watcher = None  # the reaper process watching this driver (placement/reaper.py)


def cpus() -> float:
    """CPUs Ray can give: the cluster's when connected (or ``RAY_ADDRESS`` is set), else this machine's."""
    import ray

    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        connect()
        return float(ray.cluster_resources().get("CPU", 0))
    return float(os.cpu_count() or 1)


def connect() -> None:
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    src = str(Path(rollyard.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    env = {"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}}
    prev = signal.getsignal(signal.SIGTERM)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=env, log_to_driver=True)
    else:
        global _watcher
        _watcher = _watcher or reaper.watch()  # a local session dies with this process, even on kill -9
        ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, runtime_env=env, log_to_driver=True,
                 configure_logging=False)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, prev)  # ray.init installs its own; rollyard's (signals.py) stays in charge
