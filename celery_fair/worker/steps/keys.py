"""Keyed queues (``fair_keys``): the checks a consumer of keyed queues makes while it runs."""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from ...keys.consumers import warn_about_plain_consumers
from ..pauses import PAUSED_RECHECK
from ..service import FairService

__all__ = ("KEYED_RECHECK", "FairKeysStep")

#: Seconds between two looks for keyed backlogs on queues fair_keys does not name.
KEYED_RECHECK = 30.0


class FairKeysStep(bootsteps.StartStopStep):
    """Warns of plain consumers of keyed queues and adopts keyed backlogs it finds.

    Once per worker start, a warning names the workers that consume a keyed
    queue without celery-fair (they would see no message).  While the
    channel has the atomic fetch, every :data:`KEYED_RECHECK` seconds the
    worker looks for keyed messages sent by producers that still have
    ``fair_keys`` for a queue this worker's settings no longer key.  Every
    :data:`~celery_fair.worker.pauses.PAUSED_RECHECK` seconds it reads the
    paused keys (``control fair_key_pause``), whose prefetched tasks go back.
    """

    name = "celery_fair.keys"
    requires = ("celery_fair.worker.steps.consumer:FairConsumerStep",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        service: FairService | None = getattr(c.controller, "fair", None)
        self.enabled = service is not None
        self._warned = False
        self._recheck: Any = None
        self._paused: Any = None

    def start(self, c: Any) -> None:
        service: FairService = c.controller.fair
        if c.task_consumer is None:
            return
        keyed = service.attachment.keyed
        if keyed is not None and not self._warned:
            self._warned = True
            warn_about_plain_consumers(c.app, keyed.queues)
        if service.attachment.fetch is not None:
            self._recheck = c.timer.call_repeatedly(KEYED_RECHECK, service.keys.recheck_backlogs)
        if keyed is not None:
            service.refresh_paused()
            self._paused = c.timer.call_repeatedly(PAUSED_RECHECK, service.refresh_paused)

    def stop(self, c: Any) -> None:
        for timer in (self._recheck, self._paused):
            if timer is not None:
                timer.cancel()
        self._recheck = self._paused = None
