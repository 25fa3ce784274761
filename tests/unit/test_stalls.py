"""The stall watch (pure) and the watchdog that repairs a worker's count of free slots."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery.worker import state
from kombu.asynchronous.semaphore import LaxBoundedSemaphore

from celery_fair.scheduling.stalls import StallWatch
from celery_fair.worker.dispatch import FairGate, install_on_semaphore
from celery_fair.worker.service import FairService
from celery_fair.worker.settings import FairSettings
from celery_fair.worker.watchdog import PoolWatchdog
from tests.harness.clock import FakeClock

# -- the watch ------------------------------------------------------------------


def test_a_task_waiting_with_a_process_free_is_a_stall_once() -> None:
    watch = StallWatch(after=5.0)
    assert watch.look(0.0, {"t1": "buffer"}, free=1, size=2) == []
    assert watch.look(4.9, {"t1": "buffer"}, free=1, size=2) == []
    [stall] = watch.look(5.0, {"t1": "buffer"}, free=1, size=2)
    assert (stall.task, stall.place, stall.waited, stall.free, stall.size) == (
        "t1", "buffer", 5.0, 1, 2,
    )  # fmt: skip
    assert watch.look(60.0, {"t1": "buffer"}, free=1, size=2) == []  # reported once
    assert watch.statistics().stalls == {"buffer": 1}


def test_a_busy_pool_restarts_every_wait() -> None:
    watch = StallWatch(after=5.0)
    watch.look(0.0, {"t1": "pool"}, free=1, size=1)
    watch.look(4.0, {"t1": "pool"}, free=0, size=1)  # every process busy: waiting is normal
    assert watch.look(8.0, {"t1": "pool"}, free=1, size=1) == []
    assert watch.statistics().watching == 1
    assert [s.waited for s in watch.look(13.0, {"t1": "pool"}, free=1, size=1)] == [5.0]


def test_a_task_that_left_is_forgotten() -> None:
    watch = StallWatch(after=2.0)
    watch.look(0.0, {"t1": "buffer", "t2": "pool"}, free=2, size=2)
    found = watch.look(2.0, {"t1": "buffer", "t2": "pool"}, free=2, size=2)
    assert sorted(s.task for s in found) == ["t1", "t2"]
    watch.look(3.0, {}, free=2, size=2)
    assert watch.statistics().watching == 0
    # The same id waiting again (a redelivery) is a new wait, reported again.
    watch.look(4.0, {"t1": "pool"}, free=1, size=2)
    assert [s.task for s in watch.look(6.0, {"t1": "pool"}, free=1, size=2)] == ["t1"]
    assert watch.statistics().stalls == {"buffer": 1, "pool": 2}


@pytest.mark.parametrize("after", [0, -1.0, float("nan")])
def test_after_must_be_positive(after: float) -> None:
    with pytest.raises(ValueError, match="after must be a positive"):
        StallWatch(after)


# -- the watchdog, with Celery's semaphore and worker state -----------------------


class Request:
    """What the watchdog and the dispatch read of a Celery request."""

    def __init__(self, queue: str, n: int) -> None:
        self.id = f"{queue}-{n}"
        self.name = "proj.task"
        self.delivery_info = {"routing_key": queue}


class Queue:
    def __init__(self, name: str) -> None:
        self.name = self.routing_key = name


class Pool:
    """A prefork pool's size, as ``TaskPool.num_processes`` gives it."""

    def __init__(self, processes: int) -> None:
        self.num_processes = processes


@pytest.fixture
def tracked() -> Iterator[list[Request]]:
    """Requests put in Celery's worker state, taken out again after the test."""
    requests: list[Request] = []
    yield requests
    for request in requests:
        state.task_ready(request)


def _service(clock: FakeClock) -> FairService:
    service = FairService(FairSettings(weights={"a": 1}, stall_after=10.0), clock=clock)
    service.queue_map.map([Queue("a")])
    return service


