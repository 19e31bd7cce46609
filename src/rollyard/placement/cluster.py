"""Ray for the multi-process placements: join ``RAY_ADDRESS`` or start a local Ray sized to the machine.

A local session is reachable from this machine only and by this run only: its node address is
127.0.0.1, so the GCS, the raylet, the object manager, every agent and every worker listen on
loopback (nothing on 0.0.0.0, ``::`` or the machine's address), there is no dashboard, and Ray's
token authentication is on with a fresh 256-bit token per session (``RAY_AUTH_MODE=token``,
``RAY_AUTH_TOKEN`` in this process's environment, which Ray's processes inherit): another user of
the machine who finds the GCS port is refused without it. Where the installed Ray has no token
authentication, the session still starts, on loopback, and says so once.

A multi-node run joins an existing cluster (``RAY_ADDRESS``): how that cluster listens and whether
it requires a token is its operator's choice (``ray start --node-ip-address``, ``RAY_AUTH_MODE=token``;
docs/security.md), and Ray's own environment variables apply to the connection unchanged.

Workers get this process's ``PYTHONPATH`` (so they import the same ``rollyard``) and one intra-op
thread each. A local session is watched by ``reaper.py``: if this process dies (even by SIGKILL),
nothing Ray started for it is left running.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import signal
import sys
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
    if os.environ.get("RAY_ADDRESS"):
        import ray

        if not ray.is_initialized():
            _init(lambda env: ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=env, log_to_driver=True))
        return
    before = os.environ.get(SINGLE_MACHINE)
    _loopback_only()  # before ``import ray`` where this is the first: its constants are read at import
    import ray

    if ray.is_initialized():
        return
    global _watcher
    _watcher = _watcher or reaper.watch()  # a local session dies with this process, even on kill -9
    _token_auth()
    try:
        # address="local": a new session of this run's own, even where another Ray runs on this machine
        # (`ray start`, another run's cluster); without it ray.init joins the newest one it finds in /tmp/ray
        _init(lambda env: ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, runtime_env=env,
                                   log_to_driver=True, configure_logging=False, _node_ip_address=LOOPBACK))
    finally:  # Ray's processes have it now; a process this one starts later (a cluster of its own) does not
        os.environ.pop(SINGLE_MACHINE, None) if before is None else os.environ.update({SINGLE_MACHINE: before})
    node = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node).is_loopback:  # a Ray that resolves 127.0.0.1 away: refuse, do not expose
        ray.shutdown()
        raise RuntimeError(f"the local Ray session took node address {node}, not {LOOPBACK}: its services would "
                           f"listen beyond this machine; report the Ray version ({ray.__version__}) to rollyard")


LOOPBACK = "127.0.0.1"
SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # Ray's switch: "0" = no multi-node, node address 127.0.0.1


def _init(start) -> None:
    src = str(Path(rollyard.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    env = {"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}}
    prev = signal.getsignal(signal.SIGTERM)
    start(env)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, prev)  # ray.init installs its own; rollyard's (signals.py) stays in charge


def _loopback_only() -> None:
    """Make a local session's node address 127.0.0.1. Ray resolves a loopback ``_node_ip_address`` to the
    machine's address unless multi-node clusters are off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, its
    switch for single-machine sessions, read when ``ray`` is imported: set in the environment for Ray's
    own processes, and on the imported constant when ``ray`` was imported before)."""
    os.environ[SINGLE_MACHINE] = "0"
    if "ray" in sys.modules:
        from ray._private import ray_constants
        ray_constants.ENABLE_RAY_CLUSTER = False


_warned_no_auth = False


def _token_auth() -> bool:
    """Turn on Ray's token authentication with a fresh per-session token; False where this Ray has none."""
    global _warned_no_auth
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # Ray without token authentication: loopback only
        if not _warned_no_auth:
            import ray
            print(f"rollyard: Ray {ray.__version__} has no token authentication; the local Ray session listens "
                  f"on {LOOPBACK} only, so every user of this machine can reach it (a newer Ray adds token authentication)",
                  file=sys.stderr)
            _warned_no_auth = True
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    Config.initialize("")  # Ray reads the mode from its config, cached at first use: re-read it
    AuthenticationTokenLoader.instance().reset_cache()
    return True
