"""The workload app, with one dependency changed the way a release might change it.

``CELERY_FAIR_COMPAT_FAKE`` chooses the change:

* ``renamed-fetch``: the broker scheme ``fairrenamed://`` is Kombu's Redis
  transport with ``Channel._q_for_pri``'s parameters renamed
  (:mod:`tests.integration.compat_transport`): Kombu still works, the probe
  must take the fallback;
* ``renamed-waiters``: prefork's semaphore keeps its waiters under another
  name: celery-fair cannot order waiting tasks, and the worker must refuse
  to start, naming the versions, rather than fail at the first waiting task.
"""

from __future__ import annotations

import os

import celery.worker.components as components
from kombu.transport import TRANSPORT_ALIASES

from tests.harness.workload import app

__all__ = ("app",)

FAKE = os.environ.get("CELERY_FAIR_COMPAT_FAKE", "")

if FAKE == "renamed-fetch":
    TRANSPORT_ALIASES["fairrenamed"] = "tests.integration.compat_transport:RenamedParameters"

if FAKE == "renamed-waiters":

    class RenamedWaiters(components.LaxBoundedSemaphore):  # type: ignore[misc]
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self._waiters = self.__dict__.pop("_waiting")

    components.LaxBoundedSemaphore = RenamedWaiters
