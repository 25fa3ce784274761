"""Per-task work as a chain of small observers, each with a before and an after hook.

The worker hands each task to the pool through one function
(:meth:`celery_fair.worker.tracking.TaskTracker.wrap_dispatch`).  Every
feature that must see a task there is one :class:`TaskObserver`: ``before``
runs as the task goes to the pool, ``after`` once it has finished, with its
run time.  The chain is built once, at worker start, from the features that
are on (:func:`observers_for`), in the style of dramatiq's middleware
(``before_process_message``/``after_process_message``).  Only observers that
need the finish make the tracker follow a task to its end, so a worker that
needs no run times wraps nothing per request.

Order matters and is fixed here: the key's lease is returned before the
scheduler is charged (the next task of that key may then be fetched), and
the service time reaches adaptive prefetch last.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .. import compat
from ..wire import CAPACITY_STAMP, DEMAND_STAMP, DISPATCHED_STAMP, QUEUE_STAMP, WEIGHT_STAMP
from ..wire.served import Served
from .capacity import ResourceGate
from .roles import SchedulingService
from .shedder import RECEIVED_MONOTONIC

__all__ = (
    "DispatchedTask",
    "KeyLeases",
    "KeyTokens",
    "Meter",
    "MeterObserver",
    "ResourceRelease",
    "RuntimeCharge",
    "ServiceTime",
    "TaskObserver",
    "TelemetryStamps",
    "observers_for",
)


class Meter(Protocol):
    """What the observers report to the metrics (:class:`~.metrics.DispatchMeter`)."""

    def dispatched(self, queue: str, sojourn: float | None) -> None:
        """A task of ``queue`` went to the pool after waiting ``sojourn`` s (None: unknown)."""

    def charge(self, queue: str, cost: float) -> None:
        """``queue`` was charged ``cost`` (run time) for a finished task."""


class DispatchedTask:
    """One task between its hand-over to the pool and its finish.

    ``started`` is the service clock at hand-over; ``tag`` and ``served`` are
    filled by the observers that need them (the delivery tag for a key's
    lease, the served-key header for the key's run-time charge).
    """

    __slots__ = ("cost", "queue", "request", "served", "started", "tag")

    def __init__(self, request: Any, queue: str, started: float) -> None:
        self.request = request
        self.queue = queue
        self.started = started
        self.tag: Any = None
        self.served: Served | None = None
        #: ``fair_cost="dominant"``: what the task is charged, found as it goes to the pool.
        self.cost: float | None = None


class TaskObserver:
    """One feature's view of the tasks a worker runs.  Both hooks do nothing here.

    ``follows_completion`` says whether :meth:`after` must be called; only
    then does the tracker wrap the request's completion callbacks.  With
    ``per_task`` as well, :meth:`follows` says it for each request at
    hand-over, so that tasks none of the observers follow keep their own
    callbacks; such an observer has no :meth:`before`.
    """

    follows_completion = False
    per_task = False

    def before(self, task: DispatchedTask) -> None:
        """The task is handed to the pool now."""

    def follows(self, request: Any) -> bool:
        """Whether :meth:`after` must be called for ``request`` (asked only with ``per_task``)."""
        return True

    def after(self, task: DispatchedTask, runtime: float) -> None:
        """The task finished after ``runtime`` seconds (its own run time when known)."""


class TelemetryStamps(TaskObserver):
    """Stamps queue, weight and hand-over time into the request's headers, and with
    resources on what the task holds and the worker's capacity.

    The pool process that runs the task reads them back
    (:mod:`celery_fair.worker.recorder`).  ``on_timeout(request, queue)``
    records a task killed at its hard time limit where Celery sends no
    ``task_failure`` for it (``watch_timeouts``).
    """

    def __init__(
        self,
        service: SchedulingService,
        wall: Callable[[], float],
        on_timeout: Callable[[Any, str], None] | None,
    ) -> None:
        self.service = service
        self.scheduler = service.scheduler
        self.wall = wall
        self.on_timeout = on_timeout

    def before(self, task: DispatchedTask) -> None:
        request, queue = task.request, task.queue
        headers = compat.request_headers(request)
        headers[QUEUE_STAMP] = queue
        headers[WEIGHT_STAMP] = self.scheduler.weight(queue)
        headers[DISPATCHED_STAMP] = self.wall()
        # The gate is read here, not at start: the chain may be built before it.
        gate = self.service.gate
        if isinstance(gate, ResourceGate):
            headers[DEMAND_STAMP] = dict(gate.holding(request, queue))
            headers[CAPACITY_STAMP] = dict(gate.ledger.capacity)
        on_timeout = self.on_timeout
        if on_timeout is not None:
            compat.on_hard_timeout(request, lambda: on_timeout(request, queue))


class KeyLeases(TaskObserver):
    """Per-key limits: a task holds its key's slot until it finishes."""

    follows_completion = True

    def __init__(self, service: SchedulingService) -> None:
        keyed = service.attachment.keyed
        assert keyed is not None and keyed.limited
        self.leases = keyed.leases

    def before(self, task: DispatchedTask) -> None:
        task.tag = compat.delivery_tag(task.request)
        self.leases.dispatched(task.queue, task.tag)

    def after(self, task: DispatchedTask, runtime: float) -> None:
        self.leases.finished(task.queue, task.tag, runtime)


class KeyTokens(TaskObserver):
    """Per-key limits on RabbitMQ: a finished task gives its key's tokens back.

    Only tasks that hold tokens are followed: every keyed worker on RabbitMQ
    has the token gate (a limit may be set live), and the tasks of keys
    without a limit must cost nothing more.  The gate is on the way to the
    pool, before the hand-over: a limited task holds its tokens by then.
    """

    follows_completion = True
    per_task = True

    def __init__(self, service: SchedulingService) -> None:
        self.service = service

    def follows(self, request: Any) -> bool:
        return self.service.tokens.holds(request)

    def after(self, task: DispatchedTask, runtime: float) -> None:
        self.service.tokens.finished(task.request)


class MeterObserver(TaskObserver):
    """Prometheus metrics: the sojourn at hand-over and, with run-time cost, the charge.

    ``meter`` is a :class:`~celery_fair.worker.metrics.DispatchMeter`.
    """

    def __init__(self, meter: Meter, *, charge: bool) -> None:
        self.meter = meter
        self.follows_completion = charge

    def before(self, task: DispatchedTask) -> None:
        received = getattr(task.request, RECEIVED_MONOTONIC, None)
        self.meter.dispatched(task.queue, None if received is None else task.started - received)

    def after(self, task: DispatchedTask, runtime: float) -> None:
        self.meter.charge(task.queue, measured(task, runtime))


class ResourceRelease(TaskObserver):
    """Resources (``fair_capacity`` ...): a finished task frees what it held on the gate."""

    follows_completion = True

    def __init__(self, service: SchedulingService) -> None:
        self.service = service

    def after(self, task: DispatchedTask, runtime: float) -> None:
        gate = self.service.gate
        finished = getattr(gate, "finished", None)
        if finished is not None:
            finished(task.request)


class RuntimeCharge(TaskObserver):
    """``fair_cost="runtime"`` or ``"dominant"``: the queue, and a keyed queue's key, pay
    what the task ran, or its dominant share of the worker (what it held)."""

    follows_completion = True

    def __init__(self, service: SchedulingService) -> None:
        self.service = service
        self.scheduler = service.scheduler
        self.lock = service.lock
        self.keyed = service.attachment.keyed
        self.dominant = service.settings.cost == "dominant"

    def before(self, task: DispatchedTask) -> None:
        keyed = self.keyed
        if keyed is not None and task.queue in keyed.queues:
            task.served = Served.from_headers(compat.request_headers(task.request))
        if self.dominant:
            cost = getattr(self.service.gate, "cost", None)
            task.cost = 1.0 if cost is None else cost(task.request, task.queue)

    def after(self, task: DispatchedTask, runtime: float) -> None:
        charge = measured(task, runtime)
        with self.lock:
            self.scheduler.finished(task.queue, charge)
        if task.served is not None and self.keyed is not None:
            self.keyed.finished(task.queue, task.served, charge)


def measured(task: DispatchedTask, runtime: float) -> float:
    """What a finished task is post-charged: its dominant cost when known, else its run time."""
    return runtime if task.cost is None else task.cost


class ServiceTime(TaskObserver):
    """``fair_prefetch="auto"``: the window learns the service time from every finished task."""

    follows_completion = True

    def __init__(self, service: SchedulingService) -> None:
        self.prefetch = service.prefetch

    def after(self, task: DispatchedTask, runtime: float) -> None:
        self.prefetch.observe_service(runtime)


def observers_for(
    service: SchedulingService,
    *,
    meter: Meter | None,
    wall: Callable[[], float],
    telemetry: bool,
    on_timeout: Callable[[Any, str], None] | None,
) -> Sequence[TaskObserver]:
    """The chain for this worker's features, in the order the hooks run.

    ``meter`` is the metrics' dispatch meter or None; ``telemetry`` whether
    a telemetry writer is open.  An empty chain means dispatch is not wrapped.
    """
    settings = service.settings
    post_charged = settings.cost != "count"
    chain: list[TaskObserver] = []
    if telemetry:
        chain.append(TelemetryStamps(service, wall, on_timeout))
    if settings.resources:
        chain.append(ResourceRelease(service))
    keyed = service.attachment.keyed
    if keyed is not None and keyed.limited:
        chain.append(KeyLeases(service))
    if service.tokens is not None:
        chain.append(KeyTokens(service))
    if meter is not None:
        chain.append(MeterObserver(meter, charge=post_charged))
    if post_charged:
        chain.append(RuntimeCharge(service))
    if settings.prefetch == "auto":
        chain.append(ServiceTime(service))
    return chain
