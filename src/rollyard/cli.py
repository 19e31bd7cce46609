"""`rollyard train | sft | plan | review | config`.

Bad input (an unknown config key, a dataset line that does not parse, a reward hook that does not
import, a run directory that is not one) prints one clear message and exits with code 2.
A run that fails on its own (diverging numerics) prints one line and exits 1; SIGINT / SIGTERM
finish the step, checkpoint and exit 130 / 143 (see ``rollyard.signals``); resuming a finished run
says so and exits 0.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

USAGE = """rollyard <command> [args]

commands:
  train   [--config FILE] [--resume RUN_DIR] [key.sub=value ...]   RL training (colocated)
  sft     [--config FILE] [--out DIR] [key.sub=value ...]           warm-start a preset on task demos
  plan    [FILE] [--json] [--out DIR] ...                           price a configuration (bytes, steps/hour)
  review  RUN_DIR [--plan FILE] ...                                 hold a measured run against its plan
  report  RUN_DIR                                                   PNG plots of a run (RUN_DIR/plots/)
  config  [--trl | --verl | --markdown]                              every config key with its default; TRL / verl names
"""


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from rollyard.checkpoint import CheckpointWriteError
    from rollyard.config import ConfigError
    from rollyard.tasks.base import DataError, HookError
    from rollyard.telemetry.rundir import RunDirError
    return ConfigError, DataError, HookError, RunDirError, FileNotFoundError, CheckpointWriteError


def _train_parser(name: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"rollyard {name}")
    p.add_argument("--config", help="TOML or YAML config file")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. rollout.temperature=0.7")
    return p


def cmd_train(argv: list[str]) -> int:
    from rollyard import api
    from rollyard.config import ConfigError, load_config
    from rollyard.signals import graceful

    p = _train_parser("train")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    args = p.parse_intermixed_args(argv)  # overrides may stand before or after the options
    if args.resume and args.config:
        raise ConfigError("--resume uses the run's saved config; pass overrides, not --config")
    from rollyard import checkpoint
    from rollyard.placement import RolloutCrashLoop
    from rollyard.sync.check import WeightsDiffer
    from rollyard.sync.transport_dist import SyncBroken
    from rollyard.trainer.dp import RankDied, RendezvousFailed
    try:
        with graceful():
            api.train(args.config, overrides=args.overrides, resume=args.resume)
    except RendezvousFailed:  # before the first step: its line says its own fix
        raise
    except (RolloutCrashLoop, WeightsDiffer, SyncBroken, RankDied) as e:  # the run stopped itself: say where it can
        # go on from, now that its checkpoint write in flight has settled (the train loop's end waited for it)
        run_dir = args.resume or load_config(args.config, args.overrides).out_dir
        raise type(e)(f"{e}; {checkpoint.resume_hint(run_dir)}") from None
    return 0


def cmd_report(argv: list[str]) -> int:
    from rollyard.telemetry.plots import write_plots

    p = argparse.ArgumentParser(prog="rollyard report")
    p.add_argument("run_dir", help="a run directory written by `rollyard train`")
    args = p.parse_intermixed_args(argv)  # overrides may stand before or after the options
    for path in write_plots(args.run_dir):
        print(path)
    return 0


def cmd_sft(argv: list[str]) -> int:
    from rollyard import roles
    from rollyard.config import load_config
    from rollyard.model.loading import export
    from rollyard.sft import train_sft
    from rollyard.signals import graceful
    from rollyard.telemetry.report import quiet_third_party

    p = _train_parser("sft")
    p.add_argument("--out", default="runs/sft", help="where to write the warm-started model")
    args = p.parse_intermixed_args(argv)  # overrides may stand before or after the options
    cfg = load_config(args.config, args.overrides)
    quiet_third_party()
    device = roles.device_of(cfg)
    model, tokenizer, context = roles.policy(cfg, device)
    train, held = roles.prompts(cfg, [], tokenizer)
    with graceful(), roles.rewards(cfg, tokenizer, model) as rewards:  # SIGTERM / SIGINT stop between SFT steps
        info = train_sft(model, tokenizer, train, held, rewards, cfg, context, device)
    export(model, tokenizer, Path(args.out))
    print(f"warm-started model written to {args.out}: {info}")
    return 0


def cmd_config(argv: list[str]) -> int:
    from rollyard import aliases
    from rollyard.config import describe

    p = argparse.ArgumentParser(prog="rollyard config")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--trl", action="store_true", help="TRL GRPOConfig names and the rollyard keys they set")
    g.add_argument("--verl", action="store_true", help="verl names and the rollyard keys they set")
    g.add_argument("--markdown", action="store_true", help="both mappings as docs/config-mapping.md")
    args = p.parse_args(argv)
    if args.trl or args.verl:
        print(aliases.text(aliases.TRL if args.trl else aliases.VERL))
    elif args.markdown:
        print(aliases.markdown(), end="")
    else:
        print("\n".join(describe()))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    oom = f"rollyard {argv[0]}: error: out of memory {_memory_limit()}"  # built now: no memory later
    limited = resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY
    if limited and argv[0] in ("train", "sft", "config") and not _torch_loads():
        print(oom, file=sys.stderr)
        return 2
    try:
        return _main(argv[0], argv[1:])
    except (MemoryError, ImportError, OSError, SystemError) as e:  # anywhere, imports included: under a tight ulimit -v torch cannot load
        if isinstance(e, ImportError) and "failed to map segment" not in str(e):
            raise
        if isinstance(e, OSError) and e.errno != errno.ENOMEM:
            raise  # ENOMEM: the import system itself could not allocate (listing a package directory)
        # an allocation that failed inside the import system can surface as CPython's "returned NULL without setting
        # an exception" (seen importing torch under ulimit -v 600000): out of memory only where a limit is set
        if isinstance(e, SystemError) and not (limited and "without setting an exception" in str(e)):
            raise
        print(oom, file=sys.stderr)
        dynamo = sys.modules.get("torch._dynamo.utils")  # its exit hook imports more: a second traceback
        if dynamo is not None and hasattr(dynamo, "dump_compile_times"):
            atexit.unregister(dynamo.dump_compile_times)
        return 2


def _torch_loads() -> bool:
    """Whether torch and transformers import in a child process under this process's address-space limit. An
    allocation that fails inside torch's native start-up can abort the process (pybind11's "Invalid
    clear_patients() call", SIGABRT) instead of raising, and nothing in Python can catch that: so under a limit
    the parent imports them only after a child did. A child that fails for a reason other than memory (a module
    that is not installed) leaves the parent to meet the same error and report it."""
    proc = subprocess.run([sys.executable, "-c", "import torch, transformers"], capture_output=True, text=True)
    return proc.returncode == 0 or "No module named" in proc.stderr


def _memory_limit() -> str:
    """The address-space limit this process runs under and the fix, for the out-of-memory line. Under a limit,
    numpy's OpenBLAS is held to one thread (each thread reserves a buffer; under a few hundred MB its thread
    start failed and the import spun forever)."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return "with no address-space limit set: free memory on this machine, or use a smaller model or batch"
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    return (f"under this process's address-space limit of {soft >> 20} MB (ulimit -v {soft >> 10}): torch and "
            f"transformers alone map about 1.5 GB before any model; raise the limit (ulimit -v unlimited, or at "
            f"least 3000000 for the small presets) and run again")


