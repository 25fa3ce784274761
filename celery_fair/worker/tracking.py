"""Follows each task from receipt to completion, in the worker's main process.

Stamps the receipt time (telemetry and CoDel's sojourn), runs the per-task
observers of :mod:`celery_fair.worker.observers` around each hand-over to the
pool, and writes the main process's telemetry records (tasks that never ran
here, or whose pool process died).  A request's ``on_success``/``on_failure``
are wrapped only when an observer needs the task's finish; with no feature on
nothing is wrapped, so the plain path costs nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from billiard.exceptions import WorkerLostError
from celery.exceptions import TimeLimitExceeded

from .. import compat
from ..wire import (
    CAPACITY_STAMP,
    DEMAND_STAMP,
    DISPATCHED_STAMP,
    KEY_HEADER,
    PUBLISHED_HEADER,
    QUEUE_STAMP,
    RECEIVED_STAMP,
    SERVED_HEADER,
    USER_HEADER,
)
from ..wire.served import NOT_SERVED, Served
from .capacity import ResourceGate
from .observers import DispatchedTask, Meter, TaskObserver, observers_for
from .recorder import as_amounts, as_float, as_int, as_text
from .roles import SchedulingService
from .shedder import RECEIVED_MONOTONIC

__all__ = ("PUBLISHED_HEADER", "TaskTracker")


def _follow(
    request: Any,
    task: DispatchedTask,
    afters: tuple[Callable[[DispatchedTask, float], None], ...],
    clock: Callable[[], float],
) -> None:
    """Call ``afters`` once ``request`` finishes, with its run time.

    The pool calls a request's ``on_success``/``on_failure`` in the main
    process when the task is done; they are overridden on this request only.
    """
    done = False

    def finish(runtime: float | None) -> None:
        nonlocal done
        if done:
            return
        done = True
        # The wrappers below refer to the request and the request to them:
        # drop them now so reference counting frees the request (left to the
        # cyclic GC, every request and its message would pile up between
        # collections: 6-8% of throughput, measured).
        compat.reset_request_callbacks(request)
        if runtime is None:
            runtime = clock() - task.started
        for after in afters:
            after(task, runtime)

    on_success, on_failure = compat.request_callbacks(request)

    def fair_on_success(failed__retval__runtime: Any, **kwargs: Any) -> Any:
        # The pool reports the task's own run time (without the IPC to the
        # pool); charge that, as a user means by "run time".
        try:
            _, _, runtime = failed__retval__runtime
            runtime = float(runtime)
        except (TypeError, ValueError):
            runtime = None
        finish(runtime)
        return on_success(failed__retval__runtime, **kwargs)

    def fair_on_failure(exc_info: Any, *args: Any, **kwargs: Any) -> Any:
        finish(None)
        return on_failure(exc_info, *args, **kwargs)

    compat.set_request_callbacks(request, fair_on_success, fair_on_failure)


_RECORD_TYPE: Any = None


def _task_record() -> Any:
    """``TaskRecord``, imported once (the telemetry package loads pyarrow)."""
    global _RECORD_TYPE
    if _RECORD_TYPE is None:
        from ..telemetry import TaskRecord

        _RECORD_TYPE = TaskRecord
    return _RECORD_TYPE


class TaskTracker:
    """Per-task bookkeeping for run-time cost, metrics and telemetry.

    ``service`` is the worker's :class:`~celery_fair.worker.service.FairService`;
    ``writer`` the main process's :class:`~celery_fair.telemetry.TelemetryWriter`
    or None.  Tasks that run on the pool are recorded there (see
    :mod:`celery_fair.worker.recorder`); the main process's writer gets the
    tasks that never ran or whose pool process died.
    """

    def __init__(
        self, service: SchedulingService, writer: Any = None, *, hostname: str | None = None
    ) -> None:
        self.service = service
        self.writer = writer
        self.hostname = hostname
        self.pid = os.getpid()
        self.wall: Callable[[], float] = time.time
        #: A :class:`~celery_fair.worker.metrics.DispatchMeter` when metrics are on.
        self.meter: Meter | None = None

    def observers(self) -> Sequence[TaskObserver]:
        """The per-task observers of this worker's features (see :mod:`.observers`)."""
        telemetry = self.writer is not None
        # Celery < 5.7 sends no task_failure when it kills a task at its hard
        # time limit: follow those requests' timeouts instead (on_task_failure).
        watch_timeouts = telemetry and compat.can_follow_hard_timeouts(self.service.probe)
        write = self._write
        return observers_for(
            self.service,
            meter=self.meter,
            wall=self.wall,
            telemetry=telemetry,
            on_timeout=(
                (lambda request, queue: write(request, queue, "failure"))
                if watch_timeouts
                else None
            ),
        )

    def wrap_receive(self, receive: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Stamp the receipt time (telemetry, and CoDel's sojourn).

        ``receive`` is the worker's ``process_task``: called on receipt, or
        when an ETA task comes due, so an ETA task's sojourn starts then.
        """
        # CoDel and the metrics' sojourn histogram measure from this stamp.
        monotonic = self.service.settings.codel or self.meter is not None
        telemetry = self.writer is not None
        if not telemetry and not monotonic:
            return receive
        wall, clock = self.wall, self.service.clock

        def fair_receive(request: Any) -> Any:
            if telemetry:
                compat.request_headers(request)[RECEIVED_STAMP] = wall()
            if monotonic:
                setattr(request, RECEIVED_MONOTONIC, clock())
            return receive(request)

        return fair_receive

    def returned(self, request: Any, outcome: str) -> None:
        """A task CoDel sent back or rejected: record it (it never ran here)."""
        if self.writer is not None:
            self._write(request, self.service.queue_map.queue_of(request), outcome, cost=0.0)

    def on_revoked(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        """Celery's ``task_revoked`` signal: record the task with outcome ``revoked``.

        Celery skips a revoked (or expired) task at receipt or just before it
        runs, in the main process; ``request`` is then the task's context.
        """
        task_id = getattr(request, "id", None)
        if self.writer is None or task_id is None:
            return
        self._write_context(sender, request, "revoked", cost=0.0)

    def on_task_failure(
        self, sender: Any = None, task_id: Any = None, exception: Any = None, **kwargs: Any
    ) -> None:
        """Celery's ``task_failure`` signal, for a pool process that died.

        The main process sends it when a task's pool process was lost
        (``WorkerLostError``) or killed at the hard time limit; no pool
        process is left to record that task, so the main process does.  Any
        other failure is recorded where the task ran.
        """
        if self.writer is None or os.getpid() != self.pid:
            return
        if not isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
            return
        # Celery pushes the request's context for the signal's receivers.
        request = getattr(sender, "request", None)
        if getattr(request, "id", None) != task_id:
            return
        self._write_context(sender, request, "failure")

    def wrap_dispatch(self, process: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Run the observers' hooks around each task handed to the pool.

        ``process`` is the worker's hand-over to the pool.  With no observer
        it is returned as is; with none that follows completion, only the
        ``before`` hooks run and nothing is wrapped per request.
        """
        chain = self.observers()
        if not chain:
            return process
        service, clock = self.service, self.service.clock
        # Observers that follow some tasks only (per_task) have no before hook.
        befores = tuple(observer.before for observer in chain if not observer.per_task)
        following = [observer for observer in chain if observer.follows_completion]
        afters = tuple(observer.after for observer in following if not observer.per_task)
        per_task = tuple((o.follows, o.after) for o in following if o.per_task)

        def fair_dispatch(request: Any) -> Any:
            wanted = afters
            if per_task:
                wanted += tuple(after for follows, after in per_task if follows(request))
            if not befores and not wanted:
                return process(request)  # nothing to do for this task
            queue = service.queue_map.queue_of(request)
            if queue is None:
                return process(request)
            task = DispatchedTask(request, queue, clock())
            for before in befores:
                before(task)
            if wanted:
                _follow(request, task, wanted, clock)
            return process(request)

        return fair_dispatch

    def _write_context(self, task: Any, request: Any, outcome: str, **times: Any) -> None:
        """A main-process record from a task's context (a signal's ``request``)."""

        def get(name: str) -> Any:
            return getattr(request, name, None)

        queue = get(QUEUE_STAMP) or self.service.queue_map.queue_of(request)
        name = getattr(task, "name", None) or get("task")
        self._record(get, request.id, name, queue, get("delivery_info"), outcome, **times)

    def _write(self, request: Any, queue: str | None, outcome: str, **times: Any) -> None:
        """A main-process record from a worker ``Request`` and ``times``."""
        info = getattr(request, "delivery_info", None)
        get = compat.request_headers(request).get
        self._record(get, request.id, request.name, queue, info, outcome, **times)

    def _record(
        self,
        get: Callable[[str], Any],
        task_id: Any,
        task_name: str | None,
        queue: str | None,
        info: Any,
        outcome: str,
        **times: Any,
    ) -> None:
        """One record; ``get(header)`` reads the task's headers and stamps.

        What the task held is known only once it went to the pool (stamped
        then); the capacity, with resources on, always.
        """
        served = Served.from_wire(get(SERVED_HEADER)) or NOT_SERVED
        capacity = as_amounts(get(CAPACITY_STAMP))
        gate = self.service.gate
        if capacity is None and isinstance(gate, ResourceGate):
            capacity = as_amounts(dict(gate.ledger.capacity))
        self.writer.record(
            _task_record()(
                task_id=str(task_id),
                task_name=task_name,
                queue=queue,
                outcome=outcome,
                received=as_float(get(RECEIVED_STAMP)),
                finished=self.wall(),
                routing_key=(info or {}).get("routing_key"),
                fair_key=as_text(get(KEY_HEADER)),
                published=as_float(get(PUBLISHED_HEADER)),
                dispatched=as_float(get(DISPATCHED_STAMP)),
                target_weight=None if queue is None else self.service.scheduler.weight(queue),
                key_weight=served.weight,
                key_throttled=served.throttled,
                hostname=self.hostname,
                pid=self.pid,
                priority=as_int((info or {}).get("priority")),
                key_user=served.user_or(get(USER_HEADER)),
                key_paused=served.paused,
                resources=as_amounts(get(DEMAND_STAMP)),
                capacity=capacity,
                **times,
            )
        )
