"""Keyed queues (``fair_keys``): the checks a consumer of keyed queues makes while it runs."""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from ...keys.consumers import warn_about_plain_consumers
from ..build import KEYED_RECHECK, keyed_checks
from ..service import FairService

__all__ = ("KEYED_RECHECK", "FairKeysStep")


class FairKeysStep(bootsteps.StartStopStep):
    """Warns of plain consumers of keyed queues and runs the keyed queues' checks.

    Once per worker start, a warning names the workers that consume a keyed
    queue without celery-fair (they would see no message).  The checks on
    the consumer's timer are :func:`~celery_fair.worker.build.keyed_checks`:
    every :data:`KEYED_RECHECK` seconds a look for keyed backlogs, every
    :data:`~celery_fair.worker.pauses.PAUSED_RECHECK` seconds a read of the
    paused keys (``control fair_key_pause``), whose prefetched tasks go back.
    """

    name = "celery_fair.keys"
    requires = ("celery_fair.worker.steps.consumer:FairConsumerStep",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        service: FairService | None = getattr(c.controller, "fair", None)
        self.enabled = service is not None
        self._warned = False
        self._timers: list[Any] = []

    def start(self, c: Any) -> None:
        service: FairService = c.controller.fair
        if c.task_consumer is None:
            return
        keyed, lanes = service.attachment.keyed, service.queue_map.lanes
        queues = keyed.queues if keyed is not None else lanes.keyed if lanes is not None else ()
        if queues and not self._warned:
            # On RabbitMQ too: a plain worker consumes the queue but none of its lanes.
            self._warned = True
            warn_about_plain_consumers(c.app, queues)
        checks = keyed_checks(service)
        self._timers = [c.timer.call_repeatedly(every, check) for every, check in checks]
        if service.backlog is not None:
            service.backlog.connect()

    def stop(self, c: Any) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers = []

    def shutdown(self, c: Any) -> None:
        service: FairService = c.controller.fair
        if service.backlog is not None:
            service.backlog.disconnect()
