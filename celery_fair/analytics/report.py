"""``celery-fair report``: the entry point of the Spark report over telemetry.

This module creates the SparkSession (the only place outside the test
fixture that does), runs :func:`celery_fair.analytics.pipeline.compute`,
shapes the results per queue and per key, and writes ``report.json``, the
PNG charts and ``report.html``. The same file runs under ``spark-submit``::

    spark-submit --master spark://host:7077 celery_fair/analytics/report.py DIR --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ("build_report", "format_summary", "register", "run", "session")

DEFAULT_MASTER = "local[*]"


def register(subparsers: Any) -> None:
    """Add the ``report`` subcommand to the ``celery-fair`` parser."""
    parser = subparsers.add_parser(
        "report",
        help="analyse recorded telemetry with Spark: shares, fairness, waits, CoDel, keys",
        description=(
            "Read the Parquet telemetry under DIR (from the worker's fair_telemetry_dir or "
            "`celery-fair capture`) and write report.json, PNG charts and report.html to --out."
        ),
    )
    _add_arguments(parser)
    parser.set_defaults(handler=run)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="telemetry directory (local or any URI)")
    parser.add_argument(
        "--master",
        default=None,
        help=f"Spark master (default {DEFAULT_MASTER}; under spark-submit, its own --master)",
    )
    parser.add_argument("--out", default="fair-report", help="output directory (local)")
    parser.add_argument(
        "--window", type=float, default=None, help="seconds per time window (default: auto)"
    )
    parser.add_argument(
        "--hot-factor", type=float, default=5.0, help="a hot key serves this many fair parts"
    )
    parser.add_argument("--max-keys", type=int, default=100, help="keys per queue in the JSON")
    parser.add_argument("--no-charts", action="store_true", help="skip PNG charts and HTML")
    parser.add_argument("--driver-memory", default=None, help="spark.driver.memory (local)")


def session(master: str | None, driver_memory: str | None = None) -> Any:
    """Create (or, under spark-submit, get) the SparkSession."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("celery-fair-report")
    if master is not None:
        builder = builder.master(master)
    elif not _under_spark_submit():
        builder = builder.master(DEFAULT_MASTER)
    if driver_memory:
        builder = builder.config("spark.driver.memory", driver_memory)
    if (master or DEFAULT_MASTER).startswith("local"):
        # The results are per queue and per key: a few hundred rows. Spark's
        # default of 200 shuffle partitions is made for clusters.
        builder = builder.config("spark.sql.shuffle.partitions", "8")
    builder = builder.config("spark.sql.session.timeZone", "UTC").config(
        "spark.ui.showConsoleProgress", "false"
    )
    return builder.getOrCreate()


def _under_spark_submit() -> bool:
    import os

    return "SPARK_SUBMIT_OPTS" in os.environ or "PYSPARK_GATEWAY_PORT" in os.environ


def _by(rows: list[dict[str, Any]], *keys: str) -> dict[Any, dict[str, Any]]:
    index: dict[Any, dict[str, Any]] = {}
    for row in rows:
        key = row[keys[0]] if len(keys) == 1 else tuple(row[k] for k in keys)
        index[key] = {k: v for k, v in row.items() if k not in keys}
    return index


