"""Wake an idle atomic fetch when a queue it watches changes, on RESP2 and RESP3.

A Lua script cannot block, so the atomic fetch waits for work apart from
the fetch itself (:mod:`celery_fair.kombu.atomic`).  Redis's client-side
caching tells it when to look again: with ``CLIENT TRACKING ON`` the server
remembers the keys a connection read and sends an invalidation when one of
them changes.  With ``REDIRECT <id>`` it sends those invalidations to
another connection instead, which in RESP2 receives them as messages on the
Pub/Sub channel ``__redis__:invalidate`` (Redis manual, "Client-side
caching", "Two connections mode").

That is what :class:`InvalidationListener` is: one connection of its own,
subscribed to that channel, read by a daemon thread.  It works with every
redis-py from 4.6 (which has no RESP3) and with RESP3 connections alike,
and needs nothing of redis-py but public connection methods.  Each
invalidation calls ``on_invalidate``, which ends the fetch's blocking wait.

Before, the wait relied on RESP3 pushes on the fetch connection itself;
redis-py before 8 speaks RESP2 by default, so an idle worker polled every
50 ms, which Redis (``hz 10``) answers only about every 100 ms: a task sent
to an idle worker started after a median 103 ms instead of 5 ms.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError

from .. import compat

__all__ = ("INVALIDATE_CHANNEL", "Alarm", "InvalidationListener")

logger = logging.getLogger(__name__)

#: Where Redis sends redirected invalidations to a RESP2 connection.
INVALIDATE_CHANNEL = "__redis__:invalidate"

#: How often the listener checks whether it should stop (seconds).
STOP_CHECK = 1.0
#: Seconds between attempts when the server refuses the subscription (an ACL
#: without the channel): the fetch polls meanwhile; an ACL changed later is found.
REFUSED_RETRY = 60.0


class InvalidationListener:
    """A connection subscribed to invalidations, and the thread that reads it.

    ``pool`` is the redis-py connection pool of the channel (its server, its
    credentials, its Sentinel master).  ``client_id`` is the listener's
    connection id for ``CLIENT TRACKING ON REDIRECT`` (None while it is not
    connected), and ``generation`` grows at every new connection: a fetch
    connection that was redirected to an older one must redirect again.
    ``stop_when()`` is checked every second (the channel closed).
    """

    def __init__(
        self,
        pool: Any,
        on_invalidate: Callable[[], None],
        *,
        stop_when: Callable[[], bool] = lambda: False,
        name: str = "celery-fair-wakeup",
    ) -> None:
        self.pool = pool
        self.on_invalidate = on_invalidate
        self.stop_when = stop_when
        self.client_id: int | None = None
        self.generation = 0
        self.invalidations = 0
        self.reconnects = 0
        #: The server refused ``CLIENT ID`` or ``SUBSCRIBE`` (said once, retried slowly).
        self.refused = False
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._conn: Any = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self, timeout: float = 5.0) -> bool:
        """Connect and subscribe; True when listening within ``timeout`` s."""
        self._thread.start()
        self._ready.wait(timeout)
        return self.client_id is not None

    def close(self) -> None:
        """Stop the thread and close its connection."""
        self._stop.set()
        conn = self._conn
        if conn is not None:
            conn.disconnect()

    def _stopping(self) -> bool:
        return self._stop.is_set() or self.stop_when()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stopping():
            conn = None
            try:
                conn = compat.plain_connection(self.pool)
                conn.send_command("CLIENT", "ID")
                client_id = int(conn.read_response())
                conn.send_command("SUBSCRIBE", INVALIDATE_CHANNEL)
                conn.read_response()  # the subscription's confirmation
                self._conn, self.client_id = conn, client_id
                self.generation += 1
                backoff, self.refused = 0.1, False
                # Whatever the fetch connection was told before is lost with
                # the old listener: let it look again, and redirect anew.
                # Before ``start`` returns: its caller sees that wake-up pushed.
                self.on_invalidate()
                self._ready.set()
                while not self._stopping():
                    if conn.can_read(timeout=STOP_CHECK):
                        conn.read_response()
                        self.invalidations += 1
                        self.on_invalidate()
            except ResponseError as exc:
                # An ACL refused the command (NoPermissionError is a ResponseError):
                # said once; the fetch polls; retried slowly, quietly.
                if not self.refused and not self._stopping():
                    logger.warning(
                        "celery-fair: Redis refused the invalidation listener (%s); idle "
                        "fetches poll instead (allow the channel %s to wake them at once)",
                        exc, INVALIDATE_CHANNEL,
                    )  # fmt: skip
                self.refused = True
                backoff = REFUSED_RETRY / 2  # doubled below, capped at REFUSED_RETRY
            except Exception as exc:  # noqa: BLE001 - reconnect whatever it was
                if not self._stopping():
                    self.reconnects += 1
                    logger.warning(
                        "celery-fair: invalidation listener lost its connection (%r); "
                        "idle fetches poll until it is back",
                        exc,
                    )
            finally:
                self.client_id, self._conn = None, None
                if conn is not None:
                    conn.disconnect()
                self._ready.set()
            self._stop.wait(backoff)
            backoff = min(2 * backoff, REFUSED_RETRY if self.refused else 2.0)


class Alarm:
    """Calls ``ring`` once at a deadline, from a thread of its own (started at first use).

    Redis ends a blocking command's timeout at its ``hz`` tick (10 a second by
    default), so a fetch that waits until a scheduled message or a throttled
    key is due would wake up to 100 ms late.  The alarm wakes it on time with
    a push to its wake key, which Redis answers at once; the wait's own
    timeout stays as the fallback.
    """

    def __init__(self, ring: Callable[[], None], *, name: str = "celery-fair-alarm") -> None:
        self.ring = ring
        self.name = name
        self.rung = 0
        self._deadline: float | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def set(self, delay: float) -> None:
        """Ring in ``delay`` seconds (replaces a deadline not yet reached)."""
        with self._cond:
            if self._closed:
                return
            self._deadline = time.monotonic() + max(0.0, delay)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def cancel(self) -> None:
        """Do not ring for the deadline set."""
        with self._cond:
            self._deadline = None

    def close(self) -> None:
        """Stop the thread."""
        with self._cond:
            self._closed = True
            self._deadline = None
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    deadline = self._deadline
                    if deadline is None:
                        self._cond.wait()
                        continue
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._deadline = None
                        break
                    self._cond.wait(left)
                if self._closed:
                    return
            self.rung += 1
            try:
                self.ring()
            except Exception as exc:  # the wait's own timeout still ends it
                logger.debug("celery-fair: the alarm could not wake the fetch (%r)", exc)
