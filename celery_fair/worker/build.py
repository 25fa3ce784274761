"""Assemble a worker's :class:`FairService` from its settings, and fit it to the worker.

What the bootsteps of :mod:`celery_fair.worker.steps` wire into Celery is
built and decided here, with the start-up checks that need the broker or an
optional package: the steps themselves only connect the parts to the
worker's events.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Any

from .. import compat
from ..errors import FairConfigError
from ..keys.backlog_counter import BacklogCounter
from ..keys.eta import register_app as eta_register_app
from ..keys.lanes import KeyLanes, consume_lanes, prioritised
from ..keys.pause_log import PauseLog
from ..keys.publish import register_app
from ..keys.releases import CARRY_CHECK
from ..keys.token_client import TokenClient
from ..keys.tokens import check_concurrency
from .backlog import BacklogReleases
from .capacity import Demands, ResourceGate, check_declared, worker_capacity
from .dispatch import FairGate, install_on_semaphore, park_paused
from .key_tokens import AUDIT as TOKEN_AUDIT
from .key_tokens import POLL as TOKEN_POLL
from .metrics import DispatchMeter, FairCollector, MetricsServer, require_prometheus_client
from .pauses import PAUSED_RECHECK
from .service import FairService
from .settings import FairSettings
from .watchdog import PoolWatchdog

logger = logging.getLogger(__name__)

__all__ = (
    "KEYED_RECHECK",
    "build",
    "build_metrics",
    "build_watchdog",
    "check_keyed_broker",
    "install_dispatch",
    "keyed_checks",
)

#: Seconds between two looks for keyed backlogs on queues fair_keys does not name.
KEYED_RECHECK = 30.0


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
        _check_keyed_broker(app, service)
    if settings.eta == "broker":
        _schedule_on_broker(app)
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


def install_dispatch(service: FairService, w: Any) -> None:
    """Wrap the worker's hand-over to the pool in the tracker's observers and a fair wait.

    prefork waits in its semaphore, whose waiters then leave in DWRR order;
    the pools that dispatch directly (threads, solo, gevent, eventlet) get a
    :class:`FairGate` of the service's pool slots.
    """
    tracker = service.tracker
    # threads, solo, gevent, eventlet: received tasks go straight to the
    # pool (Celery may still create a semaphore for its event loop: unused).
    direct = compat.dispatches_directly(w)
    if service.settings.resources:
        _install_resource_gate(service, w, direct=direct)
        return
    process = tracker.wrap_dispatch(compat.dispatch_of(w))
    compat.set_dispatch(w, process)
    tokens = service.tokens
    if direct:
        # No semaphore wait on the way to the pool: add a fair one.
        gate = service.gate = FairGate(service, service.concurrency)
        gated = gate.wrap(process, w.pool)
        if tokens is not None:
            gated = tokens.wrap(gated)
        # Celery's direct process_task is the unwrapped _process_task: it is
        # replaced, not called, or tasks would skip the observers and the gate.
        compat.wrap_process_task(w, lambda _direct: _received(service, gated))
    elif getattr(w, "semaphore", None) is not None:
        # prefork: tasks waiting for a slot wait in the semaphore.
        install_on_semaphore(w.semaphore, service)
        if tokens is not None:
            compat.wrap_process_task(w, lambda sem: _received(service, tokens.wrap(sem)))
        else:
            compat.wrap_process_task(w, lambda sem: _received(service, sem))


def _received(service: FairService, receive: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """What the worker calls on each task it receives: the tracker's stamp, then (on
    RabbitMQ) a paused key's task parked, then ``receive``."""
    return service.tracker.wrap_receive(park_paused(service, receive))


def _install_resource_gate(service: FairService, w: Any, *, direct: bool) -> None:
    """Every pool: tasks reach it through a :class:`ResourceGate` (prefork: before its
    semaphore, which keeps its own FIFO for the rare task that waits there)."""
    settings, tracker = service.settings, service.tracker
    capacity = worker_capacity(settings.capacity, settings.queue_concurrency, service.concurrency)
    check_declared(w.app.tasks, capacity)
    pool = w.pool
    gate = service.gate = ResourceGate(
        service,
        capacity,
        Demands(settings.queue_concurrency),
        pool_size=lambda: compat.pool_processes(pool),
        park=service.quarantine.park_request,
        direct=direct,
    )
    process = tracker.wrap_dispatch(compat.dispatch_of(w))
    compat.set_dispatch(w, process)
    tokens = service.tokens

    def limited(to_pool: Callable[[Any], Any]) -> Callable[[Any], Any]:
        # A limited key's task takes its tokens before it waits for resources.
        return to_pool if tokens is None else tokens.wrap(to_pool)

    if direct:
        gated = limited(gate.wrap(process))
        # As with the slot gate: the direct process_task is replaced, not called.
        compat.wrap_process_task(w, lambda _direct: _received(service, gated))
    else:
        compat.wrap_process_task(
            w, lambda semaphore: _received(service, limited(gate.wrap(semaphore)))
        )
    logger.info(
        "celery-fair: tasks start by what they hold; capacity %s, cost %s",
        {name: amount for name, amount in capacity.items()},
        settings.cost,
    )


