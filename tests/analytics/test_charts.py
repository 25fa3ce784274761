"""Time series are not drawn across windows without data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import pytest
from matplotlib.lines import Line2D
from matplotlib.path import Path as MplPath
from pyspark.sql import SparkSession

from celery_fair.analytics.charts import plot_jain, plot_throughput, series, window_grid
from celery_fair.analytics.pipeline import compute
from celery_fair.analytics.report import build_report
from tests.harness.synthetic import SyntheticSpec, write_synthetic

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

START = 1_700_000_000.0
# No task starts between 200 s and 300 s: an outage in the middle of the run.
GAPPY = SyntheticSpec(records=30_000, gaps=((200.0, 300.0),), keys_per_queue=5, seed=3)


def runs(line: Line2D) -> int:
    """How many separate pieces matplotlib draws for a line (NaN breaks it)."""
    return sum(code == MplPath.MOVETO for _, code in line.get_path().iter_segments())


def test_series_puts_nan_where_a_window_has_no_row() -> None:
    meta = {"window_seconds": 10.0, "first": 1003.0, "last": 1041.0}
    grid = window_grid(meta)
    assert list(grid) == [1000.0, 1010.0, 1020.0, 1030.0, 1040.0]
    rows = [{"window": 1000.0, "v": 1.0}, {"window": 1030.0, "v": 3.0}]
    rows += [{"window": 1040.0000000001, "v": None}]  # a null is missing data too
    got = series(rows, "v", grid, 10.0)
    np.testing.assert_array_equal(got, [1.0, np.nan, np.nan, 3.0, np.nan])


@pytest.fixture(scope="module")
def gappy_report(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data = tmp_path_factory.mktemp("gappy")
    write_synthetic(GAPPY, data)
    return build_report(compute(spark, str(data), window_seconds=10.0))


def _gap_mask(report: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    grid = window_grid(report["meta"]) - START
    assert grid[0] == 0.0 and grid[-1] == 590.0
    # Window 200 may hold tasks that started just before the gap and ended in it.
    inside = (grid >= 210.0) & (grid < 300.0)
    outside = (grid < 200.0) | (grid >= 300.0)
    return inside, outside


def test_throughput_lines_break_at_the_gap(gappy_report: dict[str, Any], tmp_path: Path) -> None:
    inside, outside = _gap_mask(gappy_report)
    fig, ax = plt.subplots()
    plot_throughput(ax, gappy_report)
    assert len(ax.lines) == 4  # one per queue
    for line in ax.lines:
        y = np.asarray(line.get_ydata(), dtype=float)
        assert np.isnan(y[inside]).all()
        assert np.isfinite(y[outside]).all() and (y[outside] > 0).all()
        assert runs(line) == 2  # before and after the gap, not joined
    fig.savefig(tmp_path / "throughput.png")
    plt.close(fig)


def test_jain_lines_break_at_the_gap(gappy_report: dict[str, Any]) -> None:
    inside, outside = _gap_mask(gappy_report)
    fig, ax = plt.subplots()
    plot_jain(ax, gappy_report)
    assert len(ax.lines) == 5  # the queues, and the keys of each of the 4 queues
    for line in ax.lines:
        y = np.asarray(line.get_ydata(), dtype=float)
        assert np.isnan(y[inside]).all()
        assert np.isfinite(y[outside]).all()
        assert runs(line) == 2
    plt.close(fig)
