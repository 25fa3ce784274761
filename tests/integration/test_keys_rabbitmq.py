"""Fairness keys on RabbitMQ: one keyed queue served from its lanes by the real worker.

The producer is an app with celery-fair and ``fair_keys`` (the user's
surface); the worker is the real ``celery worker`` with Celery's defaults.
The ledger (on the session's Redis) records every run.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from amqp.exceptions import PreconditionFailed
from kombu.connection import Connection
from kombu.entity import Queue

from celery_fair.keys.lanes import NOISY_LANES, SHARD_LANES, KeyLanes
from celery_fair.keys.lanes_admin import declared
from celery_fair.keys.pause_events import parked_lane
from celery_fair.routing.isolation import NOISY_MESSAGES
from celery_fair.routing.ring import HashRing
from tests.harness.control import broadcast_until_replied, control_app, wait_fair_stats
from tests.harness.exporter import ExporterProcess
from tests.harness.harness import WORKLOAD, WorkerProcess, poll_until
from tests.harness.keys import keyed_app, most_at_once, publish_by_key
from tests.harness.ledger import Entry, Ledger, percentile

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]


@pytest.fixture
def queue() -> str:
    """A keyed queue of its own for each test: lanes from another test hold nothing here."""
    return f"keyed-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def amqp_url(rabbitmq_server: Any) -> str:
    return str(rabbitmq_server.url)


def _worker(amqp_url: str, ledger_url: str, queue: str, **env: str) -> WorkerProcess:
    return WorkerProcess(
        amqp_url,
        [queue],
        concurrency=2,
        env={"CELERY_FAIR_KEYS": f"{queue}=tenant_id", "CELERY_FAIR_LEDGER": ledger_url, **env},
    )


def _ready(worker: WorkerProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while " ready." not in worker.log():
        assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
        assert time.monotonic() < deadline, worker.log()[-3000:]
        time.sleep(0.05)


def _entries(ledger: Ledger, n: int, worker: WorkerProcess, timeout: float = 120) -> list[Entry]:
    assert ledger.wait_for(n, timeout=timeout, alive=[worker]), worker.log()[-3000:]
    return sorted(ledger.entries(), key=lambda e: e.started)


@pytest.fixture
def ledger(redis_url: str) -> Ledger:
    ledger = Ledger(redis_url)
    ledger.reset()
    return ledger


WEIGHTS = {"a": 1, "b": 2, "c": 4}


def _publish_weighted(amqp_url: str, queue: str, per_weight: int) -> None:
    """``per_weight`` tasks per unit of weight and key: each key's backlog lasts as
    long as the others' at these weights.  The producer has no weights: they act
    in the workers."""
    app = keyed_app(amqp_url, {queue: "tenant_id"})
    try:
        publish_by_key(app, queue, {k: per_weight * w for k, w in WEIGHTS.items()}, ms=2)
    finally:
        app.close()


def _assert_weighted(window: list[Entry]) -> None:
    """The keys' shares of ``window`` are their weights' within 2 points."""
    counts = Counter(e.tenant for e in window)
    for key, weight in WEIGHTS.items():
        share = weight / sum(WEIGHTS.values())
        assert counts[key] / len(window) == pytest.approx(share, abs=0.02), counts


@pytest.mark.compat
def test_key_weights_hold_on_rabbitmq(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    _publish_weighted(amqp_url, queue, 200)
    with _worker(amqp_url, redis_url, queue, CELERY_FAIR_KEY_WEIGHTS="a=1,b=2,c=4") as worker:
        entries = _entries(ledger, 1000, worker)
    window = entries[100:900]  # every key backlogged throughout
    _assert_weighted(window)
    # Each key is a third of the producer's publishes: noisy, so each had a
    # noisy lane of its own after its first messages.
    noisy = set(KeyLanes(frozenset([queue])).noisy_lanes(queue))
    lanes = {}
    for key in WEIGHTS:
        mine = sorted((e for e in entries if e.tenant == key), key=lambda e: e.published or 0)
        lanes[key] = {e.queue for e in mine[NOISY_MESSAGES:]}
    assert all(len(found) == 1 and found <= noisy for found in lanes.values()), lanes
    assert len(set().union(*lanes.values())) == 3, lanes


def test_key_weights_set_live_act_in_the_worker_that_answers(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    """``control fair_key_weights`` on RabbitMQ: the answering worker's buffer takes
    the keys' turns by the new weights at once, and says they are live in it."""
    app = keyed_app(amqp_url, {queue: "tenant_id"})
    # Every key stays backlogged through 800 starts at 1:2:4 even if the worker
    # ran 900 at 1:1:1 before the command reached it.
    backlog = {"a": 500, "b": 700, "c": 1100}
    try:
        publish_by_key(app, queue, backlog, ms=2)
    finally:
        app.close()
    with _worker(amqp_url, redis_url, queue) as worker:  # every key weighs 1
        _ready(worker)
        control = control_app(amqp_url)
        try:
            replies = control.control.broadcast(
                "fair_key_weights",
                arguments={"weights": ["b=2", "c=4"]},
                reply=True,
                timeout=5,
                limit=1,
            )
            changed = time.time()
            stats = wait_fair_stats(amqp_url)
        finally:
            control.close()
        [reply] = [r for answer in replies for r in answer.values()]
        assert "on the broker" in reply.get("ok", ""), reply
        assert stats["key_weights_live"] == {"b": 2.0, "c": 4.0}, stats
        entries = _entries(ledger, sum(backlog.values()), worker)
    # Tasks already in the buffer kept their turns: from half a second on, the new ones.
    window = [e for e in entries if e.started > changed + 0.5][:800]
    assert len(window) == 800
    _assert_weighted(window)


