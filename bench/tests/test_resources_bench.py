"""bench.resources' arithmetic on ledgers made by hand (no broker)."""

from __future__ import annotations

import pytest

from bench.resources import (
    PACKING,
    PACKING_CAPACITY,
    PAPER,
    PAPER_CAPACITY,
    TENANTS,
    WORKER_CAPACITIES,
    as_setting,
    best_mix,
    dominant_of,
    drf_allocation,
    first_start,
    use_of,
)
from tests.harness.keys import most_at_once
from tests.harness.ledger import Entry
from tests.harness.resources import (
    backlogged_window,
    declared,
    over_capacity,
    peaks,
    ran_once,
    running,
    shares,
)


def _entry(n: int, tenant: str, start: float, end: float, *, held: bool = True,
           worker: str = "w@h") -> Entry:  # fmt: skip
    return Entry(
        id=f"{tenant}{n}", worker=worker, queue=tenant, tenant=tenant, published=None,
        started=start, finished=end, requeues=0,
        resources=dict(PAPER[tenant]) if held else None,
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


def test_time_averaged_running_counts_only_the_window() -> None:
    # One task the whole window, one half of it, one straddling its start, one after it.
    entries = [_entry(0, "a", 0.0, 4.0), _entry(1, "a", 1.0, 3.0), _entry(2, "a", -1.0, 1.0),
               _entry(3, "a", 5.0, 6.0)]  # fmt: skip
    assert running(entries, "a", 0.0, 4.0) == pytest.approx((4 + 2 + 1) / 4)


def test_plain_celerys_runs_are_given_the_shape_they_were_published_with() -> None:
    # Ten at once, as plain Celery's threads run them, with nothing recorded by the worker.
    entries = [_entry(i, "a" if i % 2 else "b", 0.0, 1.0, held=False) for i in range(10)]
    assert peaks(entries) == {}
    filled = declared(entries, PAPER)
    assert peaks(filled) == {"cpu": 5 * 1 + 5 * 3, "mem": 5 * 4 + 5 * 1}
    # B, A, B, A, then the third B makes 11 CPUs: that start and the five after it are over.
    assert over_capacity(filled, PAPER_CAPACITY) == 6
    # What a run recorded is kept.
    recorded = [_entry(0, "a", 0.0, 1.0)]
    assert declared(recorded, {"a": {"cpu": 99.0}})[0].resources == PAPER["a"]


def test_every_task_once_missing_and_repeats() -> None:
    entries = [_entry(0, "a", 0.0, 1.0), _entry(1, "a", 0.0, 1.0), _entry(1, "a", 2.0, 3.0)]
    assert ran_once(entries, 3) == {"ran": 2, "missing": 1, "repeats": 1}
    assert ran_once(entries[:2], 2) == {"ran": 2, "missing": 0, "repeats": 0}


def test_most_at_once_per_queue() -> None:
    entries = [_entry(0, "a", 0.0, 2.0), _entry(1, "a", 1.0, 3.0), _entry(2, "a", 2.0, 4.0),
               _entry(3, "b", 0.0, 9.0)]  # fmt: skip
    assert most_at_once(entries) == {"a": 2, "b": 1}  # a finish at a start frees its slot


def test_dominant_shares_of_two_workers_sum() -> None:
    total = {r: sum(c[r] for c in WORKER_CAPACITIES) for r in WORKER_CAPACITIES[0]}
    assert total == {"cpu": 15.0, "mem": 42.0}
    # A's share is memory's (4/42 a task), B's CPU's (3/15): 21 A to 10 B are equal.
    dominant = dominant_of({"A": 2.1, "B": 1.0}, TENANTS, total)
    assert dominant["A"] == pytest.approx(dominant["B"])
    entries = [
        Entry(id=f"{t}{i}", worker="w@h", queue="jobs", tenant=t, published=None, started=0.0,
              finished=10.0, requeues=0, resources=dict(TENANTS[t]))
        for t, n in (("A", 6), ("B", 3)) for i in range(n)
    ]  # fmt: skip
    assert shares(entries, TENANTS, total, 0.0, 10.0) == pytest.approx(
        dominant_of({"A": 6, "B": 3}, TENANTS, total)
    )


def test_drf_allocation_of_the_paper_and_of_the_four_shapes() -> None:
    assert drf_allocation(PAPER, PAPER_CAPACITY, 10) == {"a": 3, "b": 2}
    counts = drf_allocation(PACKING, PACKING_CAPACITY, 10)
    assert counts == {"small": 1, "cpu": 1, "mem": 1, "gpu": 1}
    assert use_of(counts, PACKING, PACKING_CAPACITY) == pytest.approx(
        {"cpu": 1.0, "mem": 22 / 32, "gpu": 0.5}
    )


def test_best_mix_is_exhaustive() -> None:
    # CPUs of the paper: nine A's would need 36 GB; 3 B's use all 9 CPUs in three tasks.
    counts, use = best_mix(PAPER, PAPER_CAPACITY, 10, "cpu")
    assert use == pytest.approx(1.0)
    assert counts == {"a": 0, "b": 3}  # the fewest tasks among the full mixes
    counts, use = best_mix(PAPER, PAPER_CAPACITY, 10, "mem")
    # Memory: a fifth A needs 20 GB; 4 A's leave 5 CPUs, room for one B: 17 GB of 18.
    assert use == pytest.approx(17 / 18)
    assert counts == {"a": 4, "b": 1}
    # Slots bound the mix: one slot, the memory-heaviest shape alone.
    assert best_mix(PACKING, PACKING_CAPACITY, 1, "mem") == ({"small": 0, "cpu": 0, "mem": 1,
                                                               "gpu": 0}, 12 / 32)  # fmt: skip
    counts, use = best_mix(PACKING, PACKING_CAPACITY, 10, "gpu")
    assert use == pytest.approx(1.0) and counts["gpu"] == 2


def test_the_environment_spelling() -> None:
    assert as_setting({"cpu": 9.0, "mem": 18.0}) == "cpu=9,mem=18"


def test_two_workers_window_starts_when_the_later_worker_starts() -> None:
    entries = [_entry(0, "a", 0.0, 1.0, worker="one@h"), _entry(1, "a", 2.5, 3.0, worker="two@h"),
               _entry(2, "a", 1.0, 2.0, worker="one@h")]  # fmt: skip
    assert first_start(entries, "one") == 0.0
    assert first_start(entries, "two") == 2.5
