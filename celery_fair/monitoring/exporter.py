"""``celery-fair exporter``: the broker's truth for Prometheus, with or without workers.

Workers export what they did (``fair_metrics_port``); when they scale to
zero, nothing is left to say how much work waits.  Plain exporters and
KEDA's Redis scaler read ``LLEN queue``, which misses a keyed queue's
per-key lists and its priority lists.  This exporter reads the broker at each
scrape (:mod:`celery_fair.monitoring.readings`) and needs no worker:

    celery-fair exporter -A proj                 # the app's queues, on 127.0.0.1:9808
    celery-fair exporter -b redis://... --queues jobs,mail --port 9808 --addr 0.0.0.0
    celery-fair exporter -A proj --once          # print one scrape and exit

Metric names follow Prometheus' conventions, as the worker's metrics do
(:mod:`celery_fair.worker.metrics`); every figure has a ``queue`` label.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..cli_options import add_broker_options, broker_connection
from ..keys.gauges import PREFIX, keys_throttled
from ..keys.lanes import KeyLanes, prioritised
from ..keys.throttling import Throttled
from ..parked import PARKING_SUFFIX

if TYPE_CHECKING:
    # The readers are imported by ``run``: they pull in the keyed queues' Redis
    # scripts and Kombu's transports, and every ``celery-fair`` command imports
    # this module to register ``exporter``.
    from .readings import BrokerMemory, QueueReading

__all__ = ("BrokerCollector", "app_queues", "register", "run")

logger = logging.getLogger(__name__)

#: The exporter's port unless ``--port`` says otherwise.
DEFAULT_PORT = 9808


class BrokerCollector:
    """A Prometheus collector that reads the broker at each scrape.

    ``read()`` returns the queue readings; a failed read is reported as
    ``celery_fair_exporter_up 0`` (and logged), never as an error page, so
    that an alert can fire on it.
    """

    def __init__(
        self,
        read: Callable[[], list[QueueReading]],
        *,
        broker: str,
        memory: Callable[[], BrokerMemory] | None = None,
    ) -> None:
        self.read = read
        #: The broker's memory (Redis): read with the queues, at each scrape.
        self.memory = memory
        self.broker = broker
        self.errors = 0
        self._lock = threading.Lock()  # one read at a time: scrapes may overlap
        #: The last remote-control check: keyed queue -> workers consuming it without
        #: celery-fair (None: not checked).
        self.plain_consumers: dict[str, int] | None = None
        self._memory_refused = False

    def check_consumers(self, app: Any, keyed: Sequence[str], every: float) -> threading.Thread:
        """Ask the workers every ``every`` s which consume a keyed queue without celery-fair."""
        from ..keys.consumers import ask_plain_consumers

        def run() -> None:
            while True:
                try:
                    found = ask_plain_consumers(app, keyed)
                    counts = dict.fromkeys(keyed, 0)
                    for queues in found.values():
                        for queue in queues:
                            counts[queue] += 1
                    self.plain_consumers = counts
                except Exception:  # noqa: BLE001 - a broker away: try again next time
                    logger.warning("celery-fair exporter: asking the workers failed", exc_info=True)
                time.sleep(every)

        thread = threading.Thread(target=run, name="celery-fair-consumers", daemon=True)
        thread.start()
        return thread

    def _read_memory(self, read: Callable[[], BrokerMemory]) -> BrokerMemory | None:
        """The broker's memory, or None: its ACL refuses ``INFO`` (said once), or it failed."""
        from .. import compat

        try:
            return read()
        except Exception as exc:  # noqa: BLE001 - a figure missing, not a crash
            if not compat.not_permitted(exc):
                logger.exception("celery-fair exporter: reading %s's memory failed", self.broker)
                self.errors += 1
                return None
            if not self._memory_refused:
                self._memory_refused = True
                logger.warning(
                    "celery-fair exporter: the broker refuses INFO to this user (%s): no "
                    "broker memory figures (allow it with +info)",
                    exc,
                )
            return None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        started = time.perf_counter()
        memory: BrokerMemory | None = None
        with self._lock:
            try:
                readings: list[QueueReading] | None = self.read()
            except Exception:  # noqa: BLE001 - a broker away is a figure, not a crash
                logger.exception("celery-fair exporter: reading %s failed", self.broker)
                self.errors += 1
                readings = None
            if readings is not None and self.memory is not None:
                memory = self._read_memory(self.memory)
        took = time.perf_counter() - started
        up = GaugeMetricFamily(
            f"{PREFIX}_exporter_up", "1 if the last read of the broker succeeded, else 0."
        )
        up.add_metric([], 0.0 if readings is None else 1.0)
        yield up
        errors = CounterMetricFamily(
            f"{PREFIX}_exporter_errors", "Reads of the broker that failed."
        )
        errors.add_metric([], float(self.errors))
        yield errors
        duration = GaugeMetricFamily(
            f"{PREFIX}_exporter_scrape_duration_seconds",
            "Seconds the last read of the broker took.",
        )
        duration.add_metric([], took)
        yield duration
        if readings is not None:
            yield from families(readings)
        if memory is not None:
            used = GaugeMetricFamily(
                f"{PREFIX}_broker_memory_used_bytes", "Memory the broker (Redis) uses."
            )
            used.add_metric([], float(memory.used))
            limit = GaugeMetricFamily(
                f"{PREFIX}_broker_memory_max_bytes",
                "The broker's maxmemory (Redis; 0: none): full, it refuses every write.",
            )
            limit.add_metric([], float(memory.maxmemory))
            yield from (used, limit)
        counts = self.plain_consumers
        if counts is not None:
            plain = GaugeMetricFamily(
                f"{PREFIX}_keyed_plain_consumers",
                "Workers consuming a keyed queue without celery-fair (they never see its "
                "keyed messages), at the exporter's last check.",
                labels=["queue"],
            )
            for queue, count in sorted(counts.items()):
                plain.add_metric([queue], float(count))
            yield plain


