"""``celery-fair report``: the entry point of the Spark report over telemetry.

This module creates the SparkSession (the only place outside the test
fixture that does), runs :func:`celery_fair.analytics.pipeline.compute`,
shapes the results per queue and per key, and writes ``report.json``, the
PNG charts and ``report.html``. The same file runs under ``spark-submit``
(see docs/analytics.md, "On a cluster")::

    spark-submit --master spark://host:7077 celery_fair/analytics/report.py DIR --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if __name__ == "__main__" and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    # spark-submit runs this file as a script, which puts this directory first
    # on sys.path: its html.py would shadow the standard library's html (which
    # matplotlib needs). The package is imported by its full name below.
    del sys.path[0]

from celery_fair.analytics.jvm_archive import Archive, archive_for, spark_conf_dir  # noqa: E402
from celery_fair.analytics.noisy import (  # noqa: E402
    DEFAULT_RULES,
    NoisyRules,
    findings,
    share_across,
)
from celery_fair.analytics.resources import resources_section, summary_lines  # noqa: E402

__all__ = (
    "build_report",
    "check_directory",
    "driver_java_options",
    "format_summary",
    "register",
    "run",
    "session",
    "short_run_conf",
    "written_summary",
)

DEFAULT_MASTER = "local[*]"
#: Local telemetry of at most this many bytes is read by a driver JVM started
#: for a short run (``short_run_conf``). Measured on two cores, tenant-shaped
#: telemetry, in turns (``bench/results/report_ratio_short_run.md``), whole
#: runs: 50,000 records (2.7 MB) 17.2 s against 22.2 s, 2,000,000 (80 MB)
#: 24.9 s against 29.9 s. Nothing larger was measured: the limit is kept well
#: above that, and well below the runs of minutes where the optimising
#: compiler pays for itself.
SHORT_RUN_BYTES = 128 * 2**20
#: The short run's JVM: C1 compiles only (C2's faster code does not pay for
#: its compiling before a run of seconds ends, and on few cores it takes one
#: from the executors), and the parallel collector, which has no concurrent
#: threads of its own as G1 has.
SHORT_RUN_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseParallelGC"
#: Where a user sets the driver JVM's options: with any set, none are added.
#: Spark's launcher also reads ``SPARK_SUBMIT_OPTS`` and ``PYSPARK_SUBMIT_ARGS``
#: (which may name a properties file), and ``java-opts`` in its conf directory.
JAVA_OPTION_SETTINGS = ("spark.driver.extraJavaOptions", "spark.driver.defaultJavaOptions")
JAVA_OPTION_VARIABLES = (
    "JAVA_TOOL_OPTIONS",
    "_JAVA_OPTIONS",
    "JDK_JAVA_OPTIONS",
    "SPARK_SUBMIT_OPTS",
    "PYSPARK_SUBMIT_ARGS",
)
#: The settings with which Spark's launcher starts the driver's JVM (its heap,
#: class path and native libraries; its Java options turn the short run off).
#: Others, ``spark.driver.host`` or ``maxResultSize``, act in the running JVM.
DRIVER_SETTINGS = ("spark.driver.memory", "spark.driver.extraClassPath",
                   "spark.driver.extraLibraryPath")  # fmt: skip
#: Where a local report's Spark listens (see ``session``).
LOOPBACK = "127.0.0.1"


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
    parser.add_argument("--max-keys", type=int, default=100, help="keys per queue in the JSON")
    parser.add_argument("--no-charts", action="store_true", help="skip PNG charts and HTML")
    parser.add_argument(
        "--json", action="store_true", help="print what was written (paths, counts) as JSON"
    )
    parser.add_argument("--driver-memory", default=None, help="spark.driver.memory (local)")
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting (repeatable), e.g. spark.executor.memory=1g",
    )
    noisy = parser.add_argument_group(
        "noisy tenants", "when a fairness key is reported as a noisy tenant (see docs/analytics.md)"
    )
    for field, (flag, kind, text) in _RULE_OPTIONS.items():
        noisy.add_argument(
            flag,
            dest=field,
            type=kind,
            default=getattr(DEFAULT_RULES, field),
            help=text,
        )


# NoisyRules field -> its option, the option's type and help.
_RULE_OPTIONS: dict[str, tuple[str, type, str]] = {
    "share_of_all": ("--noisy-share-of-all", float, "a key's share of all served cost"),
    "share_of_queue": ("--noisy-share-of-queue", float, "a key's share of its queue's cost"),
    "hot_factor": ("--hot-factor", float, "times its even part of its queue"),
    "in_flight_share": ("--noisy-in-flight", float, "over this share of a window's in-flight work"),
    "processing_share": ("--noisy-processing", float, "over this share of a window's run time"),
    "min_tasks": ("--noisy-min-tasks", int, "records a key needs in a window to be judged"),
    "min_in_flight": ("--noisy-min-in-flight", float, "tasks held at once, for the in-flight rule"),
    "min_windows": ("--noisy-min-windows", int, "consecutive noisy windows a key needs"),
    "excess": ("--noisy-excess", float, "every share must be this many times an even split"),
}


def rules_from(args: argparse.Namespace) -> NoisyRules:
    """The noisy-tenant rules the command line asks for (checked: errors name the option)."""
    try:
        return NoisyRules(**{f: getattr(args, f) for f in _RULE_OPTIONS})
    except ValueError as exc:
        message = str(exc)
        for field, (flag, _, _) in _RULE_OPTIONS.items():
            if message.startswith(f"{field}="):
                message = flag + " " + message[len(field) + 1 :]
        raise ValueError(message) from None


def _confs(pairs: list[str]) -> dict[str, str]:
    confs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--conf {pair!r}: must be KEY=VALUE")
        confs[key.strip()] = value.strip()
    return confs


def session(
    master: str | None,
    driver_memory: str | None = None,
    conf: dict[str, str] | None = None,
) -> Any:
    """Create (or, under spark-submit, get) the SparkSession.

    Under ``spark-submit`` the master and the settings are spark-submit's;
    ``master`` and ``conf``, when given, still win (``driver_memory`` cannot:
    the driver's JVM is already running). With a ``local`` master the driver
    and the web UI listen on 127.0.0.1 unless ``SPARK_LOCAL_IP`` says otherwise.
    """
    from pyspark.sql import SparkSession

    submitted = _under_spark_submit()
    builder = SparkSession.builder.appName("celery-fair-report")
    if master is None and not submitted:
        master = DEFAULT_MASTER
    if master is not None:
        builder = builder.master(master)
    if driver_memory:
        builder = builder.config("spark.driver.memory", driver_memory)
    if master is not None and master.startswith("local"):
        # The aggregates are per window and key: a few thousand rows. Spark's
        # default of 200 shuffle partitions is made for clusters.
        builder = builder.config("spark.sql.shuffle.partitions", "8")
        # A local Spark serves this process only: its driver and web UI listen
        # on loopback. Without SPARK_LOCAL_IP Spark binds the driver to the
        # host name's address and the UI to every interface (WebUI.bind); the
        # JVM reads it at launch, so it is set before the session starts. A
        # value the user set wins.
        os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)
    builder = builder.config("spark.sql.session.timeZone", "UTC").config(
        "spark.ui.showConsoleProgress", "false"
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _under_spark_submit() -> bool:
    # spark-submit starts the Python driver with the port of its own JVM.
    return "PYSPARK_GATEWAY_PORT" in os.environ


def _by(rows: list[dict[str, Any]], *keys: str) -> dict[Any, dict[str, Any]]:
    index: dict[Any, dict[str, Any]] = {}
    for row in rows:
        key = row[keys[0]] if len(keys) == 1 else tuple(row[k] for k in keys)
        index[key] = {k: v for k, v in row.items() if k not in keys}
    return index


def _with_totals(rows: list[dict[str, Any]], across: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Key rows with the key's share of all work over every queue (``across_queues``)."""
    totals = {t["fair_key"]: t for t in across}
    return [{**row, **share_across(row, totals)} for row in rows]


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
    # The pipeline collects the most served keys of each queue only.
    truncated = any((r.get("keys_in_queue") or 0) > max_keys for r in ranked)
    for row in ranked:
        per_queue = keys.setdefault(row["queue"], {})
        if len(per_queue) >= max_keys:
            truncated = True
            continue
        skip = ("queue", "fair_key", "keys_in_queue")
        fields = {k: v for k, v in row.items() if k not in skip}
        fields.update(latency.get((row["queue"], row["fair_key"]), {}))
        per_queue[row["fair_key"]] = fields
        queues.setdefault(row["queue"], {})["keys_in_queue"] = row.get("keys_in_queue")

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
            "noisy_rules": data.get("noisy_rules", DEFAULT_RULES.as_dict()),
            "timings": data["timings"],
            # Values out of range, per file and column: left out of every figure.
            "bad_values": data.get("bad_values", []),
        },
        "queues": dict(sorted(queues.items())),
        "keys": {q: keys[q] for q in sorted(keys)},
        "jain": {
            "queues": data["jain_queues"],
            "keys": data["jain_keys"],
            "queues_mean": mean(data["jain_queues"]),
            # Per keyed queue and window; a queue with one key is trivially fair.
            "keys_mean": mean([r for r in data["jain_keys"] if r["n"] > 1]),
            # Past the pipeline's exact_keys, the index over keys is estimated from
            # this many buckets of keys per window and queue (None: exact).
            "keys_buckets": data.get("key_buckets"),
        },
        "throughput": data["throughput"],
        # Tasks published with a Celery priority: waits per level, and the keys'
        # shares within each level (present only when some task had a priority).
        "priorities": _priorities(data),
        # What each queue and key held of the workers' capacity, and each resource's
        # use over time (present only when records carry resources, schema 6).
        "resources": resources_section(data),
        "hot_keys": _with_totals(data["hot_keys"], data.get("across_queues", [])),
        # Keys set aside by their per-key limits, longest first (schema 2 telemetry).
        "throttled_keys": data.get("throttled_keys", []),
        # Keys paused by control fair_key_pause, longest first (schema 4 telemetry).
        "paused_keys": data.get("paused_keys", []),
        "noisy_tenants": findings(
            data.get("noisy_keys", []),
            data.get("noisy_windows", []),
            data["window_seconds"],
            known_keys=data["key_shares"],
            across=data.get("across_queues", []),
            min_windows=data.get("noisy_rules", {}).get("min_windows", DEFAULT_RULES.min_windows),
        ),
        "recommended": {
            "fair_codel_interval": max((r["codel_interval"] or 0.0 for r in recs), default=None),
            "fair_codel_target": max((r["codel_target"] or 0.0 for r in recs), default=None),
            "prefetch": {r["queue"]: r["recommended_prefetch"] for r in recs},
        },
    }


