"""Telemetry with values out of range: counted per file and column, left out, never fatal."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from celery_fair.analytics.pipeline import compute
from celery_fair.analytics.report import build_report, format_summary
from celery_fair.telemetry.schema import TaskRecord, records_to_table


def _good(n: int, key: str, start: float = 1_800_000_000.0) -> list[TaskRecord]:
    return [
        TaskRecord(
            task_id=f"{key}{i}",
            task_name="work",
            queue="jobs",
            outcome="success",
            published=start + i * 0.01 - 0.005,
            received=start + i * 0.01 - 0.002,
            dispatched=start + i * 0.01,
            started=start + i * 0.01,
            finished=start + i * 0.01 + 0.002,
            runtime=0.002,
            cost=1.0,
            fair_key=key,
            target_weight=1.0,
            key_weight=1.0,
            key_throttled=0.0,
        )  # fmt: skip
        for i in range(n)
    ]


@pytest.mark.parametrize("exact_keys", [20_000, 0], ids=["exact-keys", "bucketed-keys"])
def test_bad_values_are_counted_per_file_and_column_and_left_out(
    spark: SparkSession, tmp_path: Path, exact_keys: int
) -> None:
    data = tmp_path / "telemetry"
    data.mkdir()
    a, b = _good(100, "a"), _good(100, "b")
    # A foreign writer's file: weights of 0 (the divide by zero in Jain's index
    # once), negative run times and costs, and outcomes the schema does not know.
    odd = (
        [replace(r, key_weight=0.0) for r in b[:40]]
        + [replace(r, runtime=-1.0, cost=-5.0) for r in b[40:50]]
        + [replace(r, outcome="exploded") for r in b[50:53]]
        + b[53:]
    )
    pq.write_table(records_to_table(a), data / "part-good.parquet")
    pq.write_table(records_to_table(odd), data / "part-odd.parquet")
    # exact_keys=0: the many-keys pass (transforms.keys_and_buckets) divides by
    # the key weight too.
    report = build_report(compute(spark, str(data), exact_keys=exact_keys))
    bad = {(Path(x["file"]).name, x["column"]): x["count"] for x in report["meta"]["bad_values"]}
    assert bad == {
        ("part-odd.parquet", "key_weight"): 40,
        ("part-odd.parquet", "runtime"): 10,
        ("part-odd.parquet", "cost"): 10,
        ("part-odd.parquet", "outcome"): 3,
    }
    # The figures still come, without the bad values: b's negative costs do not
    # lower its served work, its unknown outcomes do not count, Jain's index is there.
    keys = report["keys"]["jobs"]
    assert keys["a"]["served_tasks"] == 100 and keys["b"]["served_tasks"] == 97
    assert keys["b"]["served_cost"] >= keys["a"]["served_cost"] * 0.89
    assert report["jain"]["keys_mean"] is not None
    summary = format_summary(report)
    assert "WARNING: 63 value(s) out of range in 1 file(s) were left out" in summary
    assert "part-odd.parquet: key_weight <= 0 or NaN: 40" in summary


def test_clean_telemetry_reports_no_bad_values(spark: SparkSession, tmp_path: Path) -> None:
    data = tmp_path / "telemetry"
    data.mkdir()
    pq.write_table(records_to_table(_good(50, "a")), data / "part-0.parquet")
    report = build_report(compute(spark, str(data)))
    assert report["meta"]["bad_values"] == []
    assert "WARNING" not in format_summary(report)
    assert report["keys"]["jobs"]["a"]["served_tasks"] == pytest.approx(50)


def test_a_key_spread_over_queues_is_reported_with_its_share_of_all_work(
    spark: SparkSession, tmp_path: Path
) -> None:
    # One tenant with 40% of all work, routed over four queues (10% in each),
    # beside 20 small tenants per queue.
    data = tmp_path / "telemetry"
    data.mkdir()
    records: list[TaskRecord] = []
    for q in range(4):
        plan = [("big", 40)] + [(f"s{q}-{i}", 3) for i in range(20)]
        for key, count in plan:
            start = 1_800_000_000.0 + len(records) * 0.01
            records += [replace(r, queue=f"q{q}", task_id=f"{q}{r.task_id}")
                        for r in _good(count, key, start)]  # fmt: skip
    pq.write_table(records_to_table(records), data / "part-0.parquet")
    report = build_report(compute(spark, str(data)))
    hot = [h for h in report["hot_keys"] if h["fair_key"] == "big"]
    assert len(hot) == 4
    assert all(h["share"] == pytest.approx(0.1) for h in hot)
    assert all(h["share_all_queues"] == pytest.approx(0.4) and h["queues"] == 4 for h in hot)
    noisy = [f for f in report["noisy_tenants"] if f["fair_key"] == "big"]
    assert noisy and all(f["share_all_queues"] == pytest.approx(0.4) for f in noisy)
    assert "(40.0% of all work across its 4 queues)" in format_summary(report)
