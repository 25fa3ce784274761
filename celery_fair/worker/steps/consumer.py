"""The task consumer's channel: DWRR fetch order (Redis) or per-queue windows (AMQP)."""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.utils.log import get_logger

from ..service import FairService

__all__ = ("FairConsumerStep",)

logger = get_logger(__name__)


class FairConsumerStep(bootsteps.StartStopStep):
    """Connects the service to the task consumer's channel, at every (re)connection.

    What that installs is the service's to decide (:meth:`FairService.connect`).
    """

    name = "celery_fair.consumer"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.enabled = getattr(c.controller, "fair", None) is not None

    def start(self, c: Any) -> None:
        service: FairService = c.controller.fair
        service.connect(c)

    def stop(self, c: Any) -> None:
        service: FairService = c.controller.fair
        service.stop_fetching()
        logger.info("celery-fair: statistics at stop %s", service.statistics())
