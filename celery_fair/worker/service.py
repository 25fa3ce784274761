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
from typing import Any

from .. import compat
from ..errors import FairConfigError
from ..keys.lanes import LEVEL_STEPS, KeyLanes, priority_rank
from ..keys.pause_events import WEIGHT, parked_lane
from ..keys.pause_log import PauseLog
from ..keys.serving import KeyStatistics, level_weights
from ..keys.token_client import TokenClient
from ..kombu.atomic import AtomicFetchStatistics
from ..kombu.cycle import install_on_channel
from ..kombu.full import FullBroker, FullBrokerStatistics
from ..scheduling.prefetch import PrefetchStatistics
from ..scheduling.scheduler import FairScheduler, SchedulerStatistics
from ..scheduling.stalls import StallStatistics, StallWatch
from .attachment import Attachment
from .backlog import BacklogReleases
from .capacity import CapacityStatistics, ResourceGate
from .dispatch import FairGate, close_during_drain, wake_while_busy
from .key_tokens import KeyTokenGate, TokenStatistics
from .keyed_admin import KeyedAdmin
from .live_weights import LIVE_WEIGHTS, LaneKeyWeights, LiveWeights
from .pauses import PausedKeys
from .push_prefetch import PushWindowsStatistics
from .quarantine import Quarantine, QuarantineStatistics
from .queue_map import QueueMap
from .settings import FairSettings
from .shedder import Shedder, ShedderStatistics
from .tracking import TaskTracker
from .windows import PrefetchWindows

__all__ = ("LIVE_WEIGHTS", "FairService")

logger = logging.getLogger(__name__)