def _prefork(slots: int) -> tuple[FakeClock, FairService, LaxBoundedSemaphore]:
    """A prefork worker's wait: Celery's semaphore with celery-fair's buffer."""
    clock = FakeClock()
    service = _service(clock)
    semaphore = LaxBoundedSemaphore(slots)
    install_on_semaphore(semaphore, service)
    return clock, service, semaphore


def _reserve(tracked: list[Request], n: int) -> Request:
    """A task of queue ``a`` received by the worker (in Celery's worker state)."""
    request = Request("a", n)
    tracked.append(request)
    state.task_reserved(request)
    return request


def test_a_lost_semaphore_release_is_repaired_and_logged(
    tracked: list[Request], caplog: pytest.LogCaptureFixture
) -> None:
    clock, service, semaphore = _prefork(2)
    started: list[Request] = []

    def start(request: Request) -> None:
        state.task_accepted(request)
        started.append(request)

    for i in range(3):
        semaphore.acquire(start, _reserve(tracked, i))
    assert [r.id for r in started] == ["a-0", "a-1"]
    # Both finish, but the pool's releases are lost (a callback that never came).
    for request in started:
        state.task_ready(request)
    watchdog = PoolWatchdog(service, service.stalls, Pool(2), semaphore=semaphore)
    assert watchdog.look() == []
    clock.now = 9.0
    assert watchdog.look() == []
    clock.now = 10.0
    with caplog.at_level(logging.WARNING, logger="celery_fair.worker.watchdog"):
        [stall] = watchdog.look()
    assert (stall.task, stall.place, stall.free, stall.size) == ("a-2", "buffer", 2, 2)
    assert [r.id for r in started] == ["a-0", "a-1", "a-2"]  # the repair started it
    assert len(service.scheduler.dispatch) == 0
    stats = service.statistics()["stalls"]
    assert stats == {"after": 10.0, "stalls": {"buffer": 1}, "repaired": 1, "watching": 1}
    [line] = caplog.messages
    assert "celery-fair: stall: task a-2 (proj.task) of queue a waited 10.0 s" in line
    assert "gave the pool back 1 slot(s)" in line


def test_a_task_the_pool_took_is_reported_not_repaired(
    tracked: list[Request], caplog: pytest.LogCaptureFixture
) -> None:
    clock, service, semaphore = _prefork(1)
    semaphore.acquire(lambda r: None, _reserve(tracked, 0))  # handed to the pool, never started
    watchdog = PoolWatchdog(service, service.stalls, Pool(1), semaphore=semaphore)
    watchdog.look()
    clock.now = 10.0
    with caplog.at_level(logging.WARNING, logger="celery_fair.worker.watchdog"):
        [stall] = watchdog.look()
    assert stall.place == "pool"
    assert service.stalls.statistics().repaired == 0
    assert semaphore.value == 0  # nothing given back: the pool holds the task
    assert "the pool took it and has not started it" in caplog.messages[0]


def test_a_busy_pool_is_no_stall(tracked: list[Request]) -> None:
    clock, service, semaphore = _prefork(1)
    for i in range(3):
        semaphore.acquire(state.task_accepted, _reserve(tracked, i))
    watchdog = PoolWatchdog(service, service.stalls, Pool(1), semaphore=semaphore)
    for clock.now in (0.0, 30.0, 60.0):
        assert watchdog.look() == []
    assert len(service.scheduler.dispatch) == 2


def test_a_gate_that_lost_a_slot_is_repaired(tracked: list[Request]) -> None:
    clock = FakeClock()
    service = _service(clock)
    gate = service.gate = FairGate(service, 1)
    ran: list[str] = []

    def run(request: Any) -> None:
        ran.append(request.id)

    for i in range(2):
        gate.submit(run, _reserve(tracked, i))
    assert ran == ["a-0"] and gate.free == 0
    state.task_ready(tracked[0])  # finished; the gate's release never came
    watchdog = PoolWatchdog(service, service.stalls, Pool(1), gate=gate)
    watchdog.look()
    clock.now = 10.0
    [stall] = watchdog.look()
    assert stall.place == "buffer"
    assert ran == ["a-0", "a-1"]
    assert service.stalls.statistics().repaired == 1


