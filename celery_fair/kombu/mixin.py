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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any, Literal

from kombu.connection import Connection
from kombu.entity import Queue
from kombu.message import Message
from kombu.messaging import Consumer as KombuConsumer
from kombu.mixins import ConsumerMixin

from .. import compat
from ..grammar import as_positive, as_positive_int
from ..scheduling.codel import CODEL_ACTIONS, CoDelAction
from ..scheduling.cost import COST_MODES, CostMode, CostModel
from ..scheduling.dispatch import DispatchRound, SendBack, next_admitted
from ..scheduling.shedding import SheddingPolicy, check_codel, option_error
from .mixin_stats import FairConsumerStatistics, FairQueueStatistics
from .requeue import requeue, requeue_count
from .take import Take

__all__ = (
    "CODEL_ACTIONS",
    "COST_MODES",
    "ERROR_POLICIES",
    "FairConsumerMixin",
    "FairConsumerStatistics",
    "FairQueueStatistics",
    "Handler",
)

logger = logging.getLogger(__name__)

#: ``handler(queue_name, body, message)``; the mixin acks when it returns.
Handler = Callable[[str, Any, Message], None]
ErrorPolicy = Literal["reject", "requeue", "raise"]
#: Queues (names or :class:`kombu.Queue` objects) with their weights.
QueueWeights = Mapping[str, float] | Mapping[Queue, float] | Iterable[tuple[str | Queue, float]]
ERROR_POLICIES: tuple[str, ...] = ("reject", "requeue", "raise")

#: Default total window per consumed queue (split between them by weight).
WINDOW_PER_QUEUE = 25


def _option_error(option: str, value: object, expected: str) -> ValueError:
    return ValueError(f"FairConsumerMixin option {option_error(option, value, expected)}")


def _positive_number(option: str, value: object) -> float:
    number = as_positive(value)
    if number is None:
        raise _option_error(option, value, "must be a positive number")
    return number


def _positive_int(option: str, value: object) -> int:
    number = as_positive_int(value)
    if number is None:
        raise _option_error(option, value, "must be an integer of at least 1")
    return number


def _check_queues(
    queues: QueueWeights,
) -> dict[str, tuple[Queue, float]]:
    pairs = queues.items() if isinstance(queues, Mapping) else queues
    checked: dict[str, tuple[Queue, float]] = {}
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise _option_error("queues", queues, "must map queues to weights")
        queue, weight = item
        if isinstance(queue, str):
            queue = Queue(queue)
        if not isinstance(queue, Queue) or not queue.name:
            raise _option_error("queues", queue, "a queue must be a name or a named kombu.Queue")
        if queue.name in checked:
            raise _option_error("queues", queue.name, "names a queue twice")
        checked[queue.name] = (queue, _positive_number(f"queues[{queue.name!r}]", weight))
    if not checked:
        raise _option_error("queues", queues, "must name at least one queue")
    return checked


