"""Prometheus metrics of one worker, served over HTTP by its main process.

Optional: ``fair_metrics_port`` turns it on and needs the ``prometheus``
extra (``pip install celery-fair[prometheus]``).

The hot path stays cheap.  Per task the worker only does what no snapshot
can reconstruct: it counts the task handed to the pool and files its sojourn
(receipt -> dispatch) in a fixed bucket (:class:`DispatchMeter`, a bisect and
three additions under an uncontended lock).  Everything else (weights,
deficits, held and waiting tasks, fetch counts, CoDel counters) is read from
the scheduler's :meth:`~celery_fair.worker.service.FairService.statistics`
when Prometheus scrapes, by a custom collector (:class:`FairCollector`).
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import FairConfigError
from ..keys.gauges import PREFIX, keys_throttled
from ..scheduling.stalls import PLACES
from .capacity import CapacityStatistics

if TYPE_CHECKING:
    from ..keys.serving import KeyStatistics

__all__ = (
    "SOJOURN_BUCKETS",
    "DispatchMeter",
    "FairCollector",
    "MeterStatistics",
    "MetricsServer",
    "require_prometheus_client",
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Upper bounds (seconds) of the sojourn histogram's buckets; +Inf is implied.
SOJOURN_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


@dataclass(frozen=True)
class MeterStatistics:
    """A snapshot of a :class:`DispatchMeter` (per queue)."""

    served: dict[str, int]
    cost: dict[str, float]
    #: Per queue: the count in each bucket (not cumulative), the last one +Inf.
    sojourn_buckets: dict[str, list[int]]
    sojourn_sum: dict[str, float]


class DispatchMeter:
    """Counts the tasks handed to the pool, their cost and their sojourn.

    ``cost_at_dispatch``: in ``"count"`` mode a task costs 1 when it is
    dispatched; in ``"runtime"`` mode its measured run time is added by
    :meth:`charge` when it finishes.  Called from the consumer thread and,
    with ``-P threads``, from pool threads: one lock guards the counters.
    """

    def __init__(
        self, *, cost_at_dispatch: bool = True, buckets: Sequence[float] = SOJOURN_BUCKETS
    ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or list(bounds) != sorted(set(bounds)) or bounds[0] <= 0:
            raise ValueError(f"buckets must be increasing positive numbers, got {buckets!r}")
        self.buckets = bounds
        self.cost_at_dispatch = cost_at_dispatch
        self._lock = threading.Lock()
        self._served: dict[str, int] = {}
        self._cost: dict[str, float] = {}
        self._counts: dict[str, list[int]] = {}
        self._sum: dict[str, float] = {}

    def dispatched(self, queue: str, sojourn: float | None) -> None:
        """A task of ``queue`` went to the pool ``sojourn`` s after its receipt."""
        with self._lock:
            self._served[queue] = self._served.get(queue, 0) + 1
            if self.cost_at_dispatch:
                self._cost[queue] = self._cost.get(queue, 0.0) + 1.0
            if sojourn is None:
                return
            sojourn = max(0.0, sojourn)
            counts = self._counts.get(queue)
            if counts is None:
                counts = self._counts[queue] = [0] * (len(self.buckets) + 1)
                self._sum[queue] = 0.0
            # bisect_left: a value equal to a bound belongs to that bucket (le).
            counts[bisect_left(self.buckets, sojourn)] += 1
            self._sum[queue] += sojourn

    def charge(self, queue: str, cost: float) -> None:
        """Add cost measured after the task ran (runtime mode)."""
        with self._lock:
            self._cost[queue] = self._cost.get(queue, 0.0) + max(0.0, cost)

    def statistics(self) -> MeterStatistics:
        with self._lock:
            return MeterStatistics(
                served=dict(self._served),
                cost=dict(self._cost),
                sojourn_buckets={q: list(c) for q, c in self._counts.items()},
                sojourn_sum=dict(self._sum),
            )


def require_prometheus_client(setting: str = "fair_metrics_port") -> None:
    """Raise :class:`FairConfigError` if ``prometheus_client`` is missing."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise FairConfigError(
            f"{setting} is set but the Python package prometheus_client is not "
            "installed: pip install 'celery-fair[prometheus]'"
        ) from None


