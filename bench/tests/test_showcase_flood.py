"""A tiny noisy-neighbour flood on a real Redis with a real ``celery worker -P prefork -c 2``.

The flood's backlog and the quiet tenants' tasks are all published before
the worker starts, so what is asserted is an order, not a time: with
celery-fair (tenants sharded by ``ConsistentHashRouter``, DWRR across the
shards) the quiet tenants outside the flood's shard are served while most of
the flood still waits; with plain Celery's one shared queue they are served
only after the flood. The ledger proves that nothing was lost or run twice
and that every tenant's tasks came from its stable shard.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest

from bench.showcase.layout import MODES, SHARED_QUEUE, TenantLayout, TenantProducer
from tests.harness.harness import WorkerProcess
from tests.harness.ledger import Entry, Ledger

pytestmark = pytest.mark.integration

FLOOD = 300
PER_QUIET = 3


def run_tiny_flood(redis_url: str, mode_name: str) -> tuple[TenantLayout, list[Entry], set[str]]:
    layout = TenantLayout.build(shards=4, quiet=6)
    mode = MODES[mode_name]
    ledger = Ledger(redis_url)
    ledger.reset()
    producer = TenantProducer(redis_url, layout, mode)
    ids: list[str] = []
    try:
        # The flood first: in a shared queue the quiet tasks are behind all of it.
        for tenant, n in [(layout.flood, FLOOD)] + [(t, PER_QUIET) for t in layout.quiet]:
            batch = [str(uuid.uuid4()) for _ in range(n)]
            producer.burst(tenant, 2.0, batch)
            ids += batch
    finally:
        producer.close()
    worker = WorkerProcess(
        redis_url, layout.queues(mode), fair=mode.fair, env={"CELERY_FAIR_LEDGER": redis_url}
    )
    with worker:
        assert ledger.wait_for(len(ids), timeout=120, alive=[worker]), worker.log()[-3000:]
    return layout, ledger.entries(), set(ids)


def check_ledger(layout: TenantLayout, mode_name: str, entries: list[Entry], ids: set[str]) -> None:
    runs = Counter(e.id for e in entries)
    assert set(runs) == ids, "every published task ran"
    assert set(runs.values()) == {1}, "no task ran twice"
    router = layout.router()
    for e in entries:
        assert e.tenant is not None
        expected = router.queue_for(e.tenant) if MODES[mode_name].sharded else SHARED_QUEUE
        assert e.queue == expected, (e.tenant, e.queue, expected)


def flood_starts(layout: TenantLayout, entries: list[Entry]) -> list[float]:
    return sorted(e.started for e in entries if e.tenant == layout.flood)


def test_fair_serves_quiet_tenants_before_the_flood_drains(redis_url: str) -> None:
    layout, entries, ids = run_tiny_flood(redis_url, "fair")
    check_ledger(layout, "fair", entries, ids)
    others = [t for t in layout.quiet if t not in layout.neighbours]
    assert len(others) >= 3 and layout.neighbours, "the layout has both kinds of quiet tenant"
    flood = flood_starts(layout, entries)
    half = flood[len(flood) // 2]
    late = [e for e in entries if e.tenant in others and e.started >= half]
    assert not late, f"quiet tasks waited for half the flood: {[(e.tenant, e.queue) for e in late]}"
    # The flood's neighbours share its FIFO queue: they wait behind its backlog.
    neighbours = [e for e in entries if e.tenant in layout.neighbours]
    assert all(e.started > half for e in neighbours)


def test_plain_shared_queue_serves_quiet_tenants_after_the_flood(redis_url: str) -> None:
    layout, entries, ids = run_tiny_flood(redis_url, "plain-shared")
    check_ledger(layout, "plain-shared", entries, ids)
    flood = flood_starts(layout, entries)
    # Allow for the two pool processes starting adjacent tasks in either order.
    nearly_all = flood[int(len(flood) * 0.9)]
    early = [e for e in entries if e.tenant in layout.quiet and e.started < nearly_all]
    assert not early, f"{len(early)} quiet tasks overtook 90% of the flood in a FIFO queue"


def test_keyed_eta_mode_schedules_the_burst_on_the_broker(redis_url: str) -> None:
    """KS's fair-keyed-eta producer puts a burst with an eta in the queue's schedule."""
    import time

    import redis

    from celery_fair.keys.layout import KeyedNames

    layout = TenantLayout.build(shards=4, quiet=6)
    ledger = Ledger(redis_url)
    ledger.reset()
    due = time.time() + 3.0
    ids = [str(uuid.uuid4()) for _ in range(20)]
    producer = TenantProducer(redis_url, layout, MODES["fair-keyed-eta"])
    try:
        producer.burst(layout.flood, 1.0, ids, eta=due)
    finally:
        producer.close()
    client = redis.Redis.from_url(redis_url)
    assert client.zcard(KeyedNames(SHARED_QUEUE).schedule) == len(ids)
    assert client.llen(SHARED_QUEUE) == 0
    mode = MODES["fair-keyed-eta"]
    worker = WorkerProcess(
        redis_url, layout.queues(mode), fair=True, env={"CELERY_FAIR_LEDGER": redis_url, **mode.env}
    )
    with worker:
        assert ledger.wait_for(len(ids), timeout=60, alive=[worker]), worker.log()[-3000:]
    entries = ledger.entries()
    assert {e.id for e in entries} == set(ids) and len(entries) == len(ids)
    assert min(e.started for e in entries) >= due
