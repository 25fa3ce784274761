"""Bootsteps that wire the fair scheduler into a Celery worker."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click
from celery import bootsteps, signals
from celery.utils.log import get_logger

from .. import compat
from ..errors import FairConfigError
from ..keys.consumers import warn_about_plain_consumers
from .build import build
from .dispatch import FairGate, install_on_semaphore
from .recorder import PoolRecorder
from .service import FairService
from .settings import FairSettings, unknown_settings
from .tracking import TaskTracker

__all__ = ("FairConsumerStep", "FairWorkerStep", "StartError")

logger = get_logger(__name__)


class StartError(FairConfigError, click.ClickException):
    """A :class:`~celery_fair.errors.FairConfigError` as Celery's command line reports it.

    ``celery worker`` prints a ``click.ClickException`` as one ``Error: ...``
    line and exits with status 1, instead of a traceback.
    """

    def __init__(self, message: str) -> None:
        FairConfigError.__init__(self, message)
        click.ClickException.__init__(self, message)

    def __str__(self) -> str:
        return self.message


@contextmanager
def _one_line_errors() -> Iterator[None]:
    """Report a bad setting or a missing capability found at worker start in one line."""
    try:
        yield
    except StartError:
        raise
    except FairConfigError as exc:
        raise StartError(str(exc)) from None


class FairWorkerStep(bootsteps.StartStopStep):
    """Validates the settings and creates the worker's :class:`FairService`.

    Runs after the pool is created (it wraps the task dispatch) and, not being
    ``last``, before the consumer that captures ``w.process_task``.
    """

    name = "celery_fair.worker"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, w: Any, fair_weights: str | None = None, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        with _one_line_errors():
            settings = FairSettings.from_conf(w.app.conf, cli_weights=fair_weights)
            for message in unknown_settings(w.app.conf):
                logger.warning(message)
            concurrency = getattr(w, "max_concurrency", None) or getattr(w, "concurrency", 1) or 1
            w.fair, self.metrics = build(
                w.app, settings, concurrency=concurrency, hostname=getattr(w, "hostname", None)
            )
        self.recorder: PoolRecorder | None = None  # with telemetry, from create()

    def create(self, w: Any) -> None:
        with _one_line_errors():
            self._create(w)

    def _create(self, w: Any) -> None:
        service: FairService = w.fair
        tracker: TaskTracker = service.tracker
        compat.probe_worker(w, service.probe)
        # threads, solo, gevent, eventlet: received tasks go straight to the
        # pool (Celery may still create a semaphore for its event loop: unused).
        direct = compat.dispatches_directly(w)
        # The tracker reads its writer at call time: the writer is opened in
        # start(), after the pool has forked its children.
        directory = service.settings.telemetry_dir
        if directory is not None:
            tracker.writer = _MainWriter()
            self.recorder = _pool_recorder(
                w, directory, runtime_cost=service.settings.cost == "runtime"
            )
        process = tracker.wrap_dispatch(compat.dispatch_of(w))
        compat.set_dispatch(w, process)
        if direct:
            # No semaphore wait on the way to the pool: add a fair one.
            slots = getattr(w.pool, "limit", None) or getattr(w, "concurrency", 1) or 1
            gate = service.gate = FairGate(service, slots)
            gated = gate.wrap(process, w.pool)
            compat.wrap_process_task(w, lambda _direct: tracker.wrap_receive(gated))
        elif getattr(w, "semaphore", None) is not None:
            # prefork: tasks waiting for a slot wait in the semaphore.
            install_on_semaphore(w.semaphore, service)
            compat.wrap_process_task(w, tracker.wrap_receive)

    def start(self, w: Any) -> None:
        with _one_line_errors():
            self._start(w)

    def _start(self, w: Any) -> None:
        service: FairService = w.fair
        directory = service.settings.telemetry_dir
        if directory is not None:
            hostname = getattr(w, "hostname", None)
            writer = service.tracker.writer
            writer.open(lambda: _telemetry_writer(directory, hostname, os.getpid()))
            recorder = self.recorder
            if recorder is not None:
                # solo/threads run tasks here, in the main process.
                recorder.open(writer)
            signals.task_revoked.connect(service.tracker.on_revoked, weak=False)
            signals.task_failure.connect(service.tracker.on_task_failure, weak=False)
            logger.info("celery-fair: telemetry to %s", directory)
        if self.metrics is not None:
            # Here, after the pool has forked: the HTTP thread lives in the
            # main process only, where the scheduler is.
            port = self.metrics.start()
            logger.info(
                "celery-fair: Prometheus metrics on http://%s:%d/metrics",
                _host(self.metrics.addr),
                port,
            )

    def stop(self, w: Any) -> None:
        self._close(w)

    def shutdown(self, w: Any) -> None:
        self._close(w)

    def _close(self, w: Any) -> None:
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.stop()
        tracker = getattr(getattr(w, "fair", None), "tracker", None)
        writer = getattr(tracker, "writer", None)
        recorder = self.recorder
        if recorder is not None:
            # The pool has stopped: its processes flushed their own records.
            recorder.disconnect()
            recorder.writer = None
        if tracker is not None and isinstance(writer, _MainWriter) and writer.opened:
            signals.task_revoked.disconnect(tracker.on_revoked)
            signals.task_failure.disconnect(tracker.on_task_failure)
            stats = writer.close()
            logger.info("celery-fair: telemetry (main process) %s", stats or "no records")


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


def _telemetry_writer(directory: str, hostname: str | None, pid: int) -> Any:
    from ..telemetry import TelemetryWriter

    return TelemetryWriter(directory, hostname=hostname, pid=pid)


def _pool_recorder(w: Any, directory: str, *, runtime_cost: bool) -> PoolRecorder:
    """A :class:`PoolRecorder` connected to the task and pool-process signals.

    Connected here, before the prefork pool forks, so that every pool process
    (including those started later, ``max_tasks_per_child``) inherits the
    receivers; each pool process opens its own writer when it starts and
    flushes it when it exits.
    """
    hostname = getattr(w, "hostname", None)
    recorder = PoolRecorder(
        lambda pid: _telemetry_writer(directory, hostname, pid),
        hostname=hostname,
        runtime_cost=runtime_cost,
    )
    recorder.connect()
    return recorder


class _MainWriter:
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


#: Seconds between two looks for keyed backlogs on queues fair_keys does not name.
KEYED_RECHECK = 30.0


class FairConsumerStep(bootsteps.StartStopStep):
    """Installs the DWRR fetch order on the task consumer's channel."""

    name = "celery_fair.consumer"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        service: FairService | None = getattr(c.controller, "fair", None)
        if service is None or c.task_consumer is None:
            return
        channel = c.task_consumer.channel
        # Before the event loop builds the task handler, which reads them.
        service.quarantine.install(c)
        if compat.backport_immediate_acks(c, service.probe):
            logger.info("celery-fair: tasks acknowledged when they finish (green pool)")
        if service.keyed is not None and not getattr(self, "_checked_consumers", False):
            # Once per worker start (not at every reconnection).
            self._checked_consumers = True
            warn_about_plain_consumers(c.app, service.keyed.queues)
        if service.attach(channel, c.task_consumer.queues):
            if service.settings.prefetch == "auto":
                service.adapt_prefetch(c, channel)
            if service.cycle is not None and service.cycle.atomic is not None:
                # Keyed messages sent by producers that still have fair_keys.
                self._recheck = c.timer.call_repeatedly(
                    KEYED_RECHECK, service.recheck_keyed_backlogs
                )
            gate = service.gate
            if gate is not None and not compat.runs_inline(c.controller.pool):
                _wake_while_busy(c.connection, gate)
            queues = [q.name for q in c.task_consumer.queues]
            logger.info(
                "celery-fair: DWRR fetch order on %s, weights %s, cost %s",
                ", ".join(queues) or "(no queues)",
                {q: service.scheduler.weight(q) for q in queues},
                service.settings.cost,
            )
        else:
            windows = service.attach_push(c)
            logger.info(
                "celery-fair: per-queue prefetch windows %s, DWRR dispatch, cost %s",
                windows,
                service.settings.cost,
            )
            gate = service.gate
            if gate is not None and compat.runs_inline(c.controller.pool):
                # solo: order each burst of deliveries before running any.  Not
                # for pools that run tasks concurrently (gevent, eventlet): a
                # task finishing during a blocking drain must start the next.
                _hold_during_drain(c.connection, gate)

    def stop(self, c: Any) -> None:
        recheck, self._recheck = getattr(self, "_recheck", None), None
        if recheck is not None:
            recheck.cancel()
        service: FairService | None = getattr(c.controller, "fair", None)
        if service is not None:
            logger.info("celery-fair: statistics at stop %s", service.statistics())


