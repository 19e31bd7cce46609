"""Plots: no empty axis, no label over the data."""

import pytest

pytest.importorskip("matplotlib")


def test_reward_plot_has_no_empty_axis_and_its_legend_covers_no_data():
    from rollyard.telemetry.plots import reward_figure
    rows = [{"step": i, "reward": 0.1 * i, "reward_std": 0.05, "rewards/a/mean": 0.2, "rewards/b/mean": 0.3}
            for i in range(5)]
    for evals, axes in [([], 1), ([{"step": 0, "accuracy": 0.2}, {"step": 5, "accuracy": 0.6}], 2)]:
        fig = reward_figure(rows, evals)
        fig.canvas.draw()
        assert len(fig.axes) == axes  # no right-hand accuracy axis without a held-out set
        assert ("no held-out eval" in fig.axes[0].get_title()) == (not evals)
        assert not any(t.get_text() for ax in fig.axes for t in ax.texts)  # no label drawn over the lines
        [legend] = fig.legends
        box = legend.get_window_extent()
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent())
