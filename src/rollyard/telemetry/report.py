"""What a person watching a run sees: the step progress and the end-of-run tables.

On a terminal the progress is a live bar whose description is the latest step's per-role
breakdown. Anywhere else (CI, a pipe, a file) it is one complete line per step, or every
``log.progress_every`` steps and the last, with full role names and never wrapped; third-party
progress bars (transformers' "Writing model shards") are turned off (:func:`quiet_third_party`).
"""

from __future__ import annotations

from statistics import mean

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from rollyard.telemetry import rundir

# soft_wrap: a line longer than the terminal (or rich's 80 columns off one) is never cut or wrapped
console = Console(stderr=False, highlight=False, soft_wrap=True)


def quiet_third_party() -> None:
    """Turn off other libraries' progress bars: ours is the only progress output."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


def step_line(row: dict) -> str:
    """One step's breakdown: ``"rollout 0.412s | reward 0.051s | train 0.230s | sync 0.000s | step 0.70s |
    mean reward 0.41, accuracy 38%"``, full role names."""
    roles = list(rundir.ROLES) + sorted(k[len("time/"):] for k in row if k.startswith("time/")
                                        and k[len("time/"):] not in rundir.ROLES and k != rundir.STEP_TIME)
    parts = [f"{r} {row[rundir.TIME_KEY.format(role=r)]:.3f}s" for r in roles if rundir.TIME_KEY.format(role=r) in row]
    if isinstance(row.get(rundir.STEP_TIME), (int, float)):
        parts.append(f"step {row[rundir.STEP_TIME]:.2f}s")
    acc = f", accuracy {row['reward/accuracy']:.0%}" if "reward/accuracy" in row else ""  # a correctness signal only
    return " | ".join(parts) + f" | mean reward {row.get('reward', 0):.2f}{acc}"


class StepProgress:
    """The RL steps' progress: a live bar on a terminal (``live`` None: when stdout is one and
    ``enabled``), else one line every ``every`` steps (and the last step)."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True, every: int = 1, live: bool | None = None):
        self.total, self.every = total, max(1, every)
        self.live = (enabled and console.is_terminal) if live is None else live
        self._bar = None
        if self.live:
            self._bar = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.description}"), console=console, transient=False,
                                 refresh_per_second=4)
            self._task = self._bar.add_task("", total=total, completed=start)

    def __enter__(self):
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def update(self, row: dict) -> None:
        line = step_line(row)
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=line)
            return
        done = row["step"] + 1
        if done % self.every == 0 or done == self.total:
            console.print(f"step {row['step']} ({done}/{self.total}): {line}", markup=False)


def role_shares(step_seconds: dict[int, dict[str, float]]) -> list[tuple[str, float, float]]:
    """[(role, mean seconds per step, share of the summed role time)] over the run's steps."""
    roles = list(rundir.ROLES) + sorted({r for s in step_seconds.values() for r in s} - set(rundir.ROLES))  # e.g. fsdp's gather
    per_role = {r: [s.get(r, 0.0) for s in step_seconds.values()] for r in roles}
    means = {r: mean(v) if v else 0.0 for r, v in per_role.items()}
    total = sum(means.values()) or 1.0
    return [(r, means[r], means[r] / total) for r in roles]


def fmt_accuracy(acc: float | None) -> str:
    """``"12.5%"``, or ``"no held-out eval"`` when the run has no held-out set."""
    return "no held-out eval" if acc is None else f"{acc:.1%}"


def print_summary(step_seconds: dict[int, dict[str, float]], before: float | None, after: float | None,
                  outside: dict[int, tuple[float, float]] | None = None) -> None:
    """The run's closing lines: each role's mean seconds a step and share of the roles' summed time; with
    ``outside`` (step -> (wall seconds, seconds in no span of the driver's), ``Telemetry.outside``) the mean step and
    what of it no role accounts for, as a share of the step; the held-out accuracy before and after."""
    table = Table(title="where a step's time went (mean per step)")
    table.add_column("role")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for role, secs, share in role_shares(step_seconds):
        table.add_row(role, f"{secs:.3f}", f"{share:.1%}")
    if outside:
        wall, none = mean(w for w, _ in outside.values()), mean(o for _, o in outside.values())
        table.add_row("in no role (driver)", f"{none:.3f}", f"{none / wall:.1%} of the step" if wall > 0 else "")
        table.add_row("step (wall)", f"{wall:.3f}", "")
    console.print(table)
    if before is not None and after is not None:
        console.print(f"held-out greedy accuracy: before RL {before:.1%} -> after RL {after:.1%} "
                      f"({(after - before) * 100:+.1f} points)")
    else:
        console.print("held-out greedy accuracy: no held-out eval (it needs held-out prompts, data.eval_path or a "
                      "data.task, and a correctness signal: the task's verifier, eval.reward or reward.correctness=true)")