class FairService:
    """One worker's scheduler, and the collaborators that feed and steer it.

    Each job is a collaborator of its own: the :class:`TaskTracker` that
    feeds the scheduler, the :class:`Shedder` (CoDel on), the
    :class:`Quarantine` for bad input, :class:`KeyedAdmin` for keyed queues on
    the broker, :class:`LiveWeights` for weights changed at run time and
    :class:`PrefetchWindows` for the prefetch windows.  They share the
    :class:`Attachment` (the consumer's live channel and cycle) and the
    :class:`QueueMap` (which consumed queue a request came from).  Callers
    use these parts directly; the service itself only does what spans
    several of them.  ``clock`` is
    injectable (seconds, monotonic) for tests; ``hostname`` names the worker
    in telemetry.
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
        self.concurrency = max(1, concurrency)
        self.scheduler = FairScheduler(
            settings.weights,
            cost=settings.cost,
            default_weight=settings.default_weight,
            runtime_quantum=settings.runtime_quantum,
            credit=settings.credit,
            reserve=self.concurrency,
        )
        # A queue at its fair_queue_concurrency is polled last (its credit is capped).
        self.scheduler.fetch.limits = dict(settings.queue_concurrency)
        self.lock = threading.RLock()
        #: The gate of the pools that dispatch directly (threads, solo, green).
        self.gate: FairGate | ResourceGate | None = None
        #: Per-key limits on RabbitMQ (:meth:`limit_by_tokens`).
        self.tokens: KeyTokenGate | None = None
        #: Keyed queues on RabbitMQ: capped tasks free their places as they arrive.
        self.backlog: BacklogReleases | None = None
        #: What the start-up probes found missing (see :mod:`celery_fair.compat`).
        self.probe = compat.Probe()
        #: The pool never reports tasks running at a connection loss (set at start,
        #: see :func:`celery_fair.compat.pool_forgets_running_tasks`).
        self.pool_forgets_running = False
        self.attachment = Attachment()
        #: The consumed queue (and a keyed queue's key) of each request.
        self.queue_map = QueueMap(self.attachment)
        #: Tasks that wait while a pool process is free (see :mod:`.watchdog`).
        self.stalls = StallWatch(settings.stall_after)
        #: What the worker did because its broker was full (Redis at maxmemory).
        self.full = FullBroker(clock)
        self.tracker = TaskTracker(self, hostname=hostname)
        codel = settings.codel_options
        self.shedder: Shedder | None = None
        #: Paused keys of the keyed queues (their prefetched tasks go back).
        self.pauses = PausedKeys()
        if codel is not None:
            self.shedder = Shedder(
                codel,
                clock=clock,
                on_returned=self.tracker.returned,
                queue_of=self.queue_map.queue_of,
            )
        #: Bad input (undecodable, unknown task): parked or sent back, never dropped.
        self.quarantine = Quarantine(
            delay=settings.unknown_task_delay,
            max_returns=settings.unknown_task_max_returns,
            queue_of=self.queue_map.queue_of,
            clock=clock,
        )
        self.keys = KeyedAdmin(
            settings, self.scheduler, self.attachment, probe=self.probe, slots=self.concurrency
        )
        #: Keyed queues (``fair_keys``), served in fair key order by the fetch script.
        self.attachment.keyed = self.keys.serving()
        self.live_weights = LiveWeights(
            settings, self.scheduler, self.lock, self.attachment, clock=clock
        )
        #: Key weights of keyed queues on RabbitMQ, applied in this worker's buffer.
        self.lane_key_weights = LaneKeyWeights(settings.key_weights, settings.default_key_weight)
        self.prefetch = PrefetchWindows(
            settings,
            self.scheduler,
            self.lock,
            self.attachment,
            probe=self.probe,
            concurrency=self.concurrency,
            clock=clock,
        )

    def use_pause_log(self, log: PauseLog) -> None:
        """Keyed queues on RabbitMQ: pauses from ``log``; a paused key's tasks go to its
        parked lane."""
        self.keys.pause_log = log
        self.pauses.park = parked_lane

    def use_lanes(self, lanes: KeyLanes) -> None:
        """Keyed queues on RabbitMQ: served from their lanes, by key weight.

        Each lane is consumed with a window of its own
        (:meth:`PrefetchWindows.lane_window`); in the buffer a lane's tasks are
        its keyed queue's, taken in weighted fair order over their keys.
        """
        self.queue_map.use_lanes(lanes)
        self.prefetch.queue_map = self.queue_map
        given = self.settings.priority_weights
        if given is not None:
            # Weighted levels: each level has lanes of its own, and the buffer shares
            # the takes between the levels it holds (RabbitMQ's highest first).
            self.queue_map.weighted_levels = True
            weights = level_weights(given, LEVEL_STEPS, highest_first=True)
            by_rank = {
                priority_rank(step): w for step, w in zip(sorted(LEVEL_STEPS), weights, strict=True)
            }
            for queue in lanes.prioritised:
                self.scheduler.dispatch.buffer.set_level_weights(queue, by_rank)
            plain = sorted(lanes.keyed - lanes.prioritised)
            if plain:
                logger.warning(
                    "celery-fair: fair_priority='weighted': keyed queue(s) %s are declared "
                    "without a maximum priority, so their tasks have one level; declare them "
                    "with one (task_queue_max_priority) to weigh priorities (docs/priorities.md)",
                    ", ".join(plain),
                )
        # Nothing of the Redis keyed path: no fetch script, no keyed state to write.
        self.attachment.keyed = None

    def limit_by_tokens(self, client: TokenClient) -> None:
        """Per-key limits on RabbitMQ: a limited key's task starts with its tokens
        (:mod:`celery_fair.worker.key_tokens`), taken on ``client``'s connection."""
        self.tokens = KeyTokenGate(self, self.settings.key_limits, client, slots=self.concurrency)

    # -- consumer side --------------------------------------------------------

    def connect(self, consumer: Any) -> None:
        """The task consumer (re)connected: the fetch order or the per-queue windows
        on its channel, bad input kept, the event loop fitted to the pool, and
        the paused keys read.

        ``consumer`` is Celery's; it may have no task consumer (no queues yet).
        """
        task_consumer = consumer.task_consumer
        if task_consumer is None:
            return
        channel = task_consumer.channel
        # Before the event loop builds the task handler, which reads them.
        self.quarantine.install(consumer)
        if compat.backport_immediate_acks(consumer, self.probe):
            logger.info("celery-fair: tasks acknowledged when they finish (green pool)")
        gate, settings = self.gate, self.settings
        inline = compat.runs_inline(consumer.controller.pool)
        if self.attach(channel, task_consumer.queues):
            if settings.prefetch == "auto":
                self.prefetch.adapt_prefetch(consumer, channel)
            elif settings.resources:
                self.prefetch.attach_resources(consumer, channel)
            if gate is not None and not inline and getattr(gate, "direct", True):
                wake_while_busy(consumer.connection, gate)
            queues = [q.name for q in task_consumer.queues]
            logger.info(
                "celery-fair: DWRR fetch order on %s, weights %s, cost %s",
                ", ".join(queues) or "(no queues)",
                {q: self.scheduler.weight(q) for q in queues},
                settings.cost,
            )
        else:
            windows = self.attach_push(consumer)
            logger.info(
                "celery-fair: per-queue prefetch windows %s, DWRR dispatch, cost %s",
                windows,
                settings.cost,
            )
            if gate is not None and inline:
                # solo: order each burst of deliveries before running any.  Not
                # for pools that run tasks concurrently (gevent, eventlet): a
                # task finishing during a blocking drain must start the next.
                close_during_drain(consumer.connection, gate)
        # After attaching: a keyed backlog found on the channel may add keyed queues.
        # On RabbitMQ the first read takes the whole pause log, before any task
        # of this connection is dispatched.
        if self.attachment.keyed is not None or self.keys.pause_log is not None:
            self.refresh_paused()

    def attach(self, channel: Any, queues: Iterable[Any]) -> bool:
        """Install the DWRR cycle on the task consumer's channel.

        Called at every (re)connection: held counts start from zero because
        the previous channel's unacknowledged messages went back to the broker.
        """
        queues = list(queues)
        self.queue_map.map(queues)
        with self.lock:
            self.scheduler.reset_held()
        attachment = self.attachment
        attachment.channel = channel
        if self.tokens is not None:
            # Tasks aside for tokens went back with the old channel, as Celery's
            # own waiting tasks did; their tokens go back at the next audit.
            self.tokens.reset()
        if attachment.keyed is not None:
            unreported = attachment.keyed.reset(running_unreported=self.pool_forgets_running)
            if unreported:
                logger.warning(
                    "celery-fair: %d task(s) of limited keys were running when the broker "
                    "connection was lost, and this Celery's prefork pool will not report "
                    "their finish (fixed in Celery 5.6.3); their key slots are freed now "
                    "rather than when their leases expire, so those keys may run over "
                    "their limits until these tasks end",
                    unreported,
                )
        if self.settings.atomic_fetch and compat.is_redis_channel(channel):
            self.keys.adopt_backlogs(channel, [q.name for q in queues])
        attachment.cycle = cycle = install_on_channel(
            channel,
            self.scheduler,
            lock=self.lock,
            atomic=self.settings.atomic_fetch,
            live_channel=lambda: attachment.channel,
            probe=self.probe,
            keyed=attachment.keyed,
            full=self.full,
        )
        if self.settings.keys and self.queue_map.lanes is None:
            self.keys.publish_settings(
                channel,
                lambda write, exc: self.full.later(
                    "settings_refused",
                    "the keyed queues' settings are written when it accepts them",
                    write,
                    exc,
                ),
            )
        elif attachment.keyed is not None and attachment.fetch is None:
            logger.error(
                "celery-fair: keyed messages wait on %s but this worker cannot serve them "
                "without the atomic fetch (%s); `celery-fair keys unkey QUEUE` moves them to "
                "the queue's own list",
                ", ".join(sorted(attachment.keyed.queues)),
                ", ".join(self.probe.missing) or "fair_atomic_fetch is off",
            )
        if cycle is not None and compat.is_redis_channel(channel):
            self.live_weights.adopt(channel)
        if cycle is not None and self.shedder is not None:
            self._hold_fetch_while_dropping(channel.qos)
        return cycle is not None

    def stop_fetching(self) -> None:
        """The consumer stops: no fetch follows to carry a key slot's release.

        The releases waiting for one go now, and later ones go at once.
        """
        fetch, keyed = self.attachment.fetch, self.attachment.keyed
        if fetch is not None:
            fetch.stopped = True
        if keyed is not None:
            keyed.flush_releases()

    def set_key_weights(self, weights: dict[str, float | None]) -> str:
        """Set key weights live (None: back to the configured weight); where they act.

        On Redis they are stored on the broker, where every worker's fetch reads
        them; on RabbitMQ they are events of the control log, which every
        worker's buffer follows (:class:`LaneKeyWeights`).
        """
        if self.queue_map.lanes is None:
            self.keys.set_weights(weights)
            return "on the broker"
        log = self.keys.pause_log
        try:
            self.keys.set_weights(weights)
        except FairConfigError:
            if log is None or log.unsupported is None:
                raise
            # No stream queues for the control log: this worker's buffer alone.
            self.lane_key_weights.set(weights)
            return "in this worker (RabbitMQ without stream queues: until it stops)"
        self._follow_live()
        return "on the broker (every worker, those started later too)"

    def pause_keys(self, keys: list[str], queue: str | None, paused: bool) -> dict[str, int]:
        """Pause (or resume) keys on the broker: per keyed queue, how many changed."""
        changed = self.keys.pause(keys, queue, paused)
        for q in changed:
            self.pauses.change(q, keys, paused)
        return changed

    def refresh_paused(self) -> None:
        """Read the paused keys from the broker (a timer calls this); on RabbitMQ the
        control log read has the limits and key weights made live too."""
        paused = self.keys.paused_keys()
        if paused is not None:
            self.pauses.replace(paused)
        self._follow_live()

    def set_key_limits(self, fields: dict[str, str | None]) -> None:
        """Set per-key limits live, on the broker: every worker, those started later too
        (fields ``c:<key>``, ``r:<key>``; None: back to the configured limit)."""
        self.keys.set_limits(fields)
        self._follow_live()

    def _follow_live(self) -> None:
        """Keyed queues on RabbitMQ: the token gate and the buffer's key weights take
        what the control log holds."""
        log = self.keys.pause_log
        if log is None or not log.caught_up:
            return
        live = {q: log.state.live(q) for q in self.settings.keys}
        self.lane_key_weights.replace_live({q: kinds.get(WEIGHT, {}) for q, kinds in live.items()})
        if self.tokens is not None:
            tokens = {
                q: {k: v for k, v in kinds.items() if k != WEIGHT} for q, kinds in live.items()
            }
            self.tokens.set_live(tokens)

    def _hold_fetch_while_dropping(self, qos: Any) -> None:
        """A worker whose buffer CoDel finds stale fetches nothing more."""
        shedder, waiting = self.shedder, self.scheduler.dispatch
        if shedder is not None:
            policy = shedder.policy
            compat.hold_fetch_while(qos, lambda: policy.dropping and len(waiting) > 0)

    def attach_push(self, consumer: Any) -> dict[str, int]:
        """Per-queue prefetch windows on a push transport (AMQP); returns them.

        See :meth:`PrefetchWindows.attach_push`.
        """
        if compat.drain_events_without_wait(consumer, self.probe):
            # Green pools on Celery 5.7: otherwise every turn of the loop waits
            # 100 ms on the event connection and about ten tasks a second
            # arrive, too few for the dispatch order to matter.
            logger.info("celery-fair: the event connection is read without waiting (green pool)")
        self.queue_map.map(consumer.task_consumer.queues)
        return self.prefetch.attach_push(consumer)

    # -- worker side ----------------------------------------------------------

    def snapshot(self) -> WorkerStatistics:
        """The scheduler's state and every part's counters, as a frozen record."""
        cycle = self.attachment.cycle
        window = cycle.window() if cycle is not None else None
        with self.lock:
            scheduler = self.scheduler.statistics(window)
        fetch = self.attachment.fetch
        keyed = self.attachment.keyed
        prefetch = self.prefetch
        return WorkerStatistics(
            scheduler=scheduler,
            prefetch_windows=dict(prefetch.windows),
            codel=self.shedder.statistics() if self.shedder is not None else None,
            adaptive_prefetch=(
                prefetch.adaptive.statistics() if prefetch.adaptive is not None else None
            ),
            push_windows=prefetch.push.statistics() if prefetch.push is not None else None,
            atomic_fetch=fetch.statistics() if fetch is not None else None,
            compat_fallbacks=dict(self.probe.missing),
            keys=keyed.statistics() if keyed is not None else None,
            bad_input=self.quarantine.statistics(),
            stalls=self.stalls.statistics(),
            broker_full=self.full.statistics(),
            resources=self.gate.statistics() if isinstance(self.gate, ResourceGate) else None,
            key_tokens=self.tokens.statistics() if self.tokens is not None else None,
            key_weights_live=(
                self.lane_key_weights.live() if self.queue_map.lanes is not None else None
            ),
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
    stalls: StallStatistics
    broker_full: FullBrokerStatistics
    #: What the worker holds against its capacity (None: resources off).
    resources: CapacityStatistics | None = None
    #: Per-key limits on RabbitMQ: the tokens held and the tasks aside (None: none).
    key_tokens: TokenStatistics | None = None
    #: Keyed queues on RabbitMQ: the key weights set live in this worker (None: not lanes).
    key_weights_live: Mapping[str, float] | None = None

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
        stats["stalls"] = asdict(self.stalls)
        stats["broker_full"] = asdict(self.broker_full)
        stats["resources"] = self.resources.as_dict() if self.resources is not None else None
        stats["key_tokens"] = asdict(self.key_tokens) if self.key_tokens is not None else None
        if self.key_weights_live is not None:
            stats["key_weights_live"] = dict(self.key_weights_live)
        return stats
