"""Limit tokens on RabbitMQ: mint, take, give back and spend them (one connection).

The broker side of :mod:`celery_fair.keys.tokens`, on a connection of its
own (the worker's consumer connection is driven by Celery's event loop).
Every call is one short synchronous round trip, made under a lock: the
thread pool gives tokens back from its threads.

**Minting, exactly once per set.**  A set is minted by the one connection
that holds its exclusive mint-lock queue (RabbitMQ refuses a second holder,
and deletes the queue when its connection closes).  The holder declares the
token queue, purges it (a minter that died half-way left a partial set,
which no one has taken: tokens are taken only once minted), publishes the
tokens with publisher confirms, and only then declares the marker exchange
and binds it to the token queue.  The marker is auto-deleted when its
binding goes, that is when the token queue expires unused
(:data:`~celery_fair.keys.tokens.TOKEN_EXPIRES`), so a marker never
outlives its tokens.

**Heartbeats are off** on this connection: nothing reads it between calls,
so the broker would close it after two missed heartbeats and give back the
tokens of tasks still running.  A worker that dies closes its socket and
the broker gives its tokens back at once; after a fork the pool's processes
close their copy of the socket, so a dead worker's children do not keep it
open.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from time import monotonic
from typing import Any

from .limits import CONCURRENCY, RATE
from .tokens import TOKEN_EXPIRES, HeldToken, TokenSpec

__all__ = ("TokenClient",)

logger = logging.getLogger(__name__)

#: Seconds between redeclares of a rate's wait queue: messages passing
#: through do not count as use, so without them it would expire.
_TOUCH_EVERY = 600.0
#: Seconds a failed connection is not tried again.
_RETRY_AFTER = 1.0


class TokenClient:
    """Token operations on the broker of ``connect()`` (a Kombu connection, unconnected).

    Two channels: one *holds* the tokens (``basic.get`` and ``basic.reject``
    only), the other declares, checks and mints.  RabbitMQ closes a channel
    on a refusal (a marker not found: 404, a mint lock held: 405), and a
    closed channel's unacknowledged messages go back: the tokens of tasks
    still running must not go with a refused check.

    Failures of the broker are not raised: a token that cannot be taken is
    a token not free (the task waits, which never exceeds a limit), and a
    give-back that cannot be sent went back when its channel closed.
    """

    def __init__(
        self, connect: Callable[[], Any], *, clock: Callable[[], float] = monotonic
    ) -> None:
        self._connect = connect
        self._clock = clock
        self._lock = threading.RLock()
        self._connection: Any = None
        self._holder: Any = None
        self._admin: Any = None
        self._minted: set[str] = set()
        self._touched: dict[str, float] = {}
        self._failed_at: float | None = None
        #: Bumped at every new holding channel: tokens taken on an earlier one went back.
        self.generation = 0
        self.on_lost: Callable[[int], None] | None = None
        self.errors = 0
        self.mints = 0
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget_in_child)

    # -- the connection ----------------------------------------------------------

    def _ready(self) -> bool:
        """Whether both channels are open, connecting if needed (False: the broker is away)."""
        if self._holder is not None and self._admin is not None:
            return True
        if self._failed_at is not None and self._clock() - self._failed_at < _RETRY_AFTER:
            return False
        try:
            if self._connection is None:
                connection = self._connect()
                connection.ensure_connection(max_retries=1)
                self._connection = connection
                self._minted.clear()
            if self._holder is None:
                self._holder = self._connection.channel()
                self.generation += 1
            if self._admin is None:
                self._admin = self._connection.channel()
        except Exception as exc:  # noqa: BLE001 - any broker failure: try again later
            self._failed(exc)
            return False
        self._failed_at = None
        return True

    def _failed(self, exc: BaseException) -> None:
        """The connection is unusable: drop it; its tokens went back on the broker."""
        self.errors += 1
        logger.warning("celery-fair: key limit tokens: the broker connection failed: %r", exc)
        self._lose_holder()
        connection, self._connection, self._admin = self._connection, None, None
        if connection is not None:
            # It is gone either way.
            with contextlib.suppress(Exception):
                connection.release()
        self._failed_at = self._clock()

    def _lose_holder(self) -> None:
        """The holding channel closed: the broker took back every token it held."""
        had, self._holder = self._holder, None
        if had is not None and self.on_lost is not None:
            self.on_lost(self.generation)

    def _forget_in_child(self) -> None:
        # A pool process must not keep the worker's token connection open: close
        # the child's copy of the socket only (no AMQP close, no shutdown()).
        connection, self._connection = self._connection, None
        self._holder = self._admin = None
        sock = getattr(getattr(connection, "connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        self._lock = threading.RLock()

    def close(self) -> None:
        """Close the connection: every token it holds goes back."""
        with self._lock:
            connection, self._connection = self._connection, None
            self._holder = self._admin = None
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.release()

    def _errors(self) -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
        """(connection errors, channel errors) of the transport."""
        connection = self._connection
        conn_errors = tuple(getattr(connection, "connection_errors", ())) + (OSError,)
        chan_errors = tuple(getattr(connection, "channel_errors", ())) or (OSError,)
        return conn_errors, chan_errors

    # -- tokens --------------------------------------------------------------------

    def take(self, spec: TokenSpec) -> HeldToken | None:
        """A token of ``spec`` if one is free now (a rate's is spent at once)."""
        with self._lock:
            if not self._ready() or not self._ensure(spec):
                return None
            conn_errors, chan_errors = self._errors()
            holder = self._holder
            try:
                message = holder.basic_get(spec.name, no_ack=False)
                if message is None:
                    return None
                tag = message.delivery_tag
                if spec.kind == RATE:
                    # Spent: dead-lettered through the wait queue, back after the period.
                    holder.basic_reject(tag, requeue=False)
                token = HeldToken(spec, tag, self.generation)
                if spec.kind == RATE:
                    self._touch(spec)
                return token
            except chan_errors:
                # The token queue is gone (deleted, expired): mint again next time.
                self._minted.discard(spec.name)
                self._lose_holder()
                return None
            except conn_errors as exc:
                self._failed(exc)
                return None

    def give_back(self, token: HeldToken) -> bool:
        """Return a concurrency token taken on this channel (False: it went back already)."""
        if token.spec.kind != CONCURRENCY:
            return False
        with self._lock:
            if token.generation != self.generation or self._holder is None:
                return False
            conn_errors, chan_errors = self._errors()
            try:
                self._holder.basic_reject(token.tag, requeue=True)
                return True
            except chan_errors:
                self._lose_holder()
            except conn_errors as exc:
                self._failed(exc)
            return False

    # -- minting (on the admin channel) ----------------------------------------------

    def _ensure(self, spec: TokenSpec) -> bool:
        """Whether ``spec``'s tokens exist (minting them if this connection may)."""
        if spec.name in self._minted:
            return True
        conn_errors, _ = self._errors()
        try:
            minted = self._marked(spec) or self._mint(spec)
        except conn_errors as exc:
            self._failed(exc)
            return False
        if minted:
            self._minted.add(spec.name)
        return minted

    def _refused(self) -> None:
        """The admin channel was closed by a refusal: open another."""
        self._admin = None
        if self._connection is not None:
            self._admin = self._connection.channel()

    def _marked(self, spec: TokenSpec) -> bool:
        _, chan_errors = self._errors()
        try:
            self._admin.exchange_declare(spec.marker, "fanout", passive=True)
            return True
        except chan_errors:
            self._refused()  # 404: not minted
            return False

    def _mint(self, spec: TokenSpec) -> bool:
        """Mint ``spec``'s tokens unless another connection is minting them."""
        _, chan_errors = self._errors()
        try:
            self._admin.queue_declare(spec.mint_lock, exclusive=True, auto_delete=True)
        except chan_errors:
            self._refused()  # 405: another worker mints; its tokens come soon
            return False
        try:
            if self._marked(spec):
                return True
            admin = self._admin
            self._declare(admin, spec)
            admin.queue_purge(spec.name)
            if spec.kind == RATE:
                admin.queue_purge(spec.wait)
            from amqp import Message

            for _ in range(spec.count):
                admin.basic_publish_confirm(
                    Message(b"", delivery_mode=2), exchange="", routing_key=spec.name
                )
            admin.exchange_declare(spec.marker, "fanout", durable=True, auto_delete=True)
            admin.queue_bind(spec.name, spec.marker, routing_key="")
            self.mints += 1
            logger.info(
                "celery-fair: minted %d %s token(s) for key %r of %s (%s)",
                spec.count, "concurrency" if spec.kind == CONCURRENCY else "rate", spec.key,
                spec.queue, spec.name,
            )  # fmt: skip
            return True
        finally:
            if self._admin is not None:
                try:
                    self._admin.queue_delete(spec.mint_lock)
                except chan_errors:
                    self._refused()

    def _declare(self, channel: Any, spec: TokenSpec) -> None:
        arguments: dict[str, Any] = {
            "x-queue-type": "classic",
            "x-expires": int(TOKEN_EXPIRES * 1000),
        }
        if spec.kind == RATE:
            arguments.update({"x-dead-letter-exchange": "", "x-dead-letter-routing-key": spec.wait})
            channel.queue_declare(
                spec.wait, durable=True, auto_delete=False, arguments=_wait_arguments(spec)
            )
        channel.queue_declare(spec.name, durable=True, auto_delete=False, arguments=arguments)

    def _touch(self, spec: TokenSpec) -> None:
        """Keep a rate's wait queue from expiring while its tokens pass through it."""
        now = self._clock()
        last = self._touched.get(spec.wait)
        if last is not None and now - last < _TOUCH_EVERY:
            return
        self._touched[spec.wait] = now
        if last is not None:
            _, chan_errors = self._errors()
            try:
                self._admin.queue_declare(
                    spec.wait, durable=True, auto_delete=False, arguments=_wait_arguments(spec)
                )
            except chan_errors:
                self._refused()


def _wait_arguments(spec: TokenSpec) -> dict[str, Any]:
    """A rate's wait queue: a spent token expires after the period and goes back."""
    return {
        "x-queue-type": "classic",
        "x-expires": int(TOKEN_EXPIRES * 1000),
        "x-message-ttl": max(1, round(spec.period * 1000)),
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": spec.name,
    }