def split_window(weights: Mapping[str, float], total: int) -> dict[str, int]:
    """Split ``total`` prefetch slots between queues by weight, at least 1 each.

    A queue served at its share s of the consumer's rate needs a window of
    about s times (refill round trip / service time) plus one to stay
    buffered: a window proportional to the weight.
    """
    weight_sum = sum(weights.values())
    return {name: max(1, round(total * w / weight_sum)) for name, w in weights.items()}


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
        checked = _check_queues(queues)
        self._queues = {name: queue for name, (queue, _) in checked.items()}
        self._weights = {name: weight for name, (_, weight) in checked.items()}
        if handler is not None and not callable(handler):
            raise _option_error("handler", handler, "must be callable")
        if handler is None and type(self).handle is FairConsumerMixin.handle:
            raise _option_error("handler", handler, "pass a handler or override handle()")
        self._handler = handler
        total = WINDOW_PER_QUEUE * len(checked) if window is None else window
        self._windows = split_window(self._weights, _positive_int("window", total))
        for name, size in (windows or {}).items():
            if name not in self._queues:
                raise _option_error("windows", name, "is not one of the consumed queues")
            self._windows[name] = _positive_int(f"windows[{name!r}]", size)
        if cost not in COST_MODES:
            raise _option_error("cost", cost, f"must be one of {COST_MODES}")
        self.cost: CostMode = cost
        self.runtime_quantum = _positive_number("runtime_quantum", runtime_quantum)
        if on_error not in ERROR_POLICIES:
            raise _option_error("on_error", on_error, f"must be one of {ERROR_POLICIES}")
        self.on_error: ErrorPolicy = on_error
        try:
            codel = check_codel(codel_target, codel_interval, codel_action, codel_max_requeues)
        except ValueError as exc:
            raise ValueError(f"FairConsumerMixin option {exc}") from None
        self.codel_action: CoDelAction = codel_action
        self.codel_max_requeues = codel_max_requeues
        self.ack_batch = _positive_int("ack_batch", ack_batch)
        self.stop_check_interval = _positive_number("stop_check_interval", stop_check_interval)
        if not callable(clock):
            raise _option_error("clock", clock, "must be callable")
        self._clock = clock
        self._accept = None if accept is None else list(accept)
        self._codel = None if codel is None else SheddingPolicy(codel, clock=clock)

        # The worker's scheduling core: the cost model gives the quanta (the
        # heaviest queue one cost unit per visit, so no queue is served in
        # bursts longer than about one message and a small window keeps every
        # backlogged queue's buffer non-empty at its turn), and the dispatch
        # round holds (body, message, time received) per queue in DWRR order.
        self._costs = CostModel(cost, runtime_quantum=self.runtime_quantum)
        self._round: DispatchRound[tuple[Any, Message, float]] = DispatchRound(self._costs)
        self._round.set_quanta(self._costs.quanta(self._weights))
        self._in_hand: Message | None = None
        #: Below this many buffered messages a queue's window is refilled.
        self._low_water = {name: max(1, size // 2) for name, size in self._windows.items()}
        #: Some buffer is below its low water mark: collect before the next
        #: choice (see _collect_due).  Only a take can lower a buffer, so this
        #: is set by the take and recomputed by each collect.
        self._short = True
        #: AMQP with ack_batch > 1: each queue's batch size, and its last handled
        #: message not yet acknowledged with the count of them (see _acknowledge).
        self._batches: dict[str, int] = {}
        self._unacked: dict[str, tuple[Message, int]] = {}
        #: Redis only: each queue's window fill, and the queues found empty since
        #: their last delivery (not asked again).
        self._takes: list[Take] = []
        self._dry: set[str] = set()
        self._acked = dict.fromkeys(self._queues, 0)
        self._failed = dict.fromkeys(self._queues, 0)
        self._idle_waits = 0
        # Guards the round against statistics() readers.
        self._lock = threading.Lock()
        # The next message to handle, in DWRR order, that CoDel lets run.
        self._admit = partial(
            next_admitted, self._round, self._lock, [] if self._codel is None else [self._stale],
            self._send_back, empty=None if self._codel is None else self._codel.empty,
            hold=self._hold,
        )  # fmt: skip

    # -- the user's hooks ---------------------------------------------------

    def handle(self, queue: str, body: Any, message: Message) -> None:
        """Process one message of ``queue``; it is acked when this returns."""
        assert self._handler is not None
        self._handler(queue, body, message)

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
        return dict(self._weights)

    @property
    def windows(self) -> dict[str, int]:
        """The prefetch window of every consumed queue."""
        return dict(self._windows)

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
            for name in self._queues:
                channels[name] = conn.channel()
                stack.callback(self._quietly, conn, channels[name].close)
                self._hold_fetch_while_dropping(channels[name])
            stack.callback(self._requeue_buffered, conn)
            stack.callback(self._quietly, conn, self._flush_acks)
            self._batches = self._ack_batches(conn)
            consumers = []
            for name, queue in self._queues.items():
                consumer = KombuConsumer(
                    channels[name],
                    queues=[queue],
                    callbacks=[partial(self._on_delivery, name)],
                    on_decode_error=self.on_decode_error,
                    accept=self._accept,
                    # A window per consumer: basic.qos(global=False) before
                    # basic.consume, on a channel of its own.
                    prefetch_count=self._windows[name],
                )
                stack.callback(self._quietly, conn, consumer.cancel)
                consumers.append(consumer)
            for consumer in consumers:
                consumer.consume()
            # Redis delivers one message per BRPOP round trip: see _fill_windows.
            redis = conn.transport.driver_type == "redis"
            self._takes = [
                Take(channels[name], queue.name, self._accept)
                for name, queue in self._queues.items()
                if redis
            ]
            self._dry.clear()
            stack.callback(self._takes.clear)
            default_channel = conn.default_channel
            yield conn, default_channel, consumers
            self.on_consume_end(conn, default_channel)

    def _hold_fetch_while_dropping(self, channel: Any) -> None:
        # RabbitMQ pushes, and its returned copies join the back of the queue.
        codel = self._codel
        if codel is not None:
            compat.hold_fetch_while(
                getattr(channel, "qos", None), lambda: codel.dropping and bool(self._round)
            )

    def _on_delivery(self, name: str, body: Any, message: Message) -> None:
        self._dry.discard(name)
        with self._lock:
            self._round.put(name, (body, message, self._clock()))

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
                    if self._collect_due():
                        self._collect(conn)
                    self._dispatch_one()
                    handled += 1
                    idle = 0.0
                    yield
                    continue
                self._short = True  # whatever arrives, collect the rest with it
                self._flush_acks()  # the broker refills only acknowledged slots
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

    def _collect_due(self) -> bool:
        # Collect only when a queue's buffer is below half its window: DWRR's
        # choice changes only when a queue it would serve has nothing buffered,
        # and a look at the connection that finds nothing costs as much as a
        # small handler (a read that times out).  Messages left unread wait in
        # order, the broker's window bounding them.  With CoDel the buffer is
        # kept full: its sojourn times are the signal of a standing queue.
        # Kept as a flag, not counted per message: counting every buffer cost
        # more per message than the choice itself.
        return self._short or self._codel is not None

    def _below_low_water(self) -> bool:
        counts = self._round.counts()
        return any(counts.get(name, 0) < low for name, low in self._low_water.items())

    def _collect(self, conn: Connection) -> None:
        # Fill the windows (Redis), then take every delivery that is already
        # readable, without waiting, so that each queue's buffer is as full as
        # its window allows when DWRR chooses.  Filled first: Kombu's poll
        # sends a BRPOP for each channel with room, one message per round
        # trip.  Bounded: no more than the windows' sum can be delivered.
        self._fill_windows()
        for _ in range(sum(self._windows.values()) + 1):
            try:
                conn.drain_events(timeout=0)
            except TimeoutError:  # socket.timeout
                break
        self._short = self._below_low_water()

    def _fill_windows(self) -> None:
        # Kombu's Redis transport has one BRPOP in flight per channel, and its
        # reply is not readable yet when the loop looks without waiting: the
        # drain above yields at most one message per queue, and a buffer would
        # never hold more than one (nothing for DWRR to choose between, no
        # sojourn for CoDel). So, on Redis, each window is filled while the
        # channel's QoS has room (its prefetch count is the window, and CoDel
        # holds it while dropping), as many messages per round trip as it has
        # room for (kombu/take.py). A queue found empty is not asked again
        # until a delivery (its BRPOP) shows it has work: an empty queue costs
        # no round trip per handled message.
        for take in self._takes:
            name, qos = take.name, take.channel.qos
            if name in self._dry or not qos.can_consume():
                continue
            room = qos.can_consume_max_estimate() or 1
            try:
                messages = take(room)
            except Exception as exc:  # noqa: BLE001 - the next drain sees a lost connection
                logger.error("cannot read messages of queue %r: %r", name, exc)
                continue
            for message in messages:
                try:
                    body = message.decode()
                except Exception as exc:
                    self.on_decode_error(message, exc)
                    continue
                self._on_delivery(name, body, message)
            if len(messages) < room:
                self._dry.add(name)  # after the deliveries, which clear it

    def _dispatch_one(self) -> None:
        taken = self._admit()
        if taken is None:
            return
        name, (body, message, _received) = taken
        if self._round.count(name) < self._low_water[name]:
            self._short = True
        started = self._clock() if self._costs.runtime else 0.0
        try:
            self.handle(name, body, message)
        except Exception as exc:
            self._handler_failed(name, message, exc)
        else:
            if not message.acknowledged:
                self._acknowledge(name, message)
            self._acked[name] += 1
        finally:
            if self._costs.runtime:
                runtime = max(0.0, self._clock() - started)
                with self._lock:
                    self._round.finished(name, runtime)
                    self._costs.observe(name, runtime)
        # Left set if the handler raised a BaseException: shutdown requeues it.
        self._in_hand = None

    def _ack_batches(self, conn: Connection) -> dict[str, int]:
        if self.ack_batch == 1:
            return {}
        if conn.transport.driver_type != "amqp":
            logger.info(
                "FairConsumerMixin option ack_batch=%d: the %r transport ignores basic.ack's "
                "multiple flag, so each message is acknowledged when its handler returns",
                self.ack_batch,
                conn.transport.driver_type,
            )
            return {}
        return {name: min(self.ack_batch, low) for name, low in self._low_water.items()}

    def _acknowledge(self, name: str, message: Message) -> None:
        # AMQP's basic.ack with multiple acknowledges every delivery on the
        # channel up to this one.  Each queue has a channel of its own and its
        # buffer is FIFO, so every earlier delivery of that channel has been
        # handled, rejected or sent back already: none is acknowledged early.
        batch = self._batches.get(name, 1)
        if batch == 1:
            message.ack()
            return
        _, count = self._unacked.get(name, (message, 0))
        if count + 1 < batch:
            self._unacked[name] = (message, count + 1)
            return
        self._unacked.pop(name, None)
        message.ack(multiple=True)

    def _flush_acks(self) -> None:
        while self._unacked:
            _, (message, _count) = self._unacked.popitem()
            message.ack(multiple=True)

    def _stale(self, name: str, item: tuple[Any, Message, float], backlog: int) -> SendBack | None:
        """The admission loop's CoDel check (see :func:`next_admitted`)."""
        assert self._codel is not None
        _, message, received = item
        return self._codel.check(
            name, received, backlog, partial(requeue_count, message.headers), destination=name
        )

    def _send_back(self, name: str, item: tuple[Any, Message, float], back: SendBack) -> bool:
        """Send a stale message back: True if it left, False to handle it here."""
        message = item[1]
        if requeue(
            message, back, log=logger,
            failure="CoDel could not return a message of queue %r; handling it here", args=(name,),
        ):  # fmt: skip
            return True
        if message.acknowledged:
            return True  # acked anyway: the copy is out
        assert self._codel is not None
        self._codel.failed(name, back)
        return False

    def _hold(self, item: tuple[Any, Message, float] | None) -> None:
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
                self._quietly(conn, partial(message.reject, requeue=True))
        self._forget_buffered()

    def _forget_buffered(self) -> None:
        with self._lock:
            self._round.clear()
            self._round.forget_pending()
            self._in_hand = None
            self._short = True
            self._unacked.clear()  # the broker redelivers them
        if self._codel is not None:
            self._codel.reset()  # the broker has the buffered messages again

    @staticmethod
    def _quietly(conn: Connection, fun: Callable[[], object]) -> None:
        try:
            fun()
        except conn.connection_errors + conn.channel_errors + (OSError,) as exc:
            logger.debug("ignored while closing: %r", exc)

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
                    weight=self._weights[q.name],
                    window=self._windows[q.name],
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
        return f"<FairConsumerMixin queues={list(self._queues)} cost={self.cost!r}>"
