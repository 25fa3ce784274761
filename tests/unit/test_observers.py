"""The per-task observer chain: which observers a worker's features build, in what
order their hooks run, and that a task's finish reaches them once.

The worker end to end (run-time cost, key limits, metrics, telemetry under a
real ``celery worker``) is covered by the integration suite; this checks the
chain's composition and the completion wrapping without a broker.
"""

from __future__ import annotations

from typing import Any

from celery_fair.wire import (
    CAPACITY_STAMP,
    DEMAND_STAMP,
    DISPATCHED_STAMP,
    QUEUE_STAMP,
    RESOURCES_HEADER,
    WEIGHT_STAMP,
)
from celery_fair.worker.capacity import Demands, ResourceGate, worker_capacity
from celery_fair.worker.observers import (
    DispatchedTask,
    MeterObserver,
    RuntimeCharge,
    ServiceTime,
    TaskObserver,
    TelemetryStamps,
)
from celery_fair.worker.service import FairService
from celery_fair.worker.settings import FairSettings
from tests.harness.clock import FakeClock


class FakeQueue:
    def __init__(self, name: str) -> None:
        self.name = self.routing_key = name


class FakeRequest:
    """What the hand-over reads of a Celery request: queue, headers, callbacks."""

    def __init__(self, queue: str) -> None:
        self.delivery_info = {"routing_key": queue}
        self._request_dict: dict[str, Any] = {}
        self.completed: list[str] = []

    def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> None:
        self.completed.append("success")

    def on_failure(self, exc_info: Any, *args: Any, **kwargs: Any) -> None:
        self.completed.append("failure")


