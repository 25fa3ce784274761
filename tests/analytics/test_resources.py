"""The report's resources: what each tenant held of the workers' capacity, and its use.

The DRF paper's example (Ghodsi et al., NSDI 2011): a worker of <9 cpu,
18 mem>, tenant A's tasks hold <1, 4> and B's <3, 1>; DRF runs three of A
and two of B, and both dominant shares are 2/3.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from celery_fair.analytics import transforms as T
from celery_fair.analytics.charts import write_charts
from celery_fair.analytics.html import render_html
from celery_fair.analytics.pipeline import compute, spark_ddl
from celery_fair.analytics.report import build_report, format_summary
from celery_fair.telemetry.schema import TaskRecord, records_to_table

T0 = 1_800_000_000.0
CAPACITY = {"cpu": 9.0, "mem": 18.0, "slots": 8.0}
DEMANDS = {"A": {"cpu": 1.0, "mem": 4.0, "slots": 1.0}, "B": {"cpu": 3.0, "mem": 1.0, "slots": 1.0}}


def drf_records(*, lanes: dict[str, int] | None = None, seconds: float = 100.0) -> list[TaskRecord]:
    """Tasks of 10 s back to back: three lanes of A and two of B, for ``seconds``."""
    lanes = lanes or {"A": 3, "B": 2}
    records = []
    for key, count in lanes.items():
        for lane in range(count):
            t = T0
            while t < T0 + seconds - 1e-9:
                records.append(
                    TaskRecord(
                        task_id=f"{key}-{lane}-{t - T0:g}",
                        task_name="work",
                        queue="jobs",
                        outcome="success",
                        received=t,
                        dispatched=t,
                        started=t,
                        finished=t + 10.0,
                        runtime=10.0,
                        cost=1.0,
                        fair_key=key,
                        target_weight=1.0,
                        key_weight=1.0,
                        hostname="w1@h",
                        resources=DEMANDS[key],
                        capacity=CAPACITY,
                    )  # fmt: skip
                )
                t += 10.0
    return records


def write(records: list[TaskRecord], directory: Path, name: str = "part-0") -> Path:
    directory.mkdir(exist_ok=True)
    pq.write_table(records_to_table(records), directory / f"{name}.parquet")
    return directory


def test_drf_example_gives_both_tenants_a_dominant_share_of_two_thirds(
    spark: SparkSession, tmp_path: Path
) -> None:
    data = write(drf_records(), tmp_path / "telemetry")
    report = build_report(compute(spark, str(data), window_seconds=10.0))
    res = report["resources"]
    assert res["capacity_seconds"] == pytest.approx({"cpu": 900.0, "mem": 1800.0, "slots": 800.0})
    a, b = res["keys"]["jobs"]["A"], res["keys"]["jobs"]["B"]
    assert a["dominant_share"] == pytest.approx(2 / 3) and a["dominant_resource"] == "mem"
    assert b["dominant_share"] == pytest.approx(2 / 3) and b["dominant_resource"] == "cpu"
    assert a["held_seconds"] == pytest.approx({"cpu": 300.0, "mem": 1200.0, "slots": 300.0})
    assert a["shares"] == pytest.approx({"cpu": 1 / 3, "mem": 2 / 3, "slots": 3 / 8})
    assert b["shares"] == pytest.approx({"cpu": 2 / 3, "mem": 1 / 9, "slots": 2 / 8})
    # The queue holds both: all the cpu.
    queue = res["queues"]["jobs"]
    assert queue["dominant_share"] == pytest.approx(1.0) and queue["dominant_resource"] == "cpu"
    # Over time: every 10 s window holds all the cpu and 14 of the 18 mem.
    usage = {(u["window"], u["resource"]): u["held_share"] for u in res["usage"]}
    assert len(usage) == 10 * 3
    for i in range(10):
        window = T0 + 10.0 * i
        assert usage[(window, "cpu")] == pytest.approx(1.0)
        assert usage[(window, "mem")] == pytest.approx(14 / 18)
        assert usage[(window, "slots")] == pytest.approx(5 / 8)
    assert res["peak"]["cpu"] == pytest.approx(1.0)
    summary = format_summary(report)
    assert "dominant share" in summary and "A (jobs) 66.7% mem" in summary
    charts = write_charts(report, tmp_path)
    assert {"resource_usage", "dominant_shares"} <= set(charts)
    page = render_html(report, charts)
    assert "<h2>Resources</h2>" in page and "<td>66.67%</td>" in page
    assert 'alt="dominant_shares"' in page


def test_an_idle_worker_counts_its_capacity_and_runs_spread_over_windows(
    spark: SparkSession,
) -> None:
    # One task of 15 s from 5 to 20 on a worker seen from 0 (an idle task) to 30.
    base = dict(task_name="work", queue="q", outcome="success", hostname="w1@h", target_weight=1.0)
    records = [
        TaskRecord(task_id="idle", received=T0, started=T0, finished=T0 + 0.0, runtime=0.0,
                   resources={"cpu": 0.0, "slots": 1.0}, capacity={"cpu": 2.0, "slots": 1.0},
                   **base),  # type: ignore[arg-type]
        TaskRecord(task_id="long", received=T0 + 5, started=T0 + 5, finished=T0 + 20,
                   runtime=15.0, resources={"cpu": 2.0, "slots": 1.0},
                   capacity={"cpu": 2.0, "slots": 1.0}, **base),  # type: ignore[arg-type]
        # A task CoDel sent back: it never held anything, but the worker was there.
        TaskRecord(task_id="back", task_name="work", queue="q", outcome="codel-requeue",
                   hostname="w1@h", received=T0 + 29, finished=T0 + 30,
                   capacity={"cpu": 2.0, "slots": 1.0}),
    ]  # fmt: skip
    raw = spark.createDataFrame([dataclasses.astuple(r) for r in records], spark_ddl())
    usage = raw.transform(T.held_rows).transform(T.held_by_window, 10.0)
    capacity = raw.transform(T.capacity_by_window, 10.0)
    rows = {
        (r["window"] - T0, r["resource"]): (
            r["held_seconds"],
            r["capacity_seconds"],
            r["held_share"],
        )
        for r in usage.transform(T.resource_usage, capacity).collect()
    }
    assert rows[(0.0, "cpu")] == pytest.approx((10.0, 20.0, 0.5))
    assert rows[(10.0, "cpu")] == pytest.approx((20.0, 20.0, 1.0))
    assert rows[(20.0, "cpu")] == pytest.approx((0.0, 20.0, 0.0))
    # The worker's last record ends at 30: the window from 30 has none of its capacity.
    assert (30.0, "cpu") not in rows


def test_no_capacity_in_any_record_no_resources_stage(spark: SparkSession, tmp_path: Path) -> None:
    records = [dataclasses.replace(r, resources=None, capacity=None) for r in drf_records()]
    data = write(records, tmp_path / "telemetry")
    out = compute(spark, str(data), window_seconds=10.0)
    assert "resources" not in out["timings"] and "resource_shares" not in out
    report = build_report(out)
    assert report["resources"] == {}
    assert "dominant share" not in format_summary(report)
    assert "<h2>Resources</h2>" not in render_html(report, {})


def test_files_before_schema_6_read_resources_as_null(spark: SparkSession, tmp_path: Path) -> None:
    data = write(drf_records(seconds=50.0), tmp_path / "telemetry", "new")
    old = records_to_table(drf_records(lanes={"A": 1}, seconds=50.0)).drop_columns(
        ["resources", "capacity"]
    )
    assert "capacity" not in old.schema.names
    pq.write_table(pa.Table.from_batches(old.to_batches()), data / "old.parquet")
    report = build_report(compute(spark, str(data), window_seconds=10.0))
    # The old file's tasks ran but held nothing the report knows of.
    a = report["resources"]["keys"]["jobs"]["A"]
    assert a["held_seconds"]["cpu"] == pytest.approx(150.0)
    assert report["queues"]["jobs"]["served_tasks"] == 30
