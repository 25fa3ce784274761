"""Tenants, shards, the compared deployments (modes) and the producer that routes by tenant."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from celery_fair.keys.lanes import KeyLanes
from celery_fair.routing import ConsistentHashRouter, HashRing

__all__ = (
    "AUTO_ISOLATED_QUEUE",
    "ISOLATED_QUEUE",
    "MODES",
    "SHARED_QUEUE",
    "Mode",
    "TenantLayout",
    "TenantProducer",
)

#: The one queue of the "plain Celery, one shared queue" deployment.
SHARED_QUEUE = "shared"
#: The flooding tenant's own queue in the ``fair-isolated`` deployment.
ISOLATED_QUEUE = "heavy"
#: Where the router's automatic isolation sends a noisy tenant (``fair-isolating``).
AUTO_ISOLATED_QUEUE = "fair.isolated"


@dataclass(frozen=True)
class Mode:
    """One deployment being compared.

    ``fair``: the worker runs celery-fair; ``sharded``: tasks are routed by
    tenant onto the shard queues (else every task goes to :data:`SHARED_QUEUE`).
    ``env`` is extra worker environment (see :mod:`tests.harness.workload`).
    ``isolate_flood``: a route placed before the router sends the flooding
    tenant to :data:`ISOLATED_QUEUE`, one of the options for its neighbours.
    ``keyed``: every tenant publishes to :data:`SHARED_QUEUE`, a keyed queue
    (``fair_keys``, Redis only): fairness between tenants inside one queue.
    ``isolate_noisy``: the router isolates a noisy tenant by itself
    (``ConsistentHashRouter(isolate=...)``) to :data:`AUTO_ISOLATED_QUEUE`,
    which the workers consume at a low weight.
    ``broker_eta``: the producer sets ``fair_eta = "broker"`` (Redis only): a
    task with a future eta waits in its queue's schedule on the broker, not in
    the worker (scenario KS).
    """

    name: str
    label: str
    fair: bool
    sharded: bool
    env: Mapping[str, str] = field(default_factory=dict)
    isolate_flood: bool = False
    keyed: bool = False
    isolate_noisy: bool = False
    broker_eta: bool = False


#: The deployments the showcase compares. ``fair-codel`` adds CoDel and the
#: adaptive window (the slow-worker scenario); ``fair`` is DWRR alone.
MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("plain-shared", "plain Celery, one shared queue", fair=False, sharded=False),
        Mode("plain-sharded", "plain Celery, sharded queues", fair=False, sharded=True),
        # fair_prefetch=8 gives each shard's consumer Celery's whole window on
        # RabbitMQ (the default divides it by the 8 queues: 2 each, too few for
        # a lone backlogged queue to hide the broker round trip); Redis ignores it.
        Mode(
            "fair",
            "celery-fair (DWRR)",
            fair=True,
            sharded=True,
            env={"CELERY_FAIR_PREFETCH": "8"},
        ),
        Mode(
            "fair-isolated",
            "celery-fair, flood tenant on its own queue",
            fair=True,
            sharded=True,
            env={"CELERY_FAIR_PREFETCH": "8"},
            isolate_flood=True,
        ),
        Mode(
            "fair-keyed",
            "celery-fair, one queue keyed by tenant",
            fair=True,
            sharded=False,
            env={"CELERY_FAIR_KEYS": f"{SHARED_QUEUE}=tenant_id"},
            keyed=True,
        ),
        # The same worker: every celery-fair fetch promotes due messages, whatever
        # the worker's own fair_eta; only the producer sends to the schedule.
        Mode(
            "fair-keyed-eta",
            'celery-fair, keyed queue, fair_eta="broker"',
            fair=True,
            sharded=False,
            env={"CELERY_FAIR_KEYS": f"{SHARED_QUEUE}=tenant_id"},
            keyed=True,
            broker_eta=True,
        ),
        Mode(
            "fair-isolating",
            "celery-fair, router isolates the noisy tenant",
            fair=True,
            sharded=True,
            env={"CELERY_FAIR_PREFETCH": "8", "CELERY_FAIR_WEIGHTS": f"{AUTO_ISOLATED_QUEUE}=0.25"},
            isolate_noisy=True,
        ),
        Mode(
            "fair-codel",
            "celery-fair (DWRR + CoDel + auto prefetch)",
            fair=True,
            sharded=True,
            env={"CELERY_FAIR_CODEL": "0.02,0.2", "CELERY_FAIR_PREFETCH": "auto"},
        ),
    )
}


@dataclass(frozen=True)
class TenantLayout:
    """Quiet tenants, one flooding tenant and the shard queues they hash onto.

    Tenants are placed by :class:`~celery_fair.routing.ConsistentHashRouter`
    on ``tenant_id``, exactly as a user would route them, so which quiet
    tenants share the flood's shard (its *neighbours*) follows from the hash.
    """

    shards: tuple[str, ...]
    quiet: tuple[str, ...]
    flood: str = "tenant-flood"

    @classmethod
    def build(cls, shards: int = 8, quiet: int = 20, prefix: str = "s") -> TenantLayout:
        """``shards`` queues ``s0..``, ``quiet`` tenants ``tenant-01..`` and ``tenant-flood``."""
        return cls(
            shards=tuple(f"{prefix}{i}" for i in range(shards)),
            quiet=tuple(f"tenant-{i:02d}" for i in range(1, quiet + 1)),
        )

    def router(self, *, isolate: bool = False) -> ConsistentHashRouter:
        """The router a user would configure: ``tenant_id`` -> shard, equal weights.

        ``isolate``: with automatic isolation of a noisy tenant (default thresholds).
        """
        return ConsistentHashRouter(
            list(self.shards), key="tenant_id", isolate=AUTO_ISOLATED_QUEUE if isolate else None
        )

    def shard_of(self, tenant: str) -> str:
        """The shard queue ``tenant``'s tasks are routed to."""
        return HashRing(self.shards).lookup(tenant)

    @property
    def flood_shard(self) -> str:
        """The shard the flooding tenant hashes to."""
        return self.shard_of(self.flood)

    @property
    def neighbours(self) -> tuple[str, ...]:
        """Quiet tenants that share the flood's shard."""
        shard = self.flood_shard
        return tuple(t for t in self.quiet if self.shard_of(t) == shard)

    def queues(self, mode: Mode) -> list[str]:
        """The queues a worker of ``mode`` consumes."""
        if not mode.sharded:
            return [SHARED_QUEUE]
        if mode.isolate_noisy:
            return [*self.shards, AUTO_ISOLATED_QUEUE]
        return [*self.shards, ISOLATED_QUEUE] if mode.isolate_flood else list(self.shards)

    def expected_queue(self, mode: Mode, tenant: str) -> str:
        """Where ``mode`` must have routed ``tenant``'s tasks."""
        if mode.isolate_flood and tenant == self.flood:
            return ISOLATED_QUEUE
        return self.shard_of(tenant) if mode.sharded else SHARED_QUEUE

    def allowed_queues(self, mode: Mode, tenant: str) -> frozenset[str]:
        """Where ``mode`` may have routed ``tenant``'s tasks (isolation moves a noisy one)."""
        expected = self.expected_queue(mode, tenant)
        if mode.isolate_noisy:
            return frozenset((expected, AUTO_ISOLATED_QUEUE))
        if mode.keyed:
            # On RabbitMQ a keyed queue's tasks wait in its lanes (on Redis, in the queue).
            return frozenset((expected, *KeyLanes(frozenset((expected,))).lanes(expected)))
        return frozenset((expected,))

    def isolating_route(self) -> Any:
        """A ``task_routes`` entry sending the flooding tenant to :data:`ISOLATED_QUEUE`.

        Placed before the router, as a user would route one known heavy tenant.
        """
        flood = self.flood

        def route(
            name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
        ) -> dict[str, str] | None:
            return {"queue": ISOLATED_QUEUE} if (kwargs or {}).get("tenant_id") == flood else None

        return route


