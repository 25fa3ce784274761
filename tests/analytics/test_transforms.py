"""Each transform on small hand-made tables, compared with ``assertDataFrameEqual``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from celery_fair.analytics import transforms as T
from celery_fair.analytics.pipeline import KEY_PASS_CONF, _session_conf, spark_ddl
from celery_fair.telemetry.schema import TaskRecord


def rec(queue: str, **kw: object) -> TaskRecord:
    base = dict(
        task_id="t",
        task_name="work",
        queue=queue,
        outcome="success",
        received=100.0,
        finished=101.0,
        started=100.5,
        runtime=0.5,
        target_weight=1.0,
    )
    base.update(kw)
    return TaskRecord(**base)  # type: ignore[arg-type]


def frame(spark: SparkSession, records: list[TaskRecord]) -> DataFrame:
    return spark.createDataFrame([dataclasses.astuple(r) for r in records], spark_ddl())


def test_normalize_derives_costs_waits_and_windows(spark: SparkSession) -> None:
    raw = frame(
        spark,
        [
            rec("a", task_id="1", published=99.0, dispatched=100.25, cost=2.0, finished=125.0),
            rec("a", task_id="2", runtime=None, finished=59.0),  # no cost, no runtime: 1
            rec("b", task_id="3", outcome="codel-requeue", started=None, runtime=None),
            rec("b", task_id="4", cost=None, fair_key="k"),  # cost falls back to runtime
        ],
    )
    got = raw.transform(T.normalize, 30.0).select(
        "task_id", "fair_key", "ran", "cost", "wait", "sojourn", "transfer", "window"
    )
    expected = spark.createDataFrame(
        [
            ("1", "(none)", True, 2.0, 1.5, 0.25, 1.0, 120.0),
            ("2", "(none)", True, 1.0, 0.5, 0.5, None, 30.0),
            ("3", "(none)", False, 0.0, None, None, None, 90.0),
            ("4", "k", True, 0.5, 0.5, 0.5, None, 90.0),
        ],
        "task_id string, fair_key string, ran boolean, cost double, wait double, "
        "sojourn double, transfer double, window double",
    )
    assertDataFrameEqual(got, expected)


def test_queue_shares_against_weights(spark: SparkSession) -> None:
    raw = frame(
        spark,
        [rec("a", cost=1.0), rec("a", cost=1.0), rec("b", cost=6.0, target_weight=3.0)]
        + [rec("b", outcome="codel-reject", cost=9.0, target_weight=3.0)],
    )
    got = raw.transform(T.normalize).transform(T.usage_by_window).transform(T.queue_shares)
    expected = spark.createDataFrame(
        [("a", 2, 2, 2.0, 0.25, 1.0, 0.25, 1.0), ("b", 2, 1, 6.0, 0.75, 3.0, 0.75, 1.0)],
        "queue string, records long, served_tasks long, served_cost double, share double, "
        "target_weight double, target_share double, share_ratio double",
    )
    assertDataFrameEqual(got, expected)


def test_latest_weight_is_the_target(spark: SparkSession) -> None:
    raw = frame(
        spark,
        [rec("a", target_weight=1.0, finished=10.0), rec("a", target_weight=4.0, finished=20.0)]
        + [rec("b", target_weight=1.0)],
    )
    got = (
        raw.transform(T.normalize)
        .transform(T.usage_by_window)
        .transform(T.queue_shares)
        .select("queue", "target_share")
    )
    assertDataFrameEqual(
        got, spark.createDataFrame([("a", 0.8), ("b", 0.2)], "queue string, target_share double")
    )


def test_key_shares_overall_and_in_queue(spark: SparkSession) -> None:
    raw = frame(
        spark,
        [rec("a", fair_key="x", cost=3.0), rec("a", fair_key="y", cost=1.0)]
        + [rec("b", fair_key="x", cost=4.0)],
    )
    got = (
        raw.transform(T.normalize)
        .transform(T.usage_by_window)
        .transform(T.key_shares)
        .select("queue", "fair_key", "share", "share_in_queue")
    )
    expected = spark.createDataFrame(
        [("a", "x", 0.375, 0.75), ("a", "y", 0.125, 0.25), ("b", "x", 0.5, 1.0)],
        "queue string, fair_key string, share double, share_in_queue double",
    )
    assertDataFrameEqual(got, expected)


def test_jain_is_one_for_weighted_shares_and_one_over_n_for_a_monopoly(
    spark: SparkSession,
) -> None:
    served = spark.createDataFrame(
        [
            (0.0, "", "a", 1, 1.0, 1.0),
            (0.0, "", "b", 3, 3.0, 3.0),  # weighted-fair window: x = (1, 1)
            (60.0, "", "a", 5, 5.0, 1.0),
            (60.0, "", "b", 0, 0.0, 3.0),  # one queue served alone
            (60.0, "", "c", 0, 0.0, 1.0),
        ],
        "window double, group string, entity string, served_tasks long, served_cost double, "
        "weight double",
    )
    expected = spark.createDataFrame(
        [(0.0, "", 2, 1.0), (60.0, "", 3, 1 / 3)],
        "window double, queue string, n long, jain double",
    )
    assertDataFrameEqual(served.transform(T.jain_by_window), expected)


def test_jain_over_keys_is_per_keyed_queue(spark: SparkSession) -> None:
    # Queue "jobs": keys a and b served equally (J = 1); queue "mail": key x
    # alone, and tasks without a key, which are not a key of their own.
    raw = frame(
        spark,
        [rec("jobs", finished=5.0, fair_key="a"), rec("jobs", finished=6.0, fair_key="b")]
        + [rec("mail", finished=5.0, fair_key="x"), rec("mail", finished=6.0)]
        + [rec("mail", finished=7.0)],
    )
    usage = raw.transform(T.normalize, 10.0).transform(T.usage_by_window)
    got = usage.transform(T.served_by_window, "fair_key").transform(T.jain_by_window)
    expected = spark.createDataFrame(
        [(0.0, "jobs", 2, 1.0), (0.0, "mail", 1, 1.0)],
        "window double, queue string, n long, jain double",
    )
    assertDataFrameEqual(got, expected)


def test_keys_by_window_counts_each_key_once_per_window(spark: SparkSession) -> None:
    # Windows of 10 s from 0: key a in windows 0 and 2 (twice in 2), b in 2,
    # a key of the same name in another queue, and a task without a key.
    raw = frame(
        spark,
        [rec("jobs", finished=t, fair_key="a") for t in (5.0, 25.0, 26.0)]
        + [rec("jobs", finished=21.0, fair_key="b"), rec("mail", finished=12.0, fair_key="a")]
        + [rec("mail", finished=3.0)],
    )
    windows = T.Windows.spanning(3.0, 26.0, 10.0)
    assert windows == T.Windows(10.0, 0, 3)
    tasks = raw.transform(T.normalize, 10.0)
    per_key = tasks.transform(T.keys_and_buckets, 16, windows, 2).transform(T.key_rows)
    got = per_key.transform(T.key_totals, windows).transform(T.keys_by_window, windows)
    expected = spark.createDataFrame(
        [(0.0, "jobs", 1), (20.0, "jobs", 2), (10.0, "mail", 1)],
        "window double, queue string, n long",
    )
    assertDataFrameEqual(got, expected)
    with pytest.raises(ValueError, match="65 windows"):
        tasks.transform(T.keys_and_buckets, 16, T.Windows(10.0, 0, 65), 2)


def test_keys_and_buckets_sum_to_the_usage_rows_from_one_shuffle(
    spark: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two keys of one queue, one of them in two windows, and a task without a key.
    raw = frame(
        spark,
        [rec("jobs", finished=t, fair_key="a", cost=2.0) for t in (5.0, 15.0, 16.0)]
        + [rec("jobs", finished=6.0, fair_key="b", outcome="codel-requeue")]
        + [rec("jobs", finished=7.0, cost=3.0)],
    )
    tasks = raw.transform(T.normalize, 10.0)
    windows = T.Windows.spanning(5.0, 16.0, 10.0)
    with _session_conf(spark, KEY_PASS_CONF):
        grains = tasks.transform(T.keys_and_buckets, 4, windows, 3)
        grains.explain()
    plan = capsys.readouterr().out
    # Both aggregations read one shuffle of the tasks: the second reuses it.
    assert plan.count("- Exchange hashpartitioning(queue") == 1, plan
    assert "ReusedExchange" in plan, plan

    # Bucket rows summed over buckets are usage_by_window's rows summed over keys.
    figures = ["records", "served_tasks", "served_cost", "codel_requeues", "in_flight", "busy"]
    sums = [F.sum(c).alias(c) for c in figures]
    by_window = tasks.transform(T.usage_by_window).groupBy("window", "queue").agg(*sums)
    bucketed = grains.transform(T.bucket_rows).groupBy("window", "queue").agg(*sums)
    assertDataFrameEqual(bucketed, by_window)
    keys = grains.transform(T.key_rows).select("fair_key", "records", "served_cost", "present")
    expected = spark.createDataFrame(
        [("a", 3, 6.0, 0b11), ("b", 1, 0.0, 0b01), (T.NO_KEY, 1, 3.0, 0b01)],
        "fair_key string, records long, served_cost double, present long",
    )
    assertDataFrameEqual(keys, expected)


def test_served_by_window_and_throughput(spark: SparkSession) -> None:
    raw = frame(
        spark,
        [rec("a", finished=5.0, cost=2.0), rec("a", finished=7.0, cost=2.0)]
        + [rec("a", finished=15.0, cost=1.0), rec("b", finished=15.0, outcome="revoked")],
    )
    usage = raw.transform(T.normalize, 10.0).transform(T.usage_by_window)
    served = usage.transform(T.served_by_window, "queue")
    got = served.transform(T.throughput, 10.0)
    expected = spark.createDataFrame(
        [(0.0, "a", 0.2, 0.4), (10.0, "a", 0.1, 0.1), (10.0, "b", 0.0, 0.0)],
        "window double, entity string, tasks_per_second double, cost_per_second double",
    )
    assertDataFrameEqual(got, expected)


def test_codel_rates(spark: SparkSession) -> None:
    outcomes = ["success"] * 6 + ["codel-requeue"] * 2 + ["codel-reject", "failure"]
    raw = frame(spark, [rec("a", outcome=o) for o in outcomes])
    got = raw.transform(T.normalize).transform(T.usage_by_window).transform(T.codel_rates)
    expected = spark.createDataFrame(
        [("a", 10, 2, 1, 0.2, 0.1, 0.1, 0.0, 0.0)],
        "queue string, records long, codel_requeues long, codel_rejects long, "
        "codel_requeue_rate double, codel_reject_rate double, failure_rate double, "
        "retry_rate double, revoked_rate double",
    )
    assertDataFrameEqual(got, expected)


def test_recommendations_follow_the_round_trip_rule(spark: SparkSession) -> None:
    # The DESIGN example: 104 ms round trip / 4 ms per task = 26 in flight.
    # "c" waited in a backlog all along: 10.9 s from publish to receive is the
    # backlog, not a round trip (it gave prefetch 10942): no recommendation.
    latency = spark.createDataFrame(
        [("a", 0.004, 0.5, 0.104), ("b", 1.0, 2.0, 0.001), ("c", 0.001, 0.002, 10.942)],
        "queue string, runtime_p50 double, runtime_p99 double, transfer_p05 double",
    )
    got = latency.transform(T.recommendations)
    expected = spark.createDataFrame(
        [
            ("a", 0.104, 0.004, 26, 0.05, 0.5),
            ("b", 0.001, 1.0, 1, 0.2, 2.0),
            ("c", 10.942, 0.001, None, 0.0002, 0.002),
        ],
        "queue string, round_trip double, service_time double, recommended_prefetch int, "
        "codel_target double, codel_interval double",
    )
    assertDataFrameEqual(got, expected)


def test_routing_skew_and_hot_keys(spark: SparkSession) -> None:
    records = [rec("a", fair_key="hot") for _ in range(8)]
    records += [rec("a", fair_key=f"k{i}") for i in range(4)]
    records += [rec("b", fair_key=f"m{i}", target_weight=3.0) for i in range(4)]
    records += [rec("b", fair_key="m0", outcome="codel-requeue", target_weight=3.0)]
    usage = frame(spark, records).transform(T.normalize).transform(T.usage_by_window)
    shares = usage.transform(T.queue_shares)
    keys = usage.transform(T.key_shares)
    skew = keys.transform(T.routing_skew, shares)
    expected = spark.createDataFrame(
        [("a", 12, 0.75, 5, 5 / 9, 0.25, 2.0), ("b", 4, 0.25, 4, 4 / 9, 0.75, -2 / 3)],
        "queue string, arrivals long, arrival_share double, keys long, key_share double, "
        "target_share double, skew double",
    )
    assertDataFrameEqual(skew, expected)
    # "hot" has 8 of 12 tasks of a queue of 5 keys: heat 8/12 * 5 = 3.33.
    hot = keys.transform(T.hot_keys, 3.0).select("fair_key", "heat")
    assertDataFrameEqual(
        hot, spark.createDataFrame([("hot", 10 / 3)], "fair_key string, heat double")
    )


def test_key_weights_set_targets_throttled_time_and_jain(spark: SparkSession) -> None:
    # Queue "jobs": gold (weight 3) served 3 s, free (weight 1) 1 s, in one
    # window: weighted-fair, so Jain's index over keys is 1. Free's key was
    # throttled 2.5 s by its limits, told by two of its records.
    raw = frame(
        spark,
        [rec("jobs", fair_key="gold", cost=1.0, key_weight=3.0) for _ in range(3)]
        + [rec("jobs", fair_key="free", cost=0.5, key_weight=1.0, key_throttled=2.0)]
        + [rec("jobs", fair_key="free", cost=0.5, key_weight=1.0, key_throttled=0.5)]
        + [rec("jobs", cost=1.0)],  # no key: no weight, no target
    )
    usage = raw.transform(T.normalize, 10.0).transform(T.usage_by_window)
    keys = usage.transform(T.key_shares)
    got = keys.select("fair_key", "weight", "target_in_queue", "throttled")
    expected = spark.createDataFrame(
        [("gold", 3.0, 0.75, 0.0), ("free", 1.0, 0.25, 2.5), ("(none)", None, None, 0.0)],
        "fair_key string, weight double, target_in_queue double, throttled double",
    )
    assertDataFrameEqual(got, expected)
    throttled = keys.transform(T.throttled_keys).select("fair_key", "throttled")
    assertDataFrameEqual(
        throttled, spark.createDataFrame([("free", 2.5)], "fair_key string, throttled double")
    )
    jain = usage.transform(T.served_by_window, "fair_key").transform(T.jain_by_window)
    assertDataFrameEqual(
        jain,
        spark.createDataFrame(
            [(100.0, "jobs", 2, 1.0)], "window double, queue string, n long, jain double"
        ),
    )
    # Records of schema 1 carry no weight: every key weighs 1, and gold's 3x is unfair.
    old = raw.drop("key_weight", "key_throttled").selectExpr(
        "*", "CAST(NULL AS DOUBLE) AS key_weight", "CAST(NULL AS DOUBLE) AS key_throttled"
    )
    flat = old.transform(T.normalize, 10.0).transform(T.usage_by_window)
    row = flat.transform(T.served_by_window, "fair_key").transform(T.jain_by_window).first()
    assert row is not None and row["jain"] == (3 + 1) ** 2 / (2 * (9 + 1))


def test_paused_time_is_summed_per_key_and_listed_longest_first(spark: SparkSession) -> None:
    # Schema 4: the first task served after a resume tells how long its key was paused.
    raw = frame(
        spark,
        [rec("jobs", fair_key="a", cost=1.0, key_weight=1.0, key_paused=4.0)]
        + [rec("jobs", fair_key="a", cost=1.0, key_weight=1.0, key_paused=0.0)]
        + [rec("jobs", fair_key="b", cost=1.0, key_weight=1.0, key_paused=1.5)]
        + [rec("jobs", fair_key="c", cost=1.0, key_weight=1.0)],
    )
    keys = raw.transform(T.normalize, 10.0).transform(T.usage_by_window).transform(T.key_shares)
    paused = keys.transform(T.paused_keys).select("fair_key", "paused")
    assert [tuple(r) for r in paused.collect()] == [("a", 4.0), ("b", 1.5)]
    # Records before schema 4 carry no pause: 0, not null.
    old = raw.drop("key_paused").selectExpr("*", "CAST(NULL AS DOUBLE) AS key_paused")
    flat = old.transform(T.normalize, 10.0).transform(T.usage_by_window).transform(T.key_shares)
    assert flat.where("paused > 0").count() == 0


def test_a_schema_4_files_key_held_is_read_as_key_throttled(
    spark: SparkSession, tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from celery_fair.analytics.pipeline import read_telemetry
    from celery_fair.telemetry.schema import SCHEMA, records_to_table

    current = records_to_table([rec("jobs", fair_key="a", key_throttled=1.5)])
    # The same record as schema 4 wrote it: the column under its old name.
    names = ["key_held" if n == "key_throttled" else n for n in current.schema.names]
    old = pa.Table.from_arrays(current.columns, names=names)
    pq.write_table(current, tmp_path / "new.parquet")
    (tmp_path / "old").mkdir()
    pq.write_table(old, tmp_path / "old" / "old.parquet")
    df = read_telemetry(spark, str(tmp_path))
    assert df.columns == SCHEMA.names
    assert sorted(r["key_throttled"] for r in df.collect()) == [1.5, 1.5]
