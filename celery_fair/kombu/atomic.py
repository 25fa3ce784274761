"""Atomic fetch on Redis: the pop and its unacknowledged record in one step.

Kombu's Redis transport fetches with ``BRPOP`` and only afterwards, from the
client, records the message in the ``unacked`` hash and ``unacked_index``
sorted set.  A message popped just before the broker dies (or the worker is
killed) is in neither place: it exists only in the worker's memory and is
lost, even with ``appendfsync always`` and late acks.

:class:`AtomicFetch` replaces that fetch on one channel with a server-side
Lua script that pops from the first non-empty queue *in the order given*
(the DWRR order, as for BRPOP) and writes the unacked record in the same
script.  Redis runs a script atomically and logs its effects to the AOF as
one unit, so after any crash a message is either still in its queue or in
the unacked index, where the visibility timeout restores it.

Scripts cannot block.  The blocking wait is kept with client-side tracking
(:mod:`celery_fair.kombu.wakeup`): when every queue is empty the script
reads their lengths, which makes the server remember those keys for this
connection and send an invalidation, redirected to a listener connection,
when any of them next changes.  Meanwhile the fetch connection waits in
``BLPOP`` on a private wake key with Kombu's BRPOP timeout (so Kombu's
liveness check still applies); the listener pushes that key, the ``BLPOP``
returns and the next fetch runs.  Nothing is popped by the wait, so the
wait has no window to lose a message.  Without a listener (a server older
than Redis 6, or one that refuses tracking) the wait is a short ``BLPOP``
timeout: polling.

The fetch connection is Kombu's, and Celery used it before the fetch took
it over: mingle's ``hello`` polls its reply queue on the task consumer's
channel, and the last of those ``BRPOP`` commands is still waiting for its
reply when the worker's own consumers start.  Every reply on the connection
is read in the order its command was sent, so the fetch keeps track of what
is in flight (:attr:`AtomicFetch.state`), starting with what Kombu left
there, and reads a reply of Kombu's as Kombu would: a message it popped is
delivered (or requeued by Kombu when its consumer is gone), never dropped.

Every private part of Kombu and redis-py it uses goes through
:mod:`celery_fair.compat`, which probes them when the worker starts.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from queue import Empty
from time import monotonic, time
from typing import Any, Protocol

from kombu.utils.json import loads
from redis.exceptions import ResponseError

from .. import compat
from ..keys.scripts import FETCH
from ..keys.serving import KeyedServing
from ..keys.store import text
from ..parked import NOT_A_MESSAGE, PARKED_LOG, PARKING_SUFFIX, encode_record
from ..wire import SERVED_HEADER
from ..wire.replies import Idle, KeyedMessage, Malformed, Popped, decode_fetched
from .fetch_request import FetchRequest
from .wakeup import Alarm, InvalidationListener

__all__ = ("TRANSITIONS", "AtomicFetch", "AtomicFetchStatistics", "State", "install_atomic_fetch")

logger = logging.getLogger(__name__)

#: Without an invalidation listener, an idle fetch polls this often (seconds).
POLL_WAIT = 0.05

#: The most messages one fetch takes.  A fetch takes what the prefetch window
#: has room for, in the fair order (see :meth:`AtomicFetch.batch`): one script
#: call, and one round trip, for several messages.  The script runs while Redis
#: serves nobody else, so a batch stays small.
BATCH_MAX = 16


@dataclass(frozen=True)
class AtomicFetchStatistics:
    """Counters of one channel's atomic fetch."""

    #: Whether idle waits are woken by invalidations (else they poll).
    tracking: bool
    #: Messages fetched (parked payloads included).
    fetches: int
    #: Script calls that fetched them: fetches / calls is the mean batch.
    calls: int
    waits: int
    wakeups: int
    malformed: int
    listener_reconnects: int


