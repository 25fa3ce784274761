"""Tasks waiting for a pool slot leave in DWRR order (prefork, threads, solo)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from kombu.asynchronous.semaphore import LaxBoundedSemaphore

from celery_fair.worker.dispatch import FairGate, install_on_semaphore
from celery_fair.worker.service import FairService
from celery_fair.worker.settings import FairSettings


class FakeRequest:
    """What the dispatch path reads of a Celery request."""

    def __init__(self, queue: str, n: int) -> None:
        self.delivery_info = {"routing_key": queue}
        self.name = f"{queue}-{n}"


class FakeQueue:
    def __init__(self, name: str) -> None:
        self.name = self.routing_key = name


def service(weights: dict[str, float]) -> FairService:
    svc = FairService(FairSettings(weights=weights), concurrency=1)
    svc.queue_map.map([FakeQueue(q) for q in weights])
    return svc


def test_prefork_semaphore_releases_waiters_in_dwrr_order() -> None:
    svc = service({"flood": 1, "quiet": 3})
    sem = LaxBoundedSemaphore(1)
    install_on_semaphore(sem, svc)
    started: list[str] = []
    # The flood arrives first and fills the wait; the quiet queue comes later.
    for i in range(8):
        sem.acquire(lambda r: started.append(r.name), FakeRequest("flood", i))
    for i in range(6):
        sem.acquire(lambda r: started.append(r.name), FakeRequest("quiet", i))
    assert started == ["flood-0"]  # ran at once: a slot was free
    assert len(sem._waiting) == 13
    for _ in range(13):
        sem.release()
    order = [name.split("-")[0] for name in started[1:]]
    # FIFO would run the whole flood first; DWRR gives quiet 3 per flood 1.
    assert order[:8] == ["flood", "quiet", "quiet", "quiet", "flood", "quiet", "quiet", "quiet"]
    assert len(sem._waiting) == 0
    sem.release()
    assert sem.value == 1
    sem.acquire(lambda r: started.append(r.name), FakeRequest("quiet", 99))
    sem.clear()
    assert len(sem._waiting) == 0


class InlinePool:
    """The solo pool's shape: ``on_apply`` runs the task and returns."""

    def on_apply(self, target: Any, args: Any = (), **kwargs: Any) -> None:
        target(*args)


class FuturePool:
    """The thread pool's shape: ``on_apply`` returns an object with ``f``."""

    def __init__(self) -> None:
        self.running: list[tuple[Future[None], Any]] = []

    def on_apply(self, target: Any, args: Any = (), **kwargs: Any) -> Any:
        future: Future[None] = Future()
        self.running.append((future, args))

        class Result:
            f = future

        return Result()

    def finish_one(self) -> None:
        future, _ = self.running.pop(0)
        future.set_result(None)


def test_gate_on_a_thread_pool_keeps_slots_and_dwrr_order() -> None:
    svc = service({"a": 1, "b": 2})
    pool = FuturePool()
    ran: list[str] = []

    def process(request: FakeRequest) -> None:
        ran.append(request.name)
        pool.on_apply(lambda: None)

    gate = FairGate(svc, slots=2)
    gated = gate.wrap(process, pool)
    for i in range(6):
        gated(FakeRequest("a", i))
    for i in range(6):
        gated(FakeRequest("b", i))
    assert ran == ["a-0", "a-1"] and len(pool.running) == 2
    while pool.running:
        pool.finish_one()
    tail = [name.split("-")[0] for name in ran[2:]]
    assert tail[:6] == ["a", "b", "b", "a", "b", "b"]
    assert len(ran) == 12


def test_gate_on_the_solo_pool_orders_a_held_burst() -> None:
    svc = service({"a": 1, "b": 1})
    pool = InlinePool()
    ran: list[str] = []

    def process(request: FakeRequest) -> None:
        pool.on_apply(lambda: ran.append(request.name))

    gate = FairGate(svc, slots=1)
    gated = gate.wrap(process, pool)
    gate.close()  # a burst of deliveries from one drain
    for i in range(3):
        gated(FakeRequest("a", i))
    for i in range(3):
        gated(FakeRequest("b", i))
    assert ran == []
    gate.open()
    assert ran == ["a-0", "b-0", "a-1", "b-1", "a-2", "b-2"]


def test_gate_frees_the_slot_when_a_task_never_reaches_the_pool() -> None:
    svc = service({"a": 1})
    pool = InlinePool()
    seen: list[str] = []

    def process(request: FakeRequest) -> None:
        seen.append(request.name)  # revoked: never calls the pool

    gate = FairGate(svc, slots=1)
    gated = gate.wrap(process, pool)
    for i in range(3):
        gated(FakeRequest("a", i))
    assert seen == ["a-0", "a-1", "a-2"]
    assert gate.free == 1
