"""The whole pipeline recovers the generator's known shares, percentiles and Jain index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pyspark.sql import SparkSession

from celery_fair.analytics.charts import write_charts
from celery_fair.analytics.html import write_html
from celery_fair.analytics.pipeline import compute
from celery_fair.analytics.report import build_report, format_summary
from tests.harness.synthetic import SyntheticSpec, Truth, write_synthetic

# Served shares that differ from the weights, so the Jain index is not trivially 1.
SPEC = SyntheticSpec(
    records=120_000,
    weights={"p0": 1, "p1": 2, "p2": 3, "p3": 4},
    served_shares={"p0": 0.4, "p1": 0.3, "p2": 0.2, "p3": 0.1},
    latency=0.05,
    seed=7,
)


@pytest.fixture(scope="module")
def truth_and_report(
    spark: SparkSession, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Truth, dict[str, Any], Path]:
    data_dir = tmp_path_factory.mktemp("telemetry")
    truth = write_synthetic(SPEC, data_dir, chunk=40_000)
    report = build_report(compute(spark, str(data_dir)))
    return truth, report, tmp_path_factory.mktemp("report")


def test_shares_against_targets(truth_and_report: tuple[Truth, dict[str, Any], Path]) -> None:
    truth, report, _ = truth_and_report
    for q in SPEC.queues():
        got = report["queues"][q]
        assert got["share"] == pytest.approx(truth.share(q), abs=0.01), q
        assert got["target_share"] == pytest.approx(SPEC.target_shares()[q])


def test_wait_and_sojourn_percentiles(truth_and_report: tuple[Truth, dict[str, Any], Path]) -> None:
    truth, report, _ = truth_and_report
    for q in SPEC.queues():
        got = report["queues"][q]
        for p, name, rel in ((0.5, "p50", 0.04), (0.95, "p95", 0.05), (0.99, "p99", 0.1)):
            assert got[f"wait_{name}"] == pytest.approx(truth.wait_quantile(q, p), rel=rel)
            assert got[f"sojourn_{name}"] == pytest.approx(truth.sojourn_quantile(q, p), rel=rel)


def test_jain_index_per_window(truth_and_report: tuple[Truth, dict[str, Any], Path]) -> None:
    truth, report, _ = truth_and_report
    windows = report["jain"]["queues"]
    assert len(windows) >= 30
    inner = [w["jain"] for w in windows[1:-1]]  # edge windows are partly empty
    assert np.median(inner) == pytest.approx(truth.jain(), abs=0.02)
    assert truth.jain() < 0.8  # the shares really are unfair


def test_codel_rates_prefetch_and_hot_keys(
    truth_and_report: tuple[Truth, dict[str, Any], Path],
) -> None:
    _, report, _ = truth_and_report
    ranks = np.arange(1, SPEC.keys_per_queue + 1) ** -SPEC.key_skew
    for q in SPEC.queues():
        got = report["queues"][q]
        assert got["codel_requeue_rate"] == pytest.approx(SPEC.codel_requeue, abs=0.005)
        assert got["codel_reject_rate"] == pytest.approx(SPEC.codel_reject, abs=0.003)
        # 50 ms round trip / 9.18 ms median run time (gamma, shape 4, mean 10 ms).
        assert got["recommended_prefetch"] == 6
        assert got["skew"] == pytest.approx(
            SPEC.shares()[q] / SPEC.target_shares()[q] - 1, abs=0.05
        )
        top = report["keys"][q][f"{q}-k000"]
        assert top["share_in_queue"] == pytest.approx(ranks[0] / ranks.sum(), abs=0.02)
    assert report["hot_keys"][0]["fair_key"] == "p0-k000"


def test_outputs(truth_and_report: tuple[Truth, dict[str, Any], Path]) -> None:
    _, report, out = truth_and_report
    (out / "report.json").write_text(json.dumps(report))
    charts = write_charts(report, out)
    page = write_html(report, charts, out / "report.html").read_text()
    assert set(charts) >= {"shares", "jain", "waits", "throughput", "codel", "noisy_tenants"}
    assert all(p.stat().st_size > 1000 for p in charts.values())
    assert page.count("data:image/png;base64,") == len(charts) - 1
    assert "<script" not in page and "http" not in page.split("</style>", 1)[1]
    summary = format_summary(report)
    assert "p3" in summary and "Jain" in summary