class State(Enum):
    """What the fetch connection carries, and so what the fetch does next."""

    #: Nothing in flight; the next command is the fetch script.
    READY = "ready"
    #: The fetch script is in flight.
    FETCHING = "fetching"
    #: Nothing in flight; the last fetch found nothing, so the next command is the wait.
    IDLE = "idle"
    #: The wait (a ``BLPOP`` on the wake key) is in flight.
    WAITING = "waiting"
    #: A ``BRPOP`` of Kombu's own is in flight, sent before the fetch took the
    #: channel over (mingle's last poll of its reply queue): read as Kombu would.
    KOMBU_BRPOP = "kombu-brpop"

    @property
    def in_flight(self) -> bool:
        """Whether a reply is due on the connection."""
        return self in (State.FETCHING, State.WAITING, State.KOMBU_BRPOP)

    @property
    def fetch_follows(self) -> bool:
        """Whether the next command is the fetch script, not the wait (which comes
        first after a fetch that found nothing)."""
        return self in (State.READY, State.FETCHING, State.KOMBU_BRPOP)


#: Each state's allowed next states.  A state in flight goes to READY when its
#: reply is read (or fails, or its connection is replaced), the fetch script's
#: to IDLE when it found nothing.
TRANSITIONS: dict[State, frozenset[State]] = {
    # Arm, send the script, wait (no queue has room to fetch from), adopt a reply.
    State.READY: frozenset({State.READY, State.FETCHING, State.WAITING, State.KOMBU_BRPOP}),
    # Arm (the wait starts over with a fetch), send the wait, adopt a reply.
    State.IDLE: frozenset({State.READY, State.WAITING, State.KOMBU_BRPOP}),
    State.FETCHING: frozenset({State.READY, State.IDLE}),
    State.WAITING: frozenset({State.READY}),
    State.KOMBU_BRPOP: frozenset({State.READY}),
}