def test_key_weights_set_live_reach_a_worker_started_later_on_rabbitmq(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    """A weight set live is an event of the control log: a worker started after the
    command, configured with none, serves the keys by it; ``KEY=default`` lifts it."""
    control = control_app(amqp_url)
    try:
        with _worker(amqp_url, redis_url, queue) as first:  # every key weighs 1
            _ready(first)
            broadcast_until_replied(control, "fair_key_weights", weights=["b=2", "c=4"])
        _publish_weighted(amqp_url, queue, 200)
        with _worker(amqp_url, redis_url, queue) as later:
            entries = _entries(ledger, 1400, later)
            assert wait_fair_stats(amqp_url)["key_weights_live"] == {"b": 2.0, "c": 4.0}
            broadcast_until_replied(control, "fair_key_weights", weights=["b=default", "c=default"])
            assert poll_until(lambda: wait_fair_stats(amqp_url)["key_weights_live"] == {}, 20)
    finally:
        control.close()
    # Every key backlogged through the first 1,000 starts at 1:2:4; past the worker's
    # start, while its lanes' consumers come up.
    _assert_weighted(entries[100:900])


def test_key_weights_hold_across_two_workers_on_rabbitmq(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    """Each worker takes its lanes' tasks in its own weighted order: the shares of
    the two together hold as one worker's do."""
    # Enough that, after the later of the two workers is ready, more than 800
    # tasks start while every key is backlogged, however late it comes up.
    _publish_weighted(amqp_url, queue, 450)
    total = 450 * sum(WEIGHTS.values())
    env = {"CELERY_FAIR_KEY_WEIGHTS": "a=1,b=2,c=4"}
    with (
        _worker(amqp_url, redis_url, queue, **env) as one,
        _worker(amqp_url, redis_url, queue, **env) as two,
    ):
        _ready(one)
        _ready(two)
        both = time.time()
        assert ledger.wait_for(total, timeout=180, alive=[one, two]), two.log()[-3000:]
    entries = sorted(ledger.entries(), key=lambda e: e.started)
    # Both workers running, and every key still backlogged (the first 85%).
    window = [e for e in entries[: int(total * 0.85)] if e.started > both + 1.0]
    assert len(window) > 800 and len({e.worker for e in window}) == 2, len(window)
    _assert_weighted(window)


def test_urgent_tasks_pass_every_keys_batch_work_in_the_buffer_on_rabbitmq(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    """A keyed queue with a maximum priority: RabbitMQ orders each lane, and the
    worker's buffer takes the highest priority first across the lanes, as the
    Redis fetch takes the first level (strict priority)."""
    app = keyed_app(amqp_url, {queue: "tenant_id"}, task_queue_max_priority=10)
    batch = {f"k{i}": 100 for i in range(6)}
    try:
        publish_by_key(app, queue, batch, ms=20, priority=0)
        with _worker(amqp_url, redis_url, queue, CELERY_FAIR_MAX_PRIORITY="10") as worker:
            assert ledger.wait_for(30, timeout=120, alive=[worker]), worker.log()[-3000:]
            sent = time.time()
            publish_by_key(app, queue, {"urgent": 20}, ms=20, priority=9)
            assert poll_until(lambda: ledger.per_tenant().get("urgent", 0) == 20, 120)
            entries = ledger.entries()
    finally:
        app.close()
    last_urgent = max(e.started for e in entries if e.tenant == "urgent")
    passed = [e for e in entries if e.tenant != "urgent" and sent < e.started < last_urgent]
    # Only what the pool had already taken: at fair turns among seven keys, the
    # urgent key's 20 tasks would wait for about 120 batch tasks.
    assert len(passed) <= 10, len(passed)


@pytest.mark.compat
def test_every_task_runs_once_keyed_unkeyed_and_from_a_plain_producer(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    app = keyed_app(amqp_url, {queue: "tenant_id"})
    keys = {f"t{i}": 30 for i in range(40)}
    try:
        publish_by_key(app, queue, keys, ms=0)
        # A task of the keyed queue without a key: the queue itself, the unkeyed key.
        app.send_task("ledger", kwargs={"ms": 0}, queue=queue)
    finally:
        app.close()
    # A producer without celery-fair publishes to the queue itself.
    code = (
        "import sys; from celery import Celery; app = Celery(broker=sys.argv[1]); "
        f"app.send_task('ledger', kwargs={{'tenant_id': 'plain'}}, queue={queue!r})"
    )
    subprocess.run([sys.executable, "-c", code, amqp_url], check=True, timeout=60)
    total = sum(keys.values()) + 2
    with _worker(amqp_url, redis_url, queue) as worker:
        entries = _entries(ledger, total, worker)
        assert "lane(s) consumed besides" in worker.log()
        stats = wait_fair_stats(amqp_url)
        # The lanes are one queue to the scheduler, each consumed with its own window.
        assert set(stats["weights"]) == {queue}
        windows = stats["prefetch_windows"]
        assert windows[f"{queue}.fair.s0"] == windows[queue] + NOISY_MESSAGES
        assert windows[f"{queue}.fair.n0"] == windows[queue]
    runs = Counter(e.id for e in entries)
    assert len(runs) == total and set(runs.values()) == {1}
    assert Counter(e.tenant or "" for e in entries) == {**keys, "plain": 1, "": 1}
    lanes = KeyLanes(frozenset([queue]))
    shards = set(lanes.shard_lanes(queue))
    # The 40 keys were spread over the shard lanes; the two unkeyed tasks were
    # in the queue itself.
    assert {e.queue for e in entries if e.tenant in keys} <= shards
    assert len({e.queue for e in entries if e.tenant in keys}) > SHARD_LANES // 2
    assert {e.queue for e in entries if e.tenant in ("plain", None, "")} == {queue}


FLOOD = 1500  # 10 ms tasks: about 8 s of a two-process pool
FLOOD_MS = 10.0
QUIET_TENANTS = 20
EVERY = 15  # one quiet task per this many flood tasks while the flood is published


def _quiet_tenants(queue: str) -> list[str]:
    """The quiet tenants, the first of them hashed to the flood's shard lane."""
    ring = HashRing(KeyLanes(frozenset([queue])).shard_lanes(queue))
    names = (f"quiet-{i:02d}" for i in itertools.count())
    neighbour = next(t for t in names if ring.lookup(t) == ring.lookup("flood"))
    others = (t for t in names if ring.lookup(t) != ring.lookup("flood"))
    return [neighbour, *itertools.islice(others, QUIET_TENANTS - 1)]


def _flood_run(
    amqp_url: str, ledger: Ledger, queue: str, tenants: list[str], *, fair: bool
) -> list[Entry]:
    """A flood key and quiet keys in one queue, the flood published first; all entries."""
    # Both with celery-fair installed: it stamps the publish time the waits are measured from.
    app = keyed_app(amqp_url, {queue: "tenant_id"} if fair else {})
    ledger.reset()
    env = {"CELERY_FAIR_KEYS": f"{queue}=tenant_id"} if fair else {}
    worker = WorkerProcess(
        amqp_url, [queue], concurrency=2, fair=fair,
        env={"CELERY_FAIR_LEDGER": ledger.url, **env},
    )  # fmt: skip
    quiet = itertools.cycle(tenants)
    sent = 0
    try:
        with worker:
            _ready(worker)
            with app.producer_or_acquire() as producer:

                def send(tenant: str, ms: float) -> None:
                    nonlocal sent
                    app.send_task("ledger", kwargs={"ms": ms, "tenant_id": tenant},
                                  queue=queue, producer=producer)  # fmt: skip
                    sent += 1

                for i in range(FLOOD):
                    send("flood", FLOOD_MS)
                    if i % EVERY == 0:
                        send(next(quiet), 1.0)
                # The quiet tenants go on while the flood's backlog drains.
                deadline = time.monotonic() + 120
                while ledger.per_tenant().get("flood", 0) < FLOOD:
                    assert time.monotonic() < deadline, ledger.per_tenant()
                    send(next(quiet), 1.0)
                    time.sleep(0.02)
            assert ledger.wait_for(sent, timeout=60, alive=[worker]), worker.log()[-3000:]
    finally:
        app.close()
    return ledger.entries()


def test_a_flood_leaves_its_lane_and_quiet_keys_keep_a_low_wait(
    amqp_url: str, ledger: Ledger, queue: str
) -> None:
    tenants = _quiet_tenants(queue)
    plain = _flood_run(amqp_url, ledger, f"{queue}-plain", tenants, fair=False)
    fair = _flood_run(amqp_url, ledger, queue, tenants, fair=True)
    for entries in (plain, fair):
        runs = Counter(e.id for e in entries)
        assert set(runs.values()) == {1}, "no task ran twice"
        assert sum(e.tenant != "flood" for e in entries) >= FLOOD // EVERY

    def quiet_p99(entries: list[Entry]) -> float:
        """The quiet tasks' p99 wait (publish -> start) while the flood lasted."""
        flood_done = max(e.started for e in entries if e.tenant == "flood")
        waits = [
            e.wait for e in entries
            if e.tenant != "flood" and e.wait is not None and e.started <= flood_done
        ]  # fmt: skip
        assert waits
        return percentile(waits, 0.99)

    # About the first 30 flood tasks waited in the flood's shard lane; the rest
    # in a noisy lane, where no quiet key waits behind them.
    lanes = KeyLanes(frozenset([queue]))
    flood_lanes = Counter(e.queue for e in fair if e.tenant == "flood")
    noisy = set(lanes.noisy_lanes(queue))
    assert len(noisy) == NOISY_LANES
    in_noisy = sum(n for lane, n in flood_lanes.items() if lane in noisy)
    assert FLOOD - 60 <= in_noisy <= FLOOD - 29, flood_lanes
    assert all(e.queue not in noisy for e in fair if e.tenant != "flood")
    # Plain Celery's quiet tasks wait behind the flood's backlog (seconds); here
    # they wait for about a task, those hashed to the flood's shard lane too.
    shard = next(lane for lane in flood_lanes if lane not in noisy)
    neighbours = [e for e in fair if e.tenant == tenants[0]]
    assert {e.queue for e in neighbours} == {shard}
    plain_p99 = quiet_p99(plain)
    assert quiet_p99(fair) < plain_p99 / 20, (quiet_p99(fair), plain_p99)
    assert quiet_p99(neighbours + [e for e in fair if e.tenant == "flood"]) < plain_p99 / 20


TWO_LEVEL = ("tenant_id", "user_id")


def _send_users(app: Any, queue: str, tasks: list[tuple[str, str, float]]) -> None:
    """Publish ``ledger`` tasks ``(tenant, user, ms)`` in this order."""
    with app.producer_or_acquire() as producer:
        for tenant, user, ms in tasks:
            app.send_task("ledger", kwargs={"ms": ms, "tenant_id": tenant, "user_id": user},
                          queue=queue, producer=producer)  # fmt: skip


def test_two_level_keys_share_tenants_then_users_by_weight_on_rabbitmq(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str, tmp_path: Path
) -> None:
    """Tenants 1:1 whatever their number of users; t1's users 1:3 (``t1/u3=3``);
    telemetry records each task's user."""
    pq = pytest.importorskip("pyarrow.parquet")
    app = keyed_app(amqp_url, {queue: TWO_LEVEL})
    try:
        pairs = (("t1", "u1"), ("t1", "u3"), ("t2", "v"))
        _send_users(app, queue, [(t, u, 2.0) for _ in range(300) for t, u in pairs])
    finally:
        app.close()
    telemetry = tmp_path / "telemetry"
    env = {"CELERY_FAIR_KEYS": f"{queue}=tenant_id+user_id", "CELERY_FAIR_KEY_WEIGHTS": "t1/u3=3",
           "CELERY_FAIR_TELEMETRY_DIR": str(telemetry)}  # fmt: skip
    with _worker(amqp_url, redis_url, queue, **env) as worker:
        entries = _entries(ledger, 900, worker)
    window = entries[50:450]  # every tenant and user backlogged throughout
    tenants = Counter(e.tenant for e in window)
    assert tenants["t1"] / len(window) == pytest.approx(0.5, abs=0.02), tenants
    users = Counter(e.user for e in window if e.tenant == "t1")
    assert users["u3"] / sum(users.values()) == pytest.approx(0.75, abs=0.02), users
    assert len({e.id for e in entries}) == 900
    rows = {r["task_id"]: r for r in pq.read_table(telemetry).to_pylist()}
    assert {e.id: (rows[e.id]["fair_key"], rows[e.id]["key_user"]) for e in entries} == {
        e.id: (e.tenant, e.user) for e in entries
    }


def test_a_flooding_user_leaves_its_tenants_other_users_a_low_wait_on_rabbitmq(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    """One user of t1 floods: t1's other users and the other tenants wait about a
    task, not behind the flood, and the flood gets a lane of its own."""
    flood, every = 800, 10
    quiet = [("t1", f"q{i}") for i in range(4)] + [(f"t{i}", "u") for i in range(2, 6)]
    turns = itertools.cycle(quiet)
    app = keyed_app(amqp_url, {queue: TWO_LEVEL})
    env = {"CELERY_FAIR_KEYS": f"{queue}=tenant_id+user_id"}
    sent = 0
    try:
        with _worker(amqp_url, redis_url, queue, **env) as worker:
            _ready(worker)
            for i in range(flood):
                batch = [("t1", "flood", FLOOD_MS)]
                if i % every == 0:
                    batch.append((*next(turns), 1.0))
                _send_users(app, queue, batch)
                sent += len(batch)
            deadline = time.monotonic() + 120
            while ledger.per_tenant().get("t1", 0) < flood:
                assert time.monotonic() < deadline, ledger.per_tenant()
                _send_users(app, queue, [(*next(turns), 1.0)])
                sent += 1
                time.sleep(0.02)  # a quiet pace while the flood drains
            entries = _entries(ledger, sent, worker)
    finally:
        app.close()
    assert len({e.id for e in entries}) == len(entries) == sent  # none lost, none twice
    floods = [e for e in entries if e.user == "flood"]
    flood_lanes = Counter(e.queue for e in floods)
    noisy = set(KeyLanes(frozenset([queue])).noisy_lanes(queue))
    flood_lane = flood_lanes.most_common(1)[0][0]
    assert flood_lane in noisy and flood_lanes[flood_lane] >= flood - 60, flood_lanes
    others = [e for e in entries if e.user != "flood"]
    assert all(e.queue != flood_lane for e in others)
    flood_done = max(e.started for e in floods)
    lasted = flood_done - min(e.published or e.started for e in floods)
    for group in ([e for e in others if e.tenant == "t1"], [e for e in others if e.tenant != "t1"]):
        waits = [e.wait for e in group if e.wait is not None and e.started <= flood_done]
        assert len(waits) >= 20
        # Behind the flood they would wait for up to its whole backlog (seconds).
        assert percentile(waits, 0.99) < lasted / 20, (percentile(waits, 0.99), lasted)


def test_a_paused_key_starts_nothing_on_two_workers_one_started_later_then_drains(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    """``control fair_key_pause`` on RabbitMQ: the key's tasks wait in its parked lane
    on every worker, one started after the pause too, and all run after the resume."""
    app = keyed_app(amqp_url, {queue: "tenant_id"})
    try:
        publish_by_key(app, queue, {"a": 150, "b": 150}, ms=20)
        with _worker(amqp_url, redis_url, queue) as one:
            assert ledger.wait_for(20, timeout=120, alive=[one]), one.log()[-3000:]
            [reply] = [r for answer in broadcast_until_replied(app, "fair_key_pause", keys=["a"])
                       for r in answer.values()]  # fmt: skip
            assert "paused" in reply.get("ok", ""), reply
            paused_at = time.time()
            # A worker started after the pause reads it from the log at start.
            with _worker(amqp_url, redis_url, queue) as two:
                _ready(two)
                publish_by_key(app, queue, {"a": 50, "b": 50}, ms=20)
                deadline = time.monotonic() + 120
                while ledger.per_tenant().get("b", 0) < 200:
                    assert time.monotonic() < deadline, ledger.per_tenant()
                    assert two.proc is not None and two.proc.poll() is None, two.log()[-3000:]
                    time.sleep(0.1)  # polled with a deadline
                stats = broadcast_until_replied(app, "fair_stats")
                resumed_at = time.time()
                broadcast_until_replied(app, "fair_key_resume", keys=["a"])
                assert ledger.wait_for(400, timeout=120, alive=[one, two]), two.log()[-3000:]
                entries = ledger.entries()
    finally:
        app.close()
    # Tasks handed to a pool before the pause may start a moment after it; none later.
    late = [e for e in entries if e.tenant == "a" and paused_at + 0.5 < e.started < resumed_at]
    assert late == [], late
    # 0 lost, each once; the later worker served tasks too.
    assert Counter(e.tenant for e in entries) == {"a": 200, "b": 200}
    assert len({e.id for e in entries}) == 400
    assert len({e.worker for e in entries if e.started > paused_at}) == 2
    # inspect fair_stats named the paused key on both workers.
    assert len(stats) == 2 and all("'a'" in str(r) and "paused" in str(r) for r in stats), stats


def test_weighted_priority_levels_share_the_worker_from_lanes_of_their_own(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    """``fair_priority="weighted"`` on RabbitMQ: the same keys publish urgent and
    batch work; each level waits in lanes of its own, so the batch level is not
    held behind the urgent one in a lane (RabbitMQ delivers a lane's highest
    priority first), and the buffer shares the worker 4:1 between the levels."""
    app = keyed_app(amqp_url, {queue: "tenant_id"}, task_queue_max_priority=10)
    keys = [f"k{i}" for i in range(4)]
    try:
        # Batch first: in one lane per key, every urgent task would pass all of it but
        # each key's first ~30 (published to its shard before it was found noisy).
        publish_by_key(app, queue, dict.fromkeys(keys, 500), ms=2, priority=0)
        publish_by_key(app, queue, dict.fromkeys(keys, 500), ms=2, priority=9)
    finally:
        app.close()
    # The admin command reads every level's lanes.
    shown = _keys_command(amqp_url, "backlog", queue, "--json")
    assert shown.returncode == 0, shown.stderr
    lanes = json.loads(shown.stdout)["lanes"]
    assert sum(n["messages"] or 0 for n in lanes.values()) == 4000, lanes
    assert sum(n["messages"] or 0 for lane, n in lanes.items() if ".fair.pri9." in lane) == 2000
    env = {
        "CELERY_FAIR_MAX_PRIORITY": "10",
        "CELERY_FAIR_PRIORITY": "weighted",
        "CELERY_FAIR_PRIORITY_WEIGHTS": "9=4,0=1",
    }
    with _worker(amqp_url, redis_url, queue, **env) as worker:
        entries = _entries(ledger, 4000, worker)
    assert "lane(s) consumed besides" in worker.log()
    urgent = [e.queue is not None and ".fair.pri9." in e.queue for e in entries]
    # Each level from its own lanes: 2000 from the level-9 lanes, 2000 from the first level's.
    assert sum(urgent) == 2000, Counter(e.queue for e in entries).most_common(5)
    # Both levels backlogged until the urgent one's 2000 have run (at 4:1, 2500 tasks).
    # In one lane per key the batch level would get nothing here: RabbitMQ delivers a
    # lane's urgent tasks first, and its first ~30 per key (in shards) run out sooner.
    window = urgent[1000:2000]
    assert sum(window) / len(window) == pytest.approx(0.8, abs=0.02), sum(window)
    assert len({e.id for e in entries}) == 4000


def _keys_command(amqp_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery_fair.cli", "keys", *args, "-b", amqp_url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_keys_pause_and_resume_without_a_worker_on_rabbitmq(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    """``celery fair keys pause|resume`` write the pause log; a resume with no worker
    running moves the parked tasks back, and a worker then runs them."""
    paused = _keys_command(amqp_url, "pause", queue, "a")
    assert paused.returncode == 0 and f"{queue}: paused 1 of 1 key(s)" in paused.stdout, paused
    app = keyed_app(amqp_url, {queue: "tenant_id"})
    try:
        publish_by_key(app, queue, {"a": 40, "b": 40}, ms=5)
    finally:
        app.close()
    parked = parked_lane(queue, "a")
    with _worker(amqp_url, redis_url, queue) as worker:
        deadline = time.monotonic() + 120
        # Every task of a reaches the worker and is parked; b runs.
        while ledger.per_tenant().get("b", 0) < 40 or _count(amqp_url, parked) < 40:
            assert time.monotonic() < deadline, (ledger.per_tenant(), _count(amqp_url, parked))
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
            time.sleep(0.1)  # polled with a deadline
    assert ledger.per_tenant().get("a", 0) == 0
    resumed = _keys_command(amqp_url, "resume", queue, "a", "--json")
    assert resumed.returncode == 0, resumed
    assert json.loads(resumed.stdout) == {"queue": queue, "resumed": 1, "of": 1, "moved_back": 40}
    assert _count(amqp_url, parked) == 0
    with _worker(amqp_url, redis_url, queue) as worker:
        entries = _entries(ledger, 80, worker)
    assert Counter(e.tenant for e in entries) == {"a": 40, "b": 40}


def test_keys_pause_and_resume_without_the_app_on_a_queue_with_priority_levels(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    """Given a broker URL and no app, the command does not know the queue's maximum
    priority, and RabbitMQ refuses a lane declared without it: the command takes the
    lanes as the broker holds them, leaves the parked lane to the workers, and finds
    the levels from the lanes, so a resumed task goes back to its level's lane."""
    app = keyed_app(amqp_url, {queue: "tenant_id"}, task_queue_max_priority=10)
    parked = parked_lane(queue, "a")
    try:
        with _worker(amqp_url, redis_url, queue, CELERY_FAIR_MAX_PRIORITY="10") as worker:
            _ready(worker)
            paused = _keys_command(amqp_url, "pause", queue, "a")
            assert paused.returncode == 0, paused.stdout + paused.stderr
            assert f"{queue}: paused 1 of 1 key(s)" in paused.stdout
            # The worker reads the pause within 2 s, and declares the parked lane first.
            assert poll_until(lambda: _count_or_none(amqp_url, parked) is not None, 30)
            publish_by_key(app, queue, {"a": 20, "b": 20}, ms=5, priority=9)
            publish_by_key(app, queue, {"a": 20}, ms=5, priority=0)
            deadline = time.monotonic() + 120
            # The worker parks every task of a (in a lane it declares as it reads the
            # pause) and runs b's.
            while ledger.per_tenant().get("b", 0) < 20 or _count_or_none(amqp_url, parked) != 40:
                assert time.monotonic() < deadline, (ledger.per_tenant(), worker.log()[-3000:])
                assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
                time.sleep(0.1)  # polled with a deadline
            assert ledger.per_tenant().get("a", 0) == 0
            resumed = _keys_command(amqp_url, "resume", queue, "a", "--json")
            assert resumed.returncode == 0, resumed.stdout + resumed.stderr
            # The command moves back at most what was parked: the worker, until it reads
            # the resume, parks what it receives again (and moves it back after).
            done = json.loads(resumed.stdout)
            assert done["resumed"] == 1 and done["moved_back"] <= 40, done
            entries = _entries(ledger, 60, worker)
            log = worker.log()
    finally:
        app.close()
    assert "inequivalent" not in log and "PRECONDITION_FAILED" not in log, log[-3000:]
    assert Counter(e.tenant for e in entries) == {"a": 40, "b": 20}
    # a's urgent tasks went back to the urgent level's lanes, its batch to the first's.
    back = Counter(".fair.pri9." in (e.queue or "") for e in entries if e.tenant == "a")
    assert back == {True: 20, False: 20}, [e.queue for e in entries if e.tenant == "a"]


def _count(url: str, name: str) -> int:
    with Connection(url) as conn:
        return int(conn.default_channel.queue_declare(name, passive=True).message_count)


def _count_or_none(url: str, name: str) -> int | None:
    """Messages in queue ``name``; None while it is not declared."""
    with Connection(url) as conn:
        return declared(conn, conn.default_channel, name)[0]


def test_rolling_back_moves_the_lanes_into_the_queue_for_plain_workers(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    app = keyed_app(amqp_url, {queue: "tenant_id"})
    keys = {"flood": 300, **{f"t{i}": 10 for i in range(20)}}
    try:
        publish_by_key(app, queue, keys, ms=0)
    finally:
        app.close()
    total = sum(keys.values())
    shown = _keys_command(amqp_url, "backlog", queue, "--json")
    assert shown.returncode == 0, shown.stderr
    backlog = json.loads(shown.stdout)
    assert backlog["messages"] == total
    # Every task went to a lane; no worker has declared the queue itself yet, so a
    # move into it would be lost: refused, nothing moved.
    assert backlog["lanes"][queue]["messages"] is None
    refused = _keys_command(amqp_url, "unkey", queue)
    assert refused.returncode == 2 and "is not declared" in refused.stderr, refused.stderr
    with Connection(amqp_url) as conn:
        assert Queue(queue)(conn.channel()).declare() == queue  # as a worker declares it
    moved = _keys_command(amqp_url, "unkey", queue)
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert f"{queue}: {total} message(s) moved back from its lanes" in moved.stdout
    after = json.loads(_keys_command(amqp_url, "backlog", queue, "--json").stdout)
    assert after["lanes"][queue]["messages"] == total == after["messages"]
    # A worker without celery-fair consumes the queue only: it runs everything, once.
    with WorkerProcess(amqp_url, [queue], fair=False, env={"CELERY_FAIR_LEDGER": redis_url}) as w:
        entries = _entries(ledger, total, w)
    runs = Counter(e.id for e in entries)
    assert len(runs) == total and set(runs.values()) == {1}
    assert Counter(e.tenant for e in entries) == keys
    assert {e.queue for e in entries} == {queue}


def test_the_lanes_of_a_quorum_queue_are_quorum_queues(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    quorum = {"x-queue-type": "quorum"}
    app = keyed_app(
        amqp_url, {queue: "tenant_id"},
        task_queues=[Queue(queue, durable=True, queue_arguments=quorum)],
    )  # fmt: skip
    keys = {f"t{i}": 20 for i in range(10)} | {"flood": 200}
    try:
        # The producer declares each lane it uses as its queue is declared.
        publish_by_key(app, queue, keys, ms=0)
    finally:
        app.close()
    total = sum(keys.values())
    env = {"CELERY_FAIR_QUORUM_QUEUES": queue}
    with _worker(amqp_url, redis_url, queue, **env) as worker:
        entries = _entries(ledger, total, worker)
    runs = Counter(e.id for e in entries)
    assert len(runs) == total and set(runs.values()) == {1}
    # Declaring a lane again as a classic queue is refused: the lanes are quorum queues.
    with Connection(amqp_url) as conn:
        lanes = {e.queue for e in entries}
        assert len(lanes) > 5
        for lane in lanes:
            with pytest.raises(PreconditionFailed, match="x-queue-type"):
                Queue(lane, durable=True)(conn.channel()).declare()


def test_nothing_is_lost_through_a_broker_restart_and_a_worker_kill(redis_url: str) -> None:
    """Two keyed workers with late acks (Celery's at-least-once) and the flood limited
    to 2 at once: the broker restarts mid-drain, then one worker is killed with
    SIGKILL.  Every task runs; a task runs twice only if its first run began before
    the kill (Celery redelivers what was unacknowledged), never afterwards; and
    after the kill the flood's limit holds (the dead worker's tokens came back)."""
    from tests.harness.rabbitmq import RabbitMQServer

    queue = "keyed-crash"
    keys = {"flood": 600, **{f"t{i}": 30 for i in range(30)}}
    total = sum(keys.values())
    ledger = Ledger(redis_url)
    ledger.reset()
    env = {"CELERY_FAIR_ACKS_LATE": "1", "CELERY_FAIR_KEY_CONCURRENCY": "flood=2"}
    with RabbitMQServer() as server:
        app = keyed_app(server.url, {queue: "tenant_id"})
        try:
            publish_by_key(app, queue, keys, ms=5)
        finally:
            app.close()
        survivor = _worker(server.url, redis_url, queue, **env).start()
        victim = _worker(server.url, redis_url, queue, **env).start()
        try:
            assert ledger.wait_for(300, timeout=120, alive=[survivor, victim])
            server.restart()  # same port, same durable lanes and persistent messages
            done = len(ledger.entries())
            assert ledger.wait_for(done + 300, timeout=120, alive=[survivor, victim])
            victim.kill()
            killed_at = time.time()
            entries = _entries(ledger, total, survivor, timeout=180)
            unique = {e.id for e in entries}
            deadline = time.monotonic() + 120
            while len(unique) < total:
                assert time.monotonic() < deadline, f"{len(unique)} of {total} ran"
                time.sleep(0.2)
                entries = ledger.entries()
                unique = {e.id for e in entries}
        finally:
            survivor.stop()
            victim.kill()
    runs = Counter(e.id for e in entries)
    assert len(runs) == total, "every task ran"
    twice = {i for i, n in runs.items() if n > 1}
    first = {i: min(e.started for e in entries if e.id == i) for i in twice}
    assert all(started <= killed_at for started in first.values()), "no repeat after the kill"
    tenant_of = {e.id: e.tenant for e in entries}
    assert Counter(tenant_of.values()) == keys
    after = [e for e in entries if e.tenant == "flood" and e.started > killed_at]
    assert after and most_at_once(after)["flood"] <= 2


#: The flood's messages published after it was found noisy, at least: 100 less the
#: detector's first window and the few it may take to cross the share.
FLOOD_SHARE_MIN = 100 - NOISY_MESSAGES - 10


@pytest.mark.parametrize("levels", [False, True], ids=["one-level", "priority-levels"])
def test_the_exporter_counts_a_keyed_queue_with_its_lanes(
    amqp_url: str, queue: str, levels: bool
) -> None:
    """With ``levels`` the queue has a maximum priority and the tasks priority 9: they
    wait in the lanes of that level, counted as well, the flood's by its name."""
    conf: dict[str, Any] = {"task_queue_max_priority": 10} if levels else {}
    app = keyed_app(amqp_url, {queue: "tenant_id"}, **conf)
    keys = {"flood": 100, **{f"t{i}": 5 for i in range(10)}}
    try:
        publish_by_key(app, queue, keys, ms=0, priority=9 if levels else None)
        app.send_task("ledger", kwargs={"ms": 0}, queue=queue)  # no key: the queue itself
    finally:
        app.close()
    env = {"CELERY_FAIR_BROKER": amqp_url, "CELERY_FAIR_KEYS": f"{queue}=tenant_id"}
    if levels:
        env["CELERY_FAIR_MAX_PRIORITY"] = "10"
    with ExporterProcess(amqp_url, [queue], app=WORKLOAD, env=env) as exporter:
        samples = exporter.scrape()
    backlog = samples.get(("celery_fair_queue_backlog", (("queue", queue),)))
    assert backlog == sum(keys.values()) + 1
    # The lanes are read with their queue, not as queues of their own.
    assert not any(
        name == "celery_fair_queue_backlog" and ".fair." in dict(labels)["queue"]
        for name, labels in samples
    )
    # Per key: the flood, isolated to a lane of its own after its first ~30 messages,
    # with that lane's backlog (its lane's directory names it); the unkeyed key with
    # the queue's own.  The quiet keys share shard lanes: not told apart.
    per_key = {
        dict(labels)["key"]: value
        for (name, labels), value in samples.items()
        if name == "celery_fair_key_backlog" and dict(labels)["queue"] == queue
    }
    assert set(per_key) == {"flood", ""}, per_key
    assert FLOOD_SHARE_MIN <= per_key["flood"] <= 100 - NOISY_MESSAGES + 1, per_key
    assert per_key[""] == 1
    # No throttling figures: on RabbitMQ the workers hold limited keys back.
    assert not any(name == "celery_fair_keyed_active_keys" for name, _ in samples)
