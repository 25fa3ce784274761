"""redis-py's connections: the socket, and a plain connection outside a pool."""

from __future__ import annotations

from typing import Any

from .probes import _names_parameter


def broker_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a Redis at its ``maxmemory`` refusing a command (``OOM ...``,
    or a transaction Redis discarded for it)."""
    from redis.exceptions import ExecAbortError, ResponseError

    seen: BaseException | None = exc
    for _ in range(3):  # the OOM reply may be the cause of an EXECABORT
        if seen is None:
            return False
        if isinstance(seen, ResponseError) and not isinstance(seen, ExecAbortError):
            text = str(seen)
            if "maxmemory" in text or text.startswith("OOM"):
                return True
        seen = seen.__cause__ or seen.__context__
    return False


def not_permitted(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a command to this user (its ACL: ``NOPERM``)."""
    from redis.exceptions import NoPermissionError

    return isinstance(exc, NoPermissionError)


def socket_of(connection: Any) -> Any:
    """The socket of a redis-py connection (None when disconnected)."""
    return getattr(connection, "_sock", None)


def plain_connection(pool: Any) -> Any:
    """A new RESP2 connection to the server of a redis-py ``pool``, outside the pool.

    Built from the pool's public ``connection_class`` and
    ``connection_kwargs`` (Sentinel pools put themselves there, so it reaches
    the current master).  RESP2 because a RESP3 connection receives
    invalidations as push messages that redis-py's parsers route elsewhere.
    Never of Kombu's own connection class (see :func:`_outside_kombu`).
    """
    # redis-py 8's maintenance notifications need RESP3: not for this connection.
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if not k.startswith("maint_")}
    cls = _outside_kombu(pool.connection_class)
    master = getattr(pool, "get_master_address", None)
    if callable(master):
        # A Sentinel pool: how its own connections learn the master's address
        # differs between redis-py releases (6.x sets it in the pool, not in
        # the connection class), so ask the pool and connect there directly.
        from redis.connection import Connection, SSLConnection
        from redis.sentinel import SentinelManagedConnection

        kwargs.pop("connection_pool", None)
        kwargs["host"], kwargs["port"] = master()
        if issubclass(cls, SentinelManagedConnection) or not issubclass(cls, Connection):
            cls = SSLConnection if issubclass(cls, SSLConnection) else Connection
    if "protocol" in kwargs or _names_parameter(cls, "protocol"):  # redis-py >= 5
        kwargs["protocol"] = 2
    return cls(**kwargs)


def _outside_kombu(cls: type) -> type:
    """The nearest class of ``cls``'s lineage that is not Kombu's.

    Kombu's channel gives the pool of its event-loop client a subclass whose
    ``disconnect()`` tells the channel: Kombu before 5.7 then clears the
    channel's in-flight fetch and takes its poller off the worker's event
    loop for good (``Transport.register_with_event_loop``, ``_on_disconnect``
    removes ``on_poll_start`` from ``loop.on_tick``).  A connection of
    celery-fair's own that closes (a listener refused by an ACL, or one that
    reconnects) must not stop the worker's consuming.
    """
    for base in cls.__mro__:
        if not base.__module__.startswith("kombu."):
            return base
    return cls