class AtomicFetch:
    """The fetch path of one Kombu Redis channel, made atomic.

    Installed by :func:`install_atomic_fetch`, which replaces the channel's
    ``_brpop_start`` / ``_brpop_read`` pair (Kombu's poller keeps driving
    them).  ``on_fetch(seconds)`` is told the round trip of every fetch
    that returned a message (for adaptive prefetch).  :attr:`state` moves
    only through :meth:`_move`, along :data:`TRANSITIONS`.
    """

    def __init__(self, channel: Any, cycle: FetchCycle, keyed: KeyedServing | None = None) -> None:
        self.channel = channel
        self.cycle = cycle
        self.keyed = keyed
        self._request = FetchRequest(channel)
        #: Kombu may have left a BRPOP in flight: its reply comes first.
        self.state = State.KOMBU_BRPOP if compat.poll_in_flight(channel) else State.READY
        self._warned: set[tuple[State, State]] = set()  # impossible moves logged
        self.recorded: Any = None  # delivery tag recorded by the script
        self.on_fetch: Callable[[float], None] | None = None
        self.fetches = self.calls = self.waits = self.wakeups = self.malformed = 0
        self.tracking = False
        self.listener: InvalidationListener | None = None
        #: A wake-up was pushed since the last command was sent: the next is
        #: not needed (set from the listener's thread, so not part of :attr:`state`).
        self._wake_pushed = False
        self._sha: str | None = None
        self._armed_sock: Any = None
        self._armed_generation = -1
        self._sent_at = 0.0
        #: The thread that sends the fetches (the worker's loop), and whether key
        #: slots were ever released on it, or on another (see :meth:`will_fetch`).
        self._thread: int | None = None
        self._released_on_fetch_thread = self._released_off_fetch_thread = False
        #: Set when the consumer stops: no fetch follows any more.
        self.stopped = False
        self._wake_key = f"{self._request.prefix}_fair.wake.{uuid.uuid4().hex}"
        #: Seconds until a throttled key may go on or a scheduled message is due.
        self._due: float | None = None
        #: Ends a wait at ``_due`` on time (a blocking timeout ends at Redis's tick).
        self.alarm = Alarm(self.wake)
        self.serve_keyed(keyed)

    def serve_keyed(self, keyed: KeyedServing | None) -> None:
        """Serve ``keyed``'s queues in fair key order from the next fetch on."""
        self.keyed = keyed
        if keyed is not None:
            keyed.fetched_by(self)
        self._request.serve_keyed(keyed)

    def listen(self) -> bool:
        """Start the invalidation listener; False if it could not subscribe."""
        channel = self.channel
        self.listener = InvalidationListener(
            channel.client.connection_pool,
            self.wake,
            stop_when=lambda: bool(getattr(channel, "closed", False)),
        )
        if self.listener.start():
            return True
        logger.warning(
            "celery-fair: no invalidation listener (Redis client tracking needs Redis >= 6); "
            "idle fetches poll every %d ms",
            POLL_WAIT * 1000,
        )
        return False

    def close(self) -> None:
        self.alarm.close()
        if self.listener is not None:
            self.listener.close()

    def _move(self, to: State, why: str) -> State:
        """Go to state ``to``; ``why`` names the event, for the log.

        A move :data:`TRANSITIONS` does not allow is a fault of the fetch's
        bookkeeping: logged once per pair of states, at WARNING, and taken
        all the same.  The caller sends its command, or has read its reply,
        either way, and the state must say what the connection carries;
        refusing a send would leave Kombu's poller waiting for a reply never
        asked for, and raising would stop the worker's event loop.
        """
        was = self.state
        if to not in TRANSITIONS[was] and (was, to) not in self._warned:
            self._warned.add((was, to))
            logger.warning(
                "celery-fair: the atomic fetch moved from %s to %s (%s), which it never "
                "should; it goes on from %s",
                was.name, to.name, why, to.name,
            )  # fmt: skip
        self.state = to
        return to

    # -- Kombu's poller calls these ---------------------------------------

    def start(self, timeout: float | None = None) -> None:
        """Kombu's ``_brpop_start``: send the next fetch, or the next wait."""
        channel = self.channel
        queues = compat.queue_cycle(channel).consume(compat.active_queue_count(channel))
        if not queues:
            return
        self._thread = threading.get_ident()
        conn = channel.client.connection
        listener = self.listener
        generation = listener.generation if listener is not None else 0
        if compat.socket_of(conn) is not self._armed_sock or generation != self._armed_generation:
            self._arm(conn)
        command = (
            self._request.command(queues, self.batch(queues)) if self.state.fetch_follows else None
        )
        if command is not None:
            # From here on a wake-up must push the wake key: the script may
            # read the queues before the change that woke us (a lost wake-up
            # would leave the next wait to its timeout).
            self._move(State.FETCHING, "the script is sent")
            self._wake_pushed = False
            if self.keyed is not None and self.keyed.limited:
                self.keyed.releases.open_carry()
            self._begin(conn)
            conn.send_command("EVALSHA", self._sha, *command)
            return
        if self.keyed is not None:
            self.keyed.flush_releases()  # no fetch now to carry them
        if (
            self.state.fetch_follows
            and self._released_on_fetch_thread
            and not self._released_off_fetch_thread
        ):
            # Every queue is keyed and at this worker's capacity (per-key limits),
            # and slots are freed on this thread: the loop calls this again after
            # the next release, whose fetch carries it. Nothing to wait for.
            return
        if timeout is None:
            timeout = compat.brpop_timeout(channel)
        wait = timeout if self.tracking else min(timeout or POLL_WAIT, POLL_WAIT)
        if self._due is not None:
            wait = min(wait or self._due, self._due)
        # A wake-up during this wait must push the wake key, even when one was
        # pushed before: that one ended the last wait, or ends this one at once.
        # Left set, a wake-up taken while the worker was full (no fetch, so no
        # reset) would swallow the next: a freed slot waits for the timeout.
        self._move(State.WAITING, "the wait is sent")
        self._wake_pushed = False
        if self._due is not None:
            self.alarm.set(self._due)  # after the reset above, or its push is swallowed
        self.waits += 1
        self._begin(conn)
        conn.send_command("BLPOP", self._wake_key, wait or 0)

    def batch(self, queues: list[str]) -> int:
        """How many messages the next fetch takes from ``queues[0]``, the first in order.

        What the prefetch window has room for, bounded by what the fair order
        gives the queue in a row (its DRR deficit and credit: the same order
        as one fetch at a time) and, for a keyed queue with per-key limits,
        by the key slots this worker may still hold.
        """
        free = compat.free_window(self.channel)
        n = BATCH_MAX if free is None else min(free, BATCH_MAX)
        if n <= 1:
            return 1
        head = queues[0]
        keyed = self.keyed
        n = min(n, self.cycle.run(head))
        if n > 1 and keyed is not None and head in keyed.queues:
            room = keyed.leases.room(head)
            if room is not None:
                n = min(n, room)
        return max(1, n)

    def _begin(self, conn: Any) -> None:
        self._sent_at = monotonic()
        compat.begin_poll(self.channel, conn, self._sent_at)

    def will_fetch(self) -> bool:
        """Whether a fetch follows on this thread that can carry a key slot's release.

        True on the thread that sends the fetches (the worker's loop) unless the
        fetch waits, or is about to, for work: the loop sends the next fetch
        once the callback that freed the slot returns.  Elsewhere (a thread
        pool's thread, a greenlet) the release goes at once, with a wake-up.
        """
        if self.stopped or self._thread is None:
            return False
        if threading.get_ident() != self._thread:
            self._released_off_fetch_thread = True
            return False
        self._released_on_fetch_thread = True
        return self.state.fetch_follows

    def read(self, **options: Any) -> Any:
        """Kombu's ``_brpop_read``: handle a fetch's reply, or a wait's end."""
        channel = self.channel
        conn = channel.client.connection
        sent = self.state
        try:
            if not sent.in_flight:
                if not compat.reply_waiting(conn):
                    raise Empty()  # nothing was sent (no queue to fetch from)
                # Nothing of ours is in flight, yet a reply is there: only
                # Kombu's own fetch sends on this connection.
                sent = self._move(State.KOMBU_BRPOP, "a reply nothing of ours asked for")
            try:
                reply = conn.read_response()
            except ResponseError as error:
                if sent is State.KOMBU_BRPOP or "NOSCRIPT" not in str(error):
                    raise
                # The script cache was flushed (SCRIPT FLUSH, or a restart the
                # connection survived): load it again on the next fetch.
                self._armed_sock = None
                raise Empty() from error
            except channel.connection_errors:
                conn.disconnect()
                self._armed_sock = None
                raise
            if sent is State.FETCHING and self.keyed is not None:
                self.keyed.releases.confirm()  # the script ran the ones it carried
            if sent is State.KOMBU_BRPOP:
                self._move(State.READY, "Kombu's fetch replied")
                return self._deliver_popped(reply)
            if sent is State.WAITING:
                self.alarm.cancel()
                self._move(State.READY, "the wait ended: woken, or timed out")
                raise Empty()
            fetched = decode_fetched(reply)
            if isinstance(fetched, Idle):
                # Nothing to fetch; with per-key limits, the reply says when a
                # key held back may go on (nothing writes then to wake us).
                self._move(State.IDLE, "the fetch found nothing")
                self._due = fetched.due
                raise Empty()
            self._due = None  # an idle fetch says again when to look
            self._move(State.READY, "the fetch replied with a payload")
            self.calls += 1
            if self.on_fetch is not None:
                self.on_fetch(monotonic() - self._sent_at)
            return self._deliver_all(fetched)
        finally:
            if self.state.in_flight:  # an error reply, or none: the reply is gone
                self._move(State.READY, "the reply failed")
            compat.end_poll(channel)

    def _deliver_popped(self, reply: Any) -> bool:
        """A reply to Kombu's BRPOP: deliver what it popped, as Kombu's ``_brpop_read``.

        The pop wrote no unacknowledged record (it was not the script), so the
        QoS writes it when the message is delivered, as in plain Kombu.  A
        message of a queue nobody consumes any more (mingle's reply queue) is
        requeued by Kombu's delivery; one that does not decode is parked.
        """
        if not reply:
            raise Empty()
        queue, item = self._request.queue_of(text(reply[0])), reply[1]
        # Counted as a fetch before it is decoded, as Kombu's own BRPOP path does:
        # a payload parked below releases its own credit.
        compat.queue_cycle(self.channel).rotate(queue)
        try:
            payload = loads(text(item))
        except ValueError:  # json.JSONDecodeError, UnicodeDecodeError
            park_undecodable(self.channel, self.cycle, queue, item)
            raise Empty() from None
        compat.deliver(self.channel, payload, queue)
        return True

    def _deliver_all(self, fetched: tuple[Popped, ...]) -> bool:
        """Deliver each message of a fetch in the order taken; Empty if none was one.

        Every message is delivered even when an earlier delivery raised (the
        first error is raised after): the script recorded each as
        unacknowledged, and one left undelivered would wait for the
        visibility timeout.
        """
        delivered, error = False, None
        for one in fetched:
            try:
                delivered = self._deliver(one) or delivered
            except Exception as exc:  # noqa: BLE001 - raised again below
                error = error or exc
        if error is not None:
            raise error
        if not delivered:
            raise Empty()
        return True

    def _deliver(self, fetched: Popped) -> bool:
        """Deliver one message to Kombu; False for a payload the script parked."""
        channel = self.channel
        self.fetches += 1
        queue = self._request.queue_of(fetched.key)
        if isinstance(fetched, Malformed):
            # Fetched, then parked by the script: counted as a fetch (as Kombu's
            # BRPOP path rotates before it decodes), so that its release below
            # frees its own credit, not another message's.
            compat.queue_cycle(channel).rotate(queue)
            self._report_malformed(queue, fetched.item)
            return False
        try:
            payload = loads(text(fetched.item))
        except ValueError:  # json.JSONDecodeError, UnicodeDecodeError
            # The script found a delivery tag in the payload's tail and recorded
            # it (lua/unacked.lua); the rest does not decode.  Parked, then its
            # record dropped: a crash between leaves a copy, never a loss.
            compat.queue_cycle(channel).rotate(queue)
            self.malformed += 1
            park_undecodable(channel, self.cycle, queue, fetched.item)
            tag = tail_delivery_tag(text(fetched.item))
            if tag is not None:
                compat.remove_unacked_outside_transaction(channel.qos, tag)
            return False
        if isinstance(fetched, KeyedMessage) and self.keyed is not None:
            self.keyed.served(queue, fetched.fair_key)
            headers = payload.get("headers")
            if isinstance(headers, dict):
                charged = self._request.charged.get(queue, 1.0)
                headers[SERVED_HEADER] = fetched.served(charged).to_wire()
        compat.queue_cycle(channel).rotate(queue)
        self.recorded = payload["properties"]["delivery_tag"]
        try:
            compat.deliver(channel, payload, queue)
        finally:
            self.recorded = None
        return True

    # -- internals -----------------------------------------------------------

    def _arm(self, conn: Any) -> None:
        """A new connection (or a new listener): load the script, redirect tracking.

        Reads its replies at once.  Kombu's poller sends only when it sees
        nothing in flight, so a reply still due here was due on a connection
        Kombu has since dropped (a stale one, after its health check): it
        went with that connection.
        """
        if self.state.in_flight:
            self._move(State.READY, "the connection was replaced")
        listener = self.listener
        client_id = listener.client_id if listener is not None else None
        self.tracking = False
        if client_id is not None:
            try:
                # An ACL may refuse the command (NoPermissionError, a ResponseError).
                conn.send_command("CLIENT", "TRACKING", "OFF")
                conn.read_response()
                conn.send_command("CLIENT", "TRACKING", "ON", "REDIRECT", client_id, "NOLOOP")
                conn.read_response()
                self.tracking = True
            except ResponseError as exc:
                logger.warning(
                    "celery-fair: Redis refused client tracking (%s); idle fetches poll", exc
                )
        conn.send_command("SCRIPT", "LOAD", FETCH.text)  # lua/fetch.lua: KEYS, ARGV, reply
        self._sha = text(conn.read_response())
        self._armed_sock = compat.socket_of(conn)
        self._armed_generation = listener.generation if listener is not None else 0
        self._move(State.READY, "armed")

    def wake(self, pipe: Any = None) -> None:
        """End the current wait: something to fetch (the listener's thread, or a freed slot).

        With ``pipe`` (a redis-py pipeline the caller executes) the wake-up
        rides on it, for instance with the release of a key slot.
        """
        self.wakeups += 1
        if self._wake_pushed:
            return
        self._wake_pushed = True
        # The wake key only ever ends a BLPOP of this channel; a value left
        # after a timeout costs one extra fetch, and expires.
        if pipe is not None:
            pipe.lpush(self._wake_key, 1).expire(self._wake_key, 60)
            return
        with compat.redis_client(self.channel) as client:
            client.pipeline(transaction=False).lpush(self._wake_key, 1).expire(
                self._wake_key, 60
            ).execute()

    def _report_malformed(self, queue: str, item: Any) -> None:
        self.malformed += 1
        malformed_moved(self.cycle, queue, item)

    def statistics(self) -> AtomicFetchStatistics:
        """Counters for ``inspect fair_stats``."""
        listener = self.listener
        return AtomicFetchStatistics(
            tracking=self.tracking,
            fetches=self.fetches,
            calls=self.calls,
            waits=self.waits,
            wakeups=self.wakeups,
            malformed=self.malformed,
            listener_reconnects=0 if listener is None else listener.reconnects,
        )


