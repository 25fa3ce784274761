"""Assemble a worker's :class:`FairService` from its settings.

What the bootsteps of :mod:`celery_fair.worker.steps` wire into Celery is
built here, with the start-up checks that need the broker or an optional
package: the steps themselves only connect the parts to the worker's events.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ..errors import FairConfigError
from ..keys.publish import register_app
from .metrics import DispatchMeter, FairCollector, MetricsServer, require_prometheus_client
from .service import FairService
from .settings import FairSettings

__all__ = ("build", "build_metrics")


def build(
    app: Any, settings: FairSettings, *, concurrency: int, hostname: str | None = None
) -> FairService:
    """The worker's service.

    Raises :class:`FairConfigError` at start for what cannot work: CoDel's
    ``reject`` without dead-lettering, keyed queues off Redis, telemetry
    without pyarrow.
    """
    service = FairService(settings, concurrency=concurrency, hostname=hostname)
    if settings.codel and settings.codel_action == "reject":
        _check_dead_lettering(app)
    if settings.keys:
        _check_keyed_broker(app, settings)
    if settings.telemetry_dir is not None:
        _require_pyarrow()
    return service


def build_metrics(service: FairService, *, hostname: str | None = None) -> MetricsServer:
    """The (unstarted) metrics server of ``fair_metrics_port``; its meter joins the tracker.

    Raises :class:`FairConfigError` without prometheus_client or on a busy port.
    """
    settings = service.settings
    assert settings.metrics_port is not None
    require_prometheus_client()
    meter = DispatchMeter(cost_at_dispatch=settings.cost == "count")
    service.tracker.meter = meter
    collector = FairCollector(service, meter, worker=hostname or "")
    metrics = MetricsServer(collector, port=settings.metrics_port, addr=settings.metrics_addr)
    metrics.check()
    return metrics


def _require_pyarrow() -> None:
    """Fail at start, with the fix, if the telemetry extra is not installed.

    Only looks for the package: importing it here would load pyarrow (and
    numpy) into the main process, which costs a prefork worker's main
    process CPU on every task; see :class:`~celery_fair.worker.recorder.MainWriter`.
    """
    if importlib.util.find_spec("pyarrow") is None:
        raise FairConfigError(
            "fair_telemetry_dir is set but pyarrow is not installed: "
            "pip install 'celery-fair[telemetry]'"
        )


def _broker_driver(app: Any) -> str:
    """The broker transport's driver type (``redis``, ``amqp`` ...)."""
    from kombu.connection import Connection

    return str(getattr(Connection(app.conf.broker_url).transport, "driver_type", ""))


def _check_keyed_broker(app: Any, settings: FairSettings) -> None:
    """Keyed queues need server-side scripts: Redis only (and Kombu's hooks)."""
    driver = _broker_driver(app)
    if driver != "redis":
        raise FairConfigError(
            f"fair_keys={sorted(settings.keys)!r} needs the Redis broker (keys are served by a "
            f"server-side script); this broker's transport is {driver!r}. On RabbitMQ, spread "
            "the keys over shard queues with ConsistentHashRouter, which can also isolate a "
            "noisy key (isolate=...); see docs/fairness-keys.md"
        )
    # install() registered the app already; again here in case fair_keys was set
    # after it (register_app wraps Kombu's channel, probed, when there are keys).
    register_app(app)


def _check_dead_lettering(app: Any) -> None:
    """``fair_codel_action="reject"`` must not silently drop tasks."""
    driver = _broker_driver(app)
    if driver != "amqp":
        raise FairConfigError(
            "fair_codel_action='reject' needs a broker that dead-letters rejected "
            f"messages (RabbitMQ with a dead-letter exchange); got broker transport "
            f"{driver!r}. Use fair_codel_action='requeue'."
        )
