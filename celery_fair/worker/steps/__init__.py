"""The bootsteps that wire celery-fair into a Celery worker, one per feature.

In the style of Celery's own (``celery.worker.consumer.heart``): each step
only connects what :mod:`celery_fair.worker.build` made to the worker's
events, and a feature that is off leaves its step out (``enabled``).

Worker blueprint, in the order Celery runs them:

* :class:`FairWorkerStep` (``celery_fair.worker``): validates the settings
  and creates the service, ``w.fair``; probes the worker's hooks;
* :class:`FairTelemetryStep` (``celery_fair.telemetry``): the Parquet writers;
* :class:`FairMetricsStep` (``celery_fair.metrics``): the Prometheus endpoint;
* :class:`FairDispatchStep` (``celery_fair.dispatch``): the observers around
  each hand-over to the pool, and DWRR order for tasks waiting for a slot.

Consumer blueprint, at every (re)connection:

* :class:`FairConsumerStep` (``celery_fair.consumer``): the fetch order or
  per-queue windows on the task channel, bad input kept;
* :class:`FairKeysStep` (``celery_fair.keys``): plain consumers of keyed
  queues warned about, keyed backlogs adopted;
* :class:`FairWatchdogStep` (``celery_fair.watchdog``): tasks that wait while
  a pool process is free, logged, counted and repaired;
* :class:`FairResourcesStep` (``celery_fair.resources``): this worker's
  capacity on the broker, and every worker's summed (``fair_cost="dominant"``).
"""

from __future__ import annotations

from .consumer import FairConsumerStep
from .dispatch import FairDispatchStep
from .errors import StartError
from .keys import FairKeysStep
from .metrics import FairMetricsStep
from .resources import FairResourcesStep
from .service import FairWorkerStep
from .telemetry import FairTelemetryStep
from .watchdog import FairWatchdogStep

__all__ = (
    "CONSUMER_STEPS",
    "WORKER_STEPS",
    "FairConsumerStep",
    "FairDispatchStep",
    "FairKeysStep",
    "FairMetricsStep",
    "FairResourcesStep",
    "FairTelemetryStep",
    "FairWatchdogStep",
    "FairWorkerStep",
    "StartError",
)

#: What :func:`celery_fair.install` adds to ``app.steps["worker"]``.
WORKER_STEPS = (FairWorkerStep, FairTelemetryStep, FairMetricsStep, FairDispatchStep)
#: What :func:`celery_fair.install` adds to ``app.steps["consumer"]``.
CONSUMER_STEPS = (FairConsumerStep, FairKeysStep, FairWatchdogStep, FairResourcesStep)