def build_report(data: dict[str, Any], *, max_keys: int = 100) -> dict[str, Any]:
    """Shape the pipeline's rows as the JSON document: per queue, per key, over time."""
    queues: dict[str, dict[str, Any]] = {}
    tables = ("queue_shares", "queue_latency", "codel", "recommendations", "skew")
    for table in tables:
        for queue, fields in _by(data[table], "queue").items():
            queues.setdefault(queue, {}).update(fields)
    tput: dict[str, list[float]] = {}
    for row in data["throughput"]:
        tput.setdefault(row["entity"], []).append(row["tasks_per_second"])
    for queue, values in tput.items():
        if queue in queues:
            queues[queue]["throughput_mean"] = sum(values) / len(values)
            queues[queue]["throughput_max"] = max(values)

    keys: dict[str, dict[str, dict[str, Any]]] = {}
    latency = _by(data["key_latency"], "queue", "fair_key")
    ranked = sorted(data["key_shares"], key=lambda r: (-r["served_cost"], r["fair_key"]))
    truncated = False
    for row in ranked:
        per_queue = keys.setdefault(row["queue"], {})
        if len(per_queue) >= max_keys:
            truncated = True
            continue
        fields = {k: v for k, v in row.items() if k not in ("queue", "fair_key")}
        fields.update(latency.get((row["queue"], row["fair_key"]), {}))
        per_queue[row["fair_key"]] = fields

    def mean(rows: list[dict[str, Any]]) -> float | None:
        values = [r["jain"] for r in rows if r["jain"] is not None]
        return sum(values) / len(values) if values else None

    recs = data["recommendations"]
    return {
        "meta": {
            "records": data["records"],
            "first": data["first"],
            "last": data["last"],
            "window_seconds": data["window_seconds"],
            "keys_truncated_to": max_keys if truncated else None,
            "timings": data["timings"],
        },
        "queues": dict(sorted(queues.items())),
        "keys": {q: keys[q] for q in sorted(keys)},
        "jain": {
            "queues": data["jain_queues"],
            "keys": data["jain_keys"],
            "queues_mean": mean(data["jain_queues"]),
            # Per keyed queue and window; a queue with one key is trivially fair.
            "keys_mean": mean([r for r in data["jain_keys"] if r["n"] > 1]),
        },
        "throughput": data["throughput"],
        "hot_keys": data["hot_keys"],
        "recommended": {
            "fair_codel_interval": max((r["codel_interval"] or 0.0 for r in recs), default=None),
            "fair_codel_target": max((r["codel_target"] or 0.0 for r in recs), default=None),
            "prefetch": {r["queue"]: r["recommended_prefetch"] for r in recs},
        },
    }


def _f(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_summary(report: dict[str, Any]) -> str:
    """The terminal summary: one line per queue, fairness, hot keys, settings."""
    meta = report["meta"]
    lines = [
        f"{meta['records']:,} records, windows of {meta['window_seconds']:g}s",
        "",
        f"  {'queue':<14} {'share':>7} {'target':>7} {'wait p50':>9} {'p99':>9} "
        f"{'sojourn p99':>11} {'requeue':>8} {'reject':>7} {'prefetch':>8}",
    ]
    for name, q in report["queues"].items():
        lines.append(
            f"  {name:<14} {_f(q.get('share'), '7.2%')} {_f(q.get('target_share'), '7.2%')} "
            f"{_f(q.get('wait_p50'), '8.3f')}s {_f(q.get('wait_p99'), '8.3f')}s "
            f"{_f(q.get('sojourn_p99'), '10.3f')}s {_f(q.get('codel_requeue_rate'), '8.2%')} "
            f"{_f(q.get('codel_reject_rate'), '7.2%')} {_f(q.get('recommended_prefetch'), '>8')}"
        )
    jain = report["jain"]
    rec = report["recommended"]
    lines += [
        "",
        f"Jain index per window (mean): queues {_f(jain['queues_mean'], '.4f')}, "
        f"keys {_f(jain['keys_mean'], '.4f')}",
        f"recommended: fair_codel_target={_f(rec['fair_codel_target'], '.4g')} "
        f"fair_codel_interval={_f(rec['fair_codel_interval'], '.4g')}",
    ]
    if report["hot_keys"]:
        hot = ", ".join(
            f"{h['fair_key']} ({h['queue']}, {h['share']:.1%})" for h in report["hot_keys"][:5]
        )
        lines.append(f"hot keys: {hot}")
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in meta["timings"].items())
    lines.append(f"stages: {timings}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Handler of ``celery-fair report``."""
    from celery_fair.analytics.pipeline import compute

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spark = session(args.master, args.driver_memory)
    try:
        data = compute(
            spark, args.directory, window_seconds=args.window, hot_factor=args.hot_factor
        )
    finally:
        spark.stop()
    if not data["records"]:
        print(f"celery-fair report: no telemetry records under {args.directory}", file=sys.stderr)
        return 1
    report = build_report(data, max_keys=args.max_keys)
    t0 = time.perf_counter()
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    if not args.no_charts:
        from celery_fair.analytics.charts import write_charts
        from celery_fair.analytics.html import write_html

        charts = write_charts(report, out)
        write_html(report, charts, out / "report.html")
    report["meta"]["timings"]["outputs"] = time.perf_counter() - t0
    print(format_summary(report))
    print(f"\nwrote {out / 'report.json'}" + ("" if args.no_charts else " and report.html"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``spark-submit .../report.py DIR [--out OUT]`` lands here."""
    parser = argparse.ArgumentParser(prog="celery-fair report")
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
