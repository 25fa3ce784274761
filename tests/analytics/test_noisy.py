"""Noisy tenants: the share rules and the SQS-style window rules, on synthetic and made-up data."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.testing import assertDataFrameEqual

from celery_fair.analytics import transforms as T
from celery_fair.analytics.noisy import NoisyRules, findings
from celery_fair.analytics.pipeline import compute, read_telemetry
from celery_fair.analytics.report import _add_arguments, build_report, format_summary, rules_from
from tests.harness.synthetic import SyntheticSpec, write_synthetic

START = 1_700_000_000.0  # SyntheticSpec's default start, a multiple of 10 s windows
EVEN = {"p0": 1.0, "p1": 1.0, "p2": 1.0, "p3": 1.0}
SAME_SOJOURN = dict.fromkeys(EVEN, 0.05)

# The demo's situation: 20 quiet tenants on 4 queues, and one flood that takes
# 60% of the records during the middle half of the run (150 s to 450 s), in
# queue p1, which it shares with five quiet tenants; tenants are routed to
# queues, the queues are not keyed.
FLOOD = SyntheticSpec(
    keyed=False,
    records=60_000,
    weights=EVEN,
    mean_sojourn=SAME_SOJOURN,
    keys_per_queue=5,
    key_skew=0.0,
    flood_share=0.6,
    flood_queue="p1",
    flood_span=(0.25, 0.75),
    seed=11,
)


@pytest.fixture(scope="module")
def flood_report(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    data = tmp_path_factory.mktemp("flood")
    write_synthetic(FLOOD, data, chunk=20_000)
    return build_report(compute(spark, str(data), window_seconds=10.0))


def test_the_flood_is_flagged_by_its_shares(flood_report: dict[str, Any]) -> None:
    noisy = flood_report["noisy_tenants"]
    assert [n["fair_key"] for n in noisy] == ["tenant-flood"]
    flood = noisy[0]
    assert flood["queue"] == "p1"
    # 60% of the records and the same run time: 60% of the served cost.
    assert flood["share"] == pytest.approx(0.6, abs=0.02)
    assert flood["share_in_queue"] == pytest.approx(0.6 / (0.6 + 0.4 / 4), abs=0.02)
    assert {"share-of-all", "share-of-queue"} <= set(flood["rules"])
    assert flood["advice"][0].startswith("route tenant-flood to a queue of its own")
    assert "fair_keys" in flood["advice"][0]


def test_the_flood_is_flagged_in_the_windows_of_the_flood_only(
    flood_report: dict[str, Any],
) -> None:
    flood = flood_report["noisy_tenants"][0]
    assert {"in-flight", "processing-time"} <= set(flood["rules"])
    # One period, the 30 windows of the flood; tasks that started at its end
    # and finished after it are too few (< min_tasks) to extend it.
    [period] = flood["periods"]
    assert (period["start"] - START, period["end"] - START) == (150.0, 450.0)
    assert period["windows"] == flood["noisy_windows"] == 30
    # During the flood it holds 60% / (60% + 40% / 2) = 75% of the work.
    assert period["in_flight_share"] == pytest.approx(0.75, abs=0.08)
    assert period["processing_share"] == pytest.approx(0.75, abs=0.08)
    summary = format_summary(flood_report)
    assert "tenant-flood (queue p1)" in summary
    assert "-> route tenant-flood to a queue of its own" in summary


@pytest.mark.parametrize("keys_per_queue", [1, 25])
def test_an_even_workload_flags_nobody(
    spark: SparkSession, tmp_path: Path, keys_per_queue: int
) -> None:
    # With one key per queue every tenant holds 25% of everything, far over
    # SQS's 10%: the even-split rule keeps them all quiet.
    spec = SyntheticSpec(
        records=20_000,
        weights=EVEN,
        mean_sojourn=SAME_SOJOURN,
        keys_per_queue=keys_per_queue,
        key_skew=0.0,
        seed=5,
    )
    write_synthetic(spec, tmp_path)
    usage = (
        read_telemetry(spark, str(tmp_path))
        .transform(T.normalize, 30.0)
        .transform(T.usage_by_window)
        .cache()
    )
    keys = usage.transform(T.key_shares)
    assert keys.count() == 4 * keys_per_queue
    assert usage.transform(T.noisy_windows, 30.0).count() == 0
    assert keys.transform(T.noisy_keys).count() == 0
    assert keys.transform(T.hot_keys).count() == 0


def usage_rows(spark: SparkSession, rows: list[tuple[Any, ...]]) -> DataFrame:
    """(window, queue, fair_key, records, in_flight, busy) rows in the usage schema."""
    return spark.createDataFrame(
        [(*r[:4], 0, 0.0, *r[4:], 0, 0, 0, 0, 0, r[0], 1.0) for r in rows],
        "window double, queue string, fair_key string, records long, served_tasks long, "
        "served_cost double, in_flight double, busy double, codel_requeues long, "
        "codel_rejects long, failures long, retries long, revoked long, last_at double, "
        "weight double",
    )


def test_window_rules_one_by_one(spark: SparkSession) -> None:
    # Window 10 s: 10 task-seconds in flight = 1 task held on average.
    quiet = [(w, "q", f"k{i}", 40, 10.0, 1.0) for w in (0.0, 10.0) for i in range(8)]
    usage = usage_rows(
        spark,
        quiet
        + [
            # 10 keys in each window: a rule needs 1.5 x 10% = 15%.
            (0.0, "q", "holder", 40, 40.0, 1.0),  # in flight 40/128 = 31%, run time 1/9.5
            (0.0, "q", "brief", 40, 8.0, 0.5),  # 8/128: under 15%
            (10.0, "q", "slow", 40, 10.0, 5.0),  # run time 5/31 = 16%, in flight 10/270
            (10.0, "q", "few", 29, 90.0, 9.0),  # too few records to be judged
            (10.0, "q", "(none)", 400, 90.0, 9.0),  # no key: never flagged
            # A lull: 'lull' holds 8/9.5 of the in-flight work, but 0.8 tasks at once.
            (20.0, "q", "lull", 40, 8.0, 1.0),
            *[(20.0, "q", f"k{i}", 40, 0.5, 1.0) for i in range(3)],
        ],
    )
    got = usage.transform(T.noisy_windows, 10.0).select(
        "window", "fair_key", "in_flight", "processing_time"
    )
    expected = spark.createDataFrame(
        [(0.0, "holder", True, False), (10.0, "slow", False, True)],
        "window double, fair_key string, in_flight boolean, processing_time boolean",
    )
    assertDataFrameEqual(got, expected)
    # Without the floor on tasks held, the lull would be flagged.
    lax = usage.transform(T.noisy_windows, 10.0, NoisyRules(min_in_flight=0.0))
    assert "lull" in {r["fair_key"] for r in lax.collect()}


def test_share_rules_one_by_one(spark: SparkSession) -> None:
    # 17 keys in all (keys_overall): 2 + 5 + 10.
    rows = [
        # queue a: 'big' takes 30% of everything but only 30/60 of a (2 keys).
        ("a", "big", 30.0, 0.30, 0.50, 2),
        ("a", "a1", 30.0, 0.30, 0.50, 2),
        # queue b: 'boss' 20% of everything, 20/25 of b, 5 keys: queue rule.
        ("b", "boss", 20.0, 0.20, 0.80, 5),
        *[("b", f"b{i}", 1.25, 0.0125, 0.05, 5) for i in range(4)],
        # queue c: 10 keys, 'warm' 6 times its even part of c, 6% of everything.
        ("c", "warm", 1.2, 0.012, 0.6, 10),
        *[("c", f"c{i}", 0.089, 0.00089, 0.0444, 10) for i in range(9)],
    ]
    keys = spark.createDataFrame(
        [(*row, 17) for row in rows],
        "queue string, fair_key string, served_cost double, share double, "
        "share_in_queue double, keys_in_queue long, keys_overall long",
    )
    got = keys.transform(T.noisy_keys).select(
        "fair_key", "share_of_all", "share_of_queue", "hot_in_queue"
    )
    expected = spark.createDataFrame(
        [("big", True, False, False), ("a1", True, False, False)]
        + [("boss", False, True, False), ("warm", False, True, True)],
        "fair_key string, share_of_all boolean, share_of_queue boolean, hot_in_queue boolean",
    )
    assertDataFrameEqual(got, expected)


def test_findings_merge_consecutive_windows_and_advise() -> None:
    windows = [
        {"window": w, "queue": "q", "fair_key": "k", "records": 50, "in_flight_share": s,
         "processing_share": 0.05, "in_flight": True, "processing_time": False}
        for w, s in ((0.0, 0.2), (10.0, 0.4), (30.0, 0.3))
    ]  # fmt: skip
    known = [{"queue": "q", "fair_key": "k", "share": 0.1, "share_in_queue": 1.0,
              "keys_in_queue": 1}]  # fmt: skip
    [f] = findings([], windows, 10.0, known_keys=known)
    assert [(p["start"], p["end"], p["windows"]) for p in f["periods"]] == [
        (0.0, 20.0, 2),
        (30.0, 40.0, 1),
    ]
    assert f["periods"][0]["in_flight_share"] == 0.4
    assert f["rules"] == ["in-flight"]
    # Alone in its queue: isolating it changes nothing, its queue's weight does.
    assert "has queue q to itself" in f["advice"][0]
    assert any("fair_key_concurrency" in a for a in f["advice"])
    # With two windows needed, the lone window at 30 s is a blip, not a stretch.
    blip = dict(windows[0], fair_key="blip", window=50.0)
    [g] = findings([], [*windows, blip], 10.0, known_keys=known, min_windows=2)
    assert g["fair_key"] == "k" and g["noisy_windows"] == 2
    assert [(p["start"], p["end"]) for p in g["periods"]] == [(0.0, 20.0)]


def test_a_keyed_queue_is_not_advised_to_use_fairness_keys() -> None:
    rows = [
        {"queue": q, "fair_key": "flood", "share": 0.6, "share_in_queue": 0.9,
         "keys_in_queue": 20, "share_of_all": True, "share_of_queue": True,
         "hot_in_queue": True}
        for q in ("plain", "keyed")
    ]  # fmt: skip
    known = [{**r, "keyed": r["queue"] == "keyed"} for r in rows]
    found = {f["queue"]: f["advice"] for f in findings(rows, [], 10.0, known_keys=known)}
    assert "fair_keys = {'plain': ...}" in found["plain"][0]
    assert "keyed already" in found["keyed"][0]
    assert not any("fair_keys =" in a for a in found["keyed"])


def test_rules_are_checked_and_errors_name_the_option() -> None:
    parser = argparse.ArgumentParser()
    _add_arguments(parser)
    assert rules_from(parser.parse_args(["d"])) == NoisyRules()
    with pytest.raises(ValueError, match=r"^--noisy-in-flight 1.5: must be a share"):
        rules_from(parser.parse_args(["d", "--noisy-in-flight", "1.5"]))
    with pytest.raises(ValueError, match="excess"):
        NoisyRules(excess=0.5)
    with pytest.raises(ValueError, match="min_tasks"):
        NoisyRules(min_tasks=0)
