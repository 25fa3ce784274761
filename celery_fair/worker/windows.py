"""Prefetch windows: per-queue windows on AMQP, and the adaptive window on both brokers.

On a push transport (RabbitMQ) each consumed queue gets its own window, in
the ratio of the weights (:meth:`FairScheduler.push_windows`); with
``fair_prefetch="auto"`` the windows follow the measured round trip and task
time (:mod:`celery_fair.worker.push_prefetch`).  On Redis the adaptive window
is applied in place through Celery's QoS object.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from .. import compat
from ..routing.isolation import NOISY_MESSAGES
from ..scheduling.fetch import window_cap
from ..scheduling.prefetch import AdaptivePrefetch
from ..scheduling.scheduler import FairScheduler
from .attachment import Attachment
from .push_prefetch import PushWindows
from .queue_map import QueueMap
from .settings import FairSettings

__all__ = ("PrefetchWindows",)


class PrefetchWindows:
    """One worker's prefetch windows, fixed or adaptive."""

    def __init__(
        self,
        settings: FairSettings,
        scheduler: FairScheduler,
        lock: threading.RLock,
        attachment: Attachment,
        *,
        probe: compat.Probe,
        concurrency: int,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.lock = lock
        self.attachment = attachment
        self.probe = probe
        self.concurrency = concurrency
        self.clock = clock
        #: The window of each consumed queue (AMQP), or ``{"*": n}`` (adaptive, Redis).
        self.windows: dict[str, int] = {}
        self.adaptive: AdaptivePrefetch | None = None
        self.push: PushWindows | None = None  # adaptive windows on AMQP
        self._qos: Any = None
        self._base_window = 0
        #: Celery's own window, when resources fit the window to what runs at once.
        self._celery_window = 0
        #: Keyed queues on RabbitMQ: the worker's queue map, which knows the lanes.
        self.queue_map: QueueMap | None = None

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
        with self.lock:
            self.scheduler.reset_held()
            # A keyed queue's lanes are that one queue to the scheduler.
            self.scheduler.set_queues(self._logical(q.name) for q in task_consumer.queues)
        # Celery's full window, not the count it lowers for a while after a
        # reconnection: these windows are fixed until the next one.
        total = int(
            getattr(consumer, "max_prefetch_count", 0)
            or getattr(consumer, "initial_prefetch_count", 0)
            or 4 * self.concurrency
        )
        self.windows = self._split(total)
        qos = getattr(consumer, "qos", None)
        compat.probe_amqp_channel(
            channel, qos, self.probe, settlements=self.settings.prefetch == "auto"
        )
        push = self._adapt_push(channel, task_consumer, total)
        clock = self.clock

        def before_consume(queue: str, kwargs: dict[str, Any]) -> None:
            window = self.window_for(queue)
            sent = clock()
            channel.basic_qos(0, window, False)
            if push is not None:
                push.consuming(queue, kwargs, window, clock() - sent)

        compat.wrap_basic_consume(channel, before_consume)
        if compat.consumer_qos_global(consumer):
            channel.basic_qos(0, 0, True)  # 0: no channel-wide limit
        if qos is not None:
            # Celery grows the channel-wide window for ETA tasks; with
            # per-queue windows that would bring the global limit back.
            compat.keep_prefetch_fixed(qos)
        return self.windows

    def _adapt_push(self, channel: Any, task_consumer: Any, total: int) -> PushWindows | None:
        """``fair_prefetch="auto"`` on AMQP: windows re-consumed as estimates move.

        The estimates survive a reconnection; the per-channel accounting
        starts afresh.
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

    def _split(self, total: int) -> dict[str, int]:
        """Celery's window of ``total`` tasks as per-queue windows (``fair_prefetch``)."""
        setting = self.settings.prefetch
        auto = self.scheduler.push_windows(total, cap=window_cap(total))
        if setting is None or setting == "auto":
            return auto
        if isinstance(setting, int):
            return dict.fromkeys(auto, setting)
        assert not isinstance(setting, str)
        return {q: setting.get(q, w) for q, w in auto.items()}

    def _logical(self, name: str) -> str:
        return self.queue_map.logical(name) if self.queue_map is not None else name

    def window_for(self, queue: str) -> int:
        """The prefetch window of ``queue`` (a queue added later gets one too)."""
        parent = self._logical(queue)
        if parent != queue:
            return self.windows.setdefault(queue, self.lane_window(queue, parent))
        window = self.windows.get(queue)
        if window is None:
            with self.lock:
                self.scheduler.set_queues([*self.scheduler.queues, queue])
            window = self.windows[queue] = self._split(sum(self.windows.values()) or 4).get(
                queue, 1
            )
        return window

    def lane_window(self, lane: str, parent: str) -> int:
        """The window of a lane of keyed queue ``parent`` (RabbitMQ).

        The keyed queue's own window, as plain Celery gives the queue, so a
        lane alone keeps the pool as busy as the queue did; a shard lane
        :data:`NOISY_MESSAGES` more.  A flood publishes that many to its shard
        before its producer moves it to a noisy lane; with them all in the
        buffer, a neighbour's task behind them is in the buffer too, where its
        key's turn comes next, instead of waiting behind them on the broker.
        Only backlogged lanes hold messages.
        """
        base = self.window_for(parent)
        lanes = self.queue_map.lanes if self.queue_map is not None else None
        assert lanes is not None
        if lanes.is_shard(parent, lane):
            return base + NOISY_MESSAGES
        return base

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
        fetch = self.attachment.fetch
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

    def attach_resources(self, consumer: Any, channel: Any) -> None:
        """Resources on, Celery's window (no ``fair_prefetch``), Redis: the window will
        count the tasks that fit at once, not the pool's processes (:meth:`fit_to_running`)."""
        qos = getattr(consumer, "qos", None)
        if self.settings.prefetch is not None or not compat.is_redis_channel(channel):
            return
        compat.probe_consumer_qos(qos, self.probe)
        if not self.probe.has("celery.consumer.qos"):
            return
        base = int(getattr(consumer, "initial_prefetch_count", 0) or 4 * self.concurrency)
        self._qos, self._base_window, self._celery_window = qos, base, base

    def fit_to_running(self, at_once: float) -> None:
        """About ``at_once`` tasks fit the worker's capacity together: hold Celery's
        multiplier of them, not of the pool's processes (never more than Celery's window).

        A worker whose tasks wait for room would otherwise hold its whole window
        while it runs a few: tasks another worker could start now.
        """
        qos, celery = self._qos, self._celery_window
        if qos is None or not celery or self.settings.prefetch is not None:
            return
        multiplier = celery / self.concurrency
        wanted = max(1, min(celery, math.ceil(multiplier * at_once)))
        if wanted != self._base_window:
            compat.move_qos_window(qos, self._base_window, wanted)
            self._base_window = wanted
            self.windows = {"*": wanted}

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
