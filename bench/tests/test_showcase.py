"""The showcase's analysis: phases, checks and summaries from a synthetic ledger."""

from __future__ import annotations

import math

import pytest

from bench.showcase.flood import FloodParams, analyse_flood
from bench.showcase.layout import MODES, SHARED_QUEUE, TenantLayout
from bench.showcase.summary import markdown, summarise, terminal
from tests.harness.ledger import Entry, percentile, spread

LAYOUT = TenantLayout.build(shards=4, quiet=6)
FLOOD_AT = 100.0


def entry(tid: str, tenant: str, published: float, wait: float, queue: str) -> Entry:
    start = published + wait
    return Entry(tid, "w1@h", queue, tenant, published, start, start + 0.003, 0)


def synthetic(mode: str, quiet_wait: float) -> tuple[list[Entry], dict[str, tuple[str, float]]]:
    """Quiet tasks before and during a 10-task flood; every quiet wait is ``quiet_wait``."""
    m = MODES[mode]
    entries, published = [], {}
    for i in range(10):
        tid = f"f{i}"
        entries.append(
            entry(tid, LAYOUT.flood, FLOOD_AT, 1.0 + i, LAYOUT.expected_queue(m, LAYOUT.flood))
        )
        published[tid] = (LAYOUT.flood, FLOOD_AT)
    for t in LAYOUT.quiet:
        q = LAYOUT.expected_queue(m, t)
        for k in range(5):
            before, during = f"{t}-b{k}", f"{t}-d{k}"
            entries.append(entry(before, t, 95.0 + k * 0.5, 0.002, q))
            entries.append(entry(during, t, FLOOD_AT + 1 + k, quiet_wait, q))
            published[before] = (t, 95.0 + k * 0.5)
            published[during] = (t, FLOOD_AT + 1 + k)
    return entries, published


def analyse(mode: str, quiet_wait: float) -> dict:
    entries, published = synthetic(mode, quiet_wait)
    marks = {"flood_at": FLOOD_AT, "counted_from": 94.0, "complete": 1.0}
    return analyse_flood(entries, published, LAYOUT, MODES[mode], marks, FloodParams(flood=10))


def test_phases_waits_and_checks() -> None:
    r = analyse("fair", 0.003)
    assert (r["lost"], r["duplicates"], r["misrouted"]) == (0, 0, 0)
    assert r["unloaded"]["p99"] == pytest.approx(0.002)
    assert r["quiet_others"]["p50"] == pytest.approx(0.003)
    # 0.003 <= 2 x 0.002 for every quiet tenant.
    assert r["within_2x"] == len(LAYOUT.quiet)
    assert r["flood"]["tasks"] == 10
    # Ten tasks from the first publish (100.0) to the last finish (110.003).
    assert r["flood"]["throughput"] == pytest.approx(10 / 10.003)


def test_worker_throughput_and_the_publishing_phase() -> None:
    entries, published = synthetic("fair", 0.003)
    marks = {"flood_at": FLOOD_AT, "counted_from": 94.0, "complete": 1.0,
             "flood_published_from": FLOOD_AT, "flood_published_to": 102.5}  # fmt: skip
    r = analyse_flood(entries, published, LAYOUT, MODES["fair"], marks, FloodParams(flood=10))
    # Every tenant's tasks count: 10 flood + 5 per quiet tenant finished in the window.
    quiet = 5 * len(LAYOUT.quiet)
    assert r["flood"]["worker_throughput"] == pytest.approx((10 + quiet) / 10.003)
    assert r["flood"]["quiet_served"] == pytest.approx(quiet / 10.003)
    assert r["flood"]["publish_seconds"] == pytest.approx(2.5)
    # Published at 101 and 102: during the burst; 103..105: after it.
    assert r["quiet_others_publishing"]["n"] == 2 * r["others"]
    assert r["quiet_others_after"]["n"] == 3 * r["others"]
    assert r["within_2x_others_after"] == r["others"]
    s = summarise({"A": {"plain-shared": [r], "fair": [r]}})["A"]
    assert s["worker_vs"]["fair/plain-shared"] == pytest.approx(1.0)
    assert "Worker throughput during the flood" in markdown({"A": s}, {}, per_tenant=False)


def test_a_slow_quiet_tenant_misses_the_2x_target() -> None:
    assert analyse("fair", 0.005)["within_2x"] == 0


