"""Keyed queues in and out: enabling and rolling back ``fair_keys`` with tasks in flight.

docs/migrating.md gives the order.  Enabling: workers before producers.
Disabling: producers, then ``celery-fair keys unkey``, then workers.  Every
task reaches the ledger, whatever the step it was published in.  A task may
run twice when a prefork worker stops while it runs, with plain Celery as
well: the pool child's "accepted" (the early ack) can be left unread by the
stopping main process, which then puts the message back; so the tests bound
the repeats by the stopped worker's prefetch window instead of requiring none.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as redis_lib
from celery import Celery

from celery_fair.keys.layout import KeyedNames
from tests.harness.harness import WorkerProcess
from tests.harness.keys import keyed_app, publish_by_key
from tests.harness.ledger import Ledger

pytestmark = [pytest.mark.integration, pytest.mark.compat]

QUEUE = "roll"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def keyed(redis_url: str) -> Iterator[Celery]:
    app = keyed_app(redis_url, {QUEUE: "tenant_id"})
    yield app
    app.close()


@pytest.fixture
def plain(redis_url: str) -> Iterator[Celery]:
    app = Celery("plain-producer", broker=redis_url, set_as_current=False)
    yield app
    app.close()


def _fair_worker(redis_url: str, *, keys: bool) -> WorkerProcess:
    env = {"CELERY_FAIR_LEDGER": redis_url}
    if keys:
        env["CELERY_FAIR_KEYS"] = f"{QUEUE}=tenant_id"
    return WorkerProcess(redis_url, [QUEUE], env=env)


def _plain_worker(redis_url: str) -> WorkerProcess:
    return WorkerProcess(redis_url, [QUEUE], fair=False, env={"CELERY_FAIR_LEDGER": redis_url})


def _wait(
    ledger: Ledger,
    n: int,
    *workers: WorkerProcess,
    timeout: float = 90,
    ids: set[str] | None = None,
) -> None:
    """Wait for ``n`` runs (and, given ``ids``, for a run of each of them)."""
    deadline = time.monotonic() + timeout
    while ledger.wait_for(n, timeout=max(0.0, deadline - time.monotonic()), alive=list(workers)):
        if ids is None or ids <= {e.id for e in ledger.entries()}:
            return
        if time.monotonic() > deadline:
            break
        n += 1  # a repeat stood in for a run still to come
    client = redis_lib.Redis.from_url(workers[0].broker_url)
    found = {k: client.type(k) for k in client.scan_iter(f"{QUEUE}*")}
    found["unacked"] = client.hlen("unacked")
    logs = "\n".join(w.log()[-2000:] for w in workers)
    raise AssertionError(f"{ledger.count()} of {n} ran; broker: {found}\n{logs}")


@pytest.fixture
def published() -> Iterator[set[str]]:
    """The ids of every task this test's producers publish."""
    from celery.signals import before_task_publish

    ids: set[str] = set()

    def record(headers: dict[str, object] | None = None, **_: object) -> None:
        if headers is not None:
            ids.add(str(headers["id"]))

    before_task_publish.connect(record, weak=False)
    yield ids
    before_task_publish.disconnect(record)


#: Tasks a prefork worker may have prefetched (Celery's default window, 4 x 2 slots).
WINDOW = 8


def _all_ran(ran: Counter[str], published: set[str], *, stops: int) -> None:
    """Every published task ran: none lost, and repeats only from worker stops."""
    assert set(ran) == published, (len(published - set(ran)), "lost")
    repeats = sum(n - 1 for n in ran.values())
    assert repeats <= WINDOW * stops, ran.most_common(3)


def _ids(redis_url: str) -> Counter[str]:
    client = redis_lib.Redis.from_url(redis_url)
    return Counter(json.loads(e)["id"] for e in client.lrange("ledger", 0, -1))


