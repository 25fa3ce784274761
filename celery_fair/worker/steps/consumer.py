"""The task consumer's channel: DWRR fetch order (Redis) or per-queue windows (AMQP)."""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.utils.log import get_logger

from ... import compat
from ..dispatch import hold_during_drain, wake_while_busy
from ..service import FairService

__all__ = ("FairConsumerStep",)

logger = get_logger(__name__)


class FairConsumerStep(bootsteps.StartStopStep):
    """Installs the DWRR fetch order on the task consumer's channel, at every (re)connection."""

    name = "celery_fair.consumer"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.enabled = getattr(c.controller, "fair", None) is not None

    def start(self, c: Any) -> None:
        service: FairService = c.controller.fair
        if c.task_consumer is None:
            return
        channel = c.task_consumer.channel
        # Before the event loop builds the task handler, which reads them.
        service.quarantine.install(c)
        if compat.backport_immediate_acks(c, service.probe):
            logger.info("celery-fair: tasks acknowledged when they finish (green pool)")
        gate = service.gate
        if service.attach(channel, c.task_consumer.queues):
            if service.settings.prefetch == "auto":
                service.prefetch.adapt_prefetch(c, channel)
            if gate is not None and not compat.runs_inline(c.controller.pool):
                wake_while_busy(c.connection, gate)
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
            if gate is not None and compat.runs_inline(c.controller.pool):
                # solo: order each burst of deliveries before running any.  Not
                # for pools that run tasks concurrently (gevent, eventlet): a
                # task finishing during a blocking drain must start the next.
                hold_during_drain(c.connection, gate)

    def stop(self, c: Any) -> None:
        service: FairService = c.controller.fair
        service.stop_fetching()
        logger.info("celery-fair: statistics at stop %s", service.statistics())
