"""PNG charts of a report (matplotlib, no display needed).

Time series are drawn over every window between the report's first and last
record: a window in which a series has no rows is NaN, which matplotlib does
not join, so a line never bridges a stretch without data (the demo pauses
between its scenarios; a worker may have been down). Points are marked, so
a value between two gaps still shows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

__all__ = ("CHARTS", "RESOURCE_CHARTS", "series", "window_grid", "write_charts")


def window_grid(meta: dict[str, Any]) -> np.ndarray:
    """Every window start from the first record's window to the last's (epoch seconds).

    The same floor(t / w) * w as ``transforms.normalize``; empty without records.
    """
    w, first, last = meta["window_seconds"], meta.get("first"), meta.get("last")
    if first is None or last is None:
        return np.array([], dtype=np.float64)
    start = math.floor(first / w) * w
    count = int(round((math.floor(last / w) * w - start) / w)) + 1
    grid: np.ndarray = start + w * np.arange(count, dtype=np.float64)
    return grid


def series(
    rows: Iterable[dict[str, Any]], field: str, grid: Sequence[float] | np.ndarray, window: float
) -> np.ndarray:
    """``field`` of ``rows`` on ``grid``: NaN where no row has that window (or its value is null).

    Rows are placed by index, round((window - grid[0]) / window), so float
    noise in the window starts cannot drop a row.
    """
    values = np.full(len(grid), np.nan)
    if len(grid) == 0:
        return values
    for row in rows:
        i = int(round((row["window"] - grid[0]) / window))
        if 0 <= i < len(grid) and row[field] is not None:
            values[i] = row[field]
    return values


def _times(grid: np.ndarray) -> np.ndarray:
    """Window starts (epoch seconds, UTC) as datetime64, which matplotlib plots as dates."""
    return (grid * 1000).astype(np.int64).astype("datetime64[ms]")


def _plot_series(
    ax: Axes, report: dict[str, Any], rows: list[dict[str, Any]], field: str, label: str
) -> None:
    grid = window_grid(report["meta"])
    values = series(rows, field, grid, report["meta"]["window_seconds"])
    ax.plot(_times(grid), values, marker=".", markersize=3, label=label)
    # Short labels (the date once, then times): the default repeats the date
    # in every label, and they overlap.
    locator = mdates.AutoDateLocator()  # type: ignore[no-untyped-call]
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))  # type: ignore[no-untyped-call]


def plot_shares(ax: Axes, report: dict[str, Any]) -> None:
    names = list(report["queues"])
    share = [report["queues"][q].get("share") or 0.0 for q in names]
    target = [report["queues"][q].get("target_share") or 0.0 for q in names]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], share, 0.4, label="served share")
    ax.bar([x + 0.2 for x in xs], target, 0.4, label="target share", alpha=0.6)
    ax.set_xticks(list(xs), names)
    ax.set_title("Share of served cost vs target (weights)")
    ax.legend()


def plot_jain(ax: Axes, report: dict[str, Any]) -> None:
    _plot_series(ax, report, report["jain"]["queues"], "jain", "queues (weighted)")
    by_queue: dict[str, list[dict[str, Any]]] = {}
    for row in report["jain"]["keys"]:
        by_queue.setdefault(str(row.get("queue")), []).append(row)
    for queue, rows in sorted(by_queue.items()):
        if any(r["n"] > 1 for r in rows):  # a queue with one key is trivially fair
            _plot_series(ax, report, rows, "jain", f"keys of {queue}")
    ax.set_ylim(0, 1.05)
    ax.set_title("Jain's fairness index per window")
    ax.legend()


def plot_waits(ax: Axes, report: dict[str, Any]) -> None:
    names = list(report["queues"])
    xs = range(len(names))
    for i, p in enumerate(("p50", "p95", "p99")):
        values = [report["queues"][q].get(f"wait_{p}") or 0.0 for q in names]
        ax.bar([x + (i - 1) * 0.27 for x in xs], values, 0.27, label=f"wait {p}")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("seconds")
    ax.set_title("Wait, publish -> start")
    ax.legend()


def plot_throughput(ax: Axes, report: dict[str, Any]) -> None:
    by_entity: dict[str, list[dict[str, Any]]] = {}
    for row in report["throughput"]:
        by_entity.setdefault(row["entity"], []).append(row)
    for queue, rows in sorted(by_entity.items()):
        _plot_series(ax, report, rows, "tasks_per_second", queue)
    ax.set_ylabel("tasks / s")
    ax.set_title("Throughput per queue")
    ax.legend(fontsize="small")


def plot_codel(ax: Axes, report: dict[str, Any]) -> None:
    names = list(report["queues"])
    xs = range(len(names))
    req = [report["queues"][q].get("codel_requeue_rate") or 0.0 for q in names]
    rej = [report["queues"][q].get("codel_reject_rate") or 0.0 for q in names]
    ax.bar([x - 0.2 for x in xs], req, 0.4, label="requeue")
    ax.bar([x + 0.2 for x in xs], rej, 0.4, label="reject")
    ax.set_xticks(list(xs), names)
    ax.set_title("CoDel decisions per record")
    ax.legend()


def plot_noisy_tenants(ax: Axes, report: dict[str, Any]) -> None:
    noisy = report["noisy_tenants"][:10][::-1]
    labels = [f"{n['fair_key']} ({n['queue']})" for n in noisy]
    # The share of its queue is at least its share of everything: drawn first, behind.
    ax.barh(labels, [n["share_in_queue"] or 0.0 for n in noisy], alpha=0.35, label="of its queue's")
    ax.barh(labels, [n["share"] or 0.0 for n in noisy], label="of all served cost")
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of served cost")
    ax.set_title("Noisy tenants" if noisy else "Noisy tenants (none)")
    if noisy:
        ax.legend(fontsize="small")


def plot_resource_usage(ax: Axes, report: dict[str, Any]) -> None:
    by_resource: dict[str, list[dict[str, Any]]] = {}
    for row in report["resources"]["usage"]:
        by_resource.setdefault(row["resource"], []).append(row)
    for name, rows in sorted(by_resource.items()):
        _plot_series(ax, report, rows, "held_share", name)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("share of capacity held")
    ax.set_title("Resources held per window (all workers)")
    ax.legend(fontsize="small")


def plot_dominant_shares(ax: Axes, report: dict[str, Any]) -> None:
    from celery_fair.analytics.resources import ranked_tenants

    tenants = ranked_tenants(report["resources"])[:10][::-1]
    labels = [q if k is None else f"{k} ({q})" for q, k, _ in tenants]
    ax.barh(labels, [f["dominant_share"] or 0.0 for _, _, f in tenants])
    for y, (_, _, f) in enumerate(tenants):
        ax.annotate(f" {f['dominant_resource'] or ''}", (f["dominant_share"] or 0.0, y),
                    va="center", fontsize="small")  # fmt: skip
    ax.set_xlim(0, 1.1)
    ax.set_xlabel("dominant share of the capacity over the report")
    ax.set_title("Dominant shares (queues and keys)")


CHARTS = {
    "shares": plot_shares,
    "jain": plot_jain,
    "waits": plot_waits,
    "throughput": plot_throughput,
    "codel": plot_codel,
    "noisy_tenants": plot_noisy_tenants,
}

#: Charts drawn only when records carry resources (not in the overview).
RESOURCE_CHARTS = {
    "resource_usage": plot_resource_usage,
    "dominant_shares": plot_dominant_shares,
}


def write_charts(report: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write one PNG per chart and ``overview.png`` (those of :data:`CHARTS`); return name -> path.

    With resources in the report, the :data:`RESOURCE_CHARTS` too (not in the overview).
    """
    paths: dict[str, Path] = {}
    charts = dict(CHARTS)
    if report.get("resources"):
        charts.update(RESOURCE_CHARTS)
    for name, plot in charts.items():
        fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
        plot(ax, report)
        paths[name] = out / f"{name}.png"
        fig.savefig(paths[name], dpi=90)
        plt.close(fig)
    fig, axes = plt.subplots(2, 3, figsize=(18, 9), layout="constrained")
    for ax, plot in zip(axes.flat, CHARTS.values(), strict=True):
        plot(ax, report)
    fig.suptitle(f"celery-fair report: {report['meta']['records']:,} task records")
    paths["overview"] = out / "overview.png"
    fig.savefig(paths["overview"], dpi=80)
    plt.close(fig)
    return paths
