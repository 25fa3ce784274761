"""Noisy-key isolation: the detector on a fake clock, and ConsistentHashRouter(isolate=...)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import tracemalloc
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

from celery_fair.routing import ConsistentHashRouter, HashRing
from celery_fair.routing.isolation import (
    IsolationPolicy,
    IsolationStatistics,
    NoisyKeyDetector,
)
from tests.harness.clock import FakeClock

QUEUES = {"t0": 10, "t1": 10, "t2": 20}
LOGGER = "celery_fair.routing.isolation"
#: A half-life so long that nothing decays during a test: shares move only by publishes.
FOREVER = 1e9


def detector(clock: FakeClock, **policy: Any) -> NoisyKeyDetector:
    return NoisyKeyDetector(IsolationPolicy("iso", **policy), clock=clock)


def background(d: NoisyKeyDetector, keys: int, rounds: int, prefix: str = "bg") -> None:
    """``rounds`` publishes of each of ``keys`` quiet keys, interleaved."""
    for _ in range(rounds):
        for i in range(keys):
            assert not d.observe(f"{prefix}-{i}")


# -- entering ---------------------------------------------------------------------------------


def test_a_key_enters_just_above_the_share_and_not_at_it() -> None:
    clock = FakeClock(1000.0)
    d = detector(clock, half_life=FOREVER)
    background(d, keys=27, rounds=10)  # 270 publishes, 10 per key
    # 29 / 299 < 10%, 30 / 300 = 10% (not more), 31 / 301 > 10%.
    assert not any(d.observe("x") for _ in range(30))
    assert d.share("x") == pytest.approx(0.10)
    assert d.observe("x")
    assert dict(d.statistics().isolated) == {"x": pytest.approx(31 / 301)}


def test_a_key_needs_min_messages_whatever_its_share() -> None:
    clock = FakeClock(1000.0)
    d = detector(clock, half_life=FOREVER)
    # Alone on a quiet system: 100% share from the first publish.
    assert not any(d.observe("x") for _ in range(29))
    assert d.observe("x")  # the 30th
    other = detector(clock, half_life=FOREVER, min_messages=100)
    assert not any(other.observe("x") for _ in range(99))
    assert other.observe("x")


def test_recent_means_decayed_publishes() -> None:
    clock = FakeClock(1000.0)
    d = detector(clock, half_life=10.0)
    # 29 publishes long ago, then one now: its recent count is about 1, not 30.
    for _ in range(29):
        d.observe("x")
    clock.advance(100.0)
    assert not d.observe("x")
    assert d.statistics().recent == pytest.approx(1.0 + 29 / 1024)


def test_a_newly_tracked_key_does_not_enter_on_the_summary_error() -> None:
    clock = FakeClock(1000.0)
    d = detector(clock, half_life=FOREVER, capacity=40)
    # 40 counters full of keys with 50 publishes each: a newcomer inherits a count of
    # 50 from the evicted counter, but its guaranteed count is its own publishes only.
    background(d, keys=40, rounds=50)
    assert not d.observe("new")
    assert d.share("new") > 0.02  # the estimate includes the inherited count ...
    assert d.statistics().isolated == {}  # ... the decision does not


# -- hysteresis and release ---------------------------------------------------------------------


def isolate_x(d: NoisyKeyDetector) -> None:
    background(d, keys=20, rounds=1)
    for _ in range(50):
        d.observe("x")
    assert d.is_isolated("x")


def publish_until_share(d: NoisyKeyDetector, key: str, share: float) -> None:
    i = 0
    while d.share(key) >= share:
        assert d.observe(f"bg-{i % 20}") is False
        i += 1


def test_between_exit_and_enter_share_the_key_stays_isolated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(1000.0)
    d = detector(clock, half_life=FOREVER, hold=10.0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        isolate_x(d)
        publish_until_share(d, "x", 0.07)  # under enter_share (10%), over exit_share (5%)
        for _ in range(100):
            clock.advance(1.0)
            assert d.observe("x")
            publish_until_share(d, "x", 0.07)
    assert d.statistics().isolations == 1
    assert d.statistics().releases == 0
    (line,) = [r for r in caplog.records if r.name == LOGGER]
    assert line.levelno == logging.WARNING
    assert line.getMessage().startswith("celery-fair: key 'x' isolated to queue 'iso' (share ")


def test_release_after_hold_below_exit_share(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock(1000.0)
    d = detector(clock, half_life=FOREVER, hold=10.0)
    isolate_x(d)
    publish_until_share(d, "x", 0.05)  # now under exit_share: the hold starts here
    clock.advance(9.9)
    assert d.is_isolated("x")
    clock.advance(0.1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert not d.is_isolated("x")
    (line,) = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]
    assert "celery-fair: key 'x' released from queue 'iso'" in line.getMessage()
    record = d.statistics()
    assert (record.isolations, record.releases, record.transitions) == (1, 1, 2)
    assert record.isolated == {}
    # Below enter_share it is not isolated again: hysteresis in both directions.
    assert not d.observe("x")


def test_going_back_above_exit_share_restarts_the_hold() -> None:
    clock = FakeClock(1000.0)
    d = detector(clock, half_life=FOREVER, hold=10.0)
    isolate_x(d)
    publish_until_share(d, "x", 0.05)
    clock.advance(8.0)
    while d.share("x") <= 0.05:  # the key picks up again before the hold is over
        assert d.observe("x")
    publish_until_share(d, "x", 0.05)
    clock.advance(8.0)
    assert d.is_isolated("x")  # 16 s below, but not 10 s in a row
    clock.advance(2.0)
    assert not d.is_isolated("x")


def test_a_flood_that_stops_is_released_while_others_publish() -> None:
    clock = FakeClock(1000.0)
    d = detector(clock)  # the defaults: half-life 10 s, hold 10 s
    flagged_at = released_at = None
    for step in range(20_000):  # 10 ms steps: 200 s
        clock.advance(0.01)
        d.observe(f"bg-{step % 50}")  # 100 publishes/s from 50 quiet tenants
        if step < 3000 and step % 2 == 0:  # a tenant at 50 publishes/s for 30 s
            flagged = d.observe("flood")
            if flagged and flagged_at is None:
                flagged_at = step * 0.01
        if flagged_at is not None and released_at is None and not d.is_isolated("flood"):
            released_at = step * 0.01
    assert flagged_at is not None and flagged_at < 1.0
    # At 30 s the flood's decayed count is half the others' (631 against 1262); it halves
    # every 10 s, so it falls under 5% of the total (1/19 of the others') after about 31 s,
    # then the 10 s hold: released about 71 s in.
    assert released_at is not None and 68 < released_at < 74


def test_an_isolated_key_is_released_when_the_whole_system_goes_quiet() -> None:
    clock = FakeClock(1000.0)
    d = detector(clock, half_life=10.0, hold=10.0)
    isolate_x(d)
    clock.advance(600.0)  # nothing published: every count decays below min_messages
    assert not d.observe("y")  # the hold starts at the first publish seen
    assert d.is_isolated("x")
    clock.advance(10.0)
    assert not d.observe("x")  # back on its ring queue
    assert d.statistics().releases == 1


def test_hold_zero_releases_at_once_and_equal_shares_are_allowed() -> None:
    clock = FakeClock(1000.0)
    d = detector(clock, half_life=FOREVER, hold=0.0, exit_share=0.10)
    isolate_x(d)
    publish_until_share(d, "x", 0.10)
    assert not d.is_isolated("x")


# -- memory, decay, threads -----------------------------------------------------------------------


def test_memory_is_bounded_by_the_counters_with_100k_distinct_keys() -> None:
    clock = FakeClock(1000.0)
    d = detector(clock, half_life=30.0)

    def run(distinct: int, start: int) -> int:
        for i in range(start, start + distinct):
            clock.advance(0.0005)
            d.observe(f"tenant-{i}")
            if i % 5 == 0:
                d.observe("heavy")  # one publish in six
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        after_10k = run(10_000, 0)
        after_100k = run(90_000, 10_000)
    finally:
        tracemalloc.stop()
    record = d.statistics()
    assert record.tracked == record.capacity == 256
    assert record.observed == 100_000 + 20_000
    assert after_100k < after_10k * 1.2 + 16_384, (after_10k, after_100k)
    assert len(d._state.heap) <= 4 * 256 + 16  # the lazy heap stays O(counters) too
    assert set(record.isolated) == {"heavy"}
    assert record.isolated["heavy"] == pytest.approx(1 / 6, abs=256 / 120_000 + 0.01)


def test_weights_are_rescaled_long_after_the_landmark() -> None:
    clock = FakeClock(1000.0)
    d = detector(clock, half_life=1.0)
    for step in range(10_000):  # 5,000 half-lives: 2 ** 5000 would overflow a float
        clock.advance(0.5)
        d.observe("a" if step % 4 else "b")
    record = d.statistics()
    # Geometric series: the last publish (an "a") weighs 1, each earlier one 2 ** -0.5 less;
    # the "b" publishes are 1.5, 3.5, 5.5, ... half-lives old.
    total = 1 / (1 - 2**-0.5)
    assert record.recent == pytest.approx(total, rel=1e-9)
    assert d.share("b") == pytest.approx(2**-1.5 / (1 - 2**-2) / total, rel=1e-9)
    assert 0 < d._state.landmark <= clock.now


def test_several_threads_publish_concurrently() -> None:
    clock = FakeClock(1000.0)
    d = detector(clock, half_life=FOREVER)
    per_thread, threads = 20_000, 4
    results: list[int] = []
    barrier = threading.Barrier(threads)

    def publish(n: int) -> None:
        barrier.wait()
        isolated = 0
        for i in range(per_thread):
            key = "heavy" if i % 4 == 0 else f"t{n}-{i % 500}"
            isolated += d.observe(key)
        results.append(isolated)

    workers = [threading.Thread(target=publish, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    record = d.statistics()
    assert len(results) == threads
    assert record.observed == per_thread * threads
    assert record.recent == pytest.approx(per_thread * threads)
    assert set(record.isolated) == {"heavy"}
    assert record.isolated["heavy"] == pytest.approx(0.25, abs=0.01)
    assert record.isolations == 1 and record.tracked <= record.capacity


# -- the policy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"queue": ""}, "queue=''"),
        ({"queue": None}, "queue=None"),
        ({"enter_share": 0}, "enter_share=0"),
        ({"enter_share": 1.5}, "enter_share=1.5"),
        ({"enter_share": "0.1"}, "enter_share='0.1'"),
        ({"exit_share": 0.2}, "exit_share=0.2"),
        ({"exit_share": 0}, "exit_share=0"),
        ({"exit_share": float("nan")}, "exit_share=nan"),
        ({"min_messages": 0}, "min_messages=0"),
        ({"half_life": 0}, "half_life=0"),
        ({"half_life": float("inf")}, "half_life=inf"),
        ({"hold": -1}, "hold=-1"),
        ({"hold": True}, "hold=True"),
        ({"capacity": 10}, "capacity=10: must be >= 2 / exit_share = 40"),
        ({"capacity": 256.0}, "capacity=256.0"),
    ],
)
def test_policy_validates_and_names_the_argument(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        IsolationPolicy(**kwargs)


def test_policy_defaults_and_frozen_records() -> None:
    policy = IsolationPolicy()
    assert (policy.queue, policy.enter_share, policy.exit_share, policy.min_messages) == (
        "fair.isolated",
        0.10,
        0.05,
        30,
    )
    assert (policy.half_life, policy.hold, policy.capacity) == (10.0, 10.0, 256)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.enter_share = 0.2  # type: ignore[misc]
    record = NoisyKeyDetector(policy).statistics()
    assert isinstance(record, IsolationStatistics)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.releases = 1  # type: ignore[misc]


# -- the router option --------------------------------------------------------------------------


def route(router: ConsistentHashRouter, tenant: str | None, **options: Any) -> dict[str, Any]:
    result = router("proj.work", (), {} if tenant is None else {"tenant_id": tenant}, options)
    assert result is not None
    return result


def flood_router(clock: FakeClock, **kwargs: Any) -> ConsistentHashRouter:
    policy = IsolationPolicy("iso", half_life=FOREVER)
    return ConsistentHashRouter(
        QUEUES, key="tenant_id", isolate=NoisyKeyDetector(policy, clock=clock), **kwargs
    )


def test_router_sends_a_noisy_key_to_the_isolation_queue_and_leaves_others() -> None:
    router = flood_router(FakeClock(1000.0))
    ring = HashRing(QUEUES)
    tenants = [f"tenant-{i}" for i in range(30)]
    for tenant in tenants:
        assert route(router, tenant) == {
            "queue": ring.lookup(tenant),
            "headers": {"fair_key": tenant},
        }
    routes = [route(router, "flood") for _ in range(40)]
    assert routes[0]["queue"] == ring.lookup("flood")  # not noisy yet
    assert routes[-1] == {"queue": "iso", "headers": {"fair_key": "flood"}}
    for tenant in tenants:  # the others never move
        assert route(router, tenant)["queue"] == ring.lookup(tenant)
    assert router.queue_for("flood") == ring.lookup("flood")  # its ring queue, for after
    record = router.statistics()
    assert record.isolation is not None and set(record.isolation.isolated) == {"flood"}
    assert record.routed["iso"] == sum(r["queue"] == "iso" for r in routes)
    assert sum(record.routed.values()) == 2 * len(tenants) + len(routes)


def test_router_isolates_directly_in_exchange_mode() -> None:
    router = flood_router(FakeClock(1000.0), exchange="fair.hash")
    for i in range(30):
        assert route(router, f"tenant-{i}")["exchange"] == "fair.hash"
    last = [route(router, "flood") for _ in range(40)][-1]
    assert last == {"queue": "iso", "headers": {"fair_key": "flood"}}
    assert route(router, "tenant-1")["exchange"] == "fair.hash"


def test_router_does_not_observe_missing_keys() -> None:
    router = flood_router(FakeClock(1000.0), on_missing="spread")
    for _ in range(50):
        assert route(router, None)["queue"] in QUEUES
    record = router.statistics().isolation
    assert record is not None and record.observed == 0


def test_router_isolation_stamps_a_copy_of_the_callers_headers() -> None:
    router = flood_router(FakeClock(1000.0))
    caller = {"trace": "t1"}
    for _ in range(40):
        options: dict[str, Any] = {"headers": caller}
        result = router("proj.work", (), {"tenant_id": "flood"}, options)
    assert result == {"queue": "iso", "headers": {"fair_key": "flood"}}
    assert options["headers"] == {"trace": "t1", "fair_key": "flood"}
    assert caller == {"trace": "t1"}


def test_router_isolate_accepts_a_queue_name_or_a_policy() -> None:
    by_name = ConsistentHashRouter(QUEUES, key="tenant_id", isolate="noisy")
    assert by_name.isolation_queue == "noisy"
    assert by_name.detector is not None and by_name.detector.policy == IsolationPolicy("noisy")
    assert by_name.worker_queues() == ["t0", "t1", "t2", "noisy"]
    policy = IsolationPolicy("noisy", enter_share=0.2, exit_share=0.1)
    by_policy = ConsistentHashRouter(QUEUES, key="tenant_id", isolate=policy)
    assert by_policy.detector is not None and by_policy.detector.policy is policy
    assert "isolate=IsolationPolicy(queue='noisy'" in repr(by_policy)
    plain = ConsistentHashRouter(QUEUES, key="tenant_id")
    assert plain.isolation_queue is None and plain.detector is None
    assert plain.worker_queues() == ["t0", "t1", "t2"]
    assert plain.statistics().isolation is None


@pytest.mark.parametrize(
    ("isolate", "fragment"),
    [
        ("", "isolate=''"),
        (7, "isolate=7"),
        ("t1", "isolate='t1': the isolation queue 't1' must not be one of the ring's queues"),
        (IsolationPolicy("t2"), "must not be one of the ring's queues"),
    ],
)
def test_router_validates_isolate(isolate: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        ConsistentHashRouter(QUEUES, key="tenant_id", isolate=isolate)


def test_celery_publishes_an_isolated_key_to_the_isolation_queue() -> None:
    router = flood_router(FakeClock(1000.0))
    app = Celery("isolation_unit", broker="memory://", set_as_current=False)
    app.conf.task_routes = (router,)

    @app.task(name="proj.work", shared=False)
    def work(tenant_id: str | None = None) -> None:
        return None

    published: list[tuple[str, str]] = []

    def record(routing_key: str, headers: dict[str, Any], **_: Any) -> None:
        published.append((routing_key, headers["fair_key"]))

    before_task_publish.connect(record, weak=False)
    try:
        for i in range(30):
            work.delay(tenant_id=f"tenant-{i}")
        for _ in range(40):
            work.delay(tenant_id="flood")
    finally:
        before_task_publish.disconnect(record)
        app.close()
    assert published[-1] == ("iso", "flood")
    assert all(q == router.queue_for(t) for q, t in published if t != "flood")