def _hold_during_drain(connection: Any, gate: FairGate) -> None:
    """Collect every delivery already received before dispatching any.

    The solo pool runs a task inline, inside the delivery callback; without
    this the first delivery of a burst would always run first.
    """

    def hold(drain: Any, timeout: float | None, **kwargs: Any) -> Any:
        gate.hold()
        try:
            result = drain(timeout=timeout, **kwargs)
            for _ in range(1000):
                try:
                    drain(timeout=0)
                except (TimeoutError, OSError):
                    break
            return result
        finally:
            gate.open()

    compat.wrap_drain_events(connection, hold)


#: Seconds the consumer's drain may block while the gate has tasks (green pools, Redis).
BUSY_DRAIN = 0.01


def _wake_while_busy(connection: Any, gate: FairGate) -> None:
    """Green pools on Redis: do not sleep in the event loop while tasks free prefetch credit.

    With ``-P gevent``/``eventlet`` Celery's loop blocks in ``drain_events(timeout=2.0)``
    between deliveries.  Plain Celery rarely gets there while busy: a full green pool
    blocks the loop in ``spawn`` instead.  With the gate the loop goes back to the
    drain, and on Redis, once the prefetch window is full, Kombu stops polling the
    fetch connection and waits on its other sockets: the credit that each finished
    task returns goes unseen until the timeout.  Tasks that yield (I/O, sleep) then ran
    at about 5 a second whatever their length (measured with 5 ms tasks, against 280 a
    second here).  While a task is in the pool or waits for a slot, the drain returns
    after :data:`BUSY_DRAIN` at most; an idle worker keeps Celery's timeout.
    """
    waiting = gate.service.scheduler.dispatch

    def drain_briefly_while_busy(drain: Any, timeout: float | None, **kwargs: Any) -> Any:
        if gate.free < gate.slots or len(waiting):
            timeout = BUSY_DRAIN if timeout is None else min(timeout, BUSY_DRAIN)
        return drain(timeout=timeout, **kwargs)

    compat.wrap_drain_events(connection, drain_briefly_while_busy)
