"""A connection of its own to RabbitMQ, for calls made beside Celery's event loop.

Celery's event loop drives the worker's consumer connection: the limit
tokens (:mod:`.token_client`), the backlog counters (:mod:`.backlog_counter`)
and the pause log (:mod:`.pause_log`) each talk to the broker on a
:class:`SideConnection` instead, which keeps what they share in one place:

* **Heartbeats off.**  Nothing reads the connection between calls, so the
  broker would close it after two missed heartbeats (and give back the
  limit tokens of tasks still running).  A worker that dies closes its
  socket, and the broker cleans up at once.
* **Named channels**, opened on first use.  RabbitMQ closes a channel on a
  refusal (a queue not found: 404; an exclusive queue held elsewhere: 405),
  and a closed channel's unacknowledged messages go back: the caller says
  which channel was refused, and the next call opens another.
* **Failures**: the connection is dropped, counted, logged once per failure,
  and not tried again for :data:`RETRY_AFTER` seconds by :meth:`ready`.
* **Fork**: a forked child (a prefork pool process) closes its copy of the
  socket only, without an AMQP close that would end the parent's
  connection, so that a dead worker's pool processes do not keep its
  connection (and the tokens it holds) open; the child opens its own if it
  needs one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from time import monotonic
from typing import Any

__all__ = ("RETRY_AFTER", "SideConnection")

logger = logging.getLogger(__name__)

#: Seconds a failed connection is not tried again by :meth:`SideConnection.ready`.
RETRY_AFTER = 1.0

_Errors = tuple[type[BaseException], ...]


class SideConnection:
    """One connection to the broker of ``connect()`` (a new, unconnected Kombu connection
    at each call), with heartbeats off and channels by name.

    ``purpose`` names it in the warnings (``"key limit tokens"``).
    ``on_drop(names)``: called with the names of the open channels the broker
    took back (a refusal or a failed connection), not at :meth:`close`.
    Callers hold :attr:`lock` around their calls when several threads share it.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        purpose: str,
        *,
        clock: Callable[[], float] = monotonic,
        on_drop: Callable[[frozenset[str]], None] | None = None,
    ) -> None:
        self._connect = connect
        self.purpose = purpose
        self._clock = clock
        self.on_drop = on_drop
        self.lock = threading.RLock()
        self._connection: Any = None
        self._channels: dict[str, Any] = {}
        self._failed_at: float | None = None
        #: Failures of the broker (each dropped the connection).
        self.errors = 0
        #: Connections made so far (what a caller declared on an earlier one may be gone).
        self.connections = 0
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget_in_child)

    @property
    def connection(self) -> Any:
        """The connected Kombu connection, or None."""
        return self._connection

    def errors_of(self) -> tuple[_Errors, _Errors]:
        """(connection errors, channel errors) of this broker's transport (OSError with
        neither known, before a connection)."""
        connection = self._connection
        conn_errors = tuple(getattr(connection, "connection_errors", ())) + (OSError,)
        chan_errors = tuple(getattr(connection, "channel_errors", ())) or (OSError,)
        return conn_errors, chan_errors

    def has(self, name: str) -> bool:
        """Whether channel ``name`` is open (as far as known)."""
        return name in self._channels

    def channel(self, name: str) -> Any:
        """Channel ``name``, connecting and opening it if needed; raises the broker's errors."""
        channel = self._channels.get(name)
        if channel is not None:
            return channel
        if self._connection is None:
            # Heartbeats off (see the module's docstring); a clone keeps it off after
            # a failover to another of the broker's URLs.
            connection = self._connect().clone(heartbeat=0)
            connection.ensure_connection(max_retries=1)
            self._connection = connection
            self.connections += 1
        channel = self._channels[name] = self._connection.channel()
        self._failed_at = None
        return channel

    def ready(self, name: str) -> Any:
        """Channel ``name``, or None while the broker cannot be reached (a failure is
        counted and logged, and not tried again for :data:`RETRY_AFTER` s)."""
        channel = self._channels.get(name)
        if channel is not None:
            return channel
        if self._failed_at is not None and self._clock() - self._failed_at < RETRY_AFTER:
            return None
        try:
            return self.channel(name)
        except Exception as exc:  # noqa: BLE001 - any broker failure: try again later
            self.failed(exc)
            return None

    def refused(self, name: str) -> None:
        """The broker closed channel ``name`` (a refusal): the next call opens another."""
        if self._channels.pop(name, None) is not None and self.on_drop is not None:
            self.on_drop(frozenset((name,)))

    def failed(self, exc: BaseException) -> None:
        """The connection is unusable: drop it (the broker took back what it held)."""
        self.errors += 1
        self._failed_at = self._clock()
        logger.warning("celery-fair: %s: the broker connection failed: %r", self.purpose, exc)
        dropped = frozenset(self._channels)
        self._release()
        if dropped and self.on_drop is not None:
            self.on_drop(dropped)

    def close(self) -> None:
        """Close the connection: whatever its channels held goes back."""
        with self.lock:
            self._release()

    def _release(self) -> None:
        connection, self._connection = self._connection, None
        self._channels = {}
        if connection is not None:
            with contextlib.suppress(Exception):  # it is gone either way
                connection.release()

    def _forget_in_child(self) -> None:
        # Close this process's copy of the socket only: no AMQP close and no
        # shutdown(), which would end the connection for the parent too.
        connection, self._connection, self._channels = self._connection, None, {}
        sock = getattr(getattr(connection, "connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        self.lock = threading.RLock()