def keyed_checks(service: FairService) -> list[tuple[float, Callable[[], None]]]:
    """What a connected consumer of keyed queues runs on its timer: (seconds, call).

    While the channel has the atomic fetch, a look for keyed messages sent
    by producers that still key a queue this worker's settings no longer
    key; while keyed queues are served, a read of the paused keys, and with
    per-key limits the releases no fetch took (:data:`~celery_fair.keys.releases.CARRY_CHECK`).
    """
    checks: list[tuple[float, Callable[[], None]]] = []
    attachment = service.attachment
    tokens = service.tokens
    if tokens is not None:
        checks.extend([(TOKEN_POLL, tokens.poll), (TOKEN_AUDIT, tokens.audit)])
    if attachment.fetch is not None:
        checks.append((KEYED_RECHECK, service.keys.recheck_backlogs))
    if attachment.keyed is not None or service.keys.pause_log is not None:
        checks.append((PAUSED_RECHECK, service.refresh_paused))
    if attachment.keyed is not None and attachment.keyed.limited:
        checks.append((CARRY_CHECK, attachment.keyed.releases.flush_if_stuck))
    return checks


def build_watchdog(service: FairService, w: Any) -> PoolWatchdog | None:
    """The watchdog of the worker's pool, or None without the capability it needs
    (``celery.worker.state_requests``; the probe at start said so)."""
    if not service.probe.has("celery.worker.state_requests"):
        return None
    gate = service.gate
    return PoolWatchdog(
        service,
        service.stalls,
        w.pool,
        semaphore=getattr(w, "semaphore", None) if gate is None else None,
        gate=gate,
    )


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


def _check_keyed_broker(app: Any, service: FairService) -> None:
    """Keyed queues: served by a server-side script on Redis, by lanes on RabbitMQ."""
    settings = service.settings
    driver = check_keyed_broker(app, settings)
    if driver not in ("redis", "amqp"):
        raise FairConfigError(
            f"fair_keys={sorted(settings.keys)!r} needs the Redis or the RabbitMQ broker; this "
            f"broker's transport is {driver!r}. Spread the keys over shard queues with "
            "ConsistentHashRouter instead; see docs/fairness-keys.md"
        )
    if driver == "amqp":
        lanes = KeyLanes(frozenset(settings.keys), prioritised(app, settings.keys))
        service.use_lanes(lanes)
        # Limits may be set live (control fair_key_limits) on keys with none
        # configured: every keyed worker has the gate, idle until a key is limited.
        service.limit_by_tokens(TokenClient(app.connection_for_read))
        if settings.key_limits:
            limits = settings.key_limits
            logger.info(
                "celery-fair: per-key limits on RabbitMQ as limit tokens: concurrency %s, "
                "rates (per second) %s",
                dict(limits.concurrency) or "-", dict(limits.rates) or "-",
            )  # fmt: skip
        # Any producer may cap its keys (fair_key_max_backlog is the producer's):
        # every keyed worker frees the places of the capped tasks it receives.
        service.backlog = BacklogReleases(
            BacklogCounter(app.connection_for_read), service.queue_map
        )
        service.use_pause_log(PauseLog(
            app.connection_for_read,
            {q: app.amqp.queues[q] for q in settings.keys if q in app.amqp.queues},
        ))  # fmt: skip
        added = consume_lanes(app, lanes)
        logger.info(
            "celery-fair: keyed queues on RabbitMQ: %d lane(s) consumed besides %s",
            len(added),
            ", ".join(sorted(settings.keys)),
        )
    # install() registered the app already; again here in case fair_keys was set
    # after it (register_app wraps Kombu's channel, probed, when there are keys).
    register_app(app)


def check_keyed_broker(app: Any, settings: FairSettings) -> str:
    """The keyed settings checked against the broker; returns the driver.

    Redis and RabbitMQ serve everything keyed: on RabbitMQ keys, two-level keys,
    key weights and priority levels (:mod:`celery_fair.keys.lanes`), per-key
    limits (limit tokens, :mod:`celery_fair.keys.tokens`), pauses and backlog
    caps.  What remains checked is the limits' range.  Needs no connection:
    ``celery fair check`` and ``install`` call it too.
    """
    driver = _broker_driver(app)
    if not settings.keys or driver != "amqp":
        return driver
    check_concurrency(settings.key_limits.concurrency, "fair_key_concurrency")
    return driver


def _schedule_on_broker(app: Any) -> None:
    """``fair_eta="broker"``: the worker's own sends (retries) go to the schedule on Redis.

    On another broker the setting changes nothing (Celery's behaviour: the
    worker holds a task until its eta), said once at start.
    """
    driver = _broker_driver(app)
    if driver != "redis":
        logger.warning(
            "celery-fair: fair_eta='broker' applies to the Redis broker only; this broker's "
            "transport is %r, so tasks with an eta wait in the worker, as Celery does "
            "(docs/scheduled.md)",
            driver,
        )
        return
    # install() registered the app already; again here in case fair_eta was set after it.
    eta_register_app(app)


def _check_dead_lettering(app: Any) -> None:
    """``fair_codel_action="reject"`` must not silently drop tasks."""
    driver = _broker_driver(app)
    if driver != "amqp":
        raise FairConfigError(
            "fair_codel_action='reject' needs a broker that dead-letters rejected "
            f"messages (RabbitMQ with a dead-letter exchange); got broker transport "
            f"{driver!r}. Use fair_codel_action='requeue'."
        )
