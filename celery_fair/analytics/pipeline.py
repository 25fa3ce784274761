"""Run the transforms over a telemetry directory and collect the small results.

Stages are timed one by one (each ends with an action on a cached table of
tasks), which is what ``bench/analytics.py`` reports as time per stage.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from celery_fair.analytics import transforms as T
from celery_fair.telemetry.schema import SCHEMA

__all__ = ("NICE_WINDOWS", "compute", "read_telemetry", "spark_ddl")

NICE_WINDOWS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
_SPARK_TYPES = {"string": "STRING", "double": "DOUBLE", "int32": "INT", "int64": "BIGINT"}


def spark_ddl() -> str:
    """The telemetry schema as a Spark DDL string (read with it, never inferred)."""
    return ", ".join(f"`{f.name}` {_SPARK_TYPES[str(f.type)]}" for f in SCHEMA)


def read_telemetry(spark: SparkSession, path: str) -> DataFrame:
    """All Parquet files under ``path`` (hidden temporary files are skipped)."""
    return spark.read.schema(spark_ddl()).option("recursiveFileLookup", "true").parquet(path)


def _rows(df: DataFrame) -> list[dict[str, Any]]:
    return [row.asDict() for row in df.collect()]


def auto_window(span: float, windows: int = 60) -> float:
    """The smallest round window size giving at most ``windows`` windows over ``span``."""
    for size in NICE_WINDOWS:
        if span / size <= windows:
            return float(size)
    return float(math.ceil(span / windows))


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
    hot_factor: float = 5.0,
    on_stage: Callable[[str, float], None] | None = None,
) -> dict[str, Any]:
    """Compute every figure of the report; returns plain lists of row dicts."""
    timings: dict[str, float] = {}
    out: dict[str, Any] = {"timings": timings}

    with _stage(timings, "load"):
        raw = read_telemetry(spark, path)
        span_row = raw.select(
            F.count(F.lit(1)).alias("records"),
            F.min(F.coalesce("finished", "started", "received")).alias("first"),
            F.max(F.coalesce("finished", "started", "received")).alias("last"),
        ).first()
        if span_row is None:  # an aggregate without grouping always has one row
            raise RuntimeError("no summary row")
        records, first, last = span_row["records"], span_row["first"], span_row["last"]
        span = (last - first) if records else 0.0
        window = window_seconds or auto_window(span)
        tasks = raw.transform(T.normalize, window).cache()
        tasks.count()
        out.update(records=records, first=first, last=last, window_seconds=window)

    with _stage(timings, "shares"):
        shares = tasks.transform(T.queue_shares).cache()
        out["queue_shares"] = _rows(shares)
        keys = tasks.transform(T.key_shares).cache()
        out["key_shares"] = _rows(keys)

    with _stage(timings, "fairness"):
        by_queue = tasks.transform(T.served_by_window, "queue").cache()
        out["jain_queues"] = _rows(by_queue.transform(T.jain_by_window).orderBy("window"))
        out["jain_keys"] = _rows(
            tasks.transform(T.served_by_window, "fair_key")
            .transform(T.jain_by_window)
            .orderBy("window")
        )
        out["throughput"] = _rows(
            by_queue.transform(T.throughput, window).orderBy("window", "entity")
        )

    with _stage(timings, "latency"):
        latency = tasks.transform(T.latency_percentiles, ("queue",)).cache()
        out["queue_latency"] = _rows(latency)
        out["key_latency"] = _rows(tasks.transform(T.latency_percentiles, ("queue", "fair_key")))

    with _stage(timings, "codel"):
        out["codel"] = _rows(tasks.transform(T.codel_rates))
        out["recommendations"] = _rows(latency.transform(T.recommendations))

    with _stage(timings, "skew"):
        out["skew"] = _rows(tasks.transform(T.routing_skew, shares))
        out["hot_keys"] = _rows(keys.transform(T.hot_keys, hot_factor))

    for df in (tasks, shares, keys, by_queue, latency):
        df.unpersist()
    if on_stage is not None:
        for name, seconds in timings.items():
            on_stage(name, seconds)
    return out