def test_a_lost_key_slot_release_is_recounted(
    tracked: list[Request], caplog: pytest.LogCaptureFixture
) -> None:
    from celery_fair.keys.limits import KeyLimits

    clock = FakeClock()
    settings = FairSettings(
        weights={"jobs": 1}, keys={"jobs": "tenant_id"},
        key_limits=KeyLimits(concurrency={"*": 1}), stall_after=10.0,
    )  # fmt: skip
    service = FairService(settings, concurrency=2, clock=clock)
    service.queue_map.map([Queue("jobs")])
    keyed = service.attachment.keyed
    assert keyed is not None
    woken: list[bool] = []

    class Fetch:
        def will_fetch(self) -> bool:
            return False

        def wake(self, pipe: object = None) -> None:
            woken.append(True)

    keyed.fetched_by(Fetch())
    # Two tasks fetched (each holds its key's slot) and one still here; the
    # other finished but its release was lost.
    keyed.served("jobs", "t1")
    keyed.served("jobs", "t2")
    request = Request("jobs", 0)
    tracked.append(request)
    state.task_reserved(request)
    state.task_accepted(request)
    assert not keyed.leases.has_room("jobs")  # the fetch takes no more of jobs
    watchdog = PoolWatchdog(service, service.stalls, Pool(2), semaphore=LaxBoundedSemaphore(2))
    assert watchdog.look() == []
    clock.now = 10.0
    with caplog.at_level(logging.WARNING, logger="celery_fair.worker.watchdog"):
        [stall] = watchdog.look()
    assert stall.place == "leases" and stall.task == ("leases", "jobs")
    assert keyed.leases.held("jobs") == 1 and keyed.leases.has_room("jobs") and woken == [True]
    assert service.stalls.statistics().repaired == 1
    assert (
        "keyed queue jobs: this worker counted 2 task(s) holding key slots and holds 1"
        in (caplog.messages[0])
    )
    clock.now = 30.0
    assert watchdog.look() == []  # repaired: nothing more to report


class PreforkPool:
    """A prefork pool as the watchdog reads it: its size and its processes' pids."""

    __module__ = "celery.concurrency.prefork"

    def __init__(self, pids: list[int]) -> None:
        self.num_processes = len(pids)
        self.info = {"processes": pids}


def test_a_task_counted_running_on_a_gone_process_is_reported_and_its_slot_given_back(
    tracked: list[Request], caplog: pytest.LogCaptureFixture
) -> None:
    clock, service, semaphore = _prefork(1)
    ran: list[str] = []

    def start(request: Request) -> None:
        state.task_accepted(request)
        request.worker_pid = 111  # type: ignore[attr-defined]
        ran.append(request.id)

    semaphore.acquire(start, _reserve(tracked, 0))
    semaphore.acquire(start, _reserve(tracked, 1))  # waits: the one slot is taken
    # Process 111 was killed as the task started and the pool replaced it (222)
    # without reporting the task lost: Celery still counts it running.
    pool = PreforkPool([222])
    watchdog = PoolWatchdog(service, service.stalls, pool, semaphore=semaphore)
    watchdog.look()
    clock.now = 10.0
    with caplog.at_level(logging.WARNING, logger="celery_fair.worker.watchdog"):
        stalls = watchdog.look()
    assert sorted((s.task, s.place) for s in stalls) == [("a-0", "lost"), ("a-1", "buffer")]
    assert ran == ["a-0", "a-1"]  # process 222 is free: the buffered task went to it
    assert any("started on pool process 111, which is gone" in m for m in caplog.messages)
    # On a live process the same task is simply running.
    pool.info["processes"] = [111]
    clock.now = 30.0
    assert [s for s in watchdog.look() if s.place == "lost"] == []
