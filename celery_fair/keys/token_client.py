"""Limit tokens on RabbitMQ: mint, take, give back and spend them.

The broker side of :mod:`celery_fair.keys.tokens`, on two connections of its
own (the worker's consumer connection is driven by Celery's event loop):

* the **holder** takes, gives back and spends tokens: one short round trip
  per call, on the worker's event loop, under a lock (the thread pool gives
  tokens back from its threads);
* the **minter**, a thread, finds out whether a key's set exists and mints
  it if not.  A mint declares queues and an exchange and waits for the
  broker to write the tokens: 30-50 ms on this machine, too long to hold
  the event loop.  Until a key's set is known, its tasks wait aside.

Two connections also keep refusals apart from held tokens: RabbitMQ closes
a channel on a refusal (a marker not found: 404, a mint lock held: 405),
and a closed channel's unacknowledged messages go back.

**Minting, exactly once per set.**  A set is minted by the one connection
that holds its exclusive mint-lock queue (RabbitMQ refuses a second holder,
and deletes the queue when its connection closes).  The holder declares the
token queue, purges it (a minter that died half-way left a partial set,
which no one has taken: tokens are taken only once minted), publishes the
tokens in one transaction (its commit returns once the broker has them), and
only then declares the marker exchange and binds it to the token queue.  The
marker is auto-deleted when its binding goes, that is when the token queue
expires unused (:data:`~celery_fair.keys.tokens.TOKEN_EXPIRES`), so a marker
never outlives its tokens.

Both are :class:`~.side_connection.SideConnection` (heartbeats off: a
worker's tokens go back only when it dies or closes them).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from time import monotonic
from typing import Any

from .limits import CONCURRENCY, RATE
from .side_connection import RETRY_AFTER, SideConnection
from .tokens import TOKEN_EXPIRES, HeldToken, TokenSpec

__all__ = ("TokenClient",)

logger = logging.getLogger(__name__)

#: Seconds between redeclares of a rate's wait queue: messages passing
#: through do not count as use, so without them it would expire.
_TOUCH_EVERY = 600.0


class TokenClient:
    """Token operations on the broker of ``connect()`` (a new, unconnected Kombu connection
    at each call).

    Failures of the broker are not raised: a token that cannot be taken is
    a token not free (the task waits, which never exceeds a limit), and a
    give-back that cannot be sent went back when its channel closed.
    """

    def __init__(
        self, connect: Callable[[], Any], *, clock: Callable[[], float] = monotonic
    ) -> None:
        self.side = SideConnection(connect, "key limit tokens", clock=clock, on_drop=self._dropped)
        self.minter = _Minter(connect, clock=clock)
        #: Bumped at every new holding channel: tokens taken on an earlier one went back.
        self.generation = 0
        self.on_lost: Callable[[int], None] | None = None

    @property
    def mints(self) -> int:
        return self.minter.mints

    @property
    def errors(self) -> int:
        """Failures of the holder's connection."""
        return self.side.errors

    def _holder(self) -> Any:
        """The holding channel, opened if needed (None while the broker is away)."""
        fresh = not self.side.has(_HOLDER)
        holder = self.side.ready(_HOLDER)
        if holder is not None and fresh:
            self.generation += 1
        return holder

    def _dropped(self, channels: frozenset[str]) -> None:
        """The holding channel closed: the broker took back every token it held."""
        if _HOLDER in channels and self.on_lost is not None:
            self.on_lost(self.generation)

    def close(self) -> None:
        """Close the connections: every token they hold goes back."""
        self.side.close()
        self.minter.close()

    # -- tokens --------------------------------------------------------------------

    def take(self, spec: TokenSpec) -> HeldToken | None:
        """A token of ``spec`` if one is free now (a rate's is spent at once).

        None too while the set is not yet known to exist: the minter looks
        (and mints) in the background; the caller tries again later.
        """
        if not self.minter.ready(spec):
            return None
        with self.side.lock:
            holder = self._holder()
            if holder is None:
                return None
            conn_errors, chan_errors = self.side.errors_of()
            try:
                message = holder.basic_get(spec.name, no_ack=False)
                if message is None:
                    return None
                tag = message.delivery_tag
                if spec.kind == RATE:
                    # Spent: dead-lettered through the wait queue, back after the period.
                    holder.basic_reject(tag, requeue=False)
                    self.minter.spent(spec)
                return HeldToken(spec, tag, self.generation)
            except chan_errors:
                # The token queue is gone (deleted, expired): mint it again.
                self.minter.forget(spec)
                self.side.refused(_HOLDER)
                return None
            except conn_errors as exc:
                self.side.failed(exc)
                return None

    def give_back(self, token: HeldToken) -> bool:
        """Return a concurrency token taken on this channel (False: it went back already)."""
        if token.spec.kind != CONCURRENCY:
            return False
        with self.side.lock:
            if token.generation != self.generation or not self.side.has(_HOLDER):
                return False
            conn_errors, chan_errors = self.side.errors_of()
            try:
                self.side.channel(_HOLDER).basic_reject(token.tag, requeue=True)
                return True
            except chan_errors:
                self.side.refused(_HOLDER)
            except conn_errors as exc:
                self.side.failed(exc)
            return False


#: The channel that takes and holds tokens.
_HOLDER = "holder"
#: The minter's channel (declarations, mint locks, the tokens' publishes).
_ADMIN = "admin"


