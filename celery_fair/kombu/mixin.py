"""FairConsumerMixin: a Kombu consumer that serves its queues by weight.

The design's one law: in steady state a queue is consumed exactly as fast
as it is fetched, so weights must act where messages are fetched.  This
consumer therefore gives every queue its own Kombu ``Consumer`` on its own
channel with its own prefetch window (``basic.qos(prefetch_count=window)``:
per consumer on RabbitMQ, per channel on the virtual transports, and one
consumer per channel makes the two the same).  Deliveries land in a small
per-queue buffer that can never hold more than the queue's window, and the
buffers are served in Deficit Weighted Round Robin order (Shreedhar &
Varghese, SIGCOMM 1995) by the same
:class:`~celery_fair.scheduling.dispatch.DispatchRound` that orders a Celery
worker's tasks, with the same cost model and CoDel policy.
Each acknowledgement returns one unit of the queue's window to the broker,
so a queue is fetched exactly as fast as DWRR serves it.

The main loop is event driven: with every buffer empty it blocks in
``Connection.drain_events`` until a delivery arrives; with work buffered it
collects whatever else is already readable (``timeout=0``) and serves one
message.  See :meth:`FairConsumerMixin.consume` for the one timeout it uses.

Its parts, each in a module of its own: the options
(:mod:`~celery_fair.kombu.mixin_options`), the window fill
(:mod:`~celery_fair.kombu.fill`), acknowledgement batching
(:mod:`~celery_fair.kombu.acks`), CoDel on the buffers
(:mod:`~celery_fair.kombu.stale`) and the statistics records
(:mod:`~celery_fair.kombu.mixin_stats`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

from kombu.connection import Connection
from kombu.message import Message
from kombu.messaging import Consumer as KombuConsumer
from kombu.mixins import ConsumerMixin

from ..scheduling.codel import CODEL_ACTIONS, CoDelAction
from ..scheduling.cost import COST_MODES, CostMode, CostModel
from ..scheduling.dispatch import DispatchRound
from ..scheduling.shedding import SheddingPolicy
from .acks import AckBatches
from .fill import Buffered, WindowFill, split_window
from .mixin_options import ERROR_POLICIES, ErrorPolicy, Handler, QueueWeights, check_options
from .mixin_stats import FairConsumerStatistics, FairQueueStatistics
from .stale import admission, hold_fetch_while_dropping

__all__ = (
    "CODEL_ACTIONS",
    "COST_MODES",
    "ERROR_POLICIES",
    "FairConsumerMixin",
    "FairConsumerStatistics",
    "FairQueueStatistics",
    "Handler",
    "split_window",
)

logger = logging.getLogger(__name__)


class FairConsumerMixin(ConsumerMixin):
    """Consume several queues and serve them by weight (DWRR), for plain Kombu.

    Used like :class:`kombu.mixins.ConsumerMixin`: construct it with a
    connection, the queues with their weights and a handler (or subclass it
    and override :meth:`handle`), then call :meth:`run` (in a thread if you
    like) and set :attr:`should_stop` to make it return::

        consumer = FairConsumerMixin(
            Connection("redis://localhost"),
            {"bulk": 1, "interactive": 4},
            handler=lambda queue, body, message: print(queue, body),
        )
        consumer.run()

    ``queues`` maps queue names (or :class:`kombu.Queue` objects) to weights,
    or is a sequence of ``(queue, weight)`` pairs.  While queues stay
    backlogged, queue *i* receives ``weight[i] / sum(weights)`` of the
    messages (``cost="count"``) or of the handler run time (``cost="runtime"``).

    Options (keyword-only, checked here; a bad one raises ValueError naming it):

    * ``handler``: ``handler(queue_name, body, message)``.  When it returns
      the message is acked, unless the handler acked or rejected it itself.
    * ``window``: the total prefetch window, split between queues by weight
      (at least 1 each); default ``25`` per queue.  ``windows`` overrides it
      per queue (``{"bulk": 2}``).
    * ``cost``: ``"count"`` (every message costs 1) or ``"runtime"`` (the
      handler's run time: its queue's average is charged when a message is
      chosen and corrected to the measured time when the handler returns,
      DRR++ as in the worker).
      ``runtime_quantum`` is the seconds of run time the heaviest queue may
      use per DWRR visit.
    * ``on_error``: what a handler exception does to its message: ``"reject"``
      (reject without requeue: dropped, or dead-lettered where the broker is
      set up for it), ``"requeue"`` (back to the queue) or ``"raise"``
      (requeue and let the exception end :meth:`run`).  Every case is logged.
    * ``codel_target``, ``codel_interval``: CoDel (RFC 8289) on the buffered
      messages, off unless both are set (seconds, ``0 < target < interval``).
      A message's sojourn is the time since this consumer received it; when
      the sojourn has stayed at or above the target for an interval, stale
      messages leave the buffer by ``codel_action``: ``"requeue"`` (default:
      a copy goes back to its queue for another consumer, with the header
      ``fair_codel_requeues`` incremented, and the original is acked) or
      ``"reject"`` (reject without requeue: dead-lettered where the queue has
      a dead-letter exchange, dropped otherwise).  A message already sent back
      ``codel_max_requeues`` times (default 3) is handled here instead.
    * ``ack_batch``: on AMQP, acknowledge a queue's handled messages this
      many at a time, with one ``basic.ack`` carrying ``multiple`` (default
      1: each message when its handler returns).  Fewer frames for the
      consumer and the broker to process; the price is that a consumer that
      dies, or loses its connection, has its last unacknowledged handled
      messages (fewer than ``ack_batch`` per queue) redelivered.  A batch is
      at most half its queue's window, so the window keeps refilling, and
      is sent before the consumer waits for deliveries and when it stops.
      Kombu's virtual transports (Redis, in memory) ignore ``multiple``:
      there each message is acknowledged when its handler returns.
    * ``stop_check_interval``: the longest time an idle consumer takes to
      notice :attr:`should_stop` (seconds, default 1).
    * ``clock``: the clock that times handlers and sojourns (``time.monotonic``).
    * ``accept``: content types to accept, as for :class:`kombu.Consumer`.
    """

    def __init__(
        self,
        connection: Connection,
        queues: QueueWeights,
        *,
        handler: Handler | None = None,
        window: int | None = None,
        windows: Mapping[str, int] | None = None,
        cost: CostMode = "count",
        runtime_quantum: float = 0.001,
        on_error: ErrorPolicy = "reject",
        codel_target: float | None = None,
        codel_interval: float | None = None,
        codel_action: CoDelAction = "requeue",
        codel_max_requeues: int = 3,
        ack_batch: int = 1,
        stop_check_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        accept: Iterable[str] | None = None,
    ) -> None:
        self.connection = connection
        options = check_options(
            queues,
            handler=handler,
            handle_overridden=type(self).handle is not FairConsumerMixin.handle,
            window=window,
            windows=windows,
            cost=cost,
            runtime_quantum=runtime_quantum,
            on_error=on_error,
            codel_target=codel_target,
            codel_interval=codel_interval,
            codel_action=codel_action,
            codel_max_requeues=codel_max_requeues,
            ack_batch=ack_batch,
            stop_check_interval=stop_check_interval,
            clock=clock,
            accept=accept,
        )
        self._options = options
        self.cost: CostMode = options.cost
        self.runtime_quantum = options.runtime_quantum
        self.on_error: ErrorPolicy = options.on_error
        self.codel_action: CoDelAction = options.codel_action
        self.codel_max_requeues = options.codel_max_requeues
        self.ack_batch = options.ack_batch
        self.stop_check_interval = options.stop_check_interval
        self._clock = options.clock
        self._codel = (
            None if options.codel is None else SheddingPolicy(options.codel, clock=options.clock)
        )

        # The worker's scheduling core: the cost model gives the quanta (the
        # heaviest queue one cost unit per visit, so no queue is served in
        # bursts longer than about one message and a small window keeps every
        # backlogged queue's buffer non-empty at its turn), and the dispatch
        # round holds (body, message, time received) per queue in DWRR order.
        self._costs = CostModel(options.cost, runtime_quantum=options.runtime_quantum)
        self._round: DispatchRound[Buffered] = DispatchRound(self._costs)
        self._round.set_quanta(self._costs.quanta(options.weights))
        self._in_hand: Message | None = None
        # Guards the round against statistics() readers.
        self._lock = threading.Lock()
        self._fill = WindowFill(
            self._round, self._lock, options.clock, options.windows,
            keep_full=self._codel is not None, on_decode_error=self.on_decode_error,
            accept=options.accept, log=logger,
        )  # fmt: skip
        self._acks = AckBatches(options.ack_batch, self._fill.low_water, log=logger)
        self._acked = dict.fromkeys(options.queues, 0)
        self._failed = dict.fromkeys(options.queues, 0)
        self._idle_waits = 0
        # The next message to handle, in DWRR order, that CoDel lets run.
        self._admit = admission(self._round, self._lock, self._codel, hold=self._hold, log=logger)

    # -- the user's hooks ---------------------------------------------------

    def handle(self, queue: str, body: Any, message: Message) -> None:
        """Process one message of ``queue``; it is acked when this returns."""
        assert self._options.handler is not None
        self._options.handler(queue, body, message)

    def on_decode_error(self, message: Message, exc: Exception) -> None:
        """A body that cannot be decoded is logged and rejected, never handled."""
        logger.error(
            "cannot decode message body (content type %r): %r; rejecting it",
            message.content_type,
            exc,
        )
        message.reject(requeue=False)

    # -- configuration ------------------------------------------------------

    @property
    def weights(self) -> dict[str, float]:
        """The weight of every consumed queue."""
        return dict(self._options.weights)

    @property
    def windows(self) -> dict[str, int]:
        """The prefetch window of every consumed queue."""
        return dict(self._options.windows)

    # -- connection and consumers --------------------------------------------

    @contextmanager
    def Consumer(self) -> Iterator[tuple[Connection, Any, list[Any]]]:  # noqa: N802
        """Connect, and consume every queue on its own channel and window."""
        with self.establish_connection() as conn, ExitStack() as stack:
            self.on_connection_revived()
            self._forget_buffered()
            # Exit callbacks run last-in first-out: consumers are cancelled
            # first, then the buffered messages are requeued, then the
            # channels close.
            channels = {}
            for name in self._options.queues:
                channels[name] = conn.channel()
                stack.callback(_quietly, conn, channels[name].close)
                if self._codel is not None:
                    hold_fetch_while_dropping(channels[name], self._codel, self._round)
            stack.callback(self._requeue_buffered, conn)
            stack.callback(_quietly, conn, self._acks.flush)
            self._acks.start(conn)
            consumers = []
            for name, queue in self._options.queues.items():
                consumer = KombuConsumer(
                    channels[name],
                    queues=[queue],
                    callbacks=[partial(self._fill.deliver, name)],
                    on_decode_error=self.on_decode_error,
                    accept=self._options.accept,
                    # A window per consumer: basic.qos(global=False) before
                    # basic.consume, on a channel of its own.
                    prefetch_count=self._options.windows[name],
                )
                stack.callback(_quietly, conn, consumer.cancel)
                consumers.append(consumer)
            for consumer in consumers:
                consumer.consume()
            self._fill.start(conn, channels)
            stack.callback(self._fill.stop)
            default_channel = conn.default_channel
            yield conn, default_channel, consumers
            self.on_consume_end(conn, default_channel)

    # -- the main loop ---------------------------------------------------------

    def run(self, _tokens: int = 1, **kwargs: Any) -> None:
        """Consume until :attr:`should_stop` is set.

        As :meth:`kombu.mixins.ConsumerMixin.run`: a lost connection is
        logged and re-established (rate limited), and consuming resumes.
        """
        super().run(_tokens, **kwargs)

    def consume(
        self,
        limit: int | None = None,
        timeout: float | None = None,
        safety_interval: float | None = None,
        **kwargs: Any,
    ) -> Iterator[None]:
        """Consume until :attr:`should_stop`; yields after each handled message.

        ``limit`` stops after that many messages; ``timeout`` raises
        ``socket.timeout`` after that long without a delivery.

        With every buffer empty the loop blocks in ``drain_events`` and a
        delivery wakes it (Redis: the reply to a BRPOP; AMQP: a pushed
        basic.deliver).  The wait still has a timeout, ``stop_check_interval``
        (or ``safety_interval``): a thread blocked in a socket read cannot be
        woken by another thread setting :attr:`should_stop`, so the timeout
        bounds how long stopping takes.  It is not a poll for work; at one
        wake-up a second the idle cost is negligible.  Kombu's in-memory
        transport has no sockets and polls inside ``drain_events`` itself.
        """
        interval = self.stop_check_interval if safety_interval is None else safety_interval
        handled = 0
        idle = 0.0
        with self.consumer_context(**kwargs) as (conn, _channel, _consumers):
            while not self.should_stop and (limit is None or handled < limit):
                self.on_iteration()
                if self._round:
                    if self._fill.due():
                        self._fill.collect(conn)
                    self._dispatch_one()
                    handled += 1
                    idle = 0.0
                    yield
                    continue
                self._fill.short = True  # whatever arrives, collect the rest with it
                self._acks.flush()  # the broker refills only acknowledged slots
                try:
                    conn.drain_events(timeout=interval)
                except TimeoutError:  # socket.timeout
                    self._idle_waits += 1
                    conn.heartbeat_check()
                    idle += interval
                    if timeout and idle >= timeout:
                        raise
                except OSError:
                    if not self.should_stop:
                        raise

    def _dispatch_one(self) -> None:
        taken = self._admit()
        if taken is None:
            return
        name, (body, message, _received) = taken
        self._fill.taken(name)
        started = self._clock() if self._costs.runtime else 0.0
        try:
            self.handle(name, body, message)
        except Exception as exc:
            self._handler_failed(name, message, exc)
        else:
            if not message.acknowledged:
                self._acks.ack(name, message)
            self._acked[name] += 1
        finally:
            if self._costs.runtime:
                runtime = max(0.0, self._clock() - started)
                with self._lock:
                    self._round.finished(name, runtime)
                    self._costs.observe(name, runtime)
        # Left set if the handler raised a BaseException: shutdown requeues it.
        self._in_hand = None

    def _hold(self, item: Buffered | None) -> None:
        # Taken and not yet handled or sent back: shutdown requeues it.
        self._in_hand = None if item is None else item[1]

    def _handler_failed(self, name: str, message: Message, exc: Exception) -> None:
        self._failed[name] += 1
        requeue = self.on_error != "reject"
        logger.error(
            "handler failed on a message of queue %r (%s): %r",
            name,
            "requeued" if requeue else "rejected",
            exc,
            exc_info=exc,
        )
        if not message.acknowledged:
            message.reject(requeue=requeue)
        if self.on_error == "raise":
            raise exc

    # -- shutdown ------------------------------------------------------------

    def _requeue_buffered(self, conn: Connection) -> None:
        # Nothing is lost on stop: buffered (and an interrupted in-hand)
        # message goes back to its queue.  Newest first, so that transports
        # that requeue at the head (Redis) keep the original order.  If the
        # connection is gone the broker redelivers unacked messages itself.
        with self._lock:
            pending = [message for _, message, _ in self._round]
            if self._in_hand is not None:
                pending.insert(0, self._in_hand)
        for message in reversed(pending):
            if not message.acknowledged:
                _quietly(conn, partial(message.reject, requeue=True))
        self._forget_buffered()

    def _forget_buffered(self) -> None:
        with self._lock:
            self._round.clear()
            self._round.forget_pending()
            self._in_hand = None
            self._fill.short = True
            self._acks.forget()  # the broker redelivers them
        if self._codel is not None:
            self._codel.reset()  # the broker has the buffered messages again

    # -- introspection ----------------------------------------------------------

    def statistics(self) -> FairConsumerStatistics:
        """A frozen snapshot: windows, buffers, served counts and deficits."""
        with self._lock:
            drr = self._round.statistics()
            buffered = self._round.counts()
            codel = None if self._codel is None else self._codel.statistics()
            records = tuple(
                FairQueueStatistics(
                    name=q.name,
                    weight=self._options.weights[q.name],
                    window=self._options.windows[q.name],
                    buffered=buffered.get(q.name, 0),
                    acked=self._acked[q.name],
                    failed=self._failed[q.name],
                    served_count=q.served_count,
                    served_cost=q.served_cost,
                    deficit=q.deficit,
                    active=q.active,
                    codel_requeued=codel.requeued_by_queue.get(q.name, 0) if codel else 0,
                    codel_rejected=codel.rejected_by_queue.get(q.name, 0) if codel else 0,
                    codel_kept=codel.kept_by_queue.get(q.name, 0) if codel else 0,
                )
                for q in drr.queues
            )
            return FairConsumerStatistics(
                cost=self.cost,
                queues=records,
                buffered=len(self._round),
                handled=sum(self._acked.values()) + sum(self._failed.values()),
                idle_waits=self._idle_waits,
                drr=drr,
                codel=None if codel is None else codel.controller,
            )

    def __repr__(self) -> str:
        return f"<FairConsumerMixin queues={list(self._options.queues)} cost={self.cost!r}>"


def _quietly(conn: Connection, fun: Callable[[], object]) -> None:
    try:
        fun()
    except conn.connection_errors + conn.channel_errors + (OSError,) as exc:
        logger.debug("ignored while closing: %r", exc)
