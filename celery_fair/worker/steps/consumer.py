"""The task consumer's channel: DWRR fetch order (Redis) or per-queue windows (AMQP)."""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.utils.log import get_logger

from ..live_weights import LIVE_WEIGHTS_RECHECK
from ..service import FairService

__all__ = ("FairConsumerStep",)

logger = get_logger(__name__)


class FairConsumerStep(bootsteps.StartStopStep):
    """Connects the service to the task consumer's channel, at every (re)connection.

    What that installs is the service's to decide (:meth:`FairService.connect`).
    On the consumer's timer, every :data:`LIVE_WEIGHTS_RECHECK` seconds, the
    live weights whose time is up go back to the settings' weights.
    """

    name = "celery_fair.consumer"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.enabled = getattr(c.controller, "fair", None) is not None
        self._timer: Any = None

    def start(self, c: Any) -> None:
        service: FairService = c.controller.fair
        service.connect(c)
        if self._timer is None:
            self._timer = c.timer.call_repeatedly(LIVE_WEIGHTS_RECHECK, service.live_weights.expire)

    def stop(self, c: Any) -> None:
        service: FairService = c.controller.fair
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        service.stop_fetching()
        logger.info("celery-fair: statistics at stop %s", service.statistics())
