"""Telemetry records made where the task runs: in the pool process.

With no-op tasks a prefork worker's main process is the bottleneck: it
receives, schedules and dispatches every task, while the pool processes idle
part of the time.  So the main process only *stamps* what it alone knows into
the task's request headers (receipt and dispatch times, the
queue and its weight), a few dictionary writes; the pool process that runs the
task reads them back from ``task.request``, adds its own start and finish
times and outcome, and buffers the record in its own
:class:`~celery_fair.telemetry.TelemetryWriter` (one set of Parquet files per
process, named by its pid).

The headers reach the pool process because Celery hands the request's header
dict to the pool as it is (``Request._request_dict``), and ``task.request``
is built from it.  With the ``solo`` and ``threads`` pools the task runs in
the main process and the same code records it there.

What the main process still records itself: tasks that never reach the pool
(CoDel returns, revoked tasks) and tasks whose pool process died
(``WorkerLostError``, hard time limit), for which no pool process is left to
write anything; see :class:`~celery_fair.worker.tracking.TaskTracker`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from celery import signals, states

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
    WEIGHT_STAMP,
)
from ..wire.served import NOT_SERVED, Served

__all__ = (
    "MainWriter",
    "PoolRecorder",
    "as_amounts",
    "as_float",
    "as_text",
    "outcome_of",
    "telemetry_writer",
)

#: Header the router stamps with the task's fairness key.

# Where the recorder keeps a running task's start on its ``task.request``.
_STARTED = "_fair_started"
_STARTED_PERF = "_fair_started_perf"

# Celery's final task states, as telemetry outcomes. ``Ignore`` (also raised
# by ``Task.replace``) ends the task without an error; ``Reject`` is a
# failure to run it here.
_OUTCOMES = {
    states.SUCCESS: "success",
    states.RETRY: "retry",
    states.IGNORED: "success",
}


def outcome_of(state: str | None) -> str:
    """The telemetry outcome of a Celery task state (``FAILURE`` and the rest: failure)."""
    return _OUTCOMES.get(state or "", "failure")


class PoolRecorder:
    """Records each task the current process runs, from Celery's task signals.

    Connect :meth:`on_prerun` and :meth:`on_postrun` to ``task_prerun`` and
    ``task_postrun`` *before* the pool forks, so every pool process inherits
    them; call :meth:`open` in each process that runs tasks (a prefork pool
    process from ``worker_process_init``, or the main process) and
    :meth:`close` when it ends.  ``make_writer(pid)`` builds the process's
    writer; ``runtime_cost`` records the run time as the task's cost (as the
    scheduler charges it), otherwise every task costs 1.
    """

    def __init__(
        self,
        make_writer: Callable[[int], Any],
        *,
        hostname: str | None,
        runtime_cost: bool,
        wall: Callable[[], float] = time.time,
        perf: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.make_writer = make_writer
        self.hostname = hostname
        self.runtime_cost = runtime_cost
        self.wall = wall
        self.perf = perf
        #: This process's writer; None before :meth:`open` (records are not made).
        self.writer: Any = None
        self.pid: int | None = None

    def connect(self) -> None:
        """Connect to Celery's task and pool-process signals (in the main process)."""
        signals.task_prerun.connect(self.on_prerun, weak=False)
        signals.task_postrun.connect(self.on_postrun, weak=False)
        signals.worker_process_init.connect(self.on_process_init, weak=False)
        signals.worker_process_shutdown.connect(self.on_process_shutdown, weak=False)

    def disconnect(self) -> None:
        """Undo :meth:`connect`."""
        signals.task_prerun.disconnect(self.on_prerun)
        signals.task_postrun.disconnect(self.on_postrun)
        signals.worker_process_init.disconnect(self.on_process_init)
        signals.worker_process_shutdown.disconnect(self.on_process_shutdown)

    def on_process_init(self, **kwargs: Any) -> None:
        """``worker_process_init``: a prefork pool process starts; give it a writer."""
        self.open()

    def on_process_shutdown(self, **kwargs: Any) -> None:
        """``worker_process_shutdown``: a pool process exits; flush its records."""
        self.close()

    def open(self, writer: Any = None) -> Any:
        """Start recording in this process, with ``writer`` or a new one."""
        # A pool process forked after the main process opened its writer
        # inherits that writer object, its buffer included: never write
        # through it here (the main process flushes its own records).
        pid = os.getpid()
        self.writer = writer if writer is not None else self.make_writer(pid)
        self.pid = pid
        return self.writer

    def close(self) -> Any:
        """Stop recording and flush this process's writer (returns it, or None)."""
        writer, self.writer = self.writer, None
        if writer is not None and self.pid == os.getpid():
            writer.close()
            return writer
        return None

    def on_prerun(self, task: Any = None, **kwargs: Any) -> None:
        """``task_prerun``: note when the task body starts."""
        if self.writer is None or task is None:
            return
        request = task.request
        setattr(request, _STARTED, self.wall())
        setattr(request, _STARTED_PERF, self.perf())

    def on_postrun(
        self, task: Any = None, task_id: Any = None, state: str | None = None, **kwargs: Any
    ) -> None:
        """``task_postrun``: buffer the task's record (the body has ended)."""
        writer = self.writer
        if writer is None or task is None or state is None:
            # No state: the body did not end, an exception such as the
            # SystemExit of a pool process being terminated (the hard time
            # limit) went through it; the main process records that task.
            return
        request = task.request
        dispatched = getattr(request, DISPATCHED_STAMP, None)
        if dispatched is None:
            # Not dispatched by a fair worker (an eager call inside a task).
            return
        finished_perf = self.perf()
        started_perf = getattr(request, _STARTED_PERF, None)
        runtime = None if started_perf is None else finished_perf - started_perf
        served = Served.from_wire(getattr(request, SERVED_HEADER, None)) or NOT_SERVED
        # A row in the schema's FIELDS order (TaskRecord's field order; a
        # unit test holds the two together).
        writer.record_row(
            (
                str(task_id if task_id is not None else request.id),  # task_id
                task.name,  # task_name
                getattr(request, QUEUE_STAMP, None),  # queue
                outcome_of(state),  # outcome
                as_float(getattr(request, RECEIVED_STAMP, None)),  # received
                self.wall(),  # finished
                (getattr(request, "delivery_info", None) or {}).get("routing_key"),
                as_text(getattr(request, KEY_HEADER, None)),  # fair_key
                as_float(getattr(request, PUBLISHED_HEADER, None)),  # published
                as_float(dispatched),  # dispatched
                getattr(request, _STARTED, None),  # started
                runtime,  # runtime
                runtime if self.runtime_cost else 1.0,  # cost
                as_float(getattr(request, WEIGHT_STAMP, None)),  # target_weight
                served.weight,  # key_weight
                served.throttled,  # key_throttled
                self.hostname,  # hostname
                self.pid,  # pid
                "worker",  # source
                as_int((getattr(request, "delivery_info", None) or {}).get("priority")),
                served.user_or(getattr(request, USER_HEADER, None)),  # key_user
                served.paused,  # key_paused
                as_amounts(getattr(request, DEMAND_STAMP, None)),  # resources
                as_amounts(getattr(request, CAPACITY_STAMP, None)),  # capacity
            )
        )