#: Keys exported per worker with their own label (the most served).
TOP_KEYS = 10


class FairCollector:
    """A Prometheus collector that reads one worker's state at scrape time.

    ``service`` is the worker's :class:`~celery_fair.worker.service.FairService`
    and ``meter`` its :class:`DispatchMeter`.
    """

    def __init__(self, service: Any, meter: DispatchMeter, *, worker: str = "") -> None:
        self.service = service
        self.meter = meter
        self.worker = worker
        #: The broker reads failing now (each logged once, when it started failing).
        self._broker_away: set[str] = set()

    def describe(self) -> list[Any]:
        # Registering must not run a collection (the worker is not started yet).
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        snapshot = self.service.snapshot()
        stats = snapshot.scheduler
        metered = self.meter.statistics()
        labels = ["worker", "queue"]
        w = self.worker

        def family(kind: Any, name: str, doc: str, values: dict[str, Any]) -> Any:
            return _per_queue(kind, name, doc, w, values)

        cost_unit = {
            "runtime": "seconds of run time",
            "dominant": "dominant shares, in pool slots",
        }.get(stats.cost, "tasks")
        yield family(
            CounterMetricFamily,
            "served_tasks",
            "Tasks handed to the pool, per queue.",
            metered.served,
        )
        yield family(
            CounterMetricFamily,
            "served_cost",
            f"Cost of the tasks handed to the pool, per queue ({cost_unit}).",
            metered.cost,
        )
        yield family(
            CounterMetricFamily,
            "fetched_tasks",
            "Messages fetched from the broker in DWRR order, per queue (polling brokers).",
            dict(stats.fetched),
        )
        yield family(
            GaugeMetricFamily, "weight", "Weight in force, per queue.", dict(stats.weights)
        )
        yield family(
            GaugeMetricFamily,
            "deficit",
            "Fetch DRR deficit, per queue (negative: a post-charged debt).",
            {q.name: q.deficit for q in stats.drr.queues},
        )
        yield family(
            GaugeMetricFamily,
            "held_tasks",
            "Prefetched, unacknowledged messages held, per queue (polling brokers).",
            dict(stats.held),
        )
        yield family(
            GaugeMetricFamily,
            "buffer_tasks",
            "Tasks in the worker's buffer waiting for a pool slot, per queue.",
            dict(stats.waiting),
        )
        codel = snapshot.codel
        yield family(
            CounterMetricFamily,
            "codel_requeued",
            "Stale tasks CoDel sent back to the broker, per queue.",
            dict(codel.requeued_by_queue) if codel is not None else {},
        )
        yield family(
            CounterMetricFamily,
            "codel_rejected",
            "Stale tasks CoDel rejected (dead-lettered), per queue.",
            dict(codel.rejected_by_queue) if codel is not None else {},
        )
        dropping = GaugeMetricFamily(
            f"{PREFIX}_codel_dropping",
            "1 while CoDel finds the buffer stale (0 when off or not dropping).",
            labels=["worker"],
        )
        dropping.add_metric([w], 1.0 if codel is not None and codel.dropping else 0.0)
        yield dropping
        sojourn = HistogramMetricFamily(
            f"{PREFIX}_sojourn_seconds",
            "Time from a task's receipt (or ETA) to its dispatch to the pool, per queue.",
            labels=labels,
        )
        bounds = [*(repr(b) for b in self.meter.buckets), "+Inf"]
        for queue, counts in sorted(metered.sojourn_buckets.items()):
            cumulative, running = [], 0
            for bound, count in zip(bounds, counts, strict=True):
                running += count
                cumulative.append((bound, float(running)))
            sojourn.add_metric([w, queue], cumulative, metered.sojourn_sum[queue])
        yield sojourn
        stalls = CounterMetricFamily(
            f"{PREFIX}_stalls",
            "Tasks found waiting while a pool process was free for fair_stall_after seconds, "
            "by where they waited (buffer: celery-fair's; pool: taken, not started; lost: counted "
            "running on a process that is gone; leases: "
            "a keyed queue's fetch held by a count of key slots the worker does not hold).",
            labels=["worker", "place"],
        )
        stalled = snapshot.stalls
        for place in PLACES:
            stalls.add_metric([w, place], float(stalled.stalls.get(place, 0)))
        yield stalls
        repaired = CounterMetricFamily(
            f"{PREFIX}_stall_repaired_slots",
            "Pool slots the stall watchdog gave back (the worker's count had lost them).",
            labels=["worker"],
        )
        repaired.add_metric([w], float(stalled.repaired))
        yield repaired
        if snapshot.resources is not None:
            yield from self._resources(snapshot.resources)
        if snapshot.keys is not None:
            yield from self._keys(snapshot.keys)

    def _resources(self, resources: CapacityStatistics) -> Iterator[Any]:
        """``fair_capacity``: what the worker can hold and holds now, per resource."""
        from prometheus_client.core import GaugeMetricFamily

        w = self.worker
        capacity = GaugeMetricFamily(
            f"{PREFIX}_resource_capacity",
            "What this worker can hold of each resource (fair_capacity; slots: its pool's "
            "processes; queue:NAME: fair_queue_concurrency).",
            labels=["worker", "resource"],
        )
        held = GaugeMetricFamily(
            f"{PREFIX}_resource_held",
            "What the tasks running on this worker hold of each resource (fair_resources).",
            labels=["worker", "resource"],
        )
        for name, amount in sorted(resources.capacity.items()):
            capacity.add_metric([w, name], float(amount))
            held.add_metric([w, name], float(resources.held.get(name, 0.0)))
        yield capacity
        yield held
        waiting = GaugeMetricFamily(
            f"{PREFIX}_resource_waiting",
            "Tasks taken in fair order that wait for what they declare to be free.",
            labels=["worker"],
        )
        waiting.add_metric([w], float(resources.waiting_for_room))
        yield waiting

    def _keys(self, keys: KeyStatistics) -> Iterator[Any]:
        """Keyed queues: served tasks per queue, and per key for the top keys only.

        Full per-key labels do not scale (a label set per tenant); the worker
        keeps a bounded summary of the keys it served most.
        """
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        served = CounterMetricFamily(
            f"{PREFIX}_keyed_served_tasks",
            "Tasks fetched from a keyed queue, per queue.",
            labels=["worker", "queue"],
        )
        for queue, count in sorted(keys.served.items()):
            served.add_metric([self.worker, queue], float(count))
        yield served
        unkeyed = CounterMetricFamily(
            f"{PREFIX}_keyed_unkeyed_tasks",
            "Tasks fetched from a keyed queue without a key (sent by a producer without "
            "celery-fair, or with the key argument missing), per queue.",
            labels=["worker", "queue"],
        )
        for queue in sorted(keys.served):
            unkeyed.add_metric([self.worker, queue], float(keys.unkeyed.get(queue, 0)))
        yield unkeyed
        top = GaugeMetricFamily(
            f"{PREFIX}_top_key_served_tasks",
            f"Tasks fetched for the {TOP_KEYS} keys this worker served most, per queue and "
            "key (a bounded summary: counts are halved as other keys come and go).",
            labels=["worker", "queue", "key"],
        )
        for queue, key, count in keys.top[:TOP_KEYS]:
            top.add_metric([self.worker, queue, key], float(count))
        yield top
        yield from self._throttling()
        yield from self._pauses()

    def _pauses(self) -> Iterator[Any]:
        """Paused keys (``control fair_key_pause``), read from the broker at scrape."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        controls = self._from_broker("paused keys", self.service.keys.controls)
        if not controls:
            return
        w = self.worker
        yield _per_queue(
            GaugeMetricFamily,
            "keys_paused",
            "Keys paused now, per keyed queue (all workers: read from the broker).",
            w,
            {queue: len(c.paused) for queue, c in controls.items()},
        )
        yield _per_queue(
            CounterMetricFamily,
            "key_paused_seconds",
            "Seconds keys spent paused, summed over keys, the pauses still on until now "
            "included, per keyed queue.",
            w,
            {q: c.paused_seconds + sum(c.paused.values()) for q, c in controls.items()},
        )

    def _throttling(self) -> Iterator[Any]:
        """Per-key limits: how much keys were throttled, read from the broker at scrape.

        Queue-wide counters, and the seconds of the keys throttled longest
        (top keys only, as above). A broker that cannot answer leaves these
        out of this scrape; the worker's own metrics are still served.
        """
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        states = self._from_broker("per-key limits", self.service.keys.limits_state)
        if not states:
            return
        w = self.worker
        yield _per_queue(
            CounterMetricFamily,
            "key_throttled",
            "Times a key was throttled (set aside by its concurrency or rate limit), per "
            "keyed queue (all workers: read from the broker).",
            w,
            {queue: state.throttled_count for queue, state in states.items()},
        )
        yield _per_queue(
            CounterMetricFamily,
            "key_throttled_seconds",
            "Seconds keys spent throttled by their limits, summed over keys, per keyed queue.",
            w,
            {queue: state.throttled_seconds for queue, state in states.items()},
        )
        yield _per_queue(
            GaugeMetricFamily,
            "key_throttled_tasks",
            "Messages waiting in the keys throttled now (they stay on the broker).",
            w,
            {queue: state.throttled_tasks for queue, state in states.items()},
        )
        top = GaugeMetricFamily(
            f"{PREFIX}_top_key_throttled_seconds",
            "Seconds throttled by its limits, for the keys throttled longest.",
            labels=["worker", "queue", "key"],
        )
        for queue, state in sorted(states.items()):
            for key, seconds in state.top_throttled[:TOP_KEYS]:
                top.add_metric([w, queue, key], seconds)
        yield from (keys_throttled(states, worker=w), top)

    def _from_broker(self, what: str, read: Callable[[], T]) -> T | None:
        """``read()``, or None when the broker cannot answer: logged once per outage (a
        warning with the error), and once when it answers again."""
        try:
            found = read()
        except Exception as exc:
            if what not in self._broker_away:
                self._broker_away.add(what)
                logger.warning(
                    "celery-fair metrics: %s not read from the broker (%r); served again "
                    "when it answers",
                    what, exc,
                )  # fmt: skip
            return None
        if what in self._broker_away:
            self._broker_away.discard(what)
            logger.info("celery-fair metrics: %s read from the broker again", what)
        return found


def _per_queue(kind: Any, name: str, doc: str, worker: str, values: dict[str, Any]) -> Any:
    """A metric family with one sample per queue (labels ``worker`` and ``queue``)."""
    metric = kind(f"{PREFIX}_{name}", doc, labels=["worker", "queue"])
    for queue, value in sorted(values.items()):
        metric.add_metric([worker, queue], float(value))
    return metric


class MetricsServer:
    """The HTTP endpoint (``/metrics``) of one worker's main process."""

    def __init__(self, collector: FairCollector, *, port: int, addr: str) -> None:
        self.collector = collector
        self.port = port
        self.addr = addr
        self._server: Any = None

    def check(self) -> None:
        """Fail early, with one line, if the port cannot be bound.

        Called before the pool forks; the real listener is opened in
        :meth:`start`, after it, so that no child process inherits it.
        """
        if self.port == 0:
            return
        import socket

        family = socket.AF_INET6 if ":" in self.addr else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # As the HTTP server will: a port in TIME_WAIT is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.addr, self.port))
            except OSError as exc:
                raise self._error(exc) from None

    def _error(self, exc: OSError) -> Exception:

        return FairConfigError(
            f"fair_metrics_port: cannot listen on {self.addr}:{self.port} "
            f"(fair_metrics_addr={self.addr!r}, fair_metrics_port={self.port!r}): {exc}"
        )

    def start(self) -> int:
        """Listen and serve from a daemon thread; return the port bound."""
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        # The main process's memory and CPU: what an operator watches next to queues.
        ProcessCollector(namespace=PREFIX, registry=registry)
        try:
            self._server, _thread = start_http_server(self.port, addr=self.addr, registry=registry)
        except OSError as exc:
            raise self._error(exc) from exc
        return int(self._server.server_port)

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
