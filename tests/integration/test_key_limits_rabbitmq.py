"""Per-key concurrency and rate limits on RabbitMQ: limit tokens as messages, real workers.

Two real ``celery worker`` processes with Celery's defaults share one keyed
queue on a real RabbitMQ; the ledger (on the session's Redis) records
every run with its start and finish, so the tasks of a key running at once
are counted from outside the workers.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections import Counter
from typing import Any

import kombu.pools
import pytest
from kombu.connection import Connection

from celery_fair.keys.limits import KeyLimits
from celery_fair.keys.pause_events import parked_lane
from celery_fair.keys.tokens import token_specs
from tests.harness.control import broadcast_until_replied, control_app, fair_stats
from tests.harness.harness import poll_until
from tests.harness.keys import keyed_app, most_at_once, publish_by_key
from tests.harness.ledger import Ledger
from tests.integration.test_keys_rabbitmq import _ready, _worker, amqp_url, ledger, queue

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]

__all__ = ("amqp_url", "ledger", "queue")  # fixtures, imported for this module's tests


def _publish(amqp_url: str, queue: str, counts: dict[str, int], ms: float) -> None:
    app = keyed_app(amqp_url, {queue: "tenant_id"})
    try:
        publish_by_key(app, queue, counts, ms=ms)
    finally:
        app.close()


def _token_stats(amqp_url: str, workers: int) -> dict[str, dict[str, Any]]:
    """Every worker's ``key_tokens`` statistics (``inspect fair_stats``), by worker name."""
    found: dict[str, dict[str, Any]] = {}

    def answered() -> bool:
        replies = fair_stats(amqp_url, timeout=2.0, limit=workers)
        found.clear()
        found.update({name: stats["key_tokens"] for name, stats in replies.items()})
        return len(found) == workers

    assert poll_until(answered, 30), found
    return found


def _held(amqp_url: str, workers: int) -> int:
    return sum(int(s["held"]) for s in _token_stats(amqp_url, workers).values())


def _ready_tokens(amqp_url: str, spec_name: str) -> int:
    with Connection(amqp_url) as conn:
        return int(conn.default_channel.queue_declare(spec_name, passive=True).message_count)