class CountingMeter:
    """The metrics' side of the chain: hand-overs and charges, counted."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float | None]] = []

    def dispatched(self, queue: str, sojourn: float | None) -> None:
        self.events.append(("dispatched", queue, sojourn))

    def charge(self, queue: str, cost: float) -> None:
        self.events.append(("charge", queue, cost))


class Recorder(TaskObserver):
    """Records its hooks in a shared log."""

    def __init__(self, name: str, log: list[tuple[str, str, Any]], follows: bool) -> None:
        self.name, self.log, self.follows_completion = name, log, follows

    def before(self, task: DispatchedTask) -> None:
        self.log.append((self.name, "before", task.queue))

    def after(self, task: DispatchedTask, runtime: float) -> None:
        self.log.append((self.name, "after", runtime))


def make_service(clock: FakeClock | None = None, **settings: Any) -> FairService:
    svc = FairService(
        FairSettings(weights={"a": 1, "b": 2}, **settings),
        concurrency=1,
        clock=clock or FakeClock(100.0),
    )
    svc.queue_map.map([FakeQueue("a"), FakeQueue("b")])
    return svc


def test_no_feature_builds_no_observer_and_leaves_dispatch_unwrapped() -> None:
    svc = make_service()

    def process(request: Any) -> Any:
        return request

    assert list(svc.tracker.observers()) == []
    assert svc.tracker.wrap_dispatch(process) is process


def test_features_build_their_observers_in_hook_order() -> None:
    svc = make_service(cost="runtime", prefetch="auto")
    svc.tracker.writer = object()  # a telemetry writer is open
    svc.tracker.meter = CountingMeter()
    kinds = [type(o) for o in svc.tracker.observers()]
    assert kinds == [TelemetryStamps, MeterObserver, RuntimeCharge, ServiceTime]
    # Without run-time cost the meter counts hand-overs only: no finish needed.
    svc = make_service()
    svc.tracker.meter = CountingMeter()
    (meter,) = svc.tracker.observers()
    assert isinstance(meter, MeterObserver) and not meter.follows_completion


def test_the_meter_sees_the_hand_over_and_with_runtime_cost_the_charge() -> None:
    clock = FakeClock(100.0)
    svc = make_service(clock, cost="runtime")
    meter = svc.tracker.meter = CountingMeter()
    dispatch = svc.tracker.wrap_dispatch(lambda request: None)
    request = FakeRequest("a")
    dispatch(request)
    request.on_success((False, None, 0.125))
    # No receipt stamp on this request: the sojourn is unknown.
    assert meter.events == [("dispatched", "a", None), ("charge", "a", 0.125)]


def test_hooks_run_in_chain_order_and_the_finish_reaches_them_once(monkeypatch: Any) -> None:
    clock = FakeClock(100.0)
    svc = make_service(clock)
    log: list[tuple[str, str, Any]] = []
    chain = [
        Recorder("first", log, True),
        Recorder("second", log, False),
        Recorder("third", log, True),
    ]
    monkeypatch.setattr(svc.tracker, "observers", lambda: chain)
    handed: list[Any] = []
    dispatch = svc.tracker.wrap_dispatch(handed.append)

    request = FakeRequest("b")
    dispatch(request)
    assert handed == [request]
    assert log == [("first", "before", "b"), ("second", "before", "b"), ("third", "before", "b")]
    # The pool reports the task's own run time on success: that is charged.
    request.on_success((False, None, "0.25"))
    request.on_failure(None)  # a late second report does not charge again
    assert log[3:] == [("first", "after", 0.25), ("third", "after", 0.25)]
    assert request.completed == ["success", "failure"]
    # The wrappers are dropped at the finish (so reference counting frees the request).
    assert "on_success" not in vars(request) and "on_failure" not in vars(request)

    # A failure carries no run time: the service clock measures it.
    log.clear()
    failed = FakeRequest("a")
    dispatch(failed)
    clock.now += 1.5
    failed.on_failure(("exc",))
    assert log[3:] == [("first", "after", 1.5), ("third", "after", 1.5)]


def test_a_request_of_no_consumed_queue_goes_to_the_pool_unobserved(monkeypatch: Any) -> None:
    svc = make_service()
    log: list[tuple[str, str, Any]] = []
    monkeypatch.setattr(svc.tracker, "observers", lambda: [Recorder("only", log, True)])
    handed: list[Any] = []
    stranger = FakeRequest("elsewhere")
    svc.tracker.wrap_dispatch(handed.append)(stranger)
    assert handed == [stranger] and log == [] and "on_success" not in vars(stranger)


def test_runtime_cost_charges_the_queue_and_telemetry_stamps_the_headers() -> None:
    clock = FakeClock(100.0)
    svc = make_service(clock, cost="runtime")
    svc.tracker.writer = object()
    svc.tracker.wall = lambda: 1234.5
    dispatch = svc.tracker.wrap_dispatch(lambda request: None)
    request = FakeRequest("b")
    svc.scheduler.fetched("b")  # as the fetch does before the task reaches the worker
    estimate = svc.scheduler.fetch_cost("b")
    dispatch(request)
    assert request._request_dict[QUEUE_STAMP] == "b"
    assert request._request_dict[WEIGHT_STAMP] == 2
    assert request._request_dict[DISPATCHED_STAMP] == 1234.5
    request.on_success((False, None, 0.5))
    # The queue's cost estimate learned the measured run time.
    assert abs(svc.scheduler.fetch_cost("b") - 0.5) < abs(estimate - 0.5)


def test_with_resources_telemetry_stamps_what_the_task_holds_and_the_capacity() -> None:
    svc = make_service(capacity={"cpu": 9, "mem": 18}, queue_concurrency={"a": 3})
    svc.tracker.writer = object()
    svc.tracker.wall = lambda: 1234.5
    capacity = worker_capacity(svc.settings.capacity, svc.settings.queue_concurrency, 4)
    svc.gate = ResourceGate(
        svc,
        capacity,
        Demands(svc.settings.queue_concurrency),
        pool_size=lambda: None,
        park=lambda request, reason: None,
        direct=True,
    )
    dispatch = svc.tracker.wrap_dispatch(lambda request: None)
    request = FakeRequest("a")
    request._request_dict[RESOURCES_HEADER] = {"cpu": 1, "mem": 4}
    dispatch(request)
    stamps = request._request_dict
    assert stamps[DEMAND_STAMP] == {"cpu": 1.0, "mem": 4.0, "slots": 1.0, "queue:a": 1.0}
    assert stamps[CAPACITY_STAMP] == {"cpu": 9.0, "mem": 18.0, "slots": 4.0, "queue:a": 3.0}
    # A task that declares nothing holds a slot.
    plain = FakeRequest("b")
    dispatch(plain)
    assert plain._request_dict[DEMAND_STAMP] == {"slots": 1.0}


def test_without_resources_telemetry_stamps_none() -> None:
    svc = make_service()
    svc.tracker.writer = object()
    dispatch = svc.tracker.wrap_dispatch(lambda request: None)
    request = FakeRequest("a")
    dispatch(request)
    assert DEMAND_STAMP not in request._request_dict
    assert CAPACITY_STAMP not in request._request_dict


def test_a_main_process_record_carries_the_stamps_and_else_the_capacity() -> None:
    svc = make_service(capacity={"cpu": 2})
    svc.gate = ResourceGate(
        svc,
        {"cpu": 2.0, "slots": 1.0},
        Demands({}),
        pool_size=lambda: None,
        park=lambda request, reason: None,
        direct=True,
    )
    written: list[Any] = []
    svc.tracker.writer = type("W", (), {"record": staticmethod(written.append)})()
    returned = FakeRequest("a")
    returned.id, returned.name = "t-1", "work"
    svc.tracker.returned(returned, "codel-requeue")  # never reached the pool
    lost = FakeRequest("a")
    lost.id, lost.name = "t-2", "work"
    lost._request_dict.update({DEMAND_STAMP: {"cpu": 1.5}, CAPACITY_STAMP: {"cpu": 3}})
    svc.tracker.returned(lost, "failure")
    first, second = written
    assert first.resources is None and dict(first.capacity) == {"cpu": 2.0, "slots": 1.0}
    assert dict(second.resources) == {"cpu": 1.5} and dict(second.capacity) == {"cpu": 3.0}
