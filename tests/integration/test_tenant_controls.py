"""Tenant controls with the real ``celery worker`` on Redis: two-level keys, pause, caps.

Workers start with Celery's defaults (mingle, gossip and heartbeat on).
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_lib
from celery import Celery

import celery_fair
from celery_fair.keys.layout import KeyedNames
from tests.harness.control import broadcast_until_replied
from tests.harness.harness import QUICK_STOP, WorkerProcess
from tests.harness.keys import keyed_app, restore_unacked
from tests.harness.ledger import Entry, Ledger

pytestmark = [pytest.mark.integration]

QUEUE = "jobs"
NAMES = KeyedNames(QUEUE)


def _worker(redis_url: str, keys: str = f"{QUEUE}=tenant_id", **env: str) -> WorkerProcess:
    return WorkerProcess(
        redis_url,
        [QUEUE],
        concurrency=2,
        env={"CELERY_FAIR_KEYS": keys, "CELERY_FAIR_LEDGER": redis_url, **env},
    )


def _entries(ledger: Ledger, n: int, *workers: WorkerProcess) -> list[Entry]:
    assert ledger.wait_for(n, timeout=120, alive=list(workers)), workers[0].log()[-3000:]
    return sorted(ledger.entries(), key=lambda e: e.started)


def _publish(app: Celery, tasks: list[dict[str, Any]], ms: float) -> None:
    with app.producer_or_acquire() as producer:
        for kwargs in tasks:
            app.send_task("ledger", kwargs={"ms": ms, **kwargs}, queue=QUEUE, producer=producer)


@pytest.fixture
def two_level(redis_url: str) -> Iterator[Celery]:
    """A producer with two-level keys: the user's surface."""
    app = keyed_app(redis_url, {QUEUE: ("tenant_id", "user_id")})
    yield app
    app.close()


@pytest.mark.compat
def test_two_level_shares_tenants_then_users_by_weight(redis_url: str, two_level: Celery) -> None:
    # Two tenants 1:1; t1's users weighted 1:3 ("t1/u3": 3, the second level's weight).
    tasks = []
    for _ in range(300):
        tasks += [
            {"tenant_id": "t1", "user_id": "u1"},
            {"tenant_id": "t1", "user_id": "u3"},
            {"tenant_id": "t2", "user_id": "v"},
        ]
    _publish(two_level, tasks, ms=2)
    client = redis_lib.Redis.from_url(redis_url)
    assert client.zcard(NAMES.users("t1")) == 2 and client.zscore(NAMES.sizes, "t1") == 600
    ledger = Ledger(redis_url)
    keys = f"{QUEUE}=tenant_id+user_id"
    with _worker(redis_url, keys, CELERY_FAIR_KEY_WEIGHTS="t1/u3=3") as worker:
        entries = _entries(ledger, 500, worker)
        worker.stop(QUICK_STOP)  # measured
    window = entries[50:450]  # every tenant and user backlogged throughout
    tenants = Counter(e.tenant for e in window)
    assert tenants["t1"] / len(window) == pytest.approx(0.5, abs=0.02), tenants
    users = Counter(e.user for e in window if e.tenant == "t1")
    share = users["u3"] / sum(users.values())
    assert share == pytest.approx(0.75, abs=0.02), users


@pytest.mark.compat
def test_a_crash_restores_each_message_to_its_users_list(redis_url: str, two_level: Celery) -> None:
    users = {("t1", "a"): 30, ("t1", "b"): 30, ("t2", "c"): 30}
    _publish(two_level, [{"tenant_id": t, "user_id": u} for (t, u), n in users.items()
                         for _ in range(n)], ms=20)  # fmt: skip
    client = redis_lib.Redis.from_url(redis_url)
    ledger = Ledger(redis_url)
    keys = f"{QUEUE}=tenant_id+user_id"
    env = {"CELERY_FAIR_ACKS_LATE": "1", "CELERY_FAIR_VISIBILITY": "2"}
    worker = _worker(redis_url, keys, **env).start()
    try:
        assert ledger.wait_for(10, timeout=60, alive=[worker]), worker.log()[-3000:]
        worker.kill()
    finally:
        worker.stop()
    held = [json.loads(v)[0] for v in client.hvals("unacked")]
    assert held  # the killed worker held messages
    before = {p: client.llen(NAMES.user_list(*p)) for p in users}
    expected = Counter((m["headers"]["fair_key"], m["headers"]["fair_user"]) for m in held)
    restore_unacked(two_level, client, visibility=2)
    # Each went back to its user's list; none to the queue's own list or a key's own list.
    assert {p: client.llen(NAMES.user_list(*p)) - before[p] for p in users} == {
        p: expected.get(p, 0) for p in users
    }
    assert client.llen(QUEUE) == 0 and client.llen(NAMES.key_list("t1")) == 0
    with _worker(redis_url, keys, **env) as worker:
        deadline = time.monotonic() + 120
        while len({e.id for e in ledger.entries()}) < 90:
            assert time.monotonic() < deadline, worker.log()[-3000:]
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
            time.sleep(0.2)  # polled with a deadline
    ran = Counter((e.tenant, e.user) for e in {e.id: e for e in ledger.entries()}.values())
    assert ran == users  # every task ran; none lost


