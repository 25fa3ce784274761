"""The worker's fair-scheduling service: the scheduler plus its bookkeeping.

Knows nothing of bootsteps; the steps in :mod:`celery_fair.worker.steps`
only wire it into a worker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from time import monotonic
from typing import TYPE_CHECKING, Any, TypeVar

from .. import compat
from ..errors import FairConfigError
from ..keys import store
from ..keys.layout import KeyedNames
from ..keys.publish import names_for
from ..keys.serving import KeyedServing, KeyStatistics, served_header
from ..kombu.atomic import AtomicFetchStatistics
from ..kombu.cycle import DWRRCycle, connection_errors, install_on_channel
from ..scheduling.fetch import window_cap
from ..scheduling.prefetch import AdaptivePrefetch, PrefetchStatistics
from ..scheduling.scheduler import FairScheduler, SchedulerStatistics
from .push_prefetch import PushWindows, PushWindowsStatistics
from .quarantine import Quarantine, QuarantineStatistics
from .settings import FairSettings, parse_weights
from .shedding import Shedder, ShedderStatistics
from .tracking import TaskTracker

if TYPE_CHECKING:
    from .dispatch import FairGate

__all__ = ("LIVE_WEIGHTS", "FairService")

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Redis hash (under Kombu's key prefix) of queue weights set by ``control fair_weights``.
LIVE_WEIGHTS = "_fair.queue_weights"


class FairService:
    """One worker's scheduler, and the hooks that feed it.

    Owns its collaborators: the :class:`TaskTracker` that feeds it and, with
    CoDel on, the :class:`Shedder`.  ``clock`` is injectable (seconds,
    monotonic) for tests; ``hostname`` names the worker in telemetry.
    """

    def __init__(
        self,
        settings: FairSettings,
        *,
        concurrency: int = 1,
        clock: Callable[[], float] = monotonic,
        hostname: str | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.scheduler = FairScheduler(
            settings.weights,
            cost=settings.cost,
            default_weight=settings.default_weight,
            runtime_quantum=settings.runtime_quantum,
            credit=settings.credit,
            reserve=max(1, concurrency),
        )
        self.lock = threading.RLock()
        self.cycle: DWRRCycle | None = None
        #: The gate of the pools that dispatch directly (threads, solo, green).
        self.gate: FairGate | None = None
        self.tracker = TaskTracker(self, hostname=hostname)
        codel = settings.codel_options
        self.shedder: Shedder | None = None
        if codel is not None:
            self.shedder = Shedder(
                codel, clock=clock, on_returned=self.tracker.returned, queue_of=self.queue_of
            )
        self.adaptive: AdaptivePrefetch | None = None
        self.push: PushWindows | None = None  # adaptive windows on AMQP
        self._qos: Any = None
        self._base_window = 0
        self.windows: dict[str, int] = {}
        self.concurrency = max(1, concurrency)
        self._queue_by_key: dict[str, str] = {}
        self._channel: Any = None  # the task consumer's current channel
        #: What the start-up probes found missing (see :mod:`celery_fair.compat`).
        self.probe = compat.Probe()
        #: Bad input (undecodable, unknown task): parked or sent back, never dropped.
        self.quarantine = Quarantine(
            delay=settings.unknown_task_delay,
            max_returns=settings.unknown_task_max_returns,
            queue_of=self.queue_of,
            clock=clock,
        )
        #: Keyed queues (``fair_keys``), served in fair key order by the fetch script.
        self.keyed: KeyedServing | None = None
        if settings.keys:
            self.keyed = KeyedServing(
                settings.keys,
                default_weight=settings.default_key_weight,
                runtime=settings.cost == "runtime",
                estimate=self.scheduler.fetch_cost,
                limits=settings.key_limits,
                slots=max(1, concurrency),
            )

    # -- consumer side --------------------------------------------------------

    def attach(self, channel: Any, queues: Iterable[Any]) -> bool:
        """Install the DWRR cycle on the task consumer's channel.

        Called at every (re)connection: held counts start from zero because
        the previous channel's unacknowledged messages went back to the broker.
        """
        queues = list(queues)
        self._map_queues(queues)
        with self.lock:
            self.scheduler.reset_held()
        self._channel = channel
        if self.keyed is not None:
            self.keyed.reset()
        if self.settings.atomic_fetch and compat.is_redis_channel(channel):
            self._adopt_keyed_backlogs(channel, [q.name for q in queues])
        self.cycle = install_on_channel(
            channel,
            self.scheduler,
            lock=self.lock,
            atomic=self.settings.atomic_fetch,
            live_channel=lambda: self._channel,
            probe=self.probe,
            keyed=self.keyed,
        )
        if self.settings.keys:
            self._publish_key_weights(channel)
        elif self.keyed is not None and (self.cycle is None or self.cycle.atomic is None):
            logger.error(
                "celery-fair: keyed messages wait on %s but this worker cannot serve them "
                "without the atomic fetch (%s); `celery-fair keys unkey QUEUE` moves them to "
                "the queue's own list",
                ", ".join(sorted(self.keyed.queues)),
                ", ".join(self.probe.missing) or "fair_atomic_fetch is off",
            )
        if self.cycle is not None and compat.is_redis_channel(channel):
            self._adopt_live_weights(channel)
        if self.cycle is not None and self.shedder is not None:
            self._hold_fetch_while_dropping(channel.qos)
        return self.cycle is not None

    def _adopt_keyed_backlogs(self, channel: Any, queues: Iterable[str]) -> None:
        """Serve a keyed backlog on a consumed queue that ``fair_keys`` does not name.

        Messages published with a key wait in per-key lists, which only a
        keyed fetch reads.  After ``fair_keys`` is removed from a worker (a
        roll-back, docs/migrating.md) they would wait for ever; served here
        in fair key order with the default key weight, until they are gone.
        """
        keyed = self.keyed
        known = keyed.queues if keyed is not None else frozenset()
        candidates = [q for q in queues if q not in known]
        if not candidates:
            return
        with compat.redis_client(channel) as client:
            waiting = store.waiting_keyed(client, [names_for(channel, q) for q in candidates])
        found = {q: n for q, n in zip(candidates, waiting, strict=True) if n > 0}
        if not found:
            return
        if keyed is None:
            keyed = self.keyed = KeyedServing(
                (),
                default_weight=self.settings.default_key_weight,
                runtime=self.settings.cost == "runtime",
                estimate=self.scheduler.fetch_cost,
                slots=self.concurrency,
            )
        keyed.adopt(found)
        fetch = self.cycle.atomic if self.cycle is not None else None
        if fetch is not None and fetch.channel is channel:
            fetch.serve_keyed(keyed)
        for queue, count in sorted(found.items()):
            logger.warning(
                "celery-fair: queue %r holds %d message(s) published with a key, but fair_keys "
                "does not name it: they are served in fair key order until none is left "
                "(`celery-fair keys unkey %s` moves them back to the queue's own list)",
                queue, count, queue,
            )  # fmt: skip

    def recheck_keyed_backlogs(self) -> None:
        """Look again for keyed backlogs on the consumed queues (a timer calls this)."""
        channel, cycle = self._channel, self.cycle
        if channel is None or cycle is None or cycle.atomic is None:
            return
        try:
            self._adopt_keyed_backlogs(channel, cycle.items)
        except connection_errors(channel) as exc:
            logger.debug("celery-fair: keyed backlog check skipped (%r)", exc)

    def _publish_key_weights(self, channel: Any) -> None:
        """Write the configured key weights where the fetch script reads them."""
        if self.cycle is None or self.cycle.atomic is None:
            raise FairConfigError(
                f"fair_keys={sorted(self.settings.keys)!r} needs the atomic fetch, which is "
                f"not available here ({', '.join(self.probe.missing) or 'not a Redis channel'})"
            )
        limits = self.settings.key_limits.as_fields()
        with compat.redis_client(channel) as client:
            for queue in self.settings.keys:
                names = names_for(channel, queue)
                store.write_configured_weights(client, names, self.settings.key_weights)
                store.write_configured_limits(client, names, limits)
                store.keyed_again(client, names)
        if self.keyed is not None and self.keyed.limited:
            self.keyed.send_releases = self._send_releases

    def _send_releases(self, releases: list[tuple[str, str]], wake: bool = False) -> None:
        """Free key slots: ``(queue, delivery tag)`` of tasks done with (per-key limits).

        ``wake`` also ends the atomic fetch's idle wait, in the same pipeline.
        """
        channel = self._channel
        if channel is None:
            raise RuntimeError("no channel")
        sep = compat.key_separator(channel)
        leases = [(names_for(channel, q).base, tag) for q, tag in releases]
        fetch = self.cycle.atomic if self.cycle is not None else None
        with compat.redis_client(channel) as client:
            # One round trip per finished task, the wake-up (a repeat is harmless) on it.
            store.RELEASE.pipelined(
                client,
                tuple(store.release_args(sep, leases)),
                also=(lambda pipe: fetch.wake(pipe)) if wake and fetch is not None else None,
            )

    def _on_keyed_queues(
        self, setting: str, action: Callable[[Any, KeyedNames], T]
    ) -> dict[str, T]:
        """``action(client, names)`` on each keyed queue, through the consumer's channel."""
        channel = self._channel
        if self.keyed is None or channel is None:
            raise FairConfigError(f"{setting}: this worker has no keyed queue (fair_keys)")
        with compat.redis_client(channel) as client:
            return {q: action(client, names_for(channel, q)) for q in self.settings.keys}

    def set_key_limits(self, fields: dict[str, str | None]) -> None:
        """Set per-key limits live, on the broker (fields ``c:<key>``, ``r:<key>``)."""
        self._on_keyed_queues(
            "fair_key_limits", lambda client, names: store.set_live_limits(client, names, fields)
        )

    def set_key_weights(self, weights: dict[str, float | None]) -> None:
        """Set key weights live, on the broker (every worker and restart sees them)."""
        self._on_keyed_queues(
            "fair_key_weights",
            lambda client, names: store.set_live_weights(client, names, weights),
        )

    def key_limits_state(self) -> dict[str, store.KeyedLimitsState]:
        """Each keyed queue's limits in force, running counts and keys held back."""
        if self.keyed is None or not self.keyed.limited or self._channel is None:
            return {}
        return self._on_keyed_queues("fair_stats", store.limits_state)

    def key_backlogs(self, top: int = 10) -> dict[str, store.KeyedBacklog]:
        """Each keyed queue's waiting messages and next keys, read from the broker."""
        if self.keyed is None or self._channel is None:
            return {}
        return self._on_keyed_queues(
            "fair_stats", lambda client, names: store.backlog(client, names, top)
        )

    def _hold_fetch_while_dropping(self, qos: Any) -> None:
        """A worker whose buffer CoDel finds stale fetches nothing more."""
        shedder, waiting = self.shedder, self.scheduler.dispatch
        if shedder is not None:
            policy = shedder.policy
            compat.hold_fetch_while(qos, lambda: policy.dropping and len(waiting) > 0)

    def attach_push(self, consumer: Any) -> dict[str, int]:
        """Per-queue prefetch windows on a push transport (AMQP).

        RabbitMQ applies a ``basic.qos(prefetch, global=False)`` to every
        consumer created after it on the channel, so a qos issued just before
        each queue's ``basic.consume`` gives that queue its own window.
        Celery's channel-wide window (``global=True``) is lifted: it would let
        the broker's round-robin push decide what fills the buffer, and the
        shares would flatten.  Returns the windows.
        """
        task_consumer = consumer.task_consumer
        channel = task_consumer.channel
        if compat.drain_events_without_wait(consumer, self.probe):
            # Green pools on Celery 5.7: otherwise every turn of the loop waits
            # 100 ms on the event connection and about ten tasks a second
            # arrive, too few for the dispatch order to matter.
            logger.info("celery-fair: the event connection is read without waiting (green pool)")
        self._map_queues(task_consumer.queues)
        with self.lock:
            self.scheduler.reset_held()
            self.scheduler.set_queues(q.name for q in task_consumer.queues)
        # Celery's full window, not the count it lowers for a while after a
        # reconnection: these windows are fixed until the next one.
        total = int(
            getattr(consumer, "max_prefetch_count", 0)
            or getattr(consumer, "initial_prefetch_count", 0)
            or 4 * self.concurrency
        )
        self.windows = self._windows(total)
        push = self._adapt_push(channel, task_consumer, total)
        basic_consume, clock = channel.basic_consume, self.clock

        def fair_basic_consume(queue: str, *args: Any, **kwargs: Any) -> Any:
            window = self.window_for(queue)
            sent = clock()
            channel.basic_qos(0, window, False)
            if push is not None:
                push.consuming(queue, kwargs, window, clock() - sent)
            return basic_consume(queue, *args, **kwargs)

        channel.basic_consume = fair_basic_consume
        if compat.consumer_qos_global(consumer):
            channel.basic_qos(0, 0, True)  # 0: no channel-wide limit
        qos = getattr(consumer, "qos", None)
        if qos is not None:
            # Celery grows the channel-wide window for ETA tasks; with
            # per-queue windows that would bring the global limit back.
            qos.callback = lambda prefetch_count: None
        return self.windows

    def _adapt_push(self, channel: Any, task_consumer: Any, total: int) -> PushWindows | None:
        """``fair_prefetch="auto"`` on AMQP: windows re-consumed as estimates move.

        See :mod:`celery_fair.worker.push_prefetch`.  The estimates survive a
        reconnection; the per-channel accounting starts afresh.
        """
        if self.settings.prefetch != "auto":
            self.push = None
            return None
        if self.adaptive is None:
            self.adaptive = AdaptivePrefetch(
                slots=self.concurrency,
                minimum=self.concurrency,
                maximum=self.settings.prefetch_max or total,
            )
        cap = window_cap(total)

        def split(adaptive_total: int) -> dict[str, int]:
            return self.scheduler.push_windows(adaptive_total, cap=cap)

        estimates = self.adaptive.statistics()
        if estimates.round_trip is not None and estimates.service is not None:
            # After a reconnection, consume with the window the estimates call for.
            self.windows.update(split(self.adaptive.window()))
        self.push = PushWindows(self.adaptive, self.windows, split, clock=self.clock)
        self.push.attach(channel, task_consumer)
        return self.push

    def _windows(self, total: int) -> dict[str, int]:
        setting = self.settings.prefetch
        auto = self.scheduler.push_windows(total, cap=window_cap(total))
        if setting is None or setting == "auto":
            return auto
        if isinstance(setting, int):
            return dict.fromkeys(auto, setting)
        assert not isinstance(setting, str)
        return {q: setting.get(q, w) for q, w in auto.items()}

    def window_for(self, queue: str) -> int:
        """The prefetch window of ``queue`` (a queue added later gets one too)."""
        window = self.windows.get(queue)
        if window is None:
            with self.lock:
                self.scheduler.set_queues([*self.scheduler.queues, queue])
            window = self.windows[queue] = self._windows(sum(self.windows.values()) or 4).get(
                queue, 1
            )
        return window

    def adapt_prefetch(self, consumer: Any, channel: Any) -> None:
        """``fair_prefetch="auto"`` on a polling transport (Redis).

        The fetch round trip is measured from the send of Kombu's BRPOP to
        its reply; task run times come from the tracker.  The window is
        applied through Celery's QoS object, which changes the channel's
        prefetch count in place: no reconnection.
        """
        qos = getattr(consumer, "qos", None)
        if not compat.is_redis_channel(channel):
            return
        compat.probe_consumer_qos(qos, self.probe)
        if not self.probe.has("celery.consumer.qos"):
            return
        base = int(getattr(consumer, "initial_prefetch_count", 0) or 4 * self.concurrency)
        self.adaptive = AdaptivePrefetch(
            slots=self.concurrency,
            minimum=self.concurrency,
            maximum=self.settings.prefetch_max or base,
        )
        self._qos, self._base_window = qos, base
        fetch = self.cycle.atomic if self.cycle is not None else None
        if fetch is not None:
            # The atomic fetch times only fetches that returned a message.
            fetch.on_fetch = self.adaptive.observe_fetch
            return
        read, clock = compat.fetch_read(channel), self.clock
        sent: list[float | None] = [None]

        def fetch_sent() -> None:
            sent[0] = clock()

        def fair_brpop_read(**options: Any) -> Any:
            started, sent[0] = sent[0], None
            result = read(**options)
            if started is not None and self.adaptive is not None:
                self.adaptive.observe_fetch(clock() - started)
            return result

        compat.wrap_fetch_start(channel, fetch_sent)
        compat.replace_fetch_read(channel, fair_brpop_read)

    def observe_service(self, runtime: float) -> None:
        """A task ran for ``runtime`` s: resize the adaptive window if needed."""
        adaptive = self.adaptive
        if adaptive is None:
            return
        adaptive.observe_service(runtime)
        wanted = adaptive.window()
        if self.push is not None:
            self.push.resize(wanted)
            return
        qos = self._qos
        if wanted != self._base_window and qos is not None:
            compat.move_qos_window(qos, self._base_window, wanted)
            self._base_window = wanted
            self.windows = {"*": wanted}

    def _map_queues(self, queues: Iterable[Any]) -> None:
        self._queue_by_key = {}
        for queue in queues:
            self._queue_by_key.setdefault(queue.routing_key or queue.name, queue.name)
            self._queue_by_key.setdefault(queue.name, queue.name)

    def queue_of(self, request: Any) -> str | None:
        """The consumed queue a request came from (by its routing key)."""
        info = getattr(request, "delivery_info", None) or {}
        key = info.get("routing_key")
        return self._queue_by_key.get(key) if key is not None else None

    def key_of(self, request: Any, queue: str) -> str | None:
        """A keyed queue's request: the key it was served as; else None."""
        keyed = self.keyed
        if keyed is None or queue not in keyed.queues or request is None:
            return None
        served = served_header(compat.request_headers(request))
        return str(served[0]) if isinstance(served, list) and served else ""

    # -- worker side ----------------------------------------------------------

    def set_weights(self, weights: dict[str, float], *, reset: Iterable[str] = ()) -> None:
        """Change weights at run time; they act on the very next fetch.

        ``reset``: queues that go back to their configured weight.  On Redis
        the change is also stored on the broker (:data:`LIVE_WEIGHTS`), where
        a worker that starts later finds it.
        """
        settings = self.settings
        back = {q: settings.weights.get(q, settings.default_weight) for q in reset}
        with self.lock:
            self.scheduler.set_weights({**weights, **back})
        channel = self._channel
        if channel is not None and compat.is_redis_channel(channel):
            key = compat.key_prefix(channel) + LIVE_WEIGHTS
            with compat.redis_client(channel) as client:
                pipe = client.pipeline(transaction=True)
                if weights:
                    pipe.hset(key, mapping={q: repr(float(w)) for q, w in weights.items()})
                if back:
                    pipe.hdel(key, *back)
                pipe.execute()

    def clear_live_weights(self) -> None:
        """Every queue back to its configured weight; on Redis, the stored live weights go."""
        settings = self.settings
        with self.lock:
            live = set(self.scheduler.queues) | set(settings.weights)
            self.scheduler.set_weights(
                {q: settings.weights.get(q, settings.default_weight) for q in live}
            )
        channel = self._channel
        if channel is not None and compat.is_redis_channel(channel):
            with compat.redis_client(channel) as client:
                client.delete(compat.key_prefix(channel) + LIVE_WEIGHTS)

    def _adopt_live_weights(self, channel: Any) -> None:
        """Redis: weights set by ``control fair_weights`` earlier, kept on the broker."""
        key = compat.key_prefix(channel) + LIVE_WEIGHTS
        with compat.redis_client(channel) as client:
            stored = client.hgetall(key)
        if not stored:
            return
        live = parse_weights(
            {store.text(q): store.text(w) for q, w in stored.items()}, setting=f"{key} (Redis)"
        )
        with self.lock:
            self.scheduler.set_weights(live)
        logger.info("celery-fair: weights set live earlier, from the broker: %s", live)

    def snapshot(self) -> WorkerStatistics:
        """The scheduler's state and every part's counters, as a frozen record."""
        window = self.cycle.window() if self.cycle is not None else None
        with self.lock:
            scheduler = self.scheduler.statistics(window)
        fetch = self.cycle.atomic if self.cycle is not None else None
        return WorkerStatistics(
            scheduler=scheduler,
            prefetch_windows=dict(self.windows),
            codel=self.shedder.statistics() if self.shedder is not None else None,
            adaptive_prefetch=(self.adaptive.statistics() if self.adaptive is not None else None),
            push_windows=self.push.statistics() if self.push is not None else None,
            atomic_fetch=fetch.statistics() if fetch is not None else None,
            compat_fallbacks=dict(self.probe.missing),
            keys=self.keyed.statistics() if self.keyed is not None else None,
            bad_input=self.quarantine.statistics(),
        )

    def statistics(self) -> dict[str, object]:
        """:meth:`snapshot` as plain data (``inspect fair_stats``)."""
        return self.snapshot().as_dict()