def test_concurrency_limits_hold_across_two_workers_on_rabbitmq(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    singles = {f"k{i}": 20 for i in range(6)}
    _publish(amqp_url, queue, {**singles, "wide": 60}, ms=60)
    env = {"CELERY_FAIR_KEY_CONCURRENCY": "*=1,wide=3"}
    total = sum(singles.values()) + 60
    with (
        _worker(amqp_url, redis_url, queue, **env) as one,
        _worker(amqp_url, redis_url, queue, **env) as two,
    ):
        assert ledger.wait_for(total, timeout=180, alive=[one, two]), one.log()[-3000:]
        # Every token is given back once its task ended (the ledger is written
        # just before the task returns, so the last give-back may be on its way).
        assert poll_until(
            lambda: all(s["held"] == 0 for s in _token_stats(amqp_url, 2).values()), 20
        )
        stats = list(_token_stats(amqp_url, 2).values())
    entries = ledger.entries()
    assert len({e.id for e in entries}) == total
    most = most_at_once(entries)
    assert all(most[k] <= 1 for k in singles), most
    assert most["wide"] <= 3, most
    # The limits made workers wait: tasks were set aside for tokens held elsewhere.
    assert sum(s["set_aside"] for s in stats) > 0, stats
    assert all(s["aside"] == 0 and s["repaired"] == 0 for s in stats), stats
    # Both workers ran the limited keys, and every token is back in its queue.
    assert len({e.worker for e in entries}) == 2
    limits = KeyLimits(concurrency={"*": 1, "wide": 3})
    for key, count in {"k0": 1, "wide": 3}.items():
        (spec,) = token_specs(limits, queue, key)
        assert _ready_tokens(amqp_url, spec.name) == count


def test_a_rate_limited_key_runs_at_its_rate_on_rabbitmq(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    _publish(amqp_url, queue, {"slow": 40, **{f"free{i}": 40 for i in range(3)}}, ms=1)
    env = {"CELERY_FAIR_KEY_RATE": "slow=10/s"}
    with (
        _worker(amqp_url, redis_url, queue, **env) as one,
        _worker(amqp_url, redis_url, queue, **env) as two,
    ):
        assert ledger.wait_for(160, timeout=120, alive=[one, two]), one.log()[-3000:]
    entries = sorted(ledger.entries(), key=lambda e: e.started)
    slow = [e.started for e in entries if e.tenant == "slow"]
    assert len(slow) == 40
    # A token is back one period after it was spent, so at most 10 are spent in
    # any second.  A task spends its token as it goes to its worker's pool wait,
    # where it may wait for one of the pool's 2 slots: starts can bunch by up to
    # the 4 slots of the two workers.
    assert max(sum(1 for t in slow if s <= t < s + 1.0) for s in slow) <= 10 + 4, slow
    # And 10 a second once the first period's tokens are spent.
    steady = slow[10:]
    fit = statistics.linear_regression(steady, list(range(len(steady))))
    assert fit.slope == pytest.approx(10, rel=0.15), (fit.slope, steady)
    # The unlimited keys, published alongside, are not held back by it.
    free_done = max(e.finished for e in entries if e.tenant != "slow")
    assert free_done < slow[20], (free_done - slow[0], slow[20] - slow[0])


def test_a_killed_workers_tokens_come_back_and_the_limit_holds(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    _publish(amqp_url, queue, {"solo": 16}, ms=300)
    # Late acks: the task running on the killed worker is delivered again.
    env = {"CELERY_FAIR_KEY_CONCURRENCY": "solo=1", "CELERY_FAIR_ACKS_LATE": "1"}
    (spec,) = token_specs(KeyLimits(concurrency={"solo": 1}), queue, "solo")
    survivor = _worker(amqp_url, redis_url, queue, **env).start()
    doomed = _worker(amqp_url, redis_url, queue, **env).start()
    try:
        _ready(survivor)
        _ready(doomed)
        # Kill the worker whose task holds the key's one token.
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, doomed.log()[-3000:]
            held = {n: s["held"] for n, s in _token_stats(amqp_url, 2).items()}
            if sum(held.values()) == 1 and ledger.count() >= 2:
                break
            time.sleep(0.05)
        holder = next(name for name, n in held.items() if n)
        victim = doomed if holder.startswith(doomed.name + "@") else survivor
        keep = survivor if victim is doomed else doomed
        assert victim.proc is not None
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(timeout=10)
        deadline = time.monotonic() + 90
        while len({e.id for e in ledger.entries()}) < 16:
            assert time.monotonic() < deadline, keep.log()[-3000:]
            assert keep.proc is not None and keep.proc.poll() is None, keep.log()[-3000:]
            time.sleep(0.2)
        assert poll_until(lambda: _ready_tokens(amqp_url, spec.name) == 1, 20)
    finally:
        doomed.stop()
        survivor.stop()
    runs = {e.id: e for e in ledger.entries()}
    assert len(runs) == 16  # nothing lost
    assert most_at_once(list(runs.values()))["solo"] == 1  # the limit held throughout


def test_a_task_received_again_after_a_lost_connection_is_not_held_up_by_its_first_receipt(
    rabbitmq_server: Any, redis_url: str, ledger: Ledger, queue: str
) -> None:
    """Both pool processes are busy; two tasks of a key limited to 2 take its tokens
    and wait for prefork's semaphore (this worker's cap on tasks holding tokens,
    one per pool process, is reached); then the broker closes the worker's
    connections.  Celery drops those requests with no finish reported, and their
    messages come back on the new channel with the same task ids.  What the
    dropped requests held must not keep them waiting: they run, once each."""
    amqp_url = str(rabbitmq_server.url)
    env = {"CELERY_FAIR_KEY_CONCURRENCY": "lim=2"}
    _publish(amqp_url, queue, {"busy": 2}, ms=3000)
    with _worker(amqp_url, redis_url, queue, **env) as worker:
        _ready(worker)
        control = control_app(amqp_url)
        try:

            def both_busy() -> bool:
                active = control.control.inspect(timeout=1.0).active() or {}
                return sum(len(tasks) for tasks in active.values()) == 2

            assert poll_until(both_busy, 30), worker.log()[-3000:]
        finally:
            control.close()
        _publish(amqp_url, queue, {"lim": 4}, ms=0)
        # Two tasks hold the tokens (in the semaphore's wait), two wait aside.
        seen: list[Any] = []

        def held_and_aside() -> bool:
            seen[:] = [(s["held"], s["aside"]) for s in _token_stats(amqp_url, 1).values()]
            return seen == [(2, 2)]

        assert poll_until(held_and_aside, 30), (seen, worker.log()[-3000:])
        rabbitmq_server.ctl("rabbitmqctl", "close_all_connections", "test: a lost connection")
        kombu.pools.reset()  # this process's pooled connections were closed too
        assert ledger.wait_for(6, timeout=60, alive=[worker]), worker.log()[-3000:]
        assert poll_until(lambda: _held(amqp_url, 1) == 0, 20)
    runs = Counter(e.id for e in ledger.entries())
    assert len(runs) == 6 and set(runs.values()) == {1}, runs
    assert most_at_once(e for e in ledger.entries() if e.tenant == "lim")["lim"] <= 2


def test_a_paused_keys_tasks_waiting_for_tokens_are_parked_not_started(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    """A key at its limit has tasks aside in the worker when it is paused: they go to
    its parked lane rather than start when a token frees, and run after the resume."""
    from tests.harness.control import broadcast_until_replied

    _publish(amqp_url, queue, {"a": 40, "b": 40}, ms=50)
    app = control_app(amqp_url)
    try:
        with _worker(amqp_url, redis_url, queue, CELERY_FAIR_KEY_CONCURRENCY="a=1") as worker:
            assert ledger.wait_for(4, timeout=120, alive=[worker]), worker.log()[-3000:]
            assert sum(s["aside"] for s in _token_stats(amqp_url, 1).values()) > 0
            broadcast_until_replied(app, "fair_key_pause", keys=["a"])
            paused_at = time.time()
            parked = parked_lane(queue, "a")

            def settled() -> bool:
                # b done, and every task of a either started or parked: those aside
                # when the pause came among them, and pool slots free meanwhile.
                done = ledger.per_tenant()
                return (
                    done.get("b", 0) == 40
                    and done.get("a", 0) + _ready_tokens(amqp_url, parked) == 40
                )

            assert poll_until(settled, 120), (ledger.per_tenant(), _ready_tokens(amqp_url, parked))
            started = ledger.per_tenant().get("a", 0)
            resumed_at = time.time()
            broadcast_until_replied(app, "fair_key_resume", keys=["a"])
            assert ledger.wait_for(80, timeout=120, alive=[worker]), worker.log()[-3000:]
    finally:
        app.close()
    entries = ledger.entries()
    late = [e for e in entries if e.tenant == "a" and paused_at + 0.5 < e.started < resumed_at]
    assert late == [] and started < 40, (late, started)
    assert Counter(e.tenant for e in entries) == {"a": 40, "b": 40}
    assert len({e.id for e in entries}) == 80


def _live_limits(amqp_url: str, workers: int) -> list[dict[str, Any]]:
    return [s["live_limits"] for s in _token_stats(amqp_url, workers).values()]


def test_limits_set_live_hold_on_every_worker_and_one_started_later_on_rabbitmq(
    amqp_url: str, redis_url: str, ledger: Ledger, queue: str
) -> None:
    """``control fair_key_limits`` on RabbitMQ: written to the control log, read by
    every worker, one started after the command too; ``KEY=default`` lifts it."""
    first = _worker(amqp_url, redis_url, queue).start()  # no limit configured
    later = _worker(amqp_url, redis_url, queue)
    control = control_app(amqp_url)
    try:
        _ready(first)
        # A limit of that many token messages per key is refused, naming it; nothing is written.
        [refused] = control.control.broadcast(
            "fair_key_limits", arguments={"limits": ["concurrency", "live=5000"]},
            reply=True, timeout=10,
        )  # fmt: skip
        error = next(iter(refused.values()))["error"]
        assert "fair_key_limits['live']=5000" in error and "at most 1,000" in error, error
        [reply] = broadcast_until_replied(
            control, "fair_key_limits", limits=["concurrency", "live=1"]
        )
        assert "concurrency limits set: live=1" in next(iter(reply.values()))["ok"], reply
        later.start()
        _ready(later)
        assert _live_limits(amqp_url, 2) == [{queue: {"c": {"live": 1.0}}}] * 2
        # More of the limited key than one worker's window of its lane (the queue's
        # 8 and 30 more): the broker gives both workers some.
        _publish(amqp_url, queue, {"live": 80, "free": 30}, ms=100)
        assert ledger.wait_for(110, timeout=120, alive=[first, later]), later.log()[-3000:]
        limited = ledger.entries()
        # Lifted: back to the configured limit, none.
        broadcast_until_replied(control, "fair_key_limits", limits=["concurrency", "live=default"])
        assert poll_until(lambda: _live_limits(amqp_url, 2) == [{}] * 2, 20)
        ledger.reset()
        _publish(amqp_url, queue, {"live": 20}, ms=150)
        assert ledger.wait_for(20, timeout=120, alive=[first, later]), later.log()[-3000:]
        lifted = ledger.entries()
    finally:
        control.close()
        later.stop()
        first.stop()
    assert len({e.id for e in limited}) == 110
    most = most_at_once(limited)
    # The key ran one at a time across both workers; the others were not held to it.
    assert most["live"] == 1 and most["free"] >= 2, most
    assert {e.worker for e in limited if e.tenant == "live"} == {e.worker for e in limited}, (
        "both workers ran the limited key"
    )
    assert most_at_once(lifted)["live"] >= 2
