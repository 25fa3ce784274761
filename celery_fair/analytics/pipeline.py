"""Run the transforms over a telemetry directory and collect the small results.

Stages are timed one by one (each ends with actions that collect its
results), which is what ``bench/analytics.py`` reports as time per stage.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from celery_fair.analytics import quantiles as Q
from celery_fair.analytics import transforms as T
from celery_fair.analytics.grains import BucketedKeys, ExactKeys, KeyGrain
from celery_fair.analytics.noisy import DEFAULT_RULES, NoisyRules
from celery_fair.telemetry.schema import RENAMED_COLUMNS, SCHEMA

__all__ = ("NICE_WINDOWS", "compute", "read_telemetry", "spark_ddl")

NICE_WINDOWS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
_SPARK_TYPES = {
    "string": "STRING",
    "double": "DOUBLE",
    "int32": "INT",
    "int64": "BIGINT",
    "map<string, double>": "MAP<STRING, DOUBLE>",
}


#: Distinct keys (estimated) past which keys are bucketed in the usage table.
EXACT_KEYS = 20_000
#: Buckets per window and queue then (Jain's index over keys: see
#: transforms.jain_over_buckets).
KEY_BUCKETS = 1024
#: Spark's setting that plans an aggregation without its partial step.
BYPASS_PARTIAL = "spark.sql.execution.bypassPartialAggregation"
#: Shuffle partitions of the many-keys pass per core: each task's map then
#: holds a sixteenth of a core's share of the keys (10M records, 1M keys on
#: 2 cores: 16 or 32 parts ran faster than 8).
KEY_PARTS_PER_CORE = 16
#: Settings of the many-keys pass, made while it is planned and cached.
#: With a key per ten records or so, a partial aggregation before the
#: shuffle finds almost no key twice in a partition: it builds a map of every
#: key and emits about a row per record anyway. Without it (Spark >= 4.3;
#: earlier versions ignore the setting) the per-key figures took 8 s instead
#: of 11 (10M records, 1M keys). Adaptive execution is off so that the plan
#: made is the plan run: one shuffle, read by both of its aggregations
#: (``transforms.keys_and_buckets``).
KEY_PASS_CONF = {BYPASS_PARTIAL: "true", "spark.sql.adaptive.enabled": "false"}
#: Settings of the latency pass, made while it runs and is cached. Its
#: partial aggregation meets every (key, metric, bucket) of the report in
#: each task: 614,000 of them for 10M records with 100 keys shown in each of
#: 8 queues. Spark's first-level map holds 65,536 (2^16) by default and sends
#: the rest to its general map; at 2^21 they all fit (the map's bucket array
#: is then 16 MiB per task). The pass, cached, took 5.9 s instead of 7.2
#: (medians of 4 runs taking turns, 10M records on local[2]).
LATENCY_PASS_CONF = {"spark.sql.codegen.aggregate.fastHashMap.capacityBit": "21"}


def spark_ddl() -> str:
    """The telemetry schema as a Spark DDL string (read with it, never inferred)."""
    return ", ".join(f"`{f.name}` {_SPARK_TYPES[str(f.type)]}" for f in SCHEMA)


def read_telemetry(spark: SparkSession, path: str) -> DataFrame:
    """All Parquet files under ``path`` (hidden temporary files are skipped).

    A column an earlier schema version named otherwise is read under its
    current name (:data:`~celery_fair.telemetry.schema.RENAMED_COLUMNS`).
    """
    old = ", ".join(
        f"`{name}` {_SPARK_TYPES[str(SCHEMA.field(new).type)]}"
        for name, new in RENAMED_COLUMNS.items()
    )
    reader = spark.read.schema(f"{spark_ddl()}, {old}").option("recursiveFileLookup", "true")
    df = reader.parquet(path)
    for name, new in RENAMED_COLUMNS.items():
        df = df.withColumn(new, F.coalesce(F.col(new), F.col(name))).drop(name)
    return df


def _rows(df: DataFrame, order: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Collect a small result; sorted here, since orderBy would cost a sampling job."""
    rows = [row.asDict() for row in df.collect()]
    if order:
        rows.sort(key=lambda r: tuple((r[c] is None, r[c]) for c in order))
    return rows


