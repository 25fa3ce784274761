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
(Redis >= 6, RESP3, the redis-py default): when every queue is empty the
script reads their lengths, which makes the server remember those keys for
this connection and push an ``invalidate`` message when any of them next
changes.  Meanwhile the connection waits in ``BLPOP`` on a private wake key
with Kombu's BRPOP timeout (so Kombu's liveness check still applies); an
invalidation pushes that key, the ``BLPOP`` returns and the next fetch runs.
Nothing is popped by the wait, so the wait has no window to lose a message.
Without RESP3 the wait is a short ``BLPOP`` timeout (polling).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from queue import Empty
from time import monotonic, time
from typing import Any

from kombu.utils.json import loads
from redis.exceptions import ResponseError

__all__ = ("FETCH_SCRIPT", "AtomicFetch", "install_atomic_fetch")

logger = logging.getLogger(__name__)

#: KEYS: n queue keys (in fetch order), n matching "malformed" list keys,
#: the unacked hash, the unacked index.  ARGV: n, now (epoch seconds).
#: Returns {key, item} for a delivered message, {key, item, "malformed"}
#: for a payload moved aside, or nil when every queue is empty (after
#: reading the queue lengths, so that client-side tracking watches them).
FETCH_SCRIPT = """
local n = tonumber(ARGV[1])
for i = 1, n do
  local item = redis.call('RPOP', KEYS[i])
  if item then
    local ok, msg = pcall(cjson.decode, item)
    local tag, ex, rk = nil, '', ''
    if ok and type(msg) == 'table' and type(msg['properties']) == 'table' then
      local props = msg['properties']
      tag = props['delivery_tag']
      local info = props['delivery_info']
      if type(info) == 'table' then
        if type(info['exchange']) == 'string' then ex = info['exchange'] end
        if type(info['routing_key']) == 'string' then rk = info['routing_key'] end
      end
    end
    if type(tag) ~= 'string' then
      redis.call('LPUSH', KEYS[n + i], item)
      return {KEYS[i], item, 'malformed'}
    end
    local record = '[' .. item .. ',' .. cjson.encode(ex) .. ',' .. cjson.encode(rk) .. ']'
    redis.call('ZADD', KEYS[2 * n + 2], ARGV[2], tag)
    redis.call('HSET', KEYS[2 * n + 1], tag, record)
    return {KEYS[i], item}
  end
end
for i = 1, n do
  redis.call('LLEN', KEYS[i])
end
return nil
"""

#: Where a payload that cannot be decoded is kept (a Redis list per queue).
MALFORMED_SUFFIX = ".fair-malformed"

#: A RESP2 connection cannot be told when a queue fills: poll this often.
POLL_WAIT = 0.05

_FETCH, _WAIT = "fetch", "wait"


class _Pushed:
    """Marks a RESP3 push (an invalidation) read in place of a reply."""


_PUSHED = _Pushed()