def _priorities(data: dict[str, Any]) -> dict[str, Any]:
    """Per queue and priority: tasks, waits, and the keys' shares within the level."""
    out: dict[str, Any] = {}
    for row in data.get("priority_waits", []):
        level = out.setdefault(row["queue"], {}).setdefault(str(row["priority"]), {})
        level.update({k: v for k, v in row.items() if k not in ("queue", "priority")}, keys={})
    for row in data.get("priority_key_shares", []):
        level = out.setdefault(row["queue"], {}).setdefault(str(row["priority"]), {"keys": {}})
        level["keys"][row["fair_key"]] = {"tasks": row["tasks"], "share": row["share"]}
    for levels in out.values():
        for level in levels.values():
            # The three largest keys of the level, "key 12.3%", for the summaries.
            ranked = sorted(level["keys"].items(), key=lambda kv: -kv[1]["share"])[:3]
            level["largest"] = ", ".join(f"{k} {v['share']:.1%}" for k, v in ranked)
    return {q: dict(sorted(out[q].items(), key=lambda kv: int(kv[0]))) for q in sorted(out)}


def _f(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _period(p: dict[str, Any]) -> str:
    """``2026-11-23 12:00:00-12:03:00 UTC (18 windows; in flight 64%, run time 71%)``."""
    start = datetime.fromtimestamp(p["start"], timezone.utc)
    end = datetime.fromtimestamp(p["end"], timezone.utc)
    shown = end.strftime("%H:%M:%S" if end.date() == start.date() else "%Y-%m-%d %H:%M:%S")
    return (
        f"{start:%Y-%m-%d %H:%M:%S}-{shown} UTC ({p['windows']} windows; in flight "
        f"{p['in_flight_share']:.0%}, run time {p['processing_share']:.0%})"
    )


#: Files and columns with bad values the terminal summary names (the JSON has all).
BAD_VALUES_SHOWN = 5


def _bad_value_lines(bad: list[dict[str, Any]]) -> list[str]:
    """Warnings for values out of range (``meta.bad_values``): counted, left out."""
    if not bad:
        return []
    total = sum(b["count"] for b in bad)
    files = len({b["file"] for b in bad})
    lines = [
        f"WARNING: {total:,} value(s) out of range in {files} file(s) were left out of the "
        "figures (records of an unknown outcome entirely):"
    ]
    lines += [
        f"  {b['file']}: {b['column']} {b['why']}: {b['count']:,}" for b in bad[:BAD_VALUES_SHOWN]
    ]
    if len(bad) > BAD_VALUES_SHOWN:
        lines.append(f"  ... and {len(bad) - BAD_VALUES_SHOWN} more (meta.bad_values in the JSON)")
    return lines


def format_summary(report: dict[str, Any]) -> str:
    """The terminal summary: one line per queue, fairness, settings, noisy tenants."""
    meta = report["meta"]
    lines = [
        f"{meta['records']:,} records, windows of {meta['window_seconds']:g}s",
        *_bad_value_lines(meta.get("bad_values") or []),
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
        f"keys {_f(jain['keys_mean'], '.4f')}"
        + (f" (estimated, {b} buckets of keys)" if (b := jain.get("keys_buckets")) else ""),
        f"recommended: fair_codel_target={_f(rec['fair_codel_target'], '.4g')} "
        f"fair_codel_interval={_f(rec['fair_codel_interval'], '.4g')}",
    ]
    for queue, levels in (report.get("priorities") or {}).items():
        lines.append(f"priorities of {queue}:")
        for priority, level in levels.items():
            lines.append(
                f"  priority {priority:>3}: {level.get('tasks', 0):,} tasks, wait p50 "
                f"{_f(level.get('wait_p50'), '.3f')}s p99 {_f(level.get('wait_p99'), '.3f')}s; "
                f"keys {level['largest'] or '-'}"
            )
    lines += summary_lines(report.get("resources") or {})
    throttled = report.get("throttled_keys") or []
    if throttled:
        shown = ", ".join(
            f"{h['fair_key']} ({h['queue']}) {h['throttled']:.1f}s" for h in throttled[:5]
        )
        lines.append(f"throttled by per-key limits: {shown}")
    paused = report.get("paused_keys") or []
    if paused:
        shown = ", ".join(f"{p['fair_key']} ({p['queue']}) {p['paused']:.1f}s" for p in paused[:5])
        lines.append(f"paused (control fair_key_pause): {shown}")
    noisy = report["noisy_tenants"]
    lines.append("noisy tenants:" + ("" if noisy else " none"))
    for n in noisy[:5]:
        lines += [
            f"  {n['fair_key']} (queue {n['queue']}): {_f(n['share'], '.1%')} of all served "
            f"work, {_f(n['share_in_queue'], '.1%')} of its queue's"
            + (
                f" ({_f(n['share_all_queues'], '.1%')} of all work across its {n['queues']} queues)"
                if n.get("queues", 1) > 1
                else ""
            )
            + f"; {', '.join(n['rules'])}",
            *(f"    noisy {_period(p)}" for p in n["periods"][:3]),
            f"    -> {n['advice'][0]}",
        ]
    if len(noisy) > 5:
        lines.append(f"  ... and {len(noisy) - 5} more in report.json")
    timings = ", ".join(f"{k} {v:.1f}s" for k, v in meta["timings"].items())
    lines.append(f"stages: {timings}")
    return "\n".join(lines)


def check_directory(directory: str) -> None:
    """Refuse a local telemetry ``directory`` that is missing or holds no file to read.

    Spark would answer either with a traceback (a missing path) or with an
    empty report, and only after its JVM started.  A URI of another file
    system (``s3a://``, ``hdfs://``) is left to Spark.  Raises
    :class:`~celery_fair.cli_options.UsageError`.
    """
    from celery_fair.cli_options import UsageError

    path = _local_path(directory)
    if path is None:
        return
    if not path.exists():
        raise UsageError(f"{directory}: no such telemetry directory")
    if next(_telemetry_files(path), None) is None:
        raise UsageError(f"{directory}: no telemetry files in it (an empty directory)")


def _local_path(directory: str) -> Path | None:
    """``directory`` on this machine, or None for a URI of another file system."""
    from urllib.parse import urlsplit

    parsed = urlsplit(directory)
    if parsed.scheme not in ("", "file") and len(parsed.scheme) > 1:  # C:\... is local
        return None
    return Path(parsed.path if parsed.scheme == "file" else directory)


def _telemetry_files(path: Path) -> Iterator[Path]:
    """The files Spark reads at ``path``: a file, or those under a directory.

    A name starting with ``.`` or ``_`` is one Spark skips (``_SUCCESS``,
    ``.crc``), a file's or a directory's. Links to directories are followed,
    as Spark follows them, each directory once.
    """
    if path.is_file():
        yield path
        return
    seen: set[tuple[int, int]] = set()
    for root, dirs, files in os.walk(path, followlinks=True):
        try:
            st = os.stat(root)
        except OSError:  # gone since it was listed
            dirs[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen:  # a link back to a directory walked
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        yield from (Path(root, name) for name in files if not name.startswith((".", "_")))


def short_run_conf(directory: str, master: str | None, conf: dict[str, str]) -> dict[str, str]:
    """The driver JVM's options for a short run, as a Spark setting; ``{}`` where they do not apply.

    They apply to a Spark this process starts with a ``local`` master, over
    local telemetry of at most :data:`SHORT_RUN_BYTES`, and only when
    nothing else sets the driver JVM's options: ``conf`` (the user's
    ``--conf``), ``spark-defaults.conf`` or the JVM's own variables
    (``JAVA_TOOL_OPTIONS``...). A second garbage collector named there would
    stop the JVM from starting.
    """
    if _under_spark_submit() or not (master or DEFAULT_MASTER).startswith("local"):
        return {}
    if any(key in conf for key in JAVA_OPTION_SETTINGS) or _java_options_set_elsewhere():
        return {}
    path = _local_path(directory)
    if path is None or not path.exists():
        return {}
    total = 0
    try:
        for file in _telemetry_files(path):
            total += file.stat().st_size
            if total > SHORT_RUN_BYTES:
                return {}
    except OSError:  # a broken link, a file gone: the size is not known
        return {}
    return {JAVA_OPTION_SETTINGS[0]: SHORT_RUN_JAVA_OPTIONS}


def _java_options_set_elsewhere() -> bool:
    if any(os.environ.get(name) for name in JAVA_OPTION_VARIABLES):
        return True
    conf_dir = spark_conf_dir()
    try:
        defaults = (conf_dir / "spark-defaults.conf").read_text()
    except OSError:
        defaults = ""
    if any(line.strip().startswith(JAVA_OPTION_SETTINGS) for line in defaults.splitlines()):
        return True
    return (conf_dir / "java-opts").exists()


def _with_archive(
    short_run: dict[str, str], driver_memory: str | None, conf: Mapping[str, str]
) -> Archive | None:
    """Add the class archive's options to a short run's (:mod:`.jvm_archive`), in place.

    The archive's launcher arguments are ``--driver-memory`` and the
    :data:`DRIVER_SETTINGS` in ``conf`` (a heap of 32 GB or more has no
    compressed pointers; a class path of its own loads other classes).
    """
    key = JAVA_OPTION_SETTINGS[0]
    launcher: list[str] = ["--driver-memory", driver_memory] if driver_memory else []
    for name in sorted(n for n in conf if n in DRIVER_SETTINGS):
        launcher += ["--conf", f"{name}={conf[name]}"]
    archive = archive_for(short_run[key], launcher) if short_run else None
    extra = archive.java_options() if archive is not None else ""
    if extra:
        short_run[key] = f"{short_run[key]} {extra}"
    return archive


def _jvm_pid(spark: Any) -> int | None:
    """The driver JVM's process id, read from the JVM (None: not reachable)."""
    try:
        return int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    except Exception:  # a driver whose JVM py4j cannot reach: not known
        return None


def driver_java_options(spark: Any, options: str) -> str | None:
    """``options`` if the driver's JVM runs with every one of them, else None.

    Read from the JVM itself: a JVM already running in this process keeps the
    options it started with, whatever the session asked for.
    """
    try:
        bean = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
        running = {str(arg) for arg in bean.getInputArguments()}
    except Exception:  # a driver whose JVM py4j cannot reach: not known
        return None
    return options if set(options.split()) <= running else None


def run(args: argparse.Namespace) -> int:
    """Handler of ``celery-fair report``."""
    from celery_fair.analytics.pipeline import compute
    from celery_fair.cli_options import UsageError

    try:
        rules, conf = rules_from(args), _confs(args.conf)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    check_directory(args.directory)
    short_run = short_run_conf(args.directory, args.master, conf)
    archive = _with_archive(short_run, args.driver_memory, conf)
    conf = {**short_run, **conf}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The chart modules import matplotlib (a second or more of the run): done
    # while Spark starts and computes, which leaves this process waiting.
    charts_imported = None if args.no_charts else _Background(_import_outputs)
    spark = session(args.master, args.driver_memory, conf)
    asked = short_run.get(JAVA_OPTION_SETTINGS[0])
    added = driver_java_options(spark, asked) if asked else None
    if archive is not None and added is not None:
        archive.writer_started(_jvm_pid(spark))
    try:
        data = compute(
            spark,
            args.directory,
            window_seconds=args.window,
            rules=rules,
            max_keys=args.max_keys,
        )
    except BaseException:
        spark.stop()
        raise
    # Stopping Spark takes seconds (executors, web UI, block manager, all in the
    # JVM): it goes on while the outputs are written, in this process.
    stopped = _Background(spark.stop)
    try:
        if not data["records"]:
            print(
                f"celery-fair report: no telemetry records under {args.directory}",
                file=sys.stderr,
            )
            return 1
        report = build_report(data, max_keys=args.max_keys)
        # The options the report added that the driver's JVM runs with (None: none).
        report["meta"]["driver_java_options"] = added
        t0 = time.perf_counter()
        written = {"report.json": out / "report.json"}
        written["report.json"].write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
        if charts_imported is not None:
            charts_imported.result()
            from celery_fair.analytics.charts import write_charts
            from celery_fair.analytics.html import write_html

            charts = write_charts(report, out)
            written["report.html"] = write_html(report, charts, out / "report.html")
            written.update((f"{name}.png", chart) for name, chart in charts.items())
        report["meta"]["timings"]["outputs"] = time.perf_counter() - t0
    finally:
        stopped.result()
    if args.json:
        print(json.dumps(written_summary(report, written, args.directory), indent=2))
        return 0
    print(format_summary(report))
    print(f"\nwrote {out / 'report.json'}" + ("" if args.no_charts else " and report.html"))
    return 0


def _import_outputs() -> None:
    import celery_fair.analytics.charts
    import celery_fair.analytics.html  # noqa: F401 - imported for the writers


class _Background:
    """``fn()`` on a thread of its own; :meth:`result` waits for it and raises what it raised."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the thread waiting in result()
            self._error = exc

    def result(self) -> None:
        """Wait for ``fn`` to return; raise its exception if it raised one."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def written_summary(
    report: dict[str, Any], written: dict[str, Path], directory: str
) -> dict[str, Any]:
    """``report --json``: what was read and written, and how much of it (not the report)."""
    return {
        "directory": directory,
        "records": report["meta"]["records"],
        "queues": len(report["queues"]),
        "keys": sum(len(keys) for keys in report["keys"].values()),
        "noisy_tenants": len(report["noisy_tenants"]),
        "written": {name: str(path) for name, path in written.items()},
    }


def main(argv: list[str] | None = None) -> int:
    """``spark-submit .../report.py DIR [--out OUT]`` lands here."""
    from celery_fair.cli_options import HelpFormatter, UsageError

    parser = argparse.ArgumentParser(prog="celery-fair report", formatter_class=HelpFormatter)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as exc:  # as celery-fair's main says it: one line, status 2
        print(f"celery-fair report: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
