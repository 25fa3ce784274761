"""Many keys: the bucketed usage table gives the exact path's figures (Jain's index estimated)."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

import pytest
from pyspark.sql import SparkSession

from celery_fair.analytics.pipeline import BYPASS_PARTIAL, compute
from celery_fair.analytics.report import build_report
from tests.harness.synthetic import write_synthetic

from .test_noisy import FLOOD

# The flood of test_noisy with 2,000 quiet keys per queue (8,000), so most of them
# have one task or none in a window: the case the buckets are for, with a noisy
# key for the window rules to find inside its bucket.
MANY = replace(FLOOD, keys_per_queue=2_000, seed=5)
WINDOW = 10.0
BUCKETS = 1024


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("many-keys"))
    write_synthetic(MANY, path, chunk=20_000)
    return path


@pytest.fixture(scope="module")
def both(spark: SparkSession, data: str) -> tuple[dict[str, Any], dict[str, Any]]:
    exact = compute(spark, data, window_seconds=WINDOW, exact_keys=10**9)
    bucketed = compute(spark, data, window_seconds=WINDOW, exact_keys=100, key_buckets=BUCKETS)
    return exact, bucketed


def _by(rows: list[dict[str, Any]], *names: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {tuple(r[n] for n in names): r for r in rows}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        if isinstance(value, float):
            assert b[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
        else:
            assert b[name] == value, name


def test_only_the_many_keys_path_buckets(both: tuple[dict[str, Any], dict[str, Any]]) -> None:
    exact, bucketed = both
    assert exact["key_buckets"] is None
    assert bucketed["key_buckets"] == BUCKETS


@pytest.mark.parametrize(
    ("table", "names"),
    [
        ("queue_shares", ("queue",)),
        ("skew", ("queue",)),
        ("key_shares", ("queue", "fair_key")),
        ("hot_keys", ("queue", "fair_key")),
        ("noisy_keys", ("queue", "fair_key")),
        ("jain_queues", ("window",)),
        ("throughput", ("window", "entity")),
        ("key_latency", ("queue", "fair_key")),
        ("noisy_windows", ("window", "queue", "fair_key")),
    ],
)
def test_every_other_table_is_the_same(
    both: tuple[dict[str, Any], dict[str, Any]], table: str, names: tuple[str, ...]
) -> None:
    exact, bucketed = both
    a, b = _by(exact[table], *names), _by(bucketed[table], *names)
    assert a, table  # something to compare
    assert a.keys() == b.keys()
    for cell, row in a.items():
        _same(row, b[cell])


def test_the_flood_is_found_inside_its_bucket(
    both: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    _, bucketed = both
    flagged = {r["fair_key"] for r in bucketed["noisy_windows"]}
    assert flagged == {"tenant-flood"}
    noisy = build_report(bucketed)["noisy_tenants"]
    [flood] = [n for n in noisy if n["fair_key"] == "tenant-flood"]
    assert flood["periods"][0]["windows"] >= 25


def test_jain_over_keys_is_estimated_closely(
    both: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    exact, bucketed = both
    a = _by(exact["jain_keys"], "window", "queue")
    b = _by(bucketed["jain_keys"], "window", "queue")
    assert a.keys() == b.keys() and len(a) >= 200
    errors = []
    for cell, row in a.items():
        assert b[cell]["n"] == row["n"], cell  # counted from the keys' window bits
        if row["jain"] is not None and row["n"] > 1:
            errors.append(b[cell]["jain"] / row["jain"] - 1)
    # One standard error of the sum of squares is at most sqrt(2 / (1024 x 4)) = 2.2%,
    # and less with ~100 keys in 1,024 buckets: measured 0.9% typical, 7.5% worst.
    assert statistics.median(abs(e) for e in errors) < 0.02
    assert max(abs(e) for e in errors) < 0.12
    assert abs(statistics.mean(errors)) < 0.01  # no bias


def test_past_the_exact_windows_the_keys_are_estimated(
    spark: SparkSession, data: str, both: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    exact, _ = both
    estimated = compute(spark, data, window_seconds=WINDOW, exact_keys=100, exact_windows=0)
    a = _by(exact["jain_keys"], "window", "queue")
    b = _by(estimated["jain_keys"], "window", "queue")
    assert a.keys() == b.keys()
    off = 0
    for cell, row in a.items():
        # HyperLogLog++ at 1%: a key or two off in a window of a few hundred.
        assert b[cell]["n"] == pytest.approx(row["n"], rel=0.03, abs=2), cell
        off += b[cell]["n"] != row["n"]
    assert off > 0  # the estimate ran, not the exact count
    a = _by(exact["noisy_windows"], "window", "queue", "fair_key")
    b = _by(estimated["noisy_windows"], "window", "queue", "fair_key")
    assert a and a.keys() == b.keys()


def test_the_per_key_pass_leaves_the_session_settings_as_it_found_them(
    spark: SparkSession, data: str
) -> None:
    # The per-key pass plans its aggregation without the partial step; the
    # caller's own value of that setting must come back afterwards.
    spark.conf.set(BYPASS_PARTIAL, "false")
    try:
        compute(spark, data, window_seconds=WINDOW, exact_keys=100, key_buckets=BUCKETS)
        assert spark.conf.get(BYPASS_PARTIAL) == "false"
    finally:
        spark.conf.unset(BYPASS_PARTIAL)
