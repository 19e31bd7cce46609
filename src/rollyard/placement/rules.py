"""Placement rules the typed config cannot see alone (one line each, with the fix), and the error a
Ray placement stops with when its rollout workers keep dying."""

from __future__ import annotations

from rollyard.config import ConfigError, RunConfig
from rollyard.env import setup as env_setup
from rollyard.placement import reference

PLACEMENTS = ("colocated", "disaggregated", "async")


class RolloutCrashLoop(RuntimeError):
    """Rollout workers died more often than the restart limit allows within its window; the run stops."""


def check(cfg: RunConfig, ray_cpus: float | None = None) -> None:
    """Raise ``ConfigError`` (one line) for a placement setting that cannot work.

    ``ray_cpus``: the CPUs Ray can give (None: not checked)."""
    if cfg.placement not in PLACEMENTS:
        raise ConfigError(f"placement={cfg.placement!r} is not a placement: expected one of "
                          f"{', '.join(PLACEMENTS)}; set placement=colocated (the default)")
    env_setup.check(cfg)  # tools.*: the tools, and the placements that run them
    reference.check(cfg)  # reference.placement: where the reference model can run
    if cfg.max_staleness < 0:
        raise ConfigError(f"max_staleness must be >= 0 (versions a trained sample may lag), got "
                          f"{cfg.max_staleness}; set max_staleness=0 (on-policy) or more")
    if cfg.rollout.scheduler == "tail" and cfg.trainer.dp > 1:
        raise ConfigError(f"rollout.scheduler=tail runs with one trainer process (colocated streams each group's gradient "
                          f"into it; the Ray placements' tail rounds are not tested with trainer ranks), but "
                          f"trainer.dp={cfg.trainer.dp}; set trainer.dp=1 or rollout.scheduler=plain")
    if cfg.placement == "colocated":
        return
    if cfg.sync.transport == "inprocess":
        raise ConfigError(f"placement={cfg.placement} runs rollout in other processes, so sync.transport=inprocess "
                          f"cannot reach them; set sync.transport=ray (or auto)")
    if cfg.sync.mode == "inprocess":
        raise ConfigError(f"placement={cfg.placement} gives each rollout worker its own model copy, so "
                          f"sync.mode=inprocess (a shared module) cannot reach it; set sync.mode=full, delta or lora "
                          f"(or auto)")
    from rollyard import roles
    from rollyard.sync.factory import resolve
    resolve(cfg, roles.device_of(cfg))  # the mode x transport rules, one line each
    cpus = ray_cpus
    if cpus is not None and cfg.rollout.workers > cpus:
        raise ConfigError(f"rollout.workers={cfg.rollout.workers} needs one CPU each, but Ray can give {cpus:g}; "
                          f"set rollout.workers={max(1, int(cpus))} or fewer")
    if cfg.placement == "async" and cfg.sync.every > cfg.max_staleness + 1:
        raise ConfigError(f"sync.every={cfg.sync.every} leaves samples up to {cfg.sync.every - 1} versions old, over "
                          f"max_staleness={cfg.max_staleness}: no sample could be trained; set "
                          f"max_staleness={cfg.sync.every - 1} or sync.every={cfg.max_staleness + 1}")
