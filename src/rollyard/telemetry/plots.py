"""``rollyard report RUN_DIR``: PNG plots of a run, from its run directory alone.

Four figures in ``RUN_DIR/plots/``:
  - ``reward.png``: reward mean (band: +-std) per step, each reward function's mean when there are
    several, and held-out greedy accuracy at each eval (``eval.jsonl``);
  - ``time.png``: seconds per role per step, stacked (where each step's time went);
  - ``lengths.png``: response length per step (mean, band: min..max);
  - ``staleness.png``: the largest weight-version lag of a trained sample, per step.
Legends sit below the axes, never over the data; without a held-out set ``reward.png`` has no
accuracy axis (its title says so). Needs matplotlib (``rollyard[plots]``); drawn with the Agg
canvas, no display needed.
"""

from __future__ import annotations

from pathlib import Path

from rollyard.config import require_package
from rollyard.telemetry import rundir
from rollyard.telemetry.tracking import current_names

FILES = ("reward.png", "time.png", "lengths.png", "staleness.png")


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _figure(title: str, ylabel: str):
    figure = require_package("matplotlib.figure", "plots", "rollyard report (plots)")
    ticker = require_package("matplotlib.ticker", "plots", "rollyard report (plots)")
    fig = figure.Figure(figsize=(7, 4), dpi=100, layout="constrained")  # makes room for the legend outside
    ax = fig.add_subplot()
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _legend(fig, handles: list, labels: list) -> None:
    """The legend below the axes (outside the plotting area: it never covers a line)."""
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), fontsize="small")


def _save(fig, path: Path) -> Path:
    fig.savefig(path, format="png")
    return path


def _reward(rows: list[dict], evals: list[dict], path: Path) -> Path:
    return _save(reward_figure(rows, evals), path)


def reward_figure(rows: list[dict], evals: list[dict]):
    fig, ax = _figure("reward and held-out accuracy" if evals else "reward (no held-out eval)", "reward")
    x, mean = _series(rows, "reward")
    _, std = _series(rows, "reward_std")
    ax.plot(x, mean, label="reward (mean)", color="C0")
    if len(std) == len(mean):
        ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], color="C0", alpha=0.2)
    hooks = sorted({k for r in rows for k in r if k.startswith("rewards/") and k.endswith("/mean") and k.count("/") == 2})
    for i, key in enumerate(hooks, 1):
        ax.plot(*_series(rows, key), label=key.split("/")[1], color=f"C{i}", linestyle="--")
    handles, labels = ax.get_legend_handles_labels()
    if evals:  # a second axis only when there is something to put on it
        acc = ax.twinx()
        acc.set_ylabel("held-out greedy accuracy")
        acc.set_ylim(0, 1)
        acc.plot([e["step"] for e in evals], [e["accuracy"] for e in evals], "o-", color="k", label="held-out accuracy")
        more = acc.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    _legend(fig, handles, labels)
    return fig


def _time(rows: list[dict], path: Path) -> Path:
    fig, ax = _figure("time per step, by role (stacked)", "seconds")
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for i, role in enumerate(rundir.ROLES):
        key = rundir.TIME_KEY.format(role=role)
        secs = [float(r.get(key, 0.0)) for r in rows]
        if any(secs):
            ax.bar(steps, secs, bottom=bottom, label=role, color=f"C{i}", width=0.9)
            bottom = [b + s for b, s in zip(bottom, secs)]
    _legend(fig, *ax.get_legend_handles_labels())
    return _save(fig, path)


def _lengths(rows: list[dict], path: Path) -> Path:
    fig, ax = _figure("response length", "tokens")
    x, mean = _series(rows, "completions/mean_length")
    _, lo = _series(rows, "completions/min_length")
    _, hi = _series(rows, "completions/max_length")
    ax.plot(x, mean, label="mean", color="C0")
    if len(lo) == len(hi) == len(mean):
        ax.fill_between(x, lo, hi, color="C0", alpha=0.2, label="min..max")
    _legend(fig, *ax.get_legend_handles_labels())
    return _save(fig, path)


def _staleness(rows: list[dict], path: Path) -> Path:
    fig, ax = _figure("staleness (largest weight-version lag of a trained sample)", "versions behind")
    ax.step(*_series(rows, rundir.STALENESS_MAX), where="mid", color="C3")
    ax.set_ylim(bottom=0)
    return _save(fig, path)


def write_plots(run_dir: str | Path) -> list[Path]:
    """Draw the run's plots into ``RUN_DIR/plots/``; RunDirError if it is not a run, MissingPackage
    without matplotlib."""
    run = rundir.require(run_dir, rundir.METRICS)
    rows = [current_names(r) for r in rundir.read_jsonl(run / rundir.METRICS)]  # a run from before the rename too
    if not rows:
        raise rundir.RunDirError(f"{run / rundir.METRICS} is empty: the run has not finished a step yet, nothing to plot")
    evals = list(rundir.read_jsonl(run / rundir.EVAL)) if (run / rundir.EVAL).exists() else []
    out = run / rundir.PLOTS
    out.mkdir(exist_ok=True)
    return [_reward(rows, evals, out / FILES[0]), _time(rows, out / FILES[1]),
            _lengths(rows, out / FILES[2]), _staleness(rows, out / FILES[3])]
