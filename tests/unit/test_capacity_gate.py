"""The resource gate: tasks start when what they declare fits, in fair order.

The gate's pool here is a list: a task "runs" from the hand-over until the
test ends it.  Celery's count of the worker's requests is the real one
(``celery.worker.state.reserved_requests``), which the gate reads to know a
request that ended unseen.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery.worker import state

from celery_fair.scheduling.resources import SLOTS
from celery_fair.wire import RESOURCES_HEADER
from celery_fair.worker.capacity import Demands, ResourceGate, worker_capacity
from celery_fair.worker.dispatch import Holders
from celery_fair.worker.service import FairService
from celery_fair.worker.settings import FairSettings


class FakeQueue:
    def __init__(self, name: str) -> None:
        self.name = self.routing_key = name


class FakeRequest:
    """What the gate reads of a Celery request: its queue, id and headers."""

    def __init__(self, queue: str, n: int, resources: dict[str, float] | None) -> None:
        self.delivery_info = {"routing_key": queue}
        self.id = self.name = f"{queue}-{n}"
        self._request_dict = {} if resources is None else {RESOURCES_HEADER: resources}
        state.reserved_requests.add(self)

    def __hash__(self) -> int:
        return hash(self.id)


class Pool:
    """Runs nothing: keeps what was handed over, and what it held."""

    def __init__(self, gate: ResourceGate) -> None:
        self.gate = gate
        self.running: list[FakeRequest] = []
        self.started: list[str] = []
        self.peak: dict[str, float] = {}

    def process(self, request: FakeRequest) -> None:
        self.running.append(request)
        self.started.append(request.name)
        for name, held in self.gate.ledger.held.items():
            self.peak[name] = max(self.peak.get(name, 0.0), held)

    def finish(self, request: FakeRequest) -> None:
        self.running.remove(request)
        state.reserved_requests.discard(request)
        self.gate.finished(request)


@pytest.fixture(autouse=True)
def clean_state() -> Iterator[None]:
    yield
    state.reserved_requests.clear()


def _gate(
    capacity: dict[str, float], *, slots: int = 10, patience: int = 32, **settings: Any
) -> tuple[ResourceGate, Pool, list[tuple[Any, str]]]:
    service = FairService(FairSettings(capacity=capacity, **settings), concurrency=slots)
    service.queue_map.map([FakeQueue(q) for q in ("a", "b", "video")])
    parked: list[tuple[Any, str]] = []
    whole = worker_capacity(capacity, settings.get("queue_concurrency", {}), slots)
    gate = ResourceGate(
        service, whole, Demands(settings.get("queue_concurrency", {})),
        pool_size=lambda: slots, park=lambda r, why: parked.append((r, why)), direct=True,
        patience=patience,
    )  # fmt: skip
    service.gate = gate
    pool = Pool(gate)
    return gate, pool, parked


A, B = {"cpu": 1.0, "mem": 4.0}, {"cpu": 3.0, "mem": 1.0}


def test_the_papers_example_starts_three_of_a_and_two_of_b() -> None:
    gate, pool, _ = _gate({"cpu": 9, "mem": 18}, cost="dominant")
    gated = gate.wrap(pool.process)
    for i in range(20):
        gated(FakeRequest("a", i, A))
        gated(FakeRequest("b", i, B))
    assert sorted(r.name[0] for r in pool.running) == ["a", "a", "a", "b", "b"]
    # Tasks end and others start, for a while: never more than the capacity.
    for _ in range(25):
        pool.finish(pool.running[0])
    assert pool.peak["cpu"] <= 9 and pool.peak["mem"] <= 18
    assert gate.ledger.held["cpu"] <= 9


def test_a_large_task_lets_small_ones_pass_then_is_reserved() -> None:
    gate, pool, _ = _gate({"cpu": 4}, patience=3)
    gated = gate.wrap(pool.process)
    small = [FakeRequest("a", i, {"cpu": 1}) for i in range(10)]
    for request in small[:3]:
        gated(request)
    big = FakeRequest("b", 0, {"cpu": 4})
    gated(big)
    for request in small[3:]:
        gated(request)
    assert pool.started == ["a-0", "a-1", "a-2", "a-3"]  # a-3 passed the big one
    # Small tasks keep passing it until three have; then it is reserved.
    for _ in range(2):
        pool.finish(pool.running[0])
    assert "b-0" not in pool.started and Holders.task_id(gate.admission.reserved) == "b-0"
    running = list(pool.running)
    for request in running[:-1]:
        pool.finish(request)
    assert "b-0" not in pool.started  # one small task still holds a CPU
    pool.finish(running[-1])
    assert pool.started[-1] == "b-0"  # nothing else started before it fitted


def test_a_task_that_can_never_fit_is_parked_with_its_reason() -> None:
    gate, pool, parked = _gate({"cpu": 4})
    gated = gate.wrap(pool.process)
    gated(FakeRequest("a", 0, {"gpu": 1}))
    gated(FakeRequest("a", 1, {"cpu": 8}))
    gated(FakeRequest("a", 2, {"cpu": -1}))
    gated(FakeRequest("a", 3, {"cpu": 2}))
    assert pool.started == ["a-3"]
    reasons = [why for _, why in parked]
    assert "resource(s) gpu not in the worker's capacity" in reasons[0]
    assert "cpu 8 > 4" in reasons[1]
    assert "must be a number of at least 0" in reasons[2]


def test_queue_concurrency_is_a_resource_of_the_queue() -> None:
    gate, pool, _ = _gate({}, slots=4, queue_concurrency={"video": 2})
    gated = gate.wrap(pool.process)
    for i in range(6):
        gated(FakeRequest("video", i, None))
    for i in range(6):
        gated(FakeRequest("a", i, None))
    names = sorted(r.name.split("-")[0] for r in pool.running)
    assert names == ["a", "a", "video", "video"]
    assert gate.ledger.held[SLOTS] == 4


def test_a_request_that_ended_unseen_is_released_when_celery_no_longer_counts_it() -> None:
    gate, pool, _ = _gate({"cpu": 2})
    gated = gate.wrap(pool.process)
    for i in range(4):
        gated(FakeRequest("a", i, {"cpu": 1}))
    assert len(pool.running) == 2
    lost = pool.running.pop(0)
    state.reserved_requests.discard(lost)  # ended, and its end never reached the gate
    assert gate.reconcile(list(state.reserved_requests)) == 1
    assert len(pool.running) == 2  # the next task started in its place
    assert gate.statistics().repaired == 1


def test_a_request_revoked_on_the_way_to_the_pool_holds_nothing() -> None:
    gate, pool, _ = _gate({"cpu": 1})

    def revoked(request: FakeRequest) -> None:
        state.reserved_requests.discard(request)  # Celery's task_ready, no pool

    gated = gate.wrap(revoked)
    gated(FakeRequest("a", 0, {"cpu": 1}))
    assert gate.ledger.held.get("cpu", 0.0) == 0.0
    gate_two = gate.wrap(pool.process)
    gate_two(FakeRequest("a", 1, {"cpu": 1}))
    assert pool.started == ["a-1"]


def test_a_queue_at_its_limit_does_not_fill_the_look_ahead() -> None:
    gate, pool, _ = _gate({}, slots=4, queue_concurrency={"video": 1})
    gated = gate.wrap(pool.process)
    for i in range(12):  # more than the look-ahead of 8
        gated(FakeRequest("video", i, None))
    for i in range(3):
        gated(FakeRequest("a", i, None))
    names = sorted(r.name.split("-")[0] for r in pool.running)
    assert names == ["a", "a", "a", "video"]  # the other queue uses the rest


def _mix(pool: Pool) -> str:
    return "".join(sorted(r.name[0] for r in pool.running))


def test_one_queues_tasks_waiting_for_room_do_not_hide_another_queues() -> None:
    """RabbitMQ can push one queue's window before another's: a's tasks fill the
    look-ahead, and b's first task is still taken, and starts where it fits."""
    gate, pool, _ = _gate({"cpu": 9, "mem": 18})
    gated = gate.wrap(pool.process)
    for i in range(12):
        gated(FakeRequest("a", i, A))
    assert _mix(pool) == "aaaa" and len(gate.aside) == 8  # mem 16 of 18 held
    for i in range(20):
        gated(FakeRequest("b", i, B))
    assert _mix(pool) == "aaaab"
    # b's next waits aside too (cpu 7 of 9 held): every queue has one the gate sees.
    assert [queue for _, _, queue, _ in gate.aside] == ["a"] * 8 + ["b"]


def test_the_tasks_aside_start_by_drf_after_one_queue_arrived_first() -> None:
    """Under ``fair_cost="dominant"`` the queue holding the least dominant share starts
    first among the tasks aside, not the order they were taken in: a's tasks taken
    before b's arrived do not keep a at four tasks for their whole run."""
    gate, pool, _ = _gate({"cpu": 9, "mem": 18}, cost="dominant")
    gated = gate.wrap(pool.process)
    for i in range(12):
        gated(FakeRequest("a", i, A))
    for i in range(20):
        gated(FakeRequest("b", i, B))
    assert _mix(pool) == "aaaab"
    n = 100
    for _ in range(3):  # three generations of tasks, the buffer kept stocked
        for request in list(pool.running):
            queue = request.name[0]
            pool.finish(request)
            gated(FakeRequest(queue, n, A if queue == "a" else B))
            n += 1
        assert _mix(pool) == "aaabb"
    assert pool.peak["cpu"] <= 9 and pool.peak["mem"] <= 18
