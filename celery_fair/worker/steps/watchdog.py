"""The stall watchdog on the consumer's timer (see :mod:`celery_fair.worker.watchdog`)."""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from ... import compat
from ..build import build_watchdog
from ..service import FairService
from ..watchdog import LOOK_EVERY

__all__ = ("FairWatchdogStep",)


class FairWatchdogStep(bootsteps.StartStopStep):
    """Looks at the pool every :data:`~celery_fair.worker.watchdog.LOOK_EVERY` seconds.

    On the consumer's timer: with prefork that is the event loop's thread, the
    one that acquires and releases the pool's semaphore, so a repair never
    races them.  Without the capability (``celery.worker.state_requests``)
    there is no watchdog and the step does nothing; the probe at start said so.
    At each start it also has the prefork pool replace a child as soon as the
    child can be joined (:func:`celery_fair.compat.follow_process_exits`), and
    shrink none a job is on its way to
    (:func:`celery_fair.compat.spare_processes_given_a_job`).
    """

    name = "celery_fair.watchdog"
    requires = ("celery_fair.worker.steps.consumer:FairConsumerStep",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        service: FairService | None = getattr(c.controller, "fair", None)
        self.enabled = service is not None
        self._timer: Any = None

    def start(self, c: Any) -> None:
        # Before the event loop starts (and the pool joins it): a process that
        # exits is replaced as soon as it can be joined (celery#9588).
        compat.follow_process_exits(c.controller.pool, c.controller.fair.probe)
        # ... and --autoscale terminates no process a job is on its way to (celery#2587).
        compat.spare_processes_given_a_job(c.controller.pool, c.controller.fair.probe)
        if self._timer is not None:
            return
        watchdog = build_watchdog(c.controller.fair, c.controller)
        if watchdog is not None:
            self._timer = c.timer.call_repeatedly(LOOK_EVERY, watchdog.look)

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
