"""PNG charts of a report (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

__all__ = ("CHARTS", "write_charts")


def _times(rows: list[dict[str, Any]]) -> np.ndarray:
    """Window starts (epoch seconds, UTC) as datetime64, which matplotlib plots as dates."""
    millis = np.array([r["window"] * 1000 for r in rows], dtype=np.float64)
    return millis.astype(np.int64).astype("datetime64[ms]")


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
    rows = report["jain"]["queues"]
    ax.plot(_times(rows), [r["jain"] for r in rows], label="queues (weighted)")
    by_queue: dict[str, list[dict[str, Any]]] = {}
    for row in report["jain"]["keys"]:
        by_queue.setdefault(str(row.get("queue")), []).append(row)
    for queue, rows in sorted(by_queue.items()):
        if any(r["n"] > 1 for r in rows):  # a queue with one key is trivially fair
            ax.plot(_times(rows), [r["jain"] for r in rows], label=f"keys of {queue}")
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
    series: dict[str, list[dict[str, Any]]] = {}
    for row in report["throughput"]:
        series.setdefault(row["entity"], []).append(row)
    for queue, rows in sorted(series.items()):
        ax.plot(_times(rows), [r["tasks_per_second"] for r in rows], label=queue)
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
    ax.barh(labels, [n["share"] or 0.0 for n in noisy], label="of all served cost")
    ax.barh(labels, [n["share_in_queue"] or 0.0 for n in noisy], alpha=0.35, label="of its queue's")
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of served cost")
    ax.set_title("Noisy tenants" if noisy else "Noisy tenants (none)")
    if noisy:
        ax.legend(fontsize="small")


CHARTS = {
    "shares": plot_shares,
    "jain": plot_jain,
    "waits": plot_waits,
    "throughput": plot_throughput,
    "codel": plot_codel,
    "noisy_tenants": plot_noisy_tenants,
}


def write_charts(report: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write one PNG per chart and ``overview.png`` (all of them); return name -> path."""
    paths: dict[str, Path] = {}
    for name, plot in CHARTS.items():
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
