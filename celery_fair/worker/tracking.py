"""Follows each task from receipt to completion, in the worker's main process.

Feeds the scheduler the measured run time (``fair_cost="runtime"``) and, when
``fair_telemetry_dir`` is set, writes one telemetry record per task.  It only
wraps a request's ``on_success``/``on_failure`` (a ``Request`` has a
``__dict__``, so an instance attribute overrides the method); nothing is
wrapped when neither feature is on, so the plain path costs nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from celery.exceptions import Retry

from .shedding import RECEIVED_MONOTONIC

__all__ = ("PUBLISHED_HEADER", "TaskTracker")

#: Header stamped by the producer (``before_task_publish``) with its wall time.
PUBLISHED_HEADER = "fair_published"
KEY_HEADER = "fair_key"
RECEIVED_ATTR = "_fair_received"


_RECORD_TYPE: Any = None


def _task_record() -> Any:
    """``TaskRecord``, imported once (the telemetry package loads pyarrow)."""
    global _RECORD_TYPE
    if _RECORD_TYPE is None:
        from ..telemetry import TaskRecord

        _RECORD_TYPE = TaskRecord
    return _RECORD_TYPE


class TaskTracker:
    """Per-task bookkeeping for run-time cost and telemetry.

    ``service`` is the worker's :class:`~celery_fair.worker.service.FairService`;
    ``writer`` a :class:`~celery_fair.telemetry.TelemetryWriter` or None.
    """

    def __init__(self, service: Any, writer: Any = None, *, hostname: str | None = None) -> None:
        self.service = service
        self.writer = writer
        self.hostname = hostname
        self.pid = os.getpid()
        self.wall: Callable[[], float] = time.time
        #: A :class:`~celery_fair.worker.metrics.DispatchMeter` when metrics are on.
        self.meter: Any = None

    @property
    def active(self) -> bool:
        """Whether tasks are followed at all (``wrap_dispatch`` wraps)."""
        return self.follows_completion or self.meter is not None

    @property
    def follows_completion(self) -> bool:
        """Whether each task must be followed until it finishes."""
        settings = self.service.settings
        return self.writer is not None or settings.cost == "runtime" or settings.prefetch == "auto"

    def wrap_receive(self, receive: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Stamp the receipt time (telemetry, and CoDel's sojourn).

        ``receive`` is the worker's ``process_task``: called on receipt, or
        when an ETA task comes due, so an ETA task's sojourn starts then.
        """
        # CoDel and the metrics' sojourn histogram measure from this stamp.
        monotonic = self.service.settings.codel or self.meter is not None
        if self.writer is None and not monotonic:
            return receive
        wall, clock = self.wall, self.service.clock

        def fair_receive(request: Any) -> Any:
            setattr(request, RECEIVED_ATTR, wall())
            if monotonic:
                setattr(request, RECEIVED_MONOTONIC, clock())
            return receive(request)

        return fair_receive

    def returned(self, request: Any, outcome: str) -> None:
        """A task CoDel sent back or rejected: record it (it never ran here)."""
        if self.writer is not None:
            self._write(request, self.service.queue_of(request), outcome, cost=0.0)

    def on_revoked(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        """Celery's ``task_revoked`` signal: record the task with outcome ``revoked``.

        Celery skips a revoked (or expired) task at receipt or just before it
        runs, in the main process; ``request`` is then the task's context.
        """
        task_id = getattr(request, "id", None)
        if self.writer is None or task_id is None:
            return
        info = getattr(request, "delivery_info", None) or {}
        key = info.get("routing_key")
        queue = self.service.queue_of(request)
        published = getattr(request, PUBLISHED_HEADER, None)
        fair_key = getattr(request, KEY_HEADER, None)
        self.writer.record(
            _task_record()(
                task_id=str(task_id),
                task_name=getattr(sender, "name", None) or getattr(request, "task", None),
                queue=queue,
                outcome="revoked",
                received=None,
                finished=self.wall(),
                routing_key=key,
                fair_key=None if fair_key is None else str(fair_key),
                published=float(published) if isinstance(published, (int, float)) else None,
                target_weight=None if queue is None else self.service.scheduler.weight(queue),
                hostname=self.hostname,
                pid=self.pid,
                cost=0.0,
            )
        )

    def wrap_dispatch(self, process: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Follow each task handed to the pool until it finishes."""
        if not self.active:
            return process
        service, clock, wall = self.service, self.service.clock, self.wall
        scheduler, lock = service.scheduler, service.lock
        runtime_cost = service.settings.cost == "runtime"
        record, meter = self._record, self.meter
        if not self.follows_completion:
            # Metrics alone: count at dispatch, nothing wrapped per request.
            def fair_count_dispatch(request: Any) -> Any:
                queue = service.queue_of(request)
                if queue is not None:
                    received = getattr(request, RECEIVED_MONOTONIC, None)
                    meter.dispatched(queue, None if received is None else clock() - received)
                return process(request)

            return fair_count_dispatch

        def fair_process_task(request: Any) -> Any:
            queue = service.queue_of(request)
            if queue is None:
                return process(request)
            started, dispatched = clock(), wall()
            if meter is not None:
                received = getattr(request, RECEIVED_MONOTONIC, None)
                meter.dispatched(queue, None if received is None else started - received)
            done = False

            def finish(runtime: float | None, outcome: str) -> None:
                nonlocal done
                if done:
                    return
                done = True
                # The wrappers below refer to the request and the request to
                # them: drop them now so reference counting frees the request
                # (left to the cyclic GC, every request and its message would
                # pile up between collections: 6-8% of throughput, measured).
                attrs = getattr(request, "__dict__", None)
                if attrs is not None:
                    attrs.pop("on_success", None)
                    attrs.pop("on_failure", None)
                if runtime is None:
                    runtime = clock() - started
                if runtime_cost:
                    with lock:
                        scheduler.finished(queue, runtime)
                    if meter is not None:
                        meter.charge(queue, runtime)
                service.observe_service(runtime)
                if self.writer is not None:
                    record(request, queue, outcome, runtime, dispatched)

            on_success, on_failure = request.on_success, request.on_failure

            def fair_on_success(failed__retval__runtime: Any, **kwargs: Any) -> Any:
                # The pool reports the task's own run time (without the IPC to
                # the pool); charge that, as a user means by "run time".
                try:
                    failed, _, runtime = failed__retval__runtime
                    runtime = float(runtime)
                except (TypeError, ValueError):
                    failed, runtime = False, None
                finish(runtime, "failure" if failed else "success")
                return on_success(failed__retval__runtime, **kwargs)

            def fair_on_failure(exc_info: Any, *args: Any, **kwargs: Any) -> Any:
                exception = getattr(exc_info, "exception", None)
                finish(None, "retry" if isinstance(exception, Retry) else "failure")
                return on_failure(exc_info, *args, **kwargs)

            request.on_success, request.on_failure = fair_on_success, fair_on_failure
            return process(request)

        return fair_process_task

    def _record(
        self, request: Any, queue: str, outcome: str, runtime: float, dispatched: float
    ) -> None:
        cost = runtime if self.service.scheduler.cost == "runtime" else 1.0
        self._write(
            request,
            queue,
            outcome,
            cost=cost,
            dispatched=dispatched,
            started=getattr(request, "time_start", None),
            runtime=runtime,
        )

    def _write(self, request: Any, queue: str | None, outcome: str, **times: Any) -> None:
        """One telemetry record: the request's identity, headers and ``times``."""
        TaskRecord = _task_record()
        info = getattr(request, "delivery_info", None) or {}
        headers = getattr(request, "_request_dict", None) or {}
        published = headers.get(PUBLISHED_HEADER)
        key = headers.get(KEY_HEADER)
        self.writer.record(
            TaskRecord(
                task_id=request.id,
                task_name=request.name,
                queue=queue,
                outcome=outcome,
                received=getattr(request, RECEIVED_ATTR, None),
                finished=self.wall(),
                routing_key=info.get("routing_key"),
                fair_key=None if key is None else str(key),
                published=float(published) if isinstance(published, (int, float)) else None,
                target_weight=None if queue is None else self.service.scheduler.weight(queue),
                hostname=self.hostname,
                pid=self.pid,
                **times,
            )
        )
