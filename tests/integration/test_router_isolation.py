"""Noisy-key isolation on a real RabbitMQ (and Redis) with a real ``celery worker``.

One tenant floods; a quiet *neighbour* hashes to the flood's ring queue, so
without isolation it waits behind the flood's backlog in that FIFO queue (a
control run in the same test measures it). With ``isolate=`` the router sends
the flood to the isolation queue once it passes 10% of recent publishes and
30 messages, the worker serves that queue at a low weight, and the
neighbour's wait stays low. The ledger proves that every published task ran
exactly once, from the queue it was routed to.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

import celery_fair
from celery_fair.routing import ConsistentHashRouter
from celery_fair.routing.isolation import IsolationPolicy
from tests.harness.harness import WorkerProcess
from tests.harness.ledger import Entry, Ledger, percentile

pytestmark = [pytest.mark.integration]

FLOOD = 1200  # flood tasks, 10 ms each: about 6 s of a 2-process pool
FLOOD_MS = 10.0
QUIET_MS = 1.0
EVERY = 20  # one quiet task per this many flood tasks while the flood is published
QUIET_TENANTS = 15  # each well under 10% of the quiet traffic
QUIET_GAP = 0.02  # seconds between quiet tasks once the flood is published
ISOLATION_WEIGHT = 0.25


@dataclass
class Run:
    router: ConsistentHashRouter
    flood: str
    neighbour: str
    routed: dict[str, str]  # task id -> the queue it was published to
    tenants: dict[str, str]  # task id -> tenant
    entries: list[Entry]
    released: bool  # the flood was released before the run ended
    drained_at: float  # wall time when the last flood task had started


@pytest.fixture
def routed_to() -> Iterator[dict[str, str]]:
    """Task id -> routing key of every task this process publishes."""
    seen: dict[str, str] = {}

    def record(routing_key: str, headers: dict[str, Any], **_: Any) -> None:
        seen[headers["id"]] = routing_key

    before_task_publish.connect(record, weak=False)
    try:
        yield seen
    finally:
        before_task_publish.disconnect(record)


def layout(tag: str) -> tuple[dict[str, int], str, str, list[str]]:
    """Four equal shards, the flood, a neighbour on the flood's shard, the quiet tenants."""
    shards = {f"iso{tag}.s{i}": 1 for i in range(4)}
    ring = ConsistentHashRouter(shards, key="tenant_id")
    flood = "tenant-flood"
    neighbour = next(
        t
        for i in itertools.count()
        if ring.queue_for(t := f"tenant-{i:02d}") == ring.queue_for(flood)
    )
    others = [f"quiet-{i:02d}" for i in range(QUIET_TENANTS - 1)]
    return shards, flood, neighbour, [neighbour, *others]


def run(broker_url: str, ledger_url: str, routed_to: dict[str, str], *, isolate: bool) -> Run:
    tag = uuid.uuid4().hex[:6]
    shards, flood, neighbour, quiet = layout(tag)
    policy = (
        # SQS's thresholds (the defaults); a short half-life and hold so that the
        # release happens within the test, not a minute later.
        IsolationPolicy(f"iso{tag}.isolated", half_life=1.0, hold=1.0) if isolate else None
    )
    router = ConsistentHashRouter(shards, key="tenant_id", isolate=policy)
    app = Celery("isolation_producer", broker=broker_url, set_as_current=False)
    app.conf.task_routes = (router,)
    app.conf.broker_connection_retry_on_startup = True
    celery_fair.install(app)  # stamps the publish time the ledger's waits are measured from
    queues = router.worker_queues()
    with app.connection_for_write() as conn:  # declared before the worker's first poll
        for name in queues:
            app.amqp.queues[name](conn.default_channel).declare()

    ledger = Ledger(ledger_url)
    ledger.reset()
    weights = ",".join(f"{q}={ISOLATION_WEIGHT if q == router.isolation_queue else 1}"
                       for q in queues)  # fmt: skip
    worker = WorkerProcess(
        broker_url,
        queues,
        concurrency=2,
        env={
            "CELERY_FAIR_LEDGER": ledger_url,
            "CELERY_FAIR_WEIGHTS": weights,
            "CELERY_FAIR_PREFETCH": "8",
        },
    )
    tenants: dict[str, str] = {}
    cycle = itertools.cycle(quiet)

    def send(tenant: str, ms: float, producer: Any) -> None:
        task_id = str(uuid.uuid4())
        tenants[task_id] = tenant
        app.send_task(
            "ledger", args=(ms,), kwargs={"tenant_id": tenant}, task_id=task_id,
            producer=producer,
        )  # fmt: skip

    released = False
    drained_at = 0.0
    try:
        with worker:
            deadline = time.monotonic() + 60
            while " ready." not in worker.log():
                assert worker.proc is not None and worker.proc.poll() is None, worker.log()
                assert time.monotonic() < deadline, worker.log()[-3000:]
                time.sleep(0.05)
            with app.producer_pool.acquire(block=True) as producer:
                # The flood, with the neighbour and the others sprinkled in.
                for i in range(FLOOD):
                    send(flood, FLOOD_MS, producer)
                    if i % EVERY == 0:
                        send(neighbour, QUIET_MS, producer)
                        send(next(cycle), QUIET_MS, producer)
                # Quiet tenants keep publishing while the backlog drains, and, with
                # isolation, until the flood's key has calmed down and been released.
                deadline = time.monotonic() + 120
                while True:
                    send(next(cycle), QUIET_MS, producer)
                    drained = ledger.per_tenant().get(flood, 0) >= FLOOD
                    if drained and not drained_at:
                        drained_at = time.time()
                    released = router.detector is not None and not router.detector.is_isolated(
                        flood
                    )
                    if drained and (router.detector is None or released):
                        break
                    assert worker.proc is not None and worker.proc.poll() is None, worker.log()
                    assert time.monotonic() < deadline, f"not drained: {ledger.per_tenant()}"
                    time.sleep(QUIET_GAP)
                if router.detector is not None:
                    # After the release the flood's key is back on its ring queue.
                    for _ in range(3):
                        send(flood, QUIET_MS, producer)
            assert ledger.wait_for(len(tenants), timeout=60, alive=[worker]), worker.log()[-3000:]
    finally:
        app.close()
    routed = {i: routed_to[i] for i in tenants}
    return Run(router, flood, neighbour, routed, tenants, ledger.entries(), released, drained_at)


