"""The hand-over of tasks to the pool: DWRR order for tasks that wait for a slot."""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from ..build import install_dispatch

__all__ = ("FairDispatchStep",)


class FairDispatchStep(bootsteps.Step):
    """Wraps the worker's dispatch in the tracker's observers and a fair wait.

    After telemetry and metrics (their observers must exist when the chain
    is built) and, not being ``last``, before the consumer step captures
    ``w.process_task``.  What the wait is depends on the pool
    (:func:`~celery_fair.worker.build.install_dispatch`).
    """

    name = "celery_fair.dispatch"
    requires = (
        "celery_fair.worker.steps.telemetry:FairTelemetryStep",
        "celery_fair.worker.steps.metrics:FairMetricsStep",
    )

    def create(self, w: Any) -> None:
        install_dispatch(w.fair, w)
