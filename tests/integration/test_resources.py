"""Resources: tasks start by what they declare, against a real Redis and real ``celery worker``.

The Dominant Resource Fairness paper's example (Ghodsi et al., NSDI 2011): a
worker of <9 CPUs, 18 GB>, A's tasks <1 CPU, 4 GB>, B's <3 CPUs, 1 GB>; DRF
runs three of A's and two of B's.  From the ledger of starts and finishes
the capacity is never exceeded (a run's recorded interval lies inside the
time its resources are held), and A:B, time-averaged, is 3:2.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from celery import Celery

import celery_fair
from celery_fair.errors import FairConfigError
from celery_fair.parking.store import parking_for
from tests.harness.churn import CAPACITY, QUEUE_CONCURRENCY, run_churn
from tests.harness.control import wait_fair_stats
from tests.harness.harness import WorkerProcess, poll_until
from tests.harness.keys import most_at_once
from tests.harness.ledger import Ledger
from tests.harness.redis import RedisServer
from tests.harness.resources import backlogged_window, peaks, running, shares
from tests.integration.test_churn import MAX_TASKS
from tests.integration.test_churn import TASKS as CHURN_TASKS
from tests.integration.test_churn import _check as check_churn

pytestmark = [pytest.mark.integration]

A = {"cpu": 1, "mem": 4}
B = {"cpu": 3, "mem": 1}
PAPER = "cpu=9,mem=18"
#: Tasks per tenant on two workers: the start and the end of a run, where shares move,
#: weigh less in a longer window (300 gave 0.887 once, on a loaded machine).
PER_TENANT = 450


@pytest.fixture
def producer(redis_url: str) -> Iterator[Celery]:
    app = Celery("resources-producer", broker=redis_url)
    celery_fair.install(app)
    yield app
    app.close()


def _publish(app: Celery, queue: str, n: int, resources: Mapping[str, float], ms: float) -> None:
    for _ in range(n):
        app.send_task(
            "ledger", kwargs={"ms": ms, "tenant_id": queue}, queue=queue, fair_resources=resources
        )


@pytest.mark.parametrize(
    ("broker", "pool"),
    [
        ("redis", "threads"),
        ("redis", "prefork"),
        ("redis", "gevent"),
        ("redis", "eventlet"),
        pytest.param("rabbitmq", "threads", marks=pytest.mark.rabbitmq),
        pytest.param("rabbitmq", "prefork", marks=pytest.mark.rabbitmq),
    ],
)
def test_the_papers_example_runs_three_to_two_within_capacity(
    request: pytest.FixtureRequest, redis_url: str, broker: str, pool: str
) -> None:
    url = redis_url if broker == "redis" else request.getfixturevalue("rabbitmq_server").url
    app = Celery("resources-producer", broker=url)
    celery_fair.install(app)
    try:
        _publish(app, "a", 90, A, ms=300)
        _publish(app, "b", 60, B, ms=300)
    finally:
        app.close()
    ledger = Ledger(redis_url)
    env = {"CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_CAPACITY": PAPER,
           "CELERY_FAIR_COST": "dominant"}  # fmt: skip
    with WorkerProcess(url, ["a", "b"], pool=pool, concurrency=10, env=env) as worker:
        assert ledger.wait_for(150, timeout=120, alive=[worker]), worker.log()[-3000:]
        stats = wait_fair_stats(url)
    entries = ledger.entries()
    assert len({e.id for e in entries}) == 150
    peak = peaks(entries)
    assert peak["cpu"] <= 9 and peak["mem"] <= 18, peak
    start, end = backlogged_window(entries, ["a", "b"])
    ratio = running(entries, "a", start, end) / running(entries, "b", start, end)
    # RabbitMQ: 1.54-1.55 measured where Redis gives 1.50: a's window arrives first and
    # four of a's tasks start before b's first is here; see docs/resources.md, "On RabbitMQ".
    assert 1.5 * 0.9 <= ratio <= 1.5 * 1.1, (ratio, stats)
    resources = stats["resources"]
    assert resources["capacity"] == {"cpu": 9.0, "mem": 18.0, "slots": 10.0}
    assert resources["running"] == 0 and resources["parked"] == 0
    if broker == "rabbitmq":
        # No capacity board and no window fitted on RabbitMQ: each worker charges
        # against its own capacity (docs/resources.md).
        return
    # The window holds Celery's multiplier (4) of the ~5 tasks that fit at once, not of
    # the 10 threads: 20ish, where Celery's is 40.
    assert 16 <= stats["prefetch_windows"]["*"] <= 24, stats["prefetch_windows"]
    # The worker's capacity, read back from the board on the broker.
    assert resources["cluster"] == {"cpu": 9.0, "mem": 18.0, "slots": 10.0}


@pytest.mark.parametrize(
    "churn",
    [
        # Production flags: a child replaced every 5 tasks, and a pool that grows and shrinks.
        ["--max-tasks-per-child", "5"],
        ["--autoscale", "4,1"],
    ],
    ids=["max-tasks-per-child", "autoscale"],
)
def test_queue_concurrency_holds_under_churn(
    redis_url: str, producer: Celery, churn: list[str]
) -> None:
    for _ in range(300):
        producer.send_task("ledger", kwargs={"ms": 20, "tenant_id": "video"}, queue="video")
        producer.send_task("ledger", kwargs={"ms": 20, "tenant_id": "other"}, queue="other")
    ledger = Ledger(redis_url)
    env = {"CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_QUEUE_CONCURRENCY": "video=2"}
    with WorkerProcess(
        redis_url, ["video", "other"], concurrency=4, env=env, extra_args=churn
    ) as worker:
        assert ledger.wait_for(600, timeout=180, alive=[worker]), worker.log()[-3000:]
    entries = ledger.entries()
    assert len(entries) == len({e.id for e in entries}) == 600
    most = most_at_once(entries)
    assert most["video"] <= 2, most
    assert most["video"] == 2, most  # the limit is used, not only respected
    assert most["other"] >= 2, most  # the rest of the worker serves the other queue


def test_a_task_attribute_is_held_and_one_that_never_fits_is_parked(
    redis_url: str, producer: Celery
) -> None:
    queue = "held"
    for _ in range(12):
        producer.send_task("held", kwargs={"ms": 100, "tenant_id": "held"}, queue=queue)
    producer.send_task(
        "ledger", kwargs={"tenant_id": "gpu"}, queue=queue, fair_resources={"gpu": 1}
    )
    ledger = Ledger(redis_url)
    env = {"CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_CAPACITY": "cpu=4",
           "CELERY_FAIR_HELD_RESOURCES": "cpu=2"}  # fmt: skip
    with WorkerProcess(redis_url, [queue], pool="threads", concurrency=4, env=env) as worker:
        assert ledger.wait_for(12, timeout=60, alive=[worker]), worker.log()[-3000:]
        with producer.connection_for_write() as conn:
            parking = parking_for(conn.default_channel)
            assert poll_until(lambda: bool(parking.list(queue)), timeout=30), worker.log()[-3000:]
            parked = parking.list(queue)
    assert most_at_once(ledger.entries())["held"] == 2  # cpu=2 each of cpu=4, on 4 threads
    assert len(parked) == 1 and parked[0].task == "ledger"
    assert "resource(s) gpu not in the worker's capacity" in parked[0].reason
    assert ledger.per_tenant().get("gpu") is None  # parked, not run


def test_a_task_attribute_that_can_never_fit_stops_the_worker_at_start(redis_url: str) -> None:
    env = {"CELERY_FAIR_CAPACITY": "cpu=4", "CELERY_FAIR_HELD_RESOURCES": "cpu=8"}
    worker = WorkerProcess(redis_url, ["held"], pool="threads", concurrency=2, env=env).start()
    try:
        assert worker.wait(timeout=60) != 0
    finally:
        worker.stop()
    log = worker.log()
    assert "fair_resources of task 'held'" in log and "cpu 8 > 4" in log, log[-3000:]


@pytest.mark.parametrize("bad", [{"cpu": -1}, {"cpu": "lots"}, "cpu"])
def test_a_bad_declaration_is_refused_at_publish(producer: Celery, bad: object) -> None:
    with pytest.raises(FairConfigError, match="fair_resources of task 'ledger'"):
        producer.send_task("ledger", queue="a", fair_resources=bad)


def test_two_workers_of_different_sizes_give_a_keyed_queues_tenants_equal_dominant_shares(
    redis_url: str,
) -> None:
    from tests.harness.keys import keyed_app

    producer = keyed_app(redis_url, {"jobs": "tenant_id"})
    try:
        for _ in range(PER_TENANT):
            producer.send_task("ledger", kwargs={"ms": 300, "tenant_id": "A"}, queue="jobs",
                               fair_resources=A)  # fmt: skip
            producer.send_task("ledger", kwargs={"ms": 300, "tenant_id": "B"}, queue="jobs",
                               fair_resources=B)  # fmt: skip
    finally:
        producer.close()
    ledger = Ledger(redis_url)
    capacities = ["cpu=9,mem=18", "cpu=6,mem=24"]
    workers = [
        WorkerProcess(
            redis_url,
            ["jobs"],
            pool="threads",
            concurrency=10,
            env={
                "CELERY_FAIR_LEDGER": redis_url,
                "CELERY_FAIR_KEYS": "jobs=tenant_id",
                "CELERY_FAIR_CAPACITY": capacity,
                "CELERY_FAIR_COST": "dominant",
            },
        )  # fmt: skip
        for capacity in capacities
    ]
    try:
        for worker in workers:
            worker.start()
        assert ledger.wait_for(2 * PER_TENANT, timeout=240, alive=workers), workers[0].log()[-3000:]
    finally:
        for worker in workers:
            worker.stop()
    entries = ledger.entries()
    start, end = backlogged_window(entries, ["A", "B"])
    # From the moment both workers run: the first to start runs alone for a while,
    # and alone its own DRF gives A 12/42 against B's 6/15 of the two workers' sum.
    start = max(start, *(min(e.started for e in entries if e.worker.startswith(w.name + "@"))
                         for w in workers))  # fmt: skip
    total = {"cpu": 15.0, "mem": 42.0}
    dominant = shares(entries, {"A": A, "B": B}, total, start, end)
    # DRF over both workers: A's share is memory's (4/42 a task), B's CPU's (3/15).
    # Each worker charges against its own capacity, so the two add up only roughly:
    # 0.99 and 1.01 on a quiet machine, 0.92 and 0.95 with three CPU-bound processes
    # beside it, 0.89 once in the whole suite (docs/resources.md, "Evidence").
    assert 0.85 <= dominant["A"] / dominant["B"] <= 1.15, dominant
    sizes = ({"cpu": 9, "mem": 18}, {"cpu": 6, "mem": 24})
    for worker, capacity in zip(workers, sizes, strict=True):
        runs = [e for e in entries if e.worker.startswith(worker.name + "@")]
        peak = peaks(runs)
        assert runs and all(peak[r] <= capacity[r] for r in capacity), (worker.name, peak)


def test_telemetry_records_what_each_task_held_and_the_capacity(
    redis_url: str, producer: Celery, tmp_path: Path
) -> None:
    """Prefork: the main process stamps the demand and capacity, the pool process records them."""
    pq = pytest.importorskip("pyarrow.parquet")
    _publish(producer, "a", 12, A, ms=50)
    _publish(producer, "b", 8, B, ms=50)
    ledger = Ledger(redis_url)
    telemetry = tmp_path / "telemetry"
    env = {"CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_CAPACITY": PAPER,
           "CELERY_FAIR_TELEMETRY_DIR": str(telemetry)}  # fmt: skip
    with WorkerProcess(redis_url, ["a", "b"], pool="prefork", concurrency=4, env=env) as worker:
        assert ledger.wait_for(20, timeout=120, alive=[worker]), worker.log()[-3000:]
    rows = [r for r in pq.read_table(telemetry).to_pylist() if r["outcome"] == "success"]
    assert len({r["task_id"] for r in rows}) == 20
    held = {"a": {**A, "slots": 1}, "b": {**B, "slots": 1}}
    for row in rows:
        assert dict(row["resources"]) == held[row["queue"]], row
        assert dict(row["capacity"]) == {"cpu": 9.0, "mem": 18.0, "slots": 4.0}, row


def test_the_books_repair_themselves_under_churn_at_volume(
    redis_server: RedisServer, redis_url: str
) -> None:
    """The churn soak of ``tests/integration/test_churn.py`` (3,000 tasks; children
    replaced every 20 tasks, ``--autoscale 3,1``, pool processes SIGKILLed, hard time
    limits, revokes with terminate), with a capacity of 3 CPUs per worker, ``lo``
    limited to 1 and every task declaring what it holds.

    Every task is accounted for, the limits hold at every instant of the finished
    runs, and once the churn is over each worker's books hold nothing: what killed,
    time-limited and revoked tasks held came back.
    """
    # redis_url: the session's Redis is emptied after the test (db 0, the broker).
    record = run_churn(
        "redis", CHURN_TASKS, True, waves=2, max_tasks_per_child=MAX_TASKS, kill_every=1.0,
        revoke_every=1.0, slow_share=0.01, over_share=0.005, quiet=20.0, timeout=150.0,
        resources=True, redis_server=redis_server, progress=lambda _: None,
    )  # fmt: skip
    check_churn(record)
    books = record["resources"]
    assert books["settled"], books["workers"]
    for node, reply in books["workers"].items():
        assert reply["capacity"]["cpu"] == CAPACITY["cpu"], (node, reply)
    most = books["at_once"]
    assert len(most) == 2, most
    for node, held in most.items():
        assert held["cpu"] <= CAPACITY["cpu"], (node, most)
        assert held["lo"] <= QUEUE_CONCURRENCY["lo"], (node, most)
    assert any(held["cpu"] == CAPACITY["cpu"] for held in most.values()), most  # it binds


def test_codel_counts_the_wait_for_room(redis_url: str, producer: Celery) -> None:
    """A task waiting for a GPU, on a worker whose four threads are free, is stale to
    CoDel: it is asked as the task starts, so its sojourn includes the wait for room.

    One GPU, tasks of 100 ms that each hold it: the window holds a few tasks (Celery's
    multiplier of the one that fits at once) and all but one wait for the GPU, never for
    a thread.  With a target of 20 ms and a cap of one return, stale tasks go back once
    and then run: each ran exactly once, and the GPU was never held twice.
    """
    n = 24
    for _ in range(n):
        producer.send_task("ledger", kwargs={"ms": 100, "tenant_id": "gpu"}, queue="gpu",
                           fair_resources={"gpu": 1})  # fmt: skip
    ledger = Ledger(redis_url)
    env = {"CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_CAPACITY": "gpu=1",
           "CELERY_FAIR_CODEL": "0.02,0.1,requeue,1"}  # fmt: skip
    with WorkerProcess(redis_url, ["gpu"], pool="threads", concurrency=4, env=env) as worker:
        assert ledger.wait_for(n, timeout=120, alive=[worker]), worker.log()[-3000:]
    entries = ledger.entries()
    assert len(entries) == len({e.id for e in entries}) == n  # each ran exactly once
    assert peaks(entries)["gpu"] <= 1
    assert max(e.requeues for e in entries) == 1  # sent back once at most, then ran
    assert sum(e.requeues > 0 for e in entries) >= 2, [e.requeues for e in entries]


def test_solo_pool_holds_what_tasks_declare_and_parks_what_never_fits(
    redis_url: str, producer: Celery
) -> None:
    """``-P solo`` runs tasks in the consumer's own thread: the gate must neither
    block it nor hold anything after a run."""
    queue = "solo"
    for _ in range(8):
        producer.send_task("ledger", kwargs={"ms": 20, "tenant_id": "cpu"}, queue=queue,
                           fair_resources={"cpu": 2})  # fmt: skip
    producer.send_task(
        "ledger", kwargs={"tenant_id": "gpu"}, queue=queue, fair_resources={"gpu": 1}
    )
    for _ in range(8):
        producer.send_task("ledger", kwargs={"ms": 20, "tenant_id": "after"}, queue=queue)
    ledger = Ledger(redis_url)
    env = {"CELERY_FAIR_LEDGER": redis_url, "CELERY_FAIR_CAPACITY": "cpu=4"}
    with WorkerProcess(redis_url, [queue], pool="solo", env=env) as worker:
        assert ledger.wait_for(16, timeout=60, alive=[worker]), worker.log()[-3000:]
        with producer.connection_for_write() as conn:
            parking = parking_for(conn.default_channel)
            assert poll_until(lambda: bool(parking.list(queue)), timeout=30), worker.log()[-3000:]
            parked = parking.list(queue)
        stats = wait_fair_stats(redis_url)
    per_tenant = ledger.per_tenant()
    assert per_tenant.get("cpu") == 8 and per_tenant.get("after") == 8, per_tenant
    assert len(parked) == 1 and "resource(s) gpu not in the worker's capacity" in parked[0].reason
    resources = stats["resources"]
    assert resources["capacity"]["slots"] == 1.0, resources
    assert resources["running"] == 0 and not any(resources["held"].values()), resources