def families(readings: Sequence[QueueReading]) -> Iterator[Any]:
    """The metric families of one read."""
    from prometheus_client.core import GaugeMetricFamily

    def gauge(name: str, doc: str, labels: Sequence[str] = ("queue",)) -> Any:
        return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels))

    backlog = gauge("queue_backlog", "Messages waiting on the broker (priority lists and keys).")
    oldest = gauge(
        "queue_oldest_age_seconds",
        "Seconds the oldest waiting message has waited (messages stamped by celery_fair."
        "install; on a keyed queue, among its largest keys and those next in line).",
    )
    unacked = gauge("queue_unacked", "Messages delivered to workers and not acknowledged.")
    scheduled = gauge(
        "queue_scheduled",
        "Messages in the queue's schedule (fair_eta='broker'; Redis): waiting for their eta, "
        "or due and not yet moved in by a worker's fetch; not in the backlog.",
    )
    consumers = gauge("queue_consumers", "Consumers of the queue (RabbitMQ).")
    parked = gauge(
        "queue_parked", "Messages parked next to the queue, by cause.", ("queue", "reason")
    )
    active = gauge("keyed_active_keys", "Keys of a keyed queue with messages waiting in line.")
    throttled: dict[str, Throttled] = {}
    longest = gauge(
        "keyed_longest_throttled_seconds",
        "Seconds the key throttled longest by its limits has been, now.",
    )
    key_backlog = gauge(
        "key_backlog",
        "Messages waiting, for the keys with the largest backlogs of each keyed queue.",
        ("queue", "key"),
    )
    key_oldest = gauge(
        "key_oldest_age_seconds",
        "Seconds the oldest waiting message of a key has waited, for the largest keys.",
        ("queue", "key"),
    )
    key_scheduled = gauge(
        "key_scheduled",
        "Messages in the schedule (fair_eta='broker'), for the keys with the most there.",
        ("queue", "key"),
    )
    for r in readings:
        backlog.add_metric([r.queue], float(r.backlog))
        for key_name, count in r.scheduled_keys:
            key_scheduled.add_metric([r.queue, key_name], float(count))
        if r.oldest_age is not None:
            oldest.add_metric([r.queue], r.oldest_age)
        if r.unacked is not None:
            unacked.add_metric([r.queue], float(r.unacked))
        if r.consumers is not None:
            consumers.add_metric([r.queue], float(r.consumers))
        if r.scheduled is not None:
            scheduled.add_metric([r.queue], float(r.scheduled))
        for cause, count in sorted(r.parked.items()):
            parked.add_metric([r.queue, cause], float(count))
        keyed = r.keyed
        if keyed is None:
            continue
        if keyed.active_keys is not None:
            active.add_metric([r.queue], float(keyed.active_keys))
        if keyed.throttled is not None:
            throttled[r.queue] = keyed.throttled
            longest.add_metric([r.queue], keyed.longest_throttled or 0.0)
        for key in keyed.top:
            key_backlog.add_metric([r.queue, key.key], float(key.backlog))
            if key.oldest_age is not None:
                key_oldest.add_metric([r.queue, key.key], key.oldest_age)
    yield from (backlog, oldest, unacked, consumers, parked, scheduled, active)
    yield from (keys_throttled(throttled), longest)
    yield from (key_backlog, key_oldest, key_scheduled)


