"""The report's priority levels: waits per level, and key shares within a level."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from celery_fair.analytics.html import render_html
from celery_fair.analytics.pipeline import compute
from celery_fair.analytics.report import build_report, format_summary
from celery_fair.telemetry.schema import TaskRecord, records_to_table


def _records(start: float) -> list[TaskRecord]:
    records = []
    plan = [("u0", 0, 50, 0.01), ("u1", 0, 50, 0.01)]
    plan += [("a", 9, 100, 1.0), ("b", 9, 200, 1.0), ("c", 9, 400, 1.0)]
    n = 0
    for key, priority, count, wait in plan:
        for _ in range(count):
            t = start + n * 0.01
            n += 1
            records.append(
                TaskRecord(
                    task_id=f"t{n}",
                    task_name="work",
                    queue="jobs",
                    outcome="success",
                    published=t - wait,
                    received=t - wait / 2,
                    dispatched=t,
                    started=t,
                    finished=t + 0.002,
                    runtime=0.002,
                    cost=1.0,
                    fair_key=key,
                    target_weight=1.0,
                    key_weight=1.0,
                    key_throttled=0.0,
                    priority=priority,
                )  # fmt: skip
            )
    return records


def test_waits_per_level_and_key_shares_within_a_level(spark: SparkSession, tmp_path: Path) -> None:
    data = tmp_path / "telemetry"
    data.mkdir()
    pq.write_table(records_to_table(_records(1_800_000_000.0)), data / "part-0.parquet")
    report = build_report(compute(spark, str(data)))
    levels = report["priorities"]["jobs"]
    assert list(levels) == ["0", "9"]
    assert levels["0"]["tasks"] == 100 and levels["9"]["tasks"] == 700
    assert levels["0"]["wait_p99"] == pytest.approx(0.01, rel=0.02)
    assert levels["9"]["wait_p50"] == pytest.approx(1.0, rel=0.02)
    shares = {k: v["share"] for k, v in levels["9"]["keys"].items()}
    assert shares == pytest.approx({"a": 1 / 7, "b": 2 / 7, "c": 4 / 7})
    assert sum(v["share"] for v in levels["0"]["keys"].values()) == pytest.approx(1.0)
    assert "priority   9: 700 tasks" in format_summary(report)
    page = render_html(report, {})
    assert "<h2>Priorities</h2>" in page and "<td>9</td><td>700</td>" in page


def test_no_priorities_no_section(spark: SparkSession, tmp_path: Path) -> None:
    data = tmp_path / "telemetry"
    data.mkdir()
    records = [
        TaskRecord(task_id=f"t{i}", task_name="work", queue="jobs", outcome="success",
                   received=1.0e9 + i, started=1.0e9 + i, finished=1.0e9 + i + 0.1)
        for i in range(20)
    ]  # fmt: skip
    pq.write_table(records_to_table(records), data / "part-0.parquet")
    report = build_report(compute(spark, str(data)))
    assert report["priorities"] == {}
    assert "priorities of" not in format_summary(report)
    assert "<h2>Priorities</h2>" not in render_html(report, {})