@dataclass(frozen=True)
class WorkerStatistics:
    """A snapshot of a worker's :class:`FairService` (``inspect fair_stats``, metrics)."""

    scheduler: SchedulerStatistics
    prefetch_windows: Mapping[str, int]
    codel: ShedderStatistics | None
    adaptive_prefetch: PrefetchStatistics | None
    push_windows: PushWindowsStatistics | None
    atomic_fetch: AtomicFetchStatistics | None
    compat_fallbacks: Mapping[str, str]
    keys: KeyStatistics | None
    bad_input: QuarantineStatistics

    def as_dict(self) -> dict[str, object]:
        """JSON-friendly nested data: the scheduler's fields at the top level."""
        stats = self.scheduler.as_dict()
        stats["prefetch_windows"] = dict(self.prefetch_windows)
        stats["codel"] = self.codel.as_dict() if self.codel is not None else None
        adaptive: dict[str, Any] | None = None
        if self.adaptive_prefetch is not None:
            adaptive = asdict(self.adaptive_prefetch)
            if self.push_windows is not None:
                adaptive.update(asdict(self.push_windows))
        if adaptive is not None:
            stats["adaptive_prefetch"] = adaptive
        stats["atomic_fetch"] = asdict(self.atomic_fetch) if self.atomic_fetch else None
        stats["compat_fallbacks"] = dict(self.compat_fallbacks)
        stats["keys"] = asdict(self.keys) if self.keys is not None else None
        stats["bad_input"] = asdict(self.bad_input)
        return stats
