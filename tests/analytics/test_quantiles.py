"""Quantiles from log-bucket histograms: the rank percentile_approx gives, within ALPHA."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from celery_fair.analytics import transforms as T
from celery_fair.analytics.pipeline import spark_ddl
from celery_fair.analytics.quantiles import ALPHA, METRICS, latency_histograms, quantiles
from celery_fair.telemetry.schema import TaskRecord


def tasks_with(spark: SparkSession, rows: list[tuple[str, str | None, float]]) -> DataFrame:
    """(queue, fair_key, wait) -> task rows whose wait, sojourn and run time are that value."""
    records = [
        TaskRecord(task_id=str(i), task_name="work", queue=q, outcome="success", fair_key=k,
                   published=100.0, received=100.0, dispatched=100.0 + w, started=100.0 + w,
                   runtime=w, finished=101.0)
        for i, (q, k, w) in enumerate(rows)
    ]  # fmt: skip
    raw = spark.createDataFrame([dataclasses.astuple(r) for r in records], spark_ddl())
    return raw.transform(T.normalize)


def exact(values: list[float], q: float) -> float:
    """The element at rank ceil(q * n), which percentile_approx returns."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered) - 1e-9)) - 1]


def close(got: float | None, want: float) -> bool:
    return got is not None and abs(got - want) <= ALPHA * abs(want) + 1e-12


def test_ranks_on_small_data(spark: SparkSession) -> None:
    # 1..100 ms: neighbours are 1-2% apart, so a wrong rank falls outside ALPHA.
    waits = [i / 1000 for i in range(1, 101)]
    got = tasks_with(spark, [("a", None, w) for w in waits]).transform(latency_histograms, set())
    row = got.transform(quantiles).first()
    assert row is not None
    for name, want in (("wait_p50", 0.050), ("wait_p95", 0.095), ("wait_p99", 0.099)):
        assert close(row[name], want), (name, row[name])
    assert close(row["runtime_p50"], 0.050) and close(row["runtime_p99"], 0.099)
    assert row["transfer_p05"] == 0.0  # published == received: all zero
    assert not close(row["wait_p99"], 0.098) and not close(row["wait_p50"], 0.049)


def test_random_values_against_exact_ranks(spark: SparkSession) -> None:
    rng = np.random.default_rng(4)
    # Four decades of waits, and some negative ones (skewed clocks), some zeros.
    waits = list(np.exp(rng.uniform(math.log(1e-4), math.log(10.0), 3000)))
    waits += list(-np.exp(rng.uniform(math.log(1e-3), math.log(0.1), 300))) + [0.0] * 50
    row = (
        tasks_with(spark, [("a", None, float(w)) for w in waits])
        .transform(latency_histograms)
        .transform(quantiles)
        .first()
    )
    assert row is not None
    for metric in ("wait", "runtime"):
        for q in METRICS[metric]:
            name = f"{metric}_p{round(q * 100):02d}"
            assert close(row[name], exact(waits, q)), (name, row[name], exact(waits, q))


def test_queue_histogram_is_the_sum_of_its_keys(spark: SparkSession) -> None:
    rng = np.random.default_rng(9)
    rows = [("a", "x", float(w)) for w in rng.exponential(0.01, 500)]
    rows += [("a", "y", float(w)) for w in rng.exponential(0.5, 300)]
    rows += [("a", "z", float(w)) for w in rng.exponential(2.0, 200)]  # not a shown key
    rows += [("b", "x", 7.0)]
    hist = tasks_with(spark, rows).transform(latency_histograms, {"x", "y"}).cache()
    # Keys not shown are merged into one null key: the table stays small.
    assert {r["fair_key"] for r in hist.select("fair_key").distinct().collect()} == {
        "x",
        "y",
        None,
    }
    per_queue = {r["queue"]: r for r in hist.transform(quantiles, ("queue",)).collect()}
    per_key = {
        (r["queue"], r["fair_key"]): r
        for r in hist.transform(quantiles, ("queue", "fair_key")).collect()
    }
    assert set(per_key) == {("a", "x"), ("a", "y"), ("b", "x")}
    everything = [w for q, _, w in rows if q == "a"]
    for q in METRICS["wait"]:
        name = f"wait_p{round(q * 100):02d}"
        assert close(per_queue["a"][name], exact(everything, q))
        for key in ("x", "y"):
            mine = [w for q2, k, w in rows if (q2, k) == ("a", key)]
            assert close(per_key[("a", key)][name], exact(mine, q))
    assert close(per_key[("b", "x")]["wait_p99"], 7.0)


def test_pairs_from_the_usage_table_give_the_same_histograms(spark: SparkSession) -> None:
    # The pipeline names the hashed pairs from the usage table; without it they come
    # from the tasks. Both, with a key hidden, must count every value once, by name.
    rng = np.random.default_rng(12)
    rows = [("a", "x", float(w)) for w in rng.exponential(0.01, 200)]
    rows += [("a", "z", float(w)) for w in rng.exponential(1.0, 100)]
    rows += [("b", None, float(w)) for w in rng.exponential(0.1, 50)]
    tasks = tasks_with(spark, rows)
    usage = tasks.transform(T.usage_by_window)
    by_tasks = tasks.transform(latency_histograms, {"x"}).collect()
    by_usage = tasks.transform(latency_histograms, {"x"}, usage).collect()
    assert sorted(map(repr, by_tasks)) == sorted(map(repr, by_usage))
    counted: dict[tuple[str, str | None, str], int] = {}
    for r in by_usage:
        counted[(r["queue"], r["fair_key"], r["metric"])] = (
            counted.get((r["queue"], r["fair_key"], r["metric"]), 0) + r["count"]
        )
    assert counted[("a", "x", "wait")] == 200
    assert counted[("a", None, "wait")] == 100  # z is hidden: counted under the null key
    assert counted[("b", None, "wait")] == 50
    assert {r["metric"] for r in by_usage} == set(METRICS)


def test_a_bucket_over_several_rows_gives_the_same_quantiles(spark: SparkSession) -> None:
    # quantiles() merges rows of one bucket only where keys fold into their queue:
    # the running count must find the same bucket when a bucket's count is split.
    rng = np.random.default_rng(21)
    rows = [("a", "x", float(w)) for w in rng.exponential(0.02, 400)]
    rows += [("a", "y", float(w)) for w in rng.exponential(0.3, 300)]
    hist = tasks_with(spark, rows).transform(latency_histograms, {"x", "y"}).cache()
    low = hist.withColumn("count", F.floor(F.col("count") / 2))
    split = low.unionByName(hist.withColumn("count", F.col("count") - F.floor(F.col("count") / 2)))
    assert split.count() == 2 * hist.count()
    for by in (("queue",), ("queue", "fair_key")):
        whole = sorted(map(repr, hist.transform(quantiles, by).collect()))
        assert whole == sorted(map(repr, split.transform(quantiles, by).collect())), by