def _unkey(redis_url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery_fair.cli", "keys", "unkey", QUEUE, "-b", redis_url,
         *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _publish_plain(app: Celery, n: int) -> None:
    with app.producer_or_acquire() as producer:
        for i in range(n):
            app.send_task(
                "ledger", kwargs={"ms": 2, "tenant_id": f"p{i % 3}"}, queue=QUEUE,
                producer=producer,
            )  # fmt: skip


def test_a_worker_without_fair_keys_serves_the_keyed_backlog_it_finds(
    redis_url: str, keyed: Celery
) -> None:
    # The roll-back the docs used to describe: fair_keys removed from the worker.
    publish_by_key(keyed, QUEUE, {"a": 20, "b": 20, "c": 10}, ms=0)
    ledger = Ledger(redis_url)
    with _fair_worker(redis_url, keys=False) as worker:
        _wait(ledger, 50, worker)
        log = worker.log()
    assert "published with a key, but fair_keys does not name it" in log
    assert sum(_ids(redis_url).values()) == 50


def test_disabling_keys_producers_then_the_move_then_workers_loses_nothing(
    redis_url: str, keyed: Celery, plain: Celery, published: set[str]
) -> None:
    publish_by_key(keyed, QUEUE, {"a": 200, "b": 200, "c": 200}, ms=2)
    ledger = Ledger(redis_url)
    with _fair_worker(redis_url, keys=True) as fair:
        _wait(ledger, 50, fair)  # tasks in flight
        # 1. Producers without fair_keys.
        _publish_plain(plain, 100)
        # 2. The move, while the keyed worker still runs.
        moved = _unkey(redis_url)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert "moved back to its own lists" in moved.stdout
        # A producer that still has fair_keys after the move: its task is not stranded.
        publish_by_key(keyed, QUEUE, {"late": 5}, ms=2)
    # 3. Workers without celery-fair.  The keyed worker's warm shutdown put back
    # what it had prefetched: after the move, into the queue's own list.
    client = redis_lib.Redis.from_url(redis_url)
    assert int(client.hget(KeyedNames(QUEUE).state, "backlog") or 0) == 0
    with _plain_worker(redis_url) as worker:
        _wait(ledger, 705, worker, ids=published)
        assert client.llen(QUEUE) == 0
    ran = _ids(redis_url)
    _all_ran(ran, published, stops=1)


def test_enabling_keys_workers_then_producers_loses_nothing(
    redis_url: str, keyed: Celery, plain: Celery, published: set[str]
) -> None:
    _publish_plain(plain, 300)
    ledger = Ledger(redis_url)
    with _plain_worker(redis_url) as worker:
        _wait(ledger, 30, worker)  # tasks in flight
    # 1. Workers with fair_keys (the plain worker's prefetched tasks went back).
    with _fair_worker(redis_url, keys=True) as fair:
        _wait(ledger, 60, fair)
        # 2. Producers with fair_keys.
        publish_by_key(keyed, QUEUE, {"a": 100, "b": 100}, ms=2)
        _wait(ledger, 500, fair, ids=published)
    ran = _ids(redis_url)
    _all_ran(ran, published, stops=1)


def test_the_move_killed_half_way_loses_and_duplicates_nothing(
    redis_url: str, keyed: Celery
) -> None:
    publish_by_key(keyed, QUEUE, {f"k{i}": 100 for i in range(50)}, ms=0)
    client = redis_lib.Redis.from_url(redis_url)
    names = KeyedNames(QUEUE)
    published = {
        json.loads(raw)["headers"]["id"]
        for i in range(50)
        for raw in client.lrange(names.key_list(f"k{i}"), 0, -1)
    }
    assert len(published) == 5000
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery_fair.cli", "keys", "unkey", QUEUE, "-b", redis_url,
         "--batch", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while client.llen(QUEUE) < 300:  # part of the way
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)

    def everywhere() -> list[str]:
        lists = [QUEUE] + [names.key_list(f"k{i}") for i in range(50)]
        return [json.loads(r)["headers"]["id"] for q in lists for r in client.lrange(q, 0, -1)]

    half = everywhere()
    assert 300 <= client.llen(QUEUE) < 5000
    assert len(half) == 5000 and set(half) == published
    assert int(client.hget(names.state, "backlog")) == 5000 - client.llen(QUEUE)
    finished = _unkey(redis_url)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert client.llen(QUEUE) == 5000 and set(everywhere()) == published
    assert client.zcard(names.active) == 0 and int(client.hget(names.state, "backlog")) == 0
    assert client.zcard(names.sizes) == 0
    # One key at a time in turn, across batches: the first 50 moved are one of each key.
    first = [json.loads(r)["headers"]["fair_key"] for r in client.lrange(QUEUE, -50, -1)]
    assert len(set(first)) == 50
