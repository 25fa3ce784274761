"""bench.report_ratio's arithmetic on times made by hand, and its aggregation on a few rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.report_ratio import AGGREGATION, figures, marginal, markdown, report_command


def test_the_marginal_cost_is_the_slope() -> None:
    assert marginal([1_000, 3_000], [10.0, 14.0]) == pytest.approx(0.002)
    # Three sizes: the least-squares slope, not the rate between the ends.
    assert marginal([0, 1, 2], [1.0, 3.0, 3.0]) == pytest.approx(1.0)
    # A larger size that ran faster has no slope.
    assert marginal([1_000, 2_000], [5.0, 4.0]) is None


def _runs() -> dict[str, list[dict[int, float]]]:
    # Aggregation: 10 s of start-up, 1 s per 1,000 rows; the report 20 s and 2 s.
    return {
        AGGREGATION: [{1_000: 11.0, 5_000: 15.0}, {1_000: 12.0, 5_000: 16.0}],
        "after": [{1_000: 22.0, 5_000: 30.0}, {1_000: 24.0, 5_000: 32.0}],
    }


def test_figures_are_each_column_over_the_aggregation() -> None:
    fig = figures([1_000, 5_000], _runs())
    after = fig["after"]
    assert after["whole_run"]["median"] == pytest.approx(23.0)
    assert after["whole_run_ratio"]["median"] == pytest.approx(2.0)
    assert after["seconds_per_row"] == pytest.approx(0.002)
    assert after["rows_per_second"] == pytest.approx(500.0)
    assert after["per_row_ratio"] == pytest.approx(2.0)
    assert after["per_row_ratio_rounds"]["median"] == pytest.approx(2.0)
    assert fig[AGGREGATION]["per_row_ratio"] == pytest.approx(1.0)


def test_markdown_has_both_targets() -> None:
    sizes = [1_000, 5_000]
    data = {
        "command": "python -m bench.report_ratio --sizes 1000,5000 --reps 2",
        "master": "local[2]",
        "keys": 2_000,
        "reps": 2,
        "sizes": sizes,
        "environment": {"cpus": 2, "when": "now"},
        "figures": figures(sizes, _runs()),
        "stages": {"after": {"1000": {"span": {"median": 1.0}}, "5000": {}}},
    }
    text = markdown(data)
    assert "Whole run on 1,000 rows" in text
    assert "| after | 23.0 (9%) | 11.5 (9%) | 2.00x | 2.00 [2.00, 2.00] |" in text
    assert "| after | 500 | 1,000 | 2.00x | 2.00 [2.00, 2.00] |" in text
    assert "| after | 1,000 | 1.0 |" in text


def test_the_report_is_run_as_the_command_line_runs_it() -> None:
    cmd = report_command("DIR", "OUT", "local[2]")
    assert cmd[1:] == ["-m", "celery_fair.cli", "report", "DIR", "--out", "OUT",
                       "--master", "local[2]"]  # fmt: skip


def test_the_aggregation_counts_and_sums_per_queue_and_key(tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    import pyarrow.parquet as pq
    from pyspark.sql import SparkSession

    from bench.analytics import spec_for
    from bench.report_ratio import aggregate
    from tests.harness.synthetic import write_synthetic

    write_synthetic(spec_for("tenants", 4_000, 20, 1.2), tmp_path / "t")
    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    rows = aggregate(spark, str(tmp_path / "t"))
    table = pq.read_table(tmp_path / "t", columns=["runtime"])
    assert sum(r["tasks"] for r in rows) == table.num_rows == 4_000
    assert len({(r["queue"], r["fair_key"]) for r in rows}) == len(rows)
    runtime = sum(v for v in table.column("runtime").to_pylist() if v is not None)
    assert sum(r["run_time"] or 0.0 for r in rows) == pytest.approx(runtime)
    big = [r for r in rows if r["fair_key"] == "tenant-big"]
    assert len(big) == 8  # the big tenant in every queue
    for r in rows:
        assert r["wait_p50"] <= r["wait_p99"]
        assert not math.isnan(r["wait_p99"])
    json.dumps(rows)  # what --aggregate writes
