"""Bootsteps that wire the fair scheduler into a Celery worker."""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.utils.log import get_logger

from .service import FairService
from .settings import FairSettings

__all__ = ("FairConsumerStep", "FairWorkerStep")

logger = get_logger(__name__)


class FairWorkerStep(bootsteps.Step):
    """Validates the settings and creates the worker's :class:`FairService`.

    Runs after the pool is created (it wraps the task dispatch) and, not being
    ``last``, before the consumer that captures ``w.process_task``.
    """

    name = "celery_fair.worker"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, w: Any, fair_weights: str | None = None, **kwargs: Any) -> None:
        super().__init__(w, **kwargs)
        settings = FairSettings.from_conf(w.app.conf, cli_weights=fair_weights)
        concurrency = getattr(w, "max_concurrency", None) or getattr(w, "concurrency", 1) or 1
        w.fair = FairService(settings, concurrency=concurrency)

    def create(self, w: Any) -> None:
        service: FairService = w.fair
        plain = getattr(w.process_task, "__func__", None) is type(w)._process_task
        w._process_task = service.wrap_process_task(w._process_task)
        if plain:
            # Threaded pools call _process_task directly, not via the semaphore.
            w.process_task = w._process_task


class FairConsumerStep(bootsteps.StartStopStep):
    """Installs the DWRR fetch order on the task consumer's channel."""

    name = "celery_fair.consumer"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        service: FairService | None = getattr(c.controller, "fair", None)
        if service is None or c.task_consumer is None:
            return
        channel = c.task_consumer.channel
        if service.attach(channel, c.task_consumer.queues):
            logger.info(
                "celery-fair: DWRR fetch order on %s, weights %s, cost %s",
                ", ".join(service.scheduler.queues) or "(no queues yet)",
                service.scheduler.weights,
                service.settings.cost,
            )
        else:
            logger.warning(
                "celery-fair: transport %r does not poll its queues; fetch order unchanged",
                c.connection.transport.driver_type,
            )

    def stop(self, c: Any) -> None:
        service: FairService | None = getattr(c.controller, "fair", None)
        if service is not None:
            logger.info("celery-fair: statistics at stop %s", service.statistics())