def auto_window(span: float, windows: int = 60) -> float:
    """The smallest round window size giving at most ``windows`` windows over ``span``."""
    for size in NICE_WINDOWS:
        if span / size <= windows:
            return float(size)
    return float(math.ceil(span / windows))


@contextmanager
def _session_conf(spark: SparkSession, settings: dict[str, str]) -> Iterator[None]:
    """Set runtime SQL settings for a block, then restore the caller's."""
    before: dict[str, str | None] = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, old in before.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)


def _bad_values(per_file: list[Any]) -> list[dict[str, Any]]:
    """``bad_value_counts`` rows -> one entry per file and rule with bad values, largest first."""
    found = [
        {"file": row["file"], "column": rule.column, "why": rule.why, "count": int(n)}
        for row in per_file
        for rule in T.RULES
        if (n := row[rule.name])
    ]
    return sorted(found, key=lambda b: (-b["count"], b["file"], b["column"]))


def _resources(raw: DataFrame, window: float, max_keys: int) -> dict[str, Any]:
    """What tenants held of the workers' capacity (:mod:`~.transforms.resources`).

    Two jobs: the use per window and resource (what was held, and the
    workers' capacity), then per queue and key the shares of the report's
    capacity-seconds, summed from the first job's rows.
    """
    held = raw.transform(T.held_rows)
    usage = _rows(
        held.transform(T.held_by_window, window).transform(
            T.resource_usage, raw.transform(T.capacity_by_window, window)
        ),
        ("window", "resource"),
    )
    capacity: dict[str, float] = {}
    for row in usage:
        capacity[row["resource"]] = capacity.get(row["resource"], 0.0) + row["capacity_seconds"]
    shares = held.transform(T.tenant_held).transform(T.resource_shares, capacity, max_keys)
    return {
        "resource_usage": usage,
        "resource_shares": _rows(shares, ("queue", "fair_key")),
    }


def _concurrently(
    workers: int, **jobs: Callable[[], list[dict[str, Any]]]
) -> dict[str, list[dict[str, Any]]]:
    """Run each of ``jobs`` (Spark actions collecting small tables) on ``workers`` threads.

    A job over a cached table of a few thousand rows costs the driver more
    than the executors: it is analysed, optimised, planned and its code
    compiled on one thread, then runs in milliseconds. With two at a time,
    one is planned while the other runs (Spark takes actions from several
    threads; they read the same caches). Each job's rows are what it would
    return alone: only the order in which they start changes. An exception
    of a job is raised here, after the others have finished.
    """
    if workers < 2 or len(jobs) < 2:
        return {name: job() for name, job in jobs.items()}
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


