"""Example tests of a Celery project under celery-fair, with ``celery_fair.testing``.

Run them with ``pytest``: a ``redis-server`` on PATH (or a broker of yours in
``CELERY_FAIR_TEST_BROKER_URL``) is all they need; without either they are
skipped, saying so.
"""

from __future__ import annotations

from collections.abc import Callable

import proj
import pytest
from celery import Celery

from celery_fair.scheduling.codel import CoDelController
from celery_fair.scheduling.drr import DeficitRoundRobin
from celery_fair.testing import (
    FairWorker,
    FakeClock,
    assert_concurrency_at_most,
    assert_shares,
    max_concurrency,
)

# The project's marker for tests that start brokers and workers (register your
# own in your pytest configuration, or drop the line).
pytestmark = pytest.mark.integration


def test_reports_share_the_worker_by_queue_weight(
    app: Celery, proj_worker: Callable[..., FairWorker]
) -> None:
    # The backlog first, then the worker: every queue has work waiting from the start.
    for _ in range(150):
        proj.report.apply_async(queue="p0")
        proj.report.apply_async(queue="p1")
    with proj_worker(queues=["p0", "p1"], concurrency=2) as worker:
        records = worker.wait_for_records(300, timeout=60)
    # While both queues had work waiting, p0 started four tasks for each of p1's.
    assert_shares(records, {"p0": 4, "p1": 1}, by="queue", tolerance=0.2)


def test_weights_given_to_one_worker(app: Celery, proj_worker: Callable[..., FairWorker]) -> None:
    for _ in range(100):
        proj.report.apply_async(queue="p0")
        proj.report.apply_async(queue="p1")
    settings = {"fair_weights": {"p0": 1, "p1": 1}}  # Celery settings for this worker only
    with proj_worker(queues=["p0", "p1"], concurrency=2, settings=settings) as worker:
        records = worker.wait_for_records(200, timeout=60)
    assert_shares(records, {"p0": 1, "p1": 1}, by="queue", tolerance=0.2)


def test_tenants_stay_within_their_concurrency(
    app: Celery, proj_worker: Callable[..., FairWorker]
) -> None:
    counts = {"big": 12, "acme": 6, "initech": 6}
    for tenant, n in counts.items():
        for _ in range(n):
            proj.job.delay(tenant, ms=50)
    with proj_worker(queues=["jobs"], concurrency=4) as worker:
        records = worker.wait_for_records(sum(counts.values()), timeout=60)
    assert {r.fair_key for r in records} == set(counts)
    assert_concurrency_at_most(records, {"*": 1, "big": 2}, by="fair_key")
    # The limit was reached, not only respected: big ran two at once.
    assert max_concurrency(records, by="fair_key")["big"] == 2


def test_codel_sheds_on_a_fake_clock() -> None:
    # The pure core reads time only from the clock it is given: no worker, no sleep.
    clock = FakeClock()
    codel = CoDelController(target=0.1, interval=1.0, clock=clock)
    assert not codel.should_drop(0.5, backlog=5)  # above target: the interval starts
    clock.advance(0.5)
    assert not codel.should_drop(0.5, backlog=5)  # not yet a whole interval
    clock.advance(0.5)
    assert codel.should_drop(0.5, backlog=5)  # above target for a whole interval: drop
    assert not codel.should_drop(0.5, backlog=4)  # the next task: the dropping state...
    assert codel.dropping
    clock.advance(1.0)  # ...drops again interval / sqrt(count) later
    assert codel.should_drop(0.5, backlog=4)
    assert not codel.should_drop(0.05, backlog=3)  # below target: it stops dropping
    assert not codel.dropping


def test_dwrr_order_needs_no_clock() -> None:
    # DWRR's decisions depend on what was served, not on time: no clock at all.
    drr = DeficitRoundRobin({"p0": 4, "p1": 1})
    drr.activate("p0")
    drr.activate("p1")
    order = []
    for _ in range(10):
        queue = drr.head()
        drr.served(queue, 1)  # the cost of the task taken: 1 (fair_cost="count")
        order.append(queue)
    assert order == ["p0"] * 4 + ["p1"] + ["p0"] * 4 + ["p1"]