def _main(cmd: str, rest: list[str]) -> int:
    from rollyard.config import env_error
    if why := env_error():
        print(f"rollyard {cmd}: error: {why}", file=sys.stderr)
        return 2
    if cmd in ("train", "sft") and os.environ.get("ROLLYARD_CPU_KERNELS") == "1":
        from rollyard.model.kernels import KernelsRequired, kernel
        try:
            kernel()  # built (or found in the cache) now, so a missing compiler is one line, not a fallback
        except KernelsRequired as e:
            print(f"rollyard {cmd}: error: {e}", file=sys.stderr)
            return 2
    if cmd == "plan":
        from rollyard.plan.command import plan_main
        return plan_main(rest)
    if cmd == "review":
        from rollyard.plan.command import review_main
        return review_main(rest)
    commands = {"train": cmd_train, "sft": cmd_sft, "config": cmd_config, "report": cmd_report}
    if cmd not in commands:
        print(f"rollyard: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    from rollyard.placement import RolloutCrashLoop
    from rollyard.runguard import RunFinished
    from rollyard.signals import Stopped
    from rollyard.sync.check import WeightsDiffer
    from rollyard.sync.transport_dist import SyncBroken
    from rollyard.trainer.dp import RankDied
    from rollyard.trainer.numerics import NumericalError
    from rollyard.waits import NoAnswer
    try:
        return commands[cmd](rest)
    except _bad_input_errors() as e:
        print(f"rollyard {cmd}: error: {e}", file=sys.stderr)
        return 2
    except RunFinished as e:
        print(f"rollyard {cmd}: {e}", file=sys.stderr)
        return 0
    except Stopped as e:
        print(f"rollyard {cmd}: {e}", file=sys.stderr)
        return e.exit_code
    except (NumericalError, RolloutCrashLoop, RankDied, SyncBroken, NoAnswer) as e:
        print(f"rollyard {cmd}: error: {e}", file=sys.stderr)
        return 1
    except WeightsDiffer as e:  # a rollout copy off the trainer's weights: the run stops rather than sample from it
        print(f"rollyard {cmd}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"rollyard {cmd}: interrupted; the latest checkpoint is intact (resume with --resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