class FetchCycle(Protocol):
    """What the fetch needs of the queue cycle it serves (:class:`~.cycle.DWRRCycle`).

    A Protocol, so that this module does not import the cycle's, which
    imports it.
    """

    def run(self, queue: str) -> int:
        """How many messages of ``queue``, first in the fetch order, one fetch may take."""

    def moved_aside(self, queue: str) -> None:
        """A fetched payload of ``queue`` did not become a delivery: release its slot."""


def malformed_moved(cycle: FetchCycle, queue: str, item: Any) -> None:
    """A payload of ``queue`` was moved aside: release its slot and say so."""
    cycle.moved_aside(queue)
    logger.error(PARKED_LOG, queue, queue + PARKING_SUFFIX, f"{NOT_A_MESSAGE}: {item[:200]!r}")


def tail_delivery_tag(item: str) -> str | None:
    """The delivery tag the fetch script reads from a payload: in the text after its
    last ``"properties":`` up to the closing brace (see lua/unacked.lua)."""
    marker = '"properties":'
    at = item.rfind(marker)
    if at < 0 or not item.endswith("}"):
        return None
    try:
        props = json.loads(item[at + len(marker) : -1])
    except ValueError:
        return None
    tag = props.get("delivery_tag") if isinstance(props, dict) else None
    return tag if isinstance(tag, str) else None


def park_undecodable(channel: Any, cycle: FetchCycle, queue: str, item: Any) -> None:
    """Park a payload a plain ``BRPOP`` popped that does not decode (never drop it)."""
    prefix = compat.key_prefix(channel)
    if prefix and queue.startswith(prefix):
        queue = queue[len(prefix) :]  # as Kombu's own client may leave it
    raw = item.decode("utf-8", "surrogateescape") if isinstance(item, bytes) else item
    record = encode_record(None, reason=NOT_A_MESSAGE, parked_at=time(), queue=queue, raw=raw)
    with compat.redis_client(channel) as conn:
        conn.lpush(prefix + queue + PARKING_SUFFIX, record)
    malformed_moved(cycle, queue, item)


def install_atomic_fetch(
    channel: Any, cycle: FetchCycle, keyed: KeyedServing | None = None
) -> AtomicFetch:
    """Give a Kombu Redis channel the atomic fetch (probed: see :mod:`celery_fair.compat`).

    ``keyed``: the worker's keyed queues (:mod:`celery_fair.keys`), served
    in fair key order by the same script.
    """
    fetch = AtomicFetch(channel, cycle, keyed)
    fetch.listen()
    compat.replace_fetch(channel, fetch.start, fetch.read)
    return fetch
