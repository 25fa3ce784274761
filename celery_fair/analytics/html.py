"""One self-contained HTML page of a report (charts inlined as data URIs)."""

from __future__ import annotations

import base64
import html
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from celery_fair.analytics.resources import ranked_tenants

__all__ = ("render_html", "write_html")

QUEUE_COLUMNS = (
    ("share", "share", "{:.2%}"),
    ("target_share", "target", "{:.2%}"),
    ("served_tasks", "tasks", "{:,}"),
    ("wait_p50", "wait p50 s", "{:.4f}"),
    ("wait_p95", "p95", "{:.4f}"),
    ("wait_p99", "p99", "{:.4f}"),
    ("sojourn_p50", "sojourn p50 s", "{:.4f}"),
    ("sojourn_p99", "p99", "{:.4f}"),
    ("throughput_mean", "tasks/s", "{:.1f}"),
    ("codel_requeue_rate", "requeue", "{:.2%}"),
    ("codel_reject_rate", "reject", "{:.2%}"),
    ("recommended_prefetch", "prefetch", "{}"),
    ("codel_target", "CoDel target s", "{:.4g}"),
    ("codel_interval", "interval s", "{:.4g}"),
    ("skew", "routing skew", "{:+.2%}"),
)

STYLE = """
body { font: 14px system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
img { max-width: 100%; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(560px, 1fr)); gap: 1em; }
"""


def _cell(value: Any, spec: str) -> str:
    return "-" if value is None else html.escape(spec.format(value))


def _queue_table(report: dict[str, Any]) -> str:
    head = "".join(f"<th>{html.escape(t)}</th>" for _, t, _ in QUEUE_COLUMNS)
    rows = [f"<tr><th>queue</th>{head}</tr>"]
    for name, q in report["queues"].items():
        cells = "".join(f"<td>{_cell(q.get(k), s)}</td>" for k, _, s in QUEUE_COLUMNS)
        rows.append(f"<tr><td>{html.escape(name)}</td>{cells}</tr>")
    return "<table>" + "".join(rows) + "</table>"


def _when(periods: list[dict[str, Any]]) -> str:
    spans = [
        f"{datetime.fromtimestamp(p['start'], timezone.utc):%Y-%m-%d %H:%M:%S}"
        f"-{datetime.fromtimestamp(p['end'], timezone.utc):%H:%M:%S}"
        for p in periods[:5]
    ]
    more = f" (+{len(periods) - 5} more)" if len(periods) > 5 else ""
    return html.escape(", ".join(spans) + more) if spans else "whole report"


def _noisy_table(report: dict[str, Any]) -> str:
    noisy = report["noisy_tenants"]
    if not noisy:
        return "<p>No noisy tenants.</p>"
    rows = [
        "<tr><th>key</th><th>queue</th><th>share</th><th>share in queue</th>"
        "<th>share over its queues</th><th>rules</th><th>noisy (UTC)</th><th>advice</th></tr>"
    ]
    for n in noisy:
        advice = "<br>".join(html.escape(a) for a in n["advice"])
        rows.append(
            f"<tr><td>{html.escape(n['fair_key'])}</td><td>{html.escape(n['queue'])}</td>"
            f"<td>{_cell(n['share'], '{:.2%}')}</td><td>{_cell(n['share_in_queue'], '{:.2%}')}</td>"
            f"<td>{_cell(n.get('share_all_queues'), '{:.2%}')} ({n.get('queues', 1)})</td>"
            f"<td>{html.escape(', '.join(n['rules']))}</td><td>{_when(n['periods'])}</td>"
            f'<td style="text-align:left">{advice}</td></tr>'
        )
    return "<table>" + "".join(rows) + "</table>"


def _priority_table(report: dict[str, Any]) -> str:
    """Per queue and priority: tasks, waits, and the three largest keys of the level."""
    rows = []
    for queue, levels in (report.get("priorities") or {}).items():
        for priority, level in levels.items():
            rows.append(
                f"<tr><td>{html.escape(queue)}</td><td>{html.escape(priority)}</td>"
                f"<td>{_cell(level.get('tasks'), '{:,}')}</td>"
                f"<td>{_cell(level.get('wait_p50'), '{:.4f}')}</td>"
                f"<td>{_cell(level.get('wait_p99'), '{:.4f}')}</td>"
                f'<td style="text-align:left">{html.escape(level["largest"]) or "-"}</td></tr>'
            )
    if not rows:
        return ""
    head = (
        "<tr><th>queue</th><th>priority</th><th>tasks</th><th>wait p50 s</th>"
        "<th>p99</th><th>largest keys (share of the level)</th></tr>"
    )
    return "<h2>Priorities</h2><table>" + head + "".join(rows) + "</table>"