def test_missing_duplicate_and_misrouted_runs_are_counted() -> None:
    entries, published = synthetic("fair", 0.003)
    lost = entries.pop()  # a quiet task that never ran
    entries.append(entries[0])  # a flood task that ran twice
    wrong = entries[-2]
    entries[-2] = Entry(wrong.id, wrong.worker, SHARED_QUEUE, wrong.tenant, wrong.published,
                        wrong.started, wrong.finished, 0)  # fmt: skip
    marks = {"flood_at": FLOOD_AT, "counted_from": 94.0, "complete": 0.0}
    r = analyse_flood(entries, published, LAYOUT, MODES["fair"], marks, FloodParams(flood=10))
    assert lost.id in published
    assert (r["lost"], r["duplicates"], r["misrouted"], r["complete"]) == (1, 1, 1, False)


def test_summary_compares_modes_over_repetitions() -> None:
    runs = {"A": {"plain-shared": [analyse("plain-shared", 5.0), analyse("plain-shared", 7.0)],
                  "fair": [analyse("fair", 0.003), analyse("fair", 0.003)]}}  # fmt: skip
    s = summarise(runs)["A"]
    assert list(s["modes"]) == ["plain-shared", "fair"]
    assert s["modes"]["plain-shared"]["quiet_others.p50"]["median"] == pytest.approx(6.0)
    assert s["throughput_vs"]["fair/plain-shared"] == pytest.approx(1.0)
    assert "| plain-shared |" in markdown({"A": s}, {}, per_tenant=False)
    assert "flood throughput" in terminal({"A": s}, {})


def test_percentile_and_spread() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(range(1, 101)), 0.99) == 99
    assert math.isnan(percentile([], 0.5))
    assert spread([1.0, 2.0, 3.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "spread": 1.0, "n": 3}


def test_layout_routes_like_the_router() -> None:
    router = LAYOUT.router()
    for t in (*LAYOUT.quiet, LAYOUT.flood):
        assert LAYOUT.shard_of(t) == router.queue_for(t)
    assert LAYOUT.neighbours == tuple(
        t for t in LAYOUT.quiet if router.queue_for(t) == router.queue_for(LAYOUT.flood)
    )
    assert LAYOUT.queues(MODES["plain-shared"]) == [SHARED_QUEUE]


def test_a_scheduled_flood_is_measured_from_its_due_time() -> None:
    """KS: the flood's tasks share one eta; its phase and rates start when they are due."""
    due = FLOOD_AT + 3.0
    m = MODES["fair-keyed-eta"]
    entries, published = [], {}
    for i in range(10):  # published at FLOOD_AT, started from 0.5 s after due
        tid = f"f{i}"
        entries.append(entry(tid, LAYOUT.flood, FLOOD_AT, 3.5 + i, SHARED_QUEUE))
        published[tid] = (LAYOUT.flood, due)
    for t in LAYOUT.quiet:
        for k in range(4):
            for tid, at, wait in ((f"{t}-b{k}", 95.0 + k, 0.002),  # unloaded
                                  (f"{t}-w{k}", 101.0 + k * 0.5, 0.5),  # before due
                                  (f"{t}-d{k}", due + 1 + k, 0.003)):  # once due  # fmt: skip
                entries.append(entry(tid, t, at, wait, SHARED_QUEUE))
                published[tid] = (t, at)
    marks = {"flood_at": FLOOD_AT, "counted_from": 94.0, "complete": 1.0, "flood_due": due,
             "flood_published_from": FLOOD_AT, "flood_published_to": 101.0}  # fmt: skip
    r = analyse_flood(entries, published, LAYOUT, m, marks, FloodParams(flood=10, due_after=3.0))
    assert (r["lost"], r["duplicates"], r["misrouted"]) == (0, 0, 0)
    # The slow waits before due are apart; after it every quiet tenant is within 2x.
    assert r["quiet_others_before_due"]["n"] == 4 * r["others"]
    assert r["quiet_others_before_due"]["p99"] == pytest.approx(0.5)
    assert r["quiet_others"]["n"] == 4 * r["others"]
    assert r["quiet_others"]["p99"] == pytest.approx(0.003)
    assert r["within_2x"] == len(LAYOUT.quiet)
    assert r["flood"]["due_margin"] == pytest.approx(2.0)
    assert r["flood"]["early"] == 0
    assert r["flood"]["first_start_after_due"] == pytest.approx(0.5)
    # Ten tasks from the due time (103.0) to the last finish (112.503).
    assert r["flood"]["throughput"] == pytest.approx(10 / 9.503)
    s = summarise({"KS": {"fair-keyed-eta": [r]}})
    text = markdown(s, {}, per_tenant=False)
    assert "KS. Fair when due" in text and "before its due time" in text
    assert "KS. Fair when due" in terminal(s, {})