class AtomicFetch:
    """The fetch path of one Kombu Redis channel, made atomic.

    Installed by :func:`install_atomic_fetch`, which replaces the channel's
    ``_brpop_start`` / ``_brpop_read`` pair (Kombu's poller keeps driving
    them).  ``on_fetch(seconds)`` is told the round trip of every fetch
    that returned a message (for adaptive prefetch).
    """

    def __init__(self, channel: Any, cycle: Any) -> None:
        self.channel = channel
        self.cycle = cycle
        self.mode = _FETCH
        self.pending: str | None = None
        self.recorded: Any = None  # delivery tag recorded by the script
        self.on_fetch: Callable[[float], None] | None = None
        self.fetches = self.waits = self.wakeups = self.malformed = 0
        self.tracking = False
        self._woken = False
        self._waking = False
        self._sha: str | None = None
        self._armed_sock: Any = None
        self._sent_at = 0.0
        prefix = getattr(channel, "global_keyprefix", "") or ""
        self._prefix = prefix
        self._wake_key = f"{prefix}_fair.wake.{uuid.uuid4().hex}"
        self._sep = getattr(channel, "sep", "\x06\x16")
        self._malformed: dict[str, str] = {}  # queue key -> its "malformed" list key

    # -- Kombu's poller calls these ---------------------------------------

    def start(self, timeout: float | None = None) -> None:
        """Kombu's ``_brpop_start``: send the next fetch, or the next wait."""
        channel = self.channel
        queues = channel._queue_cycle.consume(len(channel.active_queues))
        if not queues:
            return
        conn = channel.client.connection
        if conn._sock is not self._armed_sock:
            self._arm(conn)
        if self._woken:
            self.mode, self._woken = _FETCH, False
        if timeout is None:
            timeout = channel.brpop_timeout
        channel._in_poll = conn
        channel._brpop_sent_at = self._sent_at = monotonic()
        if self.mode == _FETCH:
            keys = [
                self._prefix + channel._q_for_pri(queue, pri)
                for pri in channel.priority_steps
                for queue in queues
            ]
            malformed = [self._malformed_key(key) for key in keys]  # cached per key
            unacked = [self._prefix + channel.unacked_key, self._prefix + channel.unacked_index_key]
            self.pending = _FETCH
            conn.send_command(
                "EVALSHA", self._sha, 2 * len(keys) + 2, *keys, *malformed, *unacked,
                len(keys), repr(time()),
            )  # fmt: skip
        else:
            wait = timeout if self.tracking else min(timeout or POLL_WAIT, POLL_WAIT)
            self.pending, self._waking = _WAIT, False
            self.waits += 1
            conn.send_command("BLPOP", self._wake_key, wait or 0)

    def read(self, **options: Any) -> Any:
        """Kombu's ``_brpop_read``: handle a reply, or a push during a wait."""
        channel = self.channel
        conn = channel.client.connection
        keep_polling = False
        try:
            try:
                if self.pending == _WAIT:
                    keep_polling = self._read_wait(conn)
                    raise Empty()
                if self.pending is None:
                    # Only pushes can arrive with nothing outstanding.
                    conn.read_response(push_request=True)
                    self._drain(conn)
                    if self._woken:
                        self.mode = _FETCH
                    raise Empty()
                self.pending = None
                reply = conn.read_response()
            except ResponseError as error:
                return self._script_error(error)
            except channel.connection_errors:
                conn.disconnect()
                self.pending, self.mode, self._armed_sock = None, _FETCH, None
                raise
            # Pushes that came before the reply were for changes the script
            # has seen; only those after it can mean a new message.
            self._woken = False
            if not reply:
                # About to wait: a push already received would not wake the
                # poller.  (After a message the next fetch reads past them.)
                self._drain(conn)
                self.mode = _FETCH if self._woken else _WAIT
                raise Empty()
            return self._deliver(reply)
        finally:
            if not keep_polling:
                channel._in_poll = None
                flush = getattr(channel, "_flush_brpop_reauth", None)
                if flush is not None:
                    flush()

    def _read_wait(self, conn: Any) -> bool:
        """Read during a wait; True while the BLPOP reply is still due."""
        while True:
            reply = conn.read_response(push_request=True)
            if reply is not _PUSHED:
                break
            # An invalidation: a watched queue changed.  End the BLPOP now.
            self._wake()
            if not conn.can_read(timeout=0):
                return True
        self.mode, self.pending = _FETCH, None
        return False

    def _deliver(self, reply: Any) -> bool:
        channel = self.channel
        self.fetches += 1
        key = _text(reply[0])
        queue = key[len(self._prefix) :].rsplit(self._sep, 1)[0]
        if len(reply) > 2:
            self._report_malformed(queue, reply[1])
            raise Empty()
        if self.on_fetch is not None:
            self.on_fetch(monotonic() - self._sent_at)
        payload = loads(_text(reply[1]))
        channel._queue_cycle.rotate(queue)
        self.recorded = payload["properties"]["delivery_tag"]
        try:
            channel.connection._deliver(payload, queue)
        finally:
            self.recorded = None
        return True

    # -- internals -----------------------------------------------------------

    def _arm(self, conn: Any) -> None:
        """A new connection: load the script and turn tracking on."""
        parser = getattr(conn, "_parser", None)
        setter = getattr(parser, "set_invalidation_push_handler", None)
        self.tracking = False
        if setter is not None and str(getattr(conn, "protocol", 2)) == "3":
            setter(self._on_invalidate)
            conn.send_command("CLIENT", "TRACKING", "ON", "NOLOOP")
            try:
                conn.read_response()
                self.tracking = True
            except ResponseError as exc:
                logger.warning(
                    "celery-fair: Redis refused client tracking (%s); idle fetches poll", exc
                )
        conn.send_command("SCRIPT", "LOAD", FETCH_SCRIPT)
        self._sha = _text(conn.read_response())
        self._armed_sock = conn._sock
        self.mode = _FETCH

    def _on_invalidate(self, response: Any) -> _Pushed:
        self._woken = True
        self.wakeups += 1
        return _PUSHED

    def _drain(self, conn: Any) -> None:
        """Read pushes already received (they would not wake the poller)."""
        while conn.can_read(timeout=0):
            if conn.read_response(push_request=True) is not _PUSHED:
                # Nothing but pushes can follow a complete reply.
                conn.disconnect()
                self._armed_sock = None
                return

    def _wake(self) -> None:
        if self._waking:
            return
        self._waking = True
        with self.channel.conn_or_acquire() as client:
            # The wake key only ever ends a BLPOP of this channel; a value
            # left after a timeout costs one extra fetch, and expires.
            client.pipeline(transaction=False).lpush(self._wake_key, 1).expire(
                self._wake_key, 60
            ).execute()

    def _script_error(self, error: Exception) -> bool:
        if "NOSCRIPT" in str(error):
            # The script cache was flushed (SCRIPT FLUSH, or a restart the
            # connection survived): load it again on the next fetch.
            self._armed_sock = None
            raise Empty()
        raise error

    def _malformed_key(self, key: str) -> str:
        found = self._malformed.get(key)
        if found is None:
            queue = key[len(self._prefix) :].rsplit(self._sep, 1)[0]
            found = self._malformed[key] = self._prefix + queue + MALFORMED_SUFFIX
        return found

    def _report_malformed(self, queue: str, item: Any) -> None:
        self.malformed += 1
        malformed_moved(self.cycle, queue, item)

    def statistics(self) -> dict[str, object]:
        """Counters for ``inspect fair_stats``."""
        return {
            "tracking": self.tracking,
            "fetches": self.fetches,
            "waits": self.waits,
            "wakeups": self.wakeups,
            "malformed": self.malformed,
        }


def malformed_moved(cycle: Any, queue: str, item: Any) -> None:
    """A payload of ``queue`` was moved aside: release its slot and say so."""
    with cycle.lock:
        cycle.scheduler.released(queue)
    cycle.last_fetched = None
    logger.error(
        "celery-fair: undecodable message on queue %r moved to %r: %r",
        queue, queue + MALFORMED_SUFFIX, item[:200],
    )  # fmt: skip


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def install_atomic_fetch(channel: Any, cycle: Any) -> AtomicFetch | None:
    """Give a Kombu Redis channel the atomic fetch; None if not Redis."""
    if not all(
        hasattr(channel, name)
        for name in ("_brpop_start", "_brpop_read", "handlers", "client", "unacked_index_key")
    ):
        return None
    fetch = AtomicFetch(channel, cycle)
    channel._brpop_start = fetch.start
    channel._brpop_read = fetch.read
    channel.handlers["BRPOP"] = fetch.read
    return fetch