class _Minter:
    """Finds out, in a thread, whether a key's token set exists, and mints it if not."""

    def __init__(self, connect: Callable[[], Any], *, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._known: set[str] = set()
        self._asked: set[str] = set()
        self._requests: queue.Queue[TokenSpec | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.side = SideConnection(connect, "key limit tokens, minting", clock=clock)
        self._touched: dict[str, float] = {}
        self.mints = 0
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget_in_child)

    def ready(self, spec: TokenSpec) -> bool:
        """Whether ``spec``'s set is known to exist (if not, it is looked for now)."""
        with self._lock:
            if spec.name in self._known:
                return True
            if spec.name in self._asked:
                return False
            self._asked.add(spec.name)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="celery-fair-key-tokens", daemon=True
                )
                self._thread.start()
        self._requests.put(spec)
        return False

    def forget(self, spec: TokenSpec) -> None:
        """``spec``'s token queue was not found: look for (and mint) it again."""
        with self._lock:
            self._known.discard(spec.name)
            self._asked.discard(spec.name)

    def spent(self, spec: TokenSpec) -> None:
        """A rate token was spent: keep the wait queue alive now and then."""
        now = self._clock()
        with self._lock:
            last = self._touched.get(spec.wait)
            if last is None:
                self._touched[spec.wait] = now
                return
            if now - last < _TOUCH_EVERY:
                return
            self._touched[spec.wait] = now
        self._requests.put(spec)  # a look at a known rate set redeclares its wait queue

    @property
    def errors(self) -> int:
        """Failures of the minter's connection."""
        return self.side.errors

    def close(self) -> None:
        self._requests.put(None)
        self.side.close()

    def _forget_in_child(self) -> None:
        # The side connection forgets its own (it registered first).
        self._lock = threading.Lock()
        self._thread = None
        self._requests = queue.Queue()
        self._asked = set(self._known)

    # -- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            spec = self._requests.get()
            if spec is None:
                return
            try:
                found = self._look(spec)
            except Exception as exc:  # noqa: BLE001 - the broker away: try again later
                self.side.failed(exc)
                found = False
            with self._lock:
                if found:
                    self._known.add(spec.name)
                else:
                    # Asked again by the next take: a minter elsewhere, or the broker back.
                    self._asked.discard(spec.name)
            if not found:
                connected = self.side.connection is not None
                threading.Event().wait(0.05 if connected else RETRY_AFTER)

    def _channel(self) -> Any:
        return self.side.channel(_ADMIN)

    def _refused(self) -> None:
        """The channel was closed by a refusal (404, 405): the next call opens another."""
        self.side.refused(_ADMIN)

    def _look(self, spec: TokenSpec) -> bool:
        """Whether ``spec``'s set exists now, minting it if this connection may."""
        if spec.name in self._known:
            if spec.kind == RATE:
                self._channel().queue_declare(
                    spec.wait, durable=True, auto_delete=False, arguments=_wait_arguments(spec)
                )
            return True
        return self._marked(spec) or self._mint(spec)

    def _marked(self, spec: TokenSpec) -> bool:
        admin = self._channel()
        _, chan_errors = self.side.errors_of()
        try:
            admin.exchange_declare(spec.marker, "fanout", passive=True)
            return True
        except chan_errors:
            self._refused()  # 404: not minted
            return False

    def _mint(self, spec: TokenSpec) -> bool:
        """Mint ``spec``'s tokens unless another connection is minting them."""
        admin = self._channel()
        _, chan_errors = self.side.errors_of()
        try:
            admin.queue_declare(spec.mint_lock, exclusive=True, auto_delete=True)
        except chan_errors:
            self._refused()  # 405: another worker mints; its tokens come soon
            return False
        try:
            if self._marked(spec):
                return True
            admin = self._channel()
            _declare(admin, spec)
            admin.queue_purge(spec.name)
            if spec.kind == RATE:
                admin.queue_purge(spec.wait)
            from amqp import Message

            # One transaction: its commit returns once the broker has every token
            # (persistent ones written): one wait for the set, not one per token.
            admin.tx_select()
            for _ in range(spec.count):
                admin.basic_publish(
                    Message(b"", delivery_mode=2), exchange="", routing_key=spec.name
                )
            admin.tx_commit()
            admin.exchange_declare(spec.marker, "fanout", durable=True, auto_delete=True)
            admin.queue_bind(spec.name, spec.marker, routing_key="")
            self.mints += 1
            logger.debug(
                "celery-fair: minted %d %s token(s) for key %r of %s (%s)",
                spec.count, "concurrency" if spec.kind == CONCURRENCY else "rate", spec.key,
                spec.queue, spec.name,
            )  # fmt: skip
            return True
        finally:
            if self.side.has(_ADMIN):
                try:
                    self._channel().queue_delete(spec.mint_lock)
                except chan_errors:
                    self._refused()


def _declare(channel: Any, spec: TokenSpec) -> None:
    arguments: dict[str, Any] = {"x-queue-type": "classic", "x-expires": int(TOKEN_EXPIRES * 1000)}
    if spec.kind == RATE:
        arguments.update({"x-dead-letter-exchange": "", "x-dead-letter-routing-key": spec.wait})
        channel.queue_declare(
            spec.wait, durable=True, auto_delete=False, arguments=_wait_arguments(spec)
        )
    channel.queue_declare(spec.name, durable=True, auto_delete=False, arguments=arguments)


def _wait_arguments(spec: TokenSpec) -> dict[str, Any]:
    """A rate's wait queue: a spent token expires after the period and goes back."""
    return {
        "x-queue-type": "classic",
        "x-expires": int(TOKEN_EXPIRES * 1000),
        "x-message-ttl": max(1, round(spec.period * 1000)),
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": spec.name,
    }
