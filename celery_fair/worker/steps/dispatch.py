"""The hand-over of tasks to the pool: DWRR order for tasks that wait for a slot."""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from ... import compat
from ..dispatch import FairGate, install_on_semaphore
from ..service import FairService

__all__ = ("FairDispatchStep",)


class FairDispatchStep(bootsteps.Step):
    """Wraps the worker's dispatch in the tracker's observers and a fair wait.

    After telemetry and metrics (their observers must exist when the chain
    is built) and, not being ``last``, before the consumer step captures
    ``w.process_task``.  prefork waits in its semaphore, whose waiters leave
    in DWRR order; the pools that dispatch directly (threads, solo, gevent,
    eventlet) get a :class:`FairGate`.
    """

    name = "celery_fair.dispatch"
    requires = (
        "celery_fair.worker.steps.telemetry:FairTelemetryStep",
        "celery_fair.worker.steps.metrics:FairMetricsStep",
    )

    def create(self, w: Any) -> None:
        service: FairService = w.fair
        tracker = service.tracker
        # threads, solo, gevent, eventlet: received tasks go straight to the
        # pool (Celery may still create a semaphore for its event loop: unused).
        direct = compat.dispatches_directly(w)
        process = tracker.wrap_dispatch(compat.dispatch_of(w))
        compat.set_dispatch(w, process)
        if direct:
            # No semaphore wait on the way to the pool: add a fair one.
            slots = getattr(w.pool, "limit", None) or getattr(w, "concurrency", 1) or 1
            gate = service.gate = FairGate(service, slots)
            gated = gate.wrap(process, w.pool)
            # Celery's direct process_task is the unwrapped _process_task: it is
            # replaced, not called, or tasks would skip the observers and the gate.
            compat.wrap_process_task(w, lambda _direct: tracker.wrap_receive(gated))
        elif getattr(w, "semaphore", None) is not None:
            # prefork: tasks waiting for a slot wait in the semaphore.
            install_on_semaphore(w.semaphore, service)
            compat.wrap_process_task(w, tracker.wrap_receive)