def check_exactly_once(result: Run) -> None:
    runs = Counter(e.id for e in result.entries)
    assert set(runs) == set(result.tenants), "every published task ran"
    assert set(runs.values()) == {1}, "no task ran twice"
    for e in result.entries:
        assert e.tenant == result.tenants[e.id]
        assert e.queue == result.routed[e.id], (e.tenant, e.queue, result.routed[e.id])


def neighbour_waits(result: Run) -> list[float]:
    """The neighbour's waits (publish -> start) for tasks published while the flood lasted."""
    waits = [
        e.wait
        for e in result.entries
        if e.tenant == result.neighbour and e.published is not None
        if e.published < result.drained_at and e.wait is not None
    ]
    assert len(waits) >= FLOOD // EVERY
    return waits


@pytest.mark.parametrize("broker", [pytest.param("rabbitmq", marks=pytest.mark.rabbitmq), "redis"])
def test_a_flooding_tenant_is_isolated_and_its_neighbour_keeps_a_low_wait(
    broker: str, request: pytest.FixtureRequest, redis_url: str, routed_to: dict[str, str]
) -> None:
    # The ledger is kept on the session's Redis whichever broker is measured.
    server = request.getfixturevalue("rabbitmq_server" if broker == "rabbitmq" else "redis_server")
    url = server.url
    control = run(url, redis_url, routed_to, isolate=False)
    isolated = run(url, redis_url, routed_to, isolate=True)
    for result in (control, isolated):
        check_exactly_once(result)

    flood, neighbour = control.flood, control.neighbour
    ring_queue = control.router.queue_for(flood)
    assert ring_queue == control.router.queue_for(neighbour)  # they share a shard
    # Without isolation every flood task went to the shard.
    assert {control.routed[i] for i, t in control.tenants.items() if t == flood} == {ring_queue}

    router = isolated.router
    iso_queue = router.isolation_queue
    assert iso_queue is not None
    flood_queues = [isolated.routed[i] for i, t in isolated.tenants.items() if t == flood]
    # About the first 30 flood tasks (min_messages, counted with a 1 s half-life) went
    # to the shard, then all the rest to the isolation queue; after the release the
    # key is back on its shard.
    first = flood_queues.index(iso_queue)
    assert 29 <= first < 60 and set(flood_queues[first:FLOOD]) == {iso_queue}
    assert isolated.released and flood_queues[FLOOD:] == [router.queue_for(flood)] * 3
    # Nobody else was ever isolated.
    assert all(isolated.routed[i] != iso_queue for i, t in isolated.tenants.items() if t != flood)
    stats = router.statistics()
    assert stats.isolation is not None
    assert (stats.isolation.isolations, stats.isolation.releases) == (1, 1)
    assert stats.routed[iso_queue] == FLOOD - first

    before, after = neighbour_waits(control), neighbour_waits(isolated)
    p50_before, p99_before = percentile(before, 0.5), percentile(before, 0.99)
    p50_after, p99_after = percentile(after, 0.5), percentile(after, 0.99)
    print(
        f"\nneighbour wait without isolation p50 {p50_before * 1e3:.0f} ms, "
        f"p99 {p99_before * 1e3:.0f} ms; with isolation p50 {p50_after * 1e3:.0f} ms, "
        f"p99 {p99_after * 1e3:.0f} ms; the flood isolated from its task {first + 1}"
    )
    assert p99_after < 1.0
    # The control run is measured in the same test: the neighbour's wait there is
    # the flood's backlog in their shared shard.
    assert p50_before > 5 * p50_after and p99_before > 2 * p99_after