def app_queues(app: Any) -> list[str]:
    """An app's queues: its default queue, ``task_queues``, the fair settings, its routers'."""
    conf = app.conf
    found: list[str] = [conf.task_default_queue or "celery"]
    found += [q.name for q in conf.task_queues or ()]
    for setting in ("fair_weights", "fair_keys"):
        value = conf.get(setting)
        if isinstance(value, dict):
            found += [str(q) for q in value]
        elif isinstance(value, str):
            found += [part.split("=", 1)[0].strip() for part in value.split(",") if "=" in part]
    routes = conf.task_routes or ()
    for route in routes if isinstance(routes, (list, tuple)) else (routes,):
        worker_queues = getattr(route, "worker_queues", None)
        if callable(worker_queues):
            found += worker_queues()
    return list(dict.fromkeys(q for q in found if q))


def register(subparsers: Any) -> None:
    """Add the ``exporter`` subcommand to the ``celery-fair`` parser."""
    parser = subparsers.add_parser(
        "exporter",
        help="serve the broker's queue figures to Prometheus (backlog, age, unacked, keys)",
        description=(
            "Read the broker at each scrape and serve /metrics: per queue the backlog "
            "(keyed and priority lists included), the oldest message's age, the messages in "
            "flight and parked; per keyed queue the active keys, the largest backlogs and "
            "the keys throttled by their limits. Needs no worker."
        ),
    )
    add_broker_options(parser)
    parser.add_argument(
        "--queues", default="", help="queues to read, comma separated (with -A: added to its own)"
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: any free one)")
    parser.add_argument("--addr", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--top", type=int, default=10, help="largest keys per keyed queue")
    parser.add_argument(
        "--unacked-limit",
        type=int,
        default=10_000,
        help="count messages in flight per queue while at most this many are (Redis)",
    )
    parser.add_argument(
        "--rabbitmq-api",
        default=None,
        help="RabbitMQ management API (http://host:15672): adds the unacknowledged counts, "
        "and the vhost's queues are found there (--discover-every)",
    )
    parser.add_argument(
        "--consumers-every",
        type=float,
        default=60.0,
        help="with -A: ask the workers this often (s) which consume a keyed queue without "
        "celery-fair (0: never)",
    )
    parser.add_argument(
        "--discover-every",
        type=float,
        default=60.0,
        help="look for the queues on the broker this often (s), besides the ones named: "
        "Redis's bindings, or RabbitMQ's management API (--rabbitmq-api) (0: only those "
        "named)",
    )
    parser.add_argument("--once", action="store_true", help="print one scrape and exit")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``celery-fair exporter``."""
    from prometheus_client import CollectorRegistry, generate_latest, start_http_server

    from .. import compat
    from .readings import read_rabbitmq, read_redis, read_redis_memory

    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    app = None
    keyed: list[str] = []
    levelled: frozenset[str] = frozenset()  # keyed queues with lanes per priority level
    if args.app:
        from celery.app.utils import find_app

        app = find_app(args.app)
        queues = list(dict.fromkeys(app_queues(app) + queues))
        keyed = list(app.conf.get("fair_keys") or {})
        levelled = prioritised(app, keyed)
    connection = broker_connection(args)
    broker = connection.as_uri()
    memory: Callable[[], BrokerMemory] | None = None  # Redis only
    if compat.is_redis_channel(connection.default_channel):
        channel = connection.default_channel
        named = list(queues)
        looked = [-float("inf")]

        def discover() -> None:
            # Queues named only at the call or by a worker's -Q are bound on the
            # broker, not in the app's settings.
            if args.discover_every > 0 and time.monotonic() - looked[0] >= args.discover_every:
                looked[0] = time.monotonic()
                queues[:] = list(dict.fromkeys(named + compat.declared_queues(channel)))

        discover()

        def read() -> list[QueueReading]:
            discover()
            return read_redis(channel, queues, top=args.top, unacked_limit=args.unacked_limit)

        def read_memory() -> BrokerMemory:
            return read_redis_memory(channel)

        memory = read_memory
    else:
        management = _management(args.rabbitmq_api, connection) if args.rabbitmq_api else None
        listing = (
            _management_queues(args.rabbitmq_api, connection)
            if args.rabbitmq_api and args.discover_every > 0
            else None
        )
        if not queues and listing is None:
            print(
                "celery-fair exporter: no queues: give --queues, -A or --rabbitmq-api",
                file=sys.stderr,
            )
            return 2
        amqp_named = list(queues)
        amqp_looked = [-float("inf")]
        lanes = set(KeyLanes(frozenset(keyed), levelled).parents()) - set(keyed)

        def amqp_discover() -> None:
            # The vhost's queues from the management API: a queue declared only
            # by a producer's call (apply_async(queue="x")) is there too.
            if listing is None or time.monotonic() - amqp_looked[0] < args.discover_every:
                return
            amqp_looked[0] = time.monotonic()
            found = listing()
            if found is not None:
                # A keyed queue's lanes are read with it, not as queues of their own.
                found = [q for q in found if q not in lanes]
                queues[:] = list(dict.fromkeys(amqp_named + found))

        amqp_discover()

        def read() -> list[QueueReading]:
            amqp_discover()
            connection.ensure_connection(max_retries=1)
            return read_rabbitmq(
                connection,
                queues,
                management=management,
                keyed=keyed,
                top_keys=args.top,
                prioritised=levelled,
            )

    registry = CollectorRegistry(auto_describe=False)
    collector = BrokerCollector(read, broker=broker, memory=memory)
    registry.register(collector)
    if app is not None and args.consumers_every > 0 and keyed:
        collector.check_consumers(app, keyed, args.consumers_every)
    if args.once:
        sys.stdout.write(generate_latest(registry).decode())
        return 0
    server, _thread = start_http_server(args.port, addr=args.addr, registry=registry)
    print(
        f"celery-fair exporter: {len(queues)} queue(s) of {broker} on "
        f"http://{args.addr}:{server.server_port}/metrics",
        flush=True,
    )
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    return 0


def _management_get(url: str, connection: Any) -> Callable[[str], Any]:
    """``path -> the JSON`` under the vhost's ``/api/queues/<vhost>`` of the management API.

    Raises ``OSError`` (``URLError``) or ``ValueError`` when it cannot be read.
    """
    import base64
    import json
    import urllib.parse
    import urllib.request

    vhost = urllib.parse.quote(connection.virtual_host or "/", safe="")
    token = base64.b64encode(f"{connection.userid}:{connection.password}".encode()).decode()

    def get(path: str) -> Any:
        request = urllib.request.Request(
            f"{url.rstrip('/')}/api/queues/{vhost}{path}",
            headers={"Authorization": f"Basic {token}"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    return get


def _management(url: str, connection: Any) -> Callable[[str], dict[str, Any] | None]:
    """``queue -> its details`` from the RabbitMQ management API (None when unreachable)."""
    import urllib.parse

    get = _management_get(url, connection)

    def details(queue: str) -> dict[str, Any] | None:
        try:
            found = get("/" + urllib.parse.quote(queue, safe=""))
        except (ValueError, OSError):
            return None
        return found if isinstance(found, dict) else None

    return details


def celery_internal(queue: str) -> bool:
    """Whether ``queue`` is Celery's own or the broker's, not one of the app's work queues.

    Celery's broadcast (``<node>.celery.pidbox``) and remote-control reply
    (``<x>.reply.celery.pidbox``) queues, its event queues (``celeryev.*``),
    server-named queues (``amq.gen-*``; every ``amq.`` name is the broker's),
    and celery-fair's own parking queues (``<queue>.fair-malformed``, read as
    the parked figure of their queue).
    """
    return (
        queue.endswith(".pidbox")
        or queue.startswith(("celeryev.", "amq."))
        or queue.endswith(PARKING_SUFFIX)
        or not queue
    )


def _management_queues(url: str, connection: Any) -> Callable[[], list[str] | None]:
    """``() -> the vhost's queues`` (Celery's own left out; None when unreachable, logged)."""
    get = _management_get(url, connection)

    def listing() -> list[str] | None:
        try:
            found = get("?columns=name&disable_stats=true")
        except (ValueError, OSError) as exc:
            logger.warning(
                "celery-fair exporter: listing the queues from the management API %s failed "
                "(%s): reading the queues found before",
                url,
                exc,
            )
            return None
        if not isinstance(found, list):
            return None
        names = (item.get("name") for item in found if isinstance(item, dict))
        return sorted(n for n in names if isinstance(n, str) and not celery_internal(n))

    return listing
