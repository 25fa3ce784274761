"""py-amqp under Celery's loop: reading the event connection only when a frame waits,
and the channel methods that per-queue prefetch windows wrap."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from .probes import Probe, _lacks, _names_used


def drain_events_without_wait(consumer: Any, probe: Probe) -> bool:
    """Green pools with broker heartbeats (Celery 5.7): no 100 ms wait per turn of the loop.

    Celery 5.7's ``synloop`` (the loop of ``-P gevent`` and ``-P eventlet``)
    ends every turn with ``_quick_drain(obj.event_dispatcher.connection)``,
    a ``drain_events(timeout=0.1)`` on the connection that publishes events,
    so that the broker's heartbeats on it are read.  Nothing but a heartbeat
    ever arrives there (one a minute with Celery's default 120 s), so every
    turn waits the full 100 ms; and each turn's ``drain_events`` on the task
    connection handles one AMQP method (py-amqp returns after one complete
    method).  A worker then reads at most about ten deliveries a second, however
    fast its pool.  It applies with Celery's defaults (the event dispatcher
    exists with gossip, heartbeat or ``-E``; ``broker_heartbeat`` is 120).

    The event connection's ``drain_events`` is replaced, on this instance, by
    one that reads only when something is there, and then with timeout 0 (as
    py-amqp's ``basic_publish`` drains before each publish): a heartbeat is
    read at the first turn after it arrived, and no turn waits.  The kernel is
    asked how many bytes its socket holds (``FIONREAD``), not ``select``:
    eventlet's green ``select`` switches to its hub at every call, even with
    timeout 0, so the loop would yield after every single delivery, the pool
    would start each task as it arrives and the DWRR dispatch would have
    nothing to choose from (measured with equal windows: p9/p0 1.0 for 10).
    Installed again at every start of the consumer (the dispatcher's
    connection is new each time).  Returns whether it was installed.
    """
    if getattr(consumer, "hub", None) is not None:
        return False  # an event loop (asynloop) registers the connection instead
    if not getattr(getattr(consumer, "pool", None), "is_green", False):
        return False
    dispatcher = getattr(consumer, "event_dispatcher", None)
    connection = getattr(dispatcher, "connection", None)
    if not getattr(consumer, "amqheartbeat", None) or connection is None:
        return False
    if not getattr(connection, "supports_heartbeats", False):
        return False  # Redis: the loop does not drain the event connection
    from celery.worker import loops

    code = getattr(getattr(loops, "synloop", None), "__code__", None)
    if code is None or "event_dispatcher" not in _names_used(code):
        return False  # Celery < 5.7: the loop does not wait on the event connection
    drain = connection.drain_events
    if getattr(drain, "fair_without_wait", False):
        return True
    sock = _amqp_socket(connection)
    try:
        _bytes_waiting(sock)
    except (AttributeError, ImportError, OSError, ValueError) as exc:
        probe.missing_capability(
            "celery.consumer.event_drain",
            f"event connection: Connection.connection.sock, FIONREAD ({exc!r})",
        )
        return False

    def fair_drain_events(timeout: float | None = None, **kwargs: Any) -> Any:
        if timeout is None:
            return drain(**kwargs)
        if not _frame_waiting(connection):
            # What the drain would raise after waiting ``timeout`` for nothing.
            raise TimeoutError("nothing to read")
        # Reads what is there and no more, as py-amqp's basic_publish does.
        return drain(timeout=0, **kwargs)

    fair_drain_events.fair_without_wait = True  # type: ignore[attr-defined]
    connection.drain_events = fair_drain_events
    return True


def _amqp_socket(connection: Any) -> Any:
    """The socket of a Kombu connection to an AMQP broker (py-amqp's ``sock``), or None."""
    try:
        return connection.connection.sock
    except Exception:  # noqa: BLE001 - closed, reconnecting: Kombu's own drain reports it
        return None


def _bytes_waiting(sock: Any) -> int:
    """Bytes the kernel holds for ``sock`` (``FIONREAD``), plus those TLS decrypted.

    Asked of the kernel directly: neither waits nor yields to a green hub.
    Raises ``OSError`` (closed socket) or ``ImportError`` (no ``fcntl``).
    """
    import fcntl
    import termios

    raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    held = int(struct.unpack("i", raw)[0])
    pending = getattr(sock, "pending", None)  # TLS: decrypted, not read yet
    return held + (int(pending()) if callable(pending) else 0)


def _frame_waiting(connection: Any) -> bool:
    """Whether ``connection`` has something to read now (True when that cannot be told)."""
    sock = _amqp_socket(connection)
    if sock is None:
        return True
    try:
        return _bytes_waiting(sock) > 0
    except (OSError, ValueError):
        return True  # closed: Kombu's own drain reads or reports it


#: The channel methods a per-queue window needs, and those adaptive windows follow.
_CONSUME_HOOKS = ("basic_consume", "basic_qos")
_SETTLEMENTS = ("basic_ack", "basic_reject", "basic_nack")


def probe_amqp_channel(channel: Any, qos: Any, probe: Probe, *, settlements: bool) -> None:
    """Check what :func:`wrap_basic_consume` (and :func:`follow_settlements`) replace."""
    lacking = _lacks(channel, _CONSUME_HOOKS + (_SETTLEMENTS[:2] if settlements else ()))
    if qos is not None and not hasattr(qos, "callback"):
        lacking.append("consumer.qos.callback")
    if lacking:
        probe.missing_capability("amqp.channel.consume_hooks", "Channel." + "/".join(lacking))


def wrap_basic_consume(channel: Any, before: Callable[[str, dict[str, Any]], None]) -> None:
    """Call ``before(queue, kwargs)`` just before each ``basic.consume`` on ``channel``."""
    basic_consume = channel.basic_consume

    def fair_basic_consume(queue: str, *args: Any, **kwargs: Any) -> Any:
        before(queue, kwargs)
        return basic_consume(queue, *args, **kwargs)

    channel.basic_consume = fair_basic_consume


def follow_settlements(channel: Any, settled: Callable[[Any], None]) -> None:
    """Call ``settled(delivery_tag)`` after each ack, reject or nack sent on ``channel``."""
    for name in _SETTLEMENTS:
        method = getattr(channel, name, None)
        if method is not None:
            setattr(channel, name, _then(method, settled))


def _then(method: Callable[..., Any], settled: Callable[[Any], None]) -> Callable[..., Any]:
    def fair_settle(delivery_tag: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(delivery_tag, *args, **kwargs)
        settled(delivery_tag)
        return result

    return fair_settle


def keep_prefetch_fixed(qos: Any) -> None:
    """Stop Celery's consumer QoS from growing the channel-wide window (ETA tasks)."""
    qos.callback = lambda prefetch_count: None