def as_int(value: Any) -> int | None:
    """A priority as an int, None if absent or not a whole number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if float(value).is_integer() else None


def as_float(value: Any) -> float | None:
    """A header's number as a float, None if absent or not a number."""
    return float(value) if isinstance(value, (int, float)) else None


def as_amounts(value: Any) -> tuple[tuple[str, float], ...] | None:
    """A stamp of resource -> amount as (name, amount) pairs, None if absent or not one.

    Pairs, not a dict: a row of strings, numbers and tuples of them is left
    alone by the cyclic garbage collector once it survives a collection (see
    :data:`~celery_fair.telemetry.schema.as_row`).  An amount that is not a
    number leaves its resource out.
    """
    if not isinstance(value, dict):
        return None
    return tuple(
        (str(name), float(amount))
        for name, amount in value.items()
        if isinstance(amount, (int, float)) and not isinstance(amount, bool)
    )


def as_text(value: Any) -> str | None:
    """A header's value as text, None if absent."""
    return None if value is None else str(value)


class MainWriter:
    """The main process's telemetry writer, created at its first record.

    With the prefork pool the main process records only tasks that never ran
    (CoDel returns, revoked) or whose pool process died, and may never have
    one: it imports pyarrow (and numpy, ~11,000 more objects for the garbage
    collector to traverse) only then.  Importing them at start cost a prefork
    worker's main process 7-10 us of CPU per no-op task, measured, about 2%
    of its throughput.  Records that arrive before :meth:`open` are dropped.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._factory: Any = None
        self._writer: Any = None
        self.opened = False

    def open(self, factory: Any) -> None:
        """From now on, records go to ``factory()`` (called at the first record)."""
        self._factory, self.opened = factory, True

    def record(self, rec: Any) -> None:
        writer = self._get()
        if writer is not None:
            writer.record(rec)

    def record_row(self, row: tuple[Any, ...]) -> None:
        writer = self._get()
        if writer is not None:
            writer.record_row(row)

    def _get(self) -> Any:
        writer = self._writer
        if writer is None and self._factory is not None:
            with self._lock:
                if self._writer is None and self._factory is not None:
                    self._writer = self._factory()
                writer = self._writer
        return writer

    def close(self) -> Any:
        """Flush and close the writer if one was created; return its statistics."""
        with self._lock:
            writer, self._writer, self._factory = self._writer, None, None
        if writer is None:
            return None
        writer.close()
        return writer.statistics()


def telemetry_writer(directory: str, hostname: str | None, pid: int) -> Any:
    """A :class:`~celery_fair.telemetry.TelemetryWriter` (imports pyarrow, so only when needed)."""
    from ..telemetry import TelemetryWriter

    return TelemetryWriter(directory, hostname=hostname, pid=pid)