@contextmanager
def _stage(timings: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - t0


def compute(
    spark: SparkSession,
    path: str,
    *,
    window_seconds: float | None = None,
    rules: NoisyRules = DEFAULT_RULES,
    max_keys: int = 100,
    exact_keys: int = EXACT_KEYS,
    key_buckets: int = KEY_BUCKETS,
    exact_windows: int = T.MASK_BITS,
    on_stage: Callable[[str, float], None] | None = None,
) -> dict[str, Any]:
    """Compute every figure of the report; returns plain lists of row dicts.

    Three passes over the telemetry: the time span (three columns, to size
    the windows), ``usage_by_window`` (every additive figure) and the latency
    histograms, both cached: they are windows x keys and buckets x keys rows,
    not records. Every other table is computed from those two. Per key, only
    the ``max_keys`` most served keys of each queue are collected.

    Past ``exact_keys`` distinct keys (estimated in the first pass), a row
    per window and key would be about a row per record. Then one shuffle of
    the tasks gives both a row per key over the report and the usage table
    with ``key_buckets`` buckets of keys per window and queue (every
    per-queue figure stays exact): see
    :func:`~celery_fair.analytics.transforms.keys_and_buckets`. The key rows
    also count the keys of each window while there are at most
    ``exact_windows`` (up to 64; past them a pass estimates them), Jain's
    index over keys is estimated from the buckets, and the noisy-window
    rules look inside the buckets they flag.

    The usage pass also counts the records with values out of range
    (:mod:`~celery_fair.analytics.transforms.validation`). With any, two
    passes more: their count per file and rule (``bad_values``), and the
    usage again without them; every later figure reads the telemetry without
    them too.

    Records with a worker's capacity (resources on, schema 6; counted in the
    first pass) add a stage of two jobs: what each queue and key held of the
    workers' capacity, and the use of each resource per window
    (``resource_shares``, ``resource_usage``). Without any, nothing more.
    """
    timings: dict[str, float] = {}
    out: dict[str, Any] = {"timings": timings, "noisy_rules": rules.as_dict()}

    with _stage(timings, "span"):
        raw = read_telemetry(spark, path)
        span_row = raw.select(
            F.count(F.lit(1)).alias("records"),
            F.min(F.coalesce("finished", "started", "received")).alias("first"),
            F.max(F.coalesce("finished", "started", "received")).alias("last"),
            # Key names, not (queue, key) pairs: enough to choose the grain, and
            # hashing one column costs less than two.
            F.approx_count_distinct("fair_key", 0.05).alias("keys"),
            F.count("priority").alias("prioritized"),
            # Resources on (schema 6): every record of such a worker has its capacity.
            # Null in every record otherwise, which Parquet stores as levels alone.
            F.count("capacity").alias("with_capacity"),
        ).first()
        if span_row is None:  # an aggregate without grouping always has one row
            raise RuntimeError("no summary row")
        records, first, last = span_row["records"], span_row["first"], span_row["last"]
        span = (last - first) if records else 0.0
        window = window_seconds or auto_window(span)
        many = span_row["keys"] > exact_keys
        out.update(
            records=records,
            first=first,
            last=last,
            window_seconds=window,
            key_buckets=key_buckets if many else None,
        )

    parallelism = spark.sparkContext.defaultParallelism

    def key_grain() -> KeyGrain:
        if many:
            return BucketedKeys(
                spark,
                window=window,
                rules=rules,
                parallelism=parallelism,
                buckets=key_buckets,
                spread=T.Windows.spanning(first, last, window),
                exact_windows=exact_windows,
                parts=KEY_PARTS_PER_CORE * parallelism,
                conf=lambda: _session_conf(spark, KEY_PASS_CONF),
            )
        return ExactKeys(window, rules, parallelism)

    with _stage(timings, "usage"):
        # The usage table is windows x keys (or buckets) rows, read by a dozen
        # small jobs: kept in the shuffle's partitions (200 by default on a
        # cluster) each of them would run 200 tiny tasks; one per core suffices.
        clean = raw
        tasks = clean.transform(T.normalize, window)
        grain = key_grain()
        usage = grain.usage(tasks)
        # Values out of range (transforms.validation), counted in the same pass
        # (this job fills the usage cache): then counted per file, and the
        # usage computed again without them.
        bad = usage.agg(F.sum("bad_records")).first()
        out["bad_values"] = []
        if bad is not None and bad[0]:
            out["bad_values"] = _bad_values(raw.transform(T.bad_value_counts).collect())
            usage.unpersist()
            grain.release()
            clean = raw.transform(T.exclude_bad_values)
            tasks = clean.transform(T.normalize, window)
            grain = key_grain()
            usage = grain.usage(tasks)

    # The tables below are computed from the small usage table: a dozen jobs
    # whose cost is Spark's per-job overhead. Adaptive execution re-plans
    # every shuffle (built for large ones) and doubles it; one shuffle
    # partition per core is plenty for windows x keys rows; a broadcast join
    # would start a job of its own to collect its small side.
    small = {
        "spark.sql.adaptive.enabled": "false",
        "spark.sql.shuffle.partitions": str(parallelism),
        "spark.sql.autoBroadcastJoinThreshold": "-1",
    }
    with _stage(timings, "tables"), _session_conf(spark, small):
        shares = usage.transform(T.queue_shares).cache()
        # One job for the three per-queue tables (each would be a job of its
        # own, and at these sizes a job's cost is its overhead).
        codel = usage.transform(T.codel_rates).drop("records")
        keys = grain.keys(usage)
        skew = keys.transform(T.routing_skew, shares).drop("target_share")
        top = keys.transform(T.top_keys, max_keys).cache()
        by_queue = usage.transform(T.served_by_window, "queue").cache()
        # A dozen small jobs over the cached tables, independent of each other:
        # most of each one's time is the driver planning and compiling it, on one
        # core, so two at a time keep both cores busy (see _concurrently).
        tables = _concurrently(
            parallelism,
            per_queue=lambda: _rows(
                shares.join(codel, "queue", "left").join(skew, "queue", "left")
            ),
            key_shares=lambda: _rows(top),
            jain_queues=lambda: _rows(by_queue.transform(T.jain_by_window), ("window",)),
            jain_keys=lambda: _rows(grain.jain_keys(usage), ("window", "queue")),
            throughput=lambda: _rows(
                by_queue.transform(T.throughput, window), ("window", "entity")
            ),
            hot_keys=lambda: _rows(keys.transform(T.hot_keys, rules.hot_factor)),
            noisy_keys=lambda: _rows(keys.transform(T.noisy_keys, rules)),
            throttled_keys=lambda: _rows(keys.transform(T.throttled_keys)),
            paused_keys=lambda: _rows(keys.transform(T.paused_keys)),
            noisy_windows=lambda: grain.noisy_windows(usage, tasks, _rows),
        )
        per_queue = tables.pop("per_queue")
        out["queue_shares"] = out["codel"] = out["skew"] = per_queue
        out.update(tables)
        # The findings' keys over every queue that served them (a tenant routed
        # over several queues is a finding per queue, each with its queue's part).
        named = {r["fair_key"] for t in ("hot_keys", "noisy_keys", "noisy_windows")
                 for r in out[t]}  # fmt: skip
        out["across_queues"] = (
            _rows(keys.transform(T.across_queues, sorted(named))) if named else []
        )

    if span_row["prioritized"]:
        # Tasks published with a priority: one more pass, only then.
        with _stage(timings, "priorities"), _session_conf(spark, small):
            out["priority_waits"] = _rows(tasks.transform(T.waits_by_priority))
            out["priority_key_shares"] = _rows(
                tasks.transform(T.key_shares_by_priority, max_keys), ("queue", "priority")
            )

    if span_row["with_capacity"]:
        # Records of workers sharing resources: one stage more, only then.
        with _stage(timings, "resources"), _session_conf(spark, small):
            out.update(_resources(clean, window, max_keys))

    with _stage(timings, "latency"):
        # Keys beyond the shown ones share one histogram row per bucket; when
        # every key is shown, no per-row lookup is needed to tell them apart.
        every_key = all(r["keys_in_queue"] <= max_keys for r in out["key_shares"])
        shown = None if every_key else {r["fair_key"] for r in out["key_shares"]}
        # The pass over the tasks, run here with its settings and cached.
        with _session_conf(spark, LATENCY_PASS_CONF):
            histograms = (
                tasks.transform(Q.latency_histograms, shown, keys).coalesce(parallelism).cache()
            )
            histograms.count()
        with _session_conf(spark, small):
            latency = histograms.transform(Q.quantiles, ("queue",)).cache()
            recommended = latency.transform(T.recommendations)
            found = _concurrently(
                parallelism,
                # One job for the two per-queue tables.
                both=lambda: _rows(latency.join(recommended, "queue")),
                key_latency=lambda: _rows(histograms.transform(Q.quantiles, ("queue", "fair_key"))),
            )
            out["queue_latency"] = out["recommendations"] = found["both"]
            out["key_latency"] = found["key_latency"]

    for df in (usage, shares, top, by_queue, histograms, latency):
        df.unpersist()
    grain.release()
    if on_stage is not None:
        for name, seconds in timings.items():
            on_stage(name, seconds)
    return out