#: Tenants the resources table shows (queues and keys, largest dominant share first).
RESOURCE_ROWS = 50


def _resource_table(report: dict[str, Any]) -> str:
    """Per queue and key: dominant share, then per resource its share and resource-seconds."""
    section = report.get("resources") or {}
    if not section:
        return ""
    names = list(section["capacity_seconds"])
    head = "".join(f"<th>{html.escape(n)} share</th><th>{html.escape(n)} s</th>" for n in names)
    rows = [
        "<tr><th>queue</th><th>key</th><th>dominant share</th><th>of</th>" + head + "</tr>",
        "<tr><td>(all)</td><td>-</td><td>-</td><td>-</td>"
        + "".join(
            f"<td>{_cell(section['held_share'].get(n), '{:.2%}')}</td>"
            f"<td>{_cell(section['held_seconds'].get(n), '{:,.0f}')}</td>"
            for n in names
        )
        + "</tr>",
    ]
    tenants = ranked_tenants(section)
    for queue, key, f in tenants[:RESOURCE_ROWS]:
        cells = "".join(
            f"<td>{_cell(f['shares'].get(n), '{:.2%}')}</td>"
            f"<td>{_cell(f['held_seconds'].get(n), '{:,.0f}')}</td>"
            for n in names
        )
        rows.append(
            f"<tr><td>{html.escape(queue)}</td><td>{html.escape(key or '-')}</td>"
            f"<td>{_cell(f['dominant_share'], '{:.2%}')}</td>"
            f"<td>{html.escape(f['dominant_resource'] or '-')}</td>{cells}</tr>"
        )
    more = len(tenants) - RESOURCE_ROWS
    note = f"<p>... and {more} more in report.json.</p>" if more > 0 else ""
    capacity = ", ".join(f"{n} {v:,.0f}" for n, v in section["capacity_seconds"].items())
    return (
        "<h2>Resources</h2><p>Held resource-seconds (amount x run time) and their share of "
        f"the workers' capacity-seconds over the report ({html.escape(capacity)}); the "
        "dominant share is the largest of them (a queue's own resource left out).</p>"
        "<table>" + "".join(rows) + "</table>" + note
    )


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def render_html(report: dict[str, Any], charts: dict[str, Path]) -> str:
    """The page as a string: summary tables, recommendations, every chart inlined."""
    meta, jain, rec = report["meta"], report["jain"], report["recommended"]
    jq = "-" if jain["queues_mean"] is None else f"{jain['queues_mean']:.4f}"
    jk = "-" if jain["keys_mean"] is None else f"{jain['keys_mean']:.4f}"
    images = "".join(_image(p) for name, p in charts.items() if name != "overview")
    settings = html.escape(
        f"app.conf.fair_codel_target = {rec['fair_codel_target']!r}\n"
        f"app.conf.fair_codel_interval = {rec['fair_codel_interval']!r}\n"
        f"# prefetch per queue: {rec['prefetch']!r}"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>celery-fair report</title>
<style>{STYLE}</style></head><body>
<h1>celery-fair report</h1>
<p>{meta["records"]:,} task records, windows of {meta["window_seconds"]:g} s.
Jain's fairness index per window, mean: queues {jq}, fairness keys {jk}.</p>
<h2>Queues</h2>{_queue_table(report)}
{_priority_table(report)}
{_resource_table(report)}
<h2>Recommended settings</h2><pre>{settings}</pre>
<h2>Noisy tenants</h2>{_noisy_table(report)}
<h2>Charts</h2><div class="charts">{images}</div>
</body></html>
"""


def write_html(report: dict[str, Any], charts: dict[str, Path], path: Path) -> Path:
    """Write :func:`render_html` to ``path``."""
    path.write_text(render_html(report, charts), encoding="utf-8")
    return path
