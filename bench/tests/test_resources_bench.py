"""bench.resources' arithmetic on ledgers made by hand (no broker)."""

from __future__ import annotations

import pytest

from bench.resources import PAPER, PAPER_CAPACITY, use_of
from tests.harness.ledger import Entry
from tests.harness.resources import backlogged_window, over_capacity, peaks, running, shares


def _entry(n: int, tenant: str, start: float, end: float) -> Entry:
    return Entry(
        id=f"{tenant}{n}", worker="w", queue=tenant, tenant=tenant, published=None,
        started=start, finished=end, requeues=0, resources=dict(PAPER[tenant]),
    )  # fmt: skip


def test_the_papers_allocation_held_for_ten_seconds() -> None:
    entries = [_entry(i, "a", 0.0, 10.0) for i in range(3)]
    entries += [_entry(i, "b", 0.0, 10.0) for i in range(2)]
    entries += [_entry(9, "a", 10.0, 11.0), _entry(9, "b", 10.0, 11.0)]  # the last starts
    start, end = backlogged_window(entries, ["a", "b"])
    assert (start, end) == (0.0, 10.0)
    assert running(entries, "a", start, end) == pytest.approx(3.0)
    assert running(entries, "b", start, end) == pytest.approx(2.0)
    assert peaks(entries) == {"cpu": 9.0, "mem": 14.0}
    assert over_capacity(entries, PAPER_CAPACITY) == 0
    dominant = shares(entries, PAPER, PAPER_CAPACITY, start, end)
    assert dominant == pytest.approx({"a": 2 / 3, "b": 2 / 3})
    assert use_of({"a": 3, "b": 2}, PAPER, PAPER_CAPACITY) == pytest.approx(
        {"cpu": 1.0, "mem": 14 / 18}
    )


def test_a_start_over_the_capacity_is_counted() -> None:
    entries = [_entry(i, "b", 0.0, 1.0) for i in range(4)]  # 12 CPUs of 9
    assert over_capacity(entries, PAPER_CAPACITY) == 1
    assert peaks(entries)["cpu"] == 12.0