class TenantProducer:
    """Publishes ``ledger`` tasks for tenants, routed as the mode says.

    A small Celery app of its own (not the workers' app): celery-fair is
    installed on it so every message carries the producer's publish time,
    and in sharded modes its ``task_routes`` is the layout's router.
    Thread-safe: each call acquires a producer from the app's pool.
    """

    def __init__(self, broker_url: str, layout: TenantLayout, mode: Mode) -> None:
        from celery import Celery

        import celery_fair

        self.app = Celery("celery_fair_showcase_producer", broker=broker_url, set_as_current=False)
        self.app.conf.task_create_missing_queues = True
        self.app.conf.broker_connection_retry_on_startup = True
        if mode.sharded and mode.isolate_flood:
            self.app.conf.task_routes = (layout.isolating_route(), layout.router())
        elif mode.sharded:
            self.app.conf.task_routes = (layout.router(isolate=mode.isolate_noisy),)
        else:
            self.app.conf.task_default_queue = SHARED_QUEUE
        if mode.keyed:
            self.app.conf.fair_keys = {SHARED_QUEUE: "tenant_id"}
        if mode.broker_eta:
            self.app.conf.fair_eta = "broker"
        celery_fair.install(self.app)  # stamps the publish time into every message
        self._lock = threading.Lock()

    def send(
        self,
        tenant: str,
        ms: float,
        *,
        producer: Any = None,
        task_id: str | None = None,
        eta: float | None = None,
    ) -> str:
        """Publish one ``ledger(ms, tenant_id=tenant)`` task; returns its id.

        ``eta``: not before this time (epoch seconds), as ``apply_async(eta=...)``.
        """
        when = None if eta is None else datetime.fromtimestamp(eta, timezone.utc)
        result = self.app.send_task(
            "ledger",
            args=(ms,),
            kwargs={"tenant_id": tenant},
            producer=producer,
            task_id=task_id,
            eta=when,
        )
        return str(result.id)

    def burst(self, tenant: str, ms: float, ids: Sequence[str], eta: float | None = None) -> None:
        """Publish one task for ``tenant`` per id in ``ids``, as fast as possible, with ``eta``."""
        with self.app.producer_pool.acquire(block=True) as producer:
            for task_id in ids:
                self.send(tenant, ms, producer=producer, task_id=task_id, eta=eta)

    def declare(self, queues: Sequence[str]) -> None:
        """Declare the queues (so a worker's first poll finds them on every broker)."""
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            for name in queues:
                self.app.amqp.queues[name](channel).declare()

    def close(self) -> None:
        """Release the app's connections."""
        self.app.close()