@pytest.mark.compat
def test_a_paused_key_starts_nothing_on_two_workers_and_drains_in_order_after_resume(
    redis_url: str,
) -> None:
    app = keyed_app(redis_url, {QUEUE: "tenant_id"})
    # user_id carries a sequence number here (the queue has one-level keys).
    tasks = []
    for i in range(150):
        tasks += [{"tenant_id": "a", "user_id": str(i)}, {"tenant_id": "b", "user_id": str(i)}]
    _publish(app, tasks, ms=20)
    ledger = Ledger(redis_url)
    client = redis_lib.Redis.from_url(redis_url)
    with _worker(redis_url) as one, _worker(redis_url) as two:
        assert ledger.wait_for(20, timeout=120, alive=[one, two]), one.log()[-3000:]
        replies = broadcast_until_replied(app, "fair_key_pause", keys=["a"])
        paused_at = time.time()
        assert len(replies) >= 1
        # b goes on and ends; a waits.
        deadline = time.monotonic() + 120
        while ledger.per_tenant().get("b", 0) < 150:
            assert time.monotonic() < deadline, ledger.per_tenant()
            time.sleep(0.1)
        waiting = [json.loads(m) for m in client.lrange(NAMES.key_list("a"), 0, -1)]
        stats = broadcast_until_replied(app, "fair_stats")
        resumed_at = time.time()
        broadcast_until_replied(app, "fair_key_resume", keys=["a"])
        entries = _entries(ledger, 300, one, two)
    # Tasks handed to a pool before the pause may start a moment after it; none later.
    late = [e for e in entries if e.tenant == "a" and paused_at + 0.5 < e.started < resumed_at]
    assert late == [], late
    assert not client.sismember(NAMES.paused, "a")
    # While paused, the key's list held its messages in publish order (the prefetched
    # ones sent back to the front): the fetch takes them from the right end.
    seq = [_kwargs(m)["user_id"] for m in reversed(waiting)]
    assert seq == sorted(seq, key=int) and len(seq) > 100, seq[:10]
    # 0 lost, each once.
    assert Counter(e.tenant for e in entries) == {"a": 150, "b": 150}
    assert len({e.id for e in entries}) == 300
    # inspect fair_stats named the paused key on each worker.
    assert all("'a'" in str(r) and "paused" in str(r) for r in stats), stats


def _kwargs(payload: dict[str, Any]) -> dict[str, Any]:
    body = json.loads(base64.b64decode(payload["body"]))
    kwargs: dict[str, Any] = body[1]
    return kwargs


@pytest.mark.compat
def test_a_backlog_cap_refuses_exactly_the_excess_with_concurrent_producers(
    redis_url: str,
) -> None:
    refused: list[celery_fair.KeyBacklogFull] = []
    lock = threading.Lock()

    def produce() -> None:
        app = keyed_app(
            redis_url, {QUEUE: "tenant_id"}, fair_key_max_backlog={"*": 1000, "capped": 100}
        )
        try:
            for _ in range(60):
                try:
                    app.send_task("ledger", kwargs={"tenant_id": "capped"}, queue=QUEUE)
                except celery_fair.KeyBacklogFull as exc:
                    with lock:
                        refused.append(exc)
                app.send_task("ledger", kwargs={"tenant_id": "other"}, queue=QUEUE)
        finally:
            app.close()

    threads = [threading.Thread(target=produce) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    client = redis_lib.Redis.from_url(redis_url)
    assert len(refused) == 4 * 60 - 100
    assert client.llen(NAMES.key_list("capped")) == 100
    assert client.llen(NAMES.key_list("other")) == 240  # under the "*" cap
    err = refused[0]
    assert (err.queue, err.key, err.cap, err.backlog) == (QUEUE, "capped", 100, 100)
    assert "fair_key_max_backlog" in str(err) and "'capped'" in str(err)


def test_a_bad_backlog_cap_is_refused_at_start_naming_the_setting(redis_url: str) -> None:
    with _worker(redis_url, CELERY_FAIR_KEY_MAX_BACKLOG="a=0") as worker:
        code = worker.wait(timeout=60)
    assert code != 0
    assert "fair_key_max_backlog: the cap of key 'a' must be an integer of at least 1" in (
        worker.log()
    )
