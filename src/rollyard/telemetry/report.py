"""What a person watching a run sees: a live progress bar and the end-of-run tables."""

from __future__ import annotations

import sys
from statistics import mean

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from rollyard.telemetry import rundir

console = Console(stderr=False, highlight=False)


class StepProgress:
    """A progress bar whose description is the latest step's per-role breakdown."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self.enabled = enabled
        self._bar = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                             TextColumn("{task.description}"), console=console,
                             disable=not enabled, transient=False, refresh_per_second=4)
        self._task = self._bar.add_task("", total=total, completed=start)

    def __enter__(self):
        self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        self._bar.__exit__(*exc)

    def update(self, row: dict) -> None:
        parts = [f"{r[:4]} {row[rundir.TIME_KEY.format(role=r)]:.2f}s" for r in rundir.ROLES
                 if rundir.TIME_KEY.format(role=r) in row]
        desc = " | ".join(parts) + f" | reward {row.get('reward/mean', 0):.2f} acc {row.get('reward/accuracy', 0):.0%}"
        self._bar.update(self._task, advance=1, description=desc)
        if not self.enabled or not sys.stdout.isatty():
            # No live bar (CI, a pipe): one line per step is the progress output.
            console.print(f"step {row['step']}: {desc}")


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


def print_summary(step_seconds: dict[int, dict[str, float]], before: float | None, after: float | None) -> None:
    table = Table(title="where a step's time went (mean per step)")
    table.add_column("role")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for role, secs, share in role_shares(step_seconds):
        table.add_row(role, f"{secs:.3f}", f"{share:.1%}")
    console.print(table)
    if before is not None and after is not None:
        console.print(f"held-out greedy accuracy: before RL {before:.1%} -> after RL {after:.1%} "
                      f"({(after - before) * 100:+.1f} points)")
    else:
        console.print("held-out greedy accuracy: no held-out eval (set data.eval_path, or name data.task)")
