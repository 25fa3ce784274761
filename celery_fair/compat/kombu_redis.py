"""Kombu's Redis transport: the channel's fetch, queue cycle, keys and QoS."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

from kombu.transport.virtual import QoS as VirtualQoS

from ..errors import CompatibilityError
from .probes import KOMBU_BRPOP_TIMEOUT, Probe, _callable_with, _lacks, versions

_FETCH_HOOKS = (
    "_in_poll",
    "_brpop_start",
    "_brpop_read",
    "handlers",
    "client",
    "_q_for_pri",
    "priority_steps",
    "unacked_key",
    "unacked_index_key",
    "active_queues",
    "conn_or_acquire",
)


def is_polling_channel(channel: Any) -> bool:
    """Whether ``channel`` fetches by polling through a queue cycle (Kombu's Redis)."""
    return hasattr(channel, "_queue_cycle")


def is_redis_channel(channel: Any) -> bool:
    """Whether ``channel`` belongs to Kombu's Redis transport (Sentinel included)."""
    transport = getattr(channel, "connection", None)
    return getattr(transport, "driver_type", None) == "redis"


def probe_redis_channel(channel: Any, probe: Probe) -> None:
    """Check the parts of a Kombu Redis channel the fetch path uses."""
    if not hasattr(channel, "_queue_cycle"):
        probe.missing_capability("kombu.redis.queue_cycle", "Channel._queue_cycle")
    lacking = _lacks(channel, _FETCH_HOOKS)
    deliver = getattr(getattr(channel, "connection", None), "_deliver", None)
    if deliver is None:
        lacking.append("Transport._deliver")
    if not lacking and not isinstance(channel.handlers, dict):
        lacking.append("Channel.handlers (not a dict)")
    if not lacking and not _callable_with(channel._q_for_pri, "queue", "pri"):
        lacking.append("Channel._q_for_pri(queue, pri)")
    if not lacking and not _callable_with(
        getattr(channel.client.connection_pool.connection_class, "can_read", None), "timeout"
    ):
        lacking.append("Connection.can_read(timeout)")
    if lacking:
        probe.missing_capability("kombu.redis.fetch_hooks", ", ".join(lacking))
    if not isinstance(getattr(channel, "brpop_timeout", None), (int, float)):
        probe.missing_capability("kombu.redis.brpop_timeout", "Channel.brpop_timeout")
    client = getattr(channel, "client", None)
    if not callable(getattr(client, "parse_response", None)):
        probe.missing_capability("kombu.redis.parse_response", "client.parse_response")
    if _lacks(channel, ("_q_for_pri", "_get_message_priority")):
        probe.missing_capability(
            "kombu.redis.requeue_front", "Channel._q_for_pri/_get_message_priority"
        )
    qos = getattr(channel, "qos", None)
    lacking = [
        n for n in ("_remove_from_indices", "restore_by_tag") if not callable(getattr(qos, n, None))
    ]
    if lacking:
        probe.missing_capability("kombu.redis.unacked_indices", "QoS." + "/".join(lacking))
    probe_virtual_qos(qos, probe)
    lacking = _lacks(channel, ("_size", "_queue_bind", "_delete", "_q_for_pri"))
    if not isinstance(getattr(channel, "keyprefix_queue", None), str):
        lacking.append("keyprefix_queue")
    if not isinstance(getattr(channel, "sep", None), str):
        lacking.append("sep")
    if lacking:
        probe.missing_capability("kombu.redis.declare_while_full", "Channel." + "/".join(lacking))
    connection = getattr(client, "connection", None)
    if connection is not None and not hasattr(connection, "_sock"):
        probe.missing_capability("redis.connection.socket", "Connection._sock")


#: Kombu Redis channel methods wrapped for keyed queues, with the
#: parameters celery-fair passes them.
_PUBLISH_HOOKS: dict[str, tuple[str, ...]] = {
    "_put": ("queue", "message"),
    "_do_restore_message": ("payload", "exchange", "routing_key", "pipe", "leftmost"),
    "_size": ("queue",),
    "_purge": ("queue",),
    "_has_queue": ("queue",),
    "_lookup": ("exchange", "routing_key"),
}


def redis_channel_class() -> Any:
    """Kombu's Redis channel class (the Sentinel channel derives from it)."""
    from kombu.transport import redis as kombu_redis

    return kombu_redis.Channel


def probe_redis_publishing(probe: Probe) -> None:
    """Check the channel methods keyed queues wrap (at ``install`` and at worker start)."""
    cls = redis_channel_class()
    lacking = [
        f"Channel.{name}({', '.join(params)})"
        for name, params in _PUBLISH_HOOKS.items()
        if not _callable_with(getattr(cls, name, None), "self", *params)
    ]
    if lacking:
        probe.missing_capability("kombu.redis.publish_hooks", ", ".join(lacking))


def wrap_redis_publishing(**hooks: Callable[..., Any]) -> None:
    """Wrap Kombu's Redis channel methods: ``put``, ``restore``, ``size``, ``purge``, ``exists``.

    Each hook is called as ``hook(original, channel, *args, **kwargs)``.  The
    class is wrapped (not an instance): a producer's channels are created by
    Kombu's pools, out of reach.  Raises :class:`CompatibilityError` when the
    methods are not as probed.
    """
    probe_redis_publishing(Probe())
    cls = redis_channel_class()
    names = {
        "put": "_put", "restore": "_do_restore_message", "size": "_size", "purge": "_purge",
        "exists": "_has_queue",
    }  # fmt: skip
    for hook_name, hook in hooks.items():
        name = names[hook_name]
        setattr(cls, name, _wrapped_method(name, getattr(cls, name), hook))


def _wrapped_method(name: str, original: Any, hook: Callable[..., Any]) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(original, self, *args, **kwargs)

    method.__name__ = method.__qualname__ = f"fair{name}"
    method.__wrapped__ = original  # type: ignore[attr-defined]
    return method


class _SenderHook:
    """One named hook around ``app.amqp.send_task_message``; its hook can be replaced."""

    def __init__(self, original: Callable[..., Any], hook: Callable[..., Any] | None, name: str):
        #: ``inspect.signature`` follows it: a hook put on later probes the original's.
        self.__wrapped__ = original
        self.hook = hook
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.hook is None:  # taken off: the message goes on as Celery sends it
            return self.__wrapped__(*args, **kwargs)
        return self.hook(self.__wrapped__, *args, **kwargs)


def wrap_task_sender(app: Any, hook: Callable[..., Any] | None, name: str = "keys") -> None:
    """Wrap ``app.amqp.send_task_message`` (every task the app sends goes through it).

    ``hook(original, producer, name, message, *args, **options)``.  Probed:
    it must take ``(producer, name, message)`` as Celery 5.3-5.7's does.
    ``name`` tells celery-fair's hooks apart: each is put on once per app, a
    hook put on later runs first, and registering a name again replaces its
    hook in place (``install()`` called again, or the worker reading
    ``fair_keys`` set after ``install``): the settings in force are the last
    ones read.  ``hook=None`` takes a hook of that name off.
    """
    amqp = app.amqp
    if hook is None and "send_task_message" not in vars(amqp):
        # Nothing of ours to take off.  Reading the attribute would build Celery's
        # task sender now (a cached property that makes an event dispatcher and so
        # resolves the broker's transport), at import time, before the app is done.
        return
    original = amqp.send_task_message
    if not _callable_with(original, "producer", "name", "message"):
        raise CompatibilityError(
            f"celery-fair cannot run with {versions()}: it needs the app's task "
            "sender (app.amqp.send_task_message(producer, name, message, ...)), which is "
            "not as expected"
        )
    if not _replaced(original, name, hook) and hook is not None:
        amqp.send_task_message = _SenderHook(original, hook, name)


def wrap_send_task(app: Any, name: str, hook: Callable[..., Any]) -> None:
    """Wrap ``app.send_task`` (``apply_async`` and ``send_task`` both end there) once per ``name``.

    ``hook(original, task_name, *args, **options)``.  The app's own method is
    replaced on the instance; unlike :func:`wrap_task_sender` this builds
    nothing of the app's (install may run before the app is configured).
    """
    current = app.send_task
    if not _replaced(current, name, hook):
        app.send_task = _SenderHook(current, hook, name)


def _replaced(wrapped: Any, name: str, hook: Callable[..., Any] | None) -> bool:
    """Put ``hook`` in place of the hook named ``name`` in a chain of hooks, if it has one."""
    while wrapped is not None:
        if isinstance(wrapped, _SenderHook) and wrapped.name == name:
            wrapped.hook = hook
            return True
        wrapped = getattr(wrapped, "__wrapped__", None)
    return False


def bound_queues(channel: Any, exchange: Any, routing_key: Any) -> list[str]:
    """The queues ``exchange`` routes ``routing_key`` to (the channel's bindings)."""
    return list(channel._lookup(exchange, routing_key))


def probe_virtual_qos(qos: Any, probe: Probe) -> None:
    """Check the virtual transport QoS methods replaced per instance."""
    lacking = [
        n for n in ("append", "ack", "reject", "can_consume") if not callable(getattr(qos, n, None))
    ]
    if lacking:
        probe.missing_capability("kombu.qos.hooks", "QoS." + "/".join(lacking))


def wrap_virtual_qos(qos: Any, fair: Any) -> None:
    """Put ``fair``'s methods over a virtual QoS instance's own (per instance).

    ``fair`` has ``append``, ``ack``, ``reject`` and ``restore_unacked``
    (:class:`celery_fair.kombu.cycle.FairQoS`); ``restore_unacked`` is
    replaced only where the QoS has one.  Probed by :func:`probe_virtual_qos`.
    """
    qos.append, qos.ack, qos.reject = fair.append, fair.ack, fair.reject
    if getattr(qos, "restore_unacked", None) is not None:
        qos.restore_unacked = fair.restore_unacked


def unrecorded_append(qos: Any) -> Callable[[Any, Any], Any]:
    """The virtual QoS's own ``append`` (memory only), without Redis's unacked write.

    For a message the atomic fetch already recorded in the unacked hash and
    index: the Redis QoS's ``append`` would write it a second time.
    """
    return partial(VirtualQoS.append, qos)


def set_queue_cycle(channel: Any, cycle: Any) -> None:
    """Make ``cycle`` the channel's queue cycle (Kombu's ``queue_order_strategy``)."""
    channel._queue_cycle = cycle


def queue_cycle(channel: Any) -> Any:
    return channel._queue_cycle


def replace_fetch(channel: Any, start: Callable[..., Any], read: Callable[..., Any]) -> None:
    """Replace the channel's fetch pair; Kombu's poller keeps driving it."""
    channel._brpop_start = start
    channel._brpop_read = read
    channel.handlers["BRPOP"] = read


def fetch_read(channel: Any) -> Callable[..., Any]:
    """The channel's current fetch-reply handler (``_brpop_read``)."""
    read: Callable[..., Any] = channel._brpop_read
    return read


def replace_fetch_read(channel: Any, read: Callable[..., Any]) -> None:
    """Replace only the reply handler of Kombu's own BRPOP fetch."""
    channel._brpop_read = read
    channel.handlers["BRPOP"] = read


def wrap_fetch_start(channel: Any, before: Callable[[], None]) -> None:
    """Call ``before()`` each time Kombu sends its BRPOP (times the fetch)."""
    start = channel._brpop_start

    def fair_brpop_start(*args: Any, **kwargs: Any) -> Any:
        before()
        return start(*args, **kwargs)

    channel._brpop_start = fair_brpop_start


def brpop_timeout(channel: Any) -> float:
    """The idle wait's server-side timeout (Kombu < 5.6: its fixed 1 s)."""
    value = getattr(channel, "brpop_timeout", None)
    return float(value) if isinstance(value, (int, float)) else KOMBU_BRPOP_TIMEOUT


def queue_key(channel: Any, queue: str, priority: int) -> str:
    """The Redis list of ``queue`` at ``priority``, without the global key prefix."""
    key: str = channel._q_for_pri(queue, priority)
    return key


def priority_steps(channel: Any) -> Sequence[int]:
    steps: Sequence[int] = channel.priority_steps
    return steps


def active_queue_count(channel: Any) -> int:
    return len(channel.active_queues)


def key_prefix(channel: Any) -> str:
    return getattr(channel, "global_keyprefix", "") or ""


@contextmanager
def redis_client(channel: Any) -> Iterator[Any]:
    """A client of the channel's Redis that sends every key name as given.

    With ``global_keyprefix`` Kombu's client adds the prefix to some commands
    only (which ones differs between releases, and for ``EVALSHA`` only the
    first key), so celery-fair names every key in full, prefix included
    (:func:`key_prefix`), and talks to Redis through this client.
    """
    with channel.conn_or_acquire() as client:
        if getattr(client, "global_keyprefix", None):
            import redis

            client = redis.Redis(connection_pool=client.connection_pool)
        yield client


def key_separator(channel: Any) -> str:
    """The separator between a queue name and its priority in a Redis key."""
    return getattr(channel, "sep", "\x06\x16")


def declared_queues(channel: Any, limit: int = 10_000) -> list[str]:
    """The queues bound on the channel's Redis (Kombu's ``_kombu.binding.<exchange>`` sets).

    Every queue a producer or worker declared is there, a queue named only at
    the call (``apply_async(queue="x")``) included.  Celery's own broadcast and
    event exchanges (``*pidbox``, ``celeryev``) are left out.  Found by ``SCAN``
    of the binding keys (one per exchange), at most ``limit`` queues.
    """
    start = key_prefix(channel) + (channel.keyprefix_queue % ("",))
    pattern, sep = start + "*", key_separator(channel)
    found: dict[str, None] = {}
    with redis_client(channel) as client:
        for key in client.scan_iter(match=pattern, count=1000):
            exchange = (key.decode() if isinstance(key, bytes) else key)[len(start) :]
            if "pidbox" in exchange or exchange.startswith("celeryev"):
                continue
            for member in client.smembers(key):
                text = member.decode() if isinstance(member, bytes) else member
                found.setdefault(text.split(sep)[-1], None)
                if len(found) >= limit:
                    return list(found)
    return [queue for queue in found if queue]


def unacked_keys(channel: Any) -> tuple[str, str]:
    """The unacked hash and index keys, without the global key prefix."""
    return channel.unacked_key, channel.unacked_index_key


def poll_in_flight(channel: Any) -> bool:
    """Whether Kombu's fetch (a ``BRPOP``) waits for its reply on the channel's connection."""
    return bool(channel._in_poll)


def reply_waiting(connection: Any) -> bool:
    """Whether a reply can be read from a redis-py connection without waiting."""
    return bool(connection.can_read(timeout=0))


def begin_poll(channel: Any, connection: Any, sent_at: float) -> None:
    """Tell Kombu a fetch is in flight on ``connection`` (its liveness check reads it)."""
    channel._in_poll = connection
    channel._brpop_sent_at = sent_at


def end_poll(channel: Any) -> None:
    """The fetch reply was read: the connection is idle again."""
    channel._in_poll = None
    flush = getattr(channel, "_flush_brpop_reauth", None)  # Kombu >= 5.7
    if flush is not None:
        flush()


def deliver(channel: Any, payload: Any, queue: str) -> None:
    """Hand a fetched payload to Kombu, as its own fetch does."""
    channel.connection._deliver(payload, queue)


def free_window(channel: Any) -> int | None:
    """How many more messages the channel's prefetch window takes (None: no limit).

    Kombu's virtual QoS ``can_consume_max_estimate`` (public); a channel without
    it takes one at a time.
    """
    estimate = getattr(getattr(channel, "qos", None), "can_consume_max_estimate", None)
    if estimate is None:
        return 1
    free = estimate()
    return None if free is None else max(0, int(free))


def can_push_front(channel: Any) -> bool:
    """Whether a copy can be put at the front of a Redis queue (``requeue_front``)."""
    return is_redis_channel(channel) and not _lacks(
        channel, ("_q_for_pri", "_get_message_priority")
    )


def message_priority(channel: Any, payload: Any) -> int:
    priority: int = channel._get_message_priority(payload, reverse=False)
    return priority


def raw_payload(message: Any) -> Any:
    """The payload a Kombu virtual-transport message was decoded from, or None."""
    return getattr(message, "_raw", None)


#: Marks celery-fair's wrappers for a full broker (other wrappers, such as the
#: keyed queues' ``_size``, may be there before them).
_WHILE_FULL = "_celery_fair_while_full"


def skip_restores_while_full(skipped: Callable[[Exception], None]) -> None:
    """Make every Redis QoS's ``restore_visible`` skip a round the broker refuses as full.

    Kombu restores messages past their visibility timeout from the poller, the
    first time when the worker connects, under a lock taken with ``SET NX``,
    which a full Redis refuses: the worker exited at start.  The round is
    skipped (``skipped(exc)``); Kombu tries again at its next poll.  The
    class is wrapped, once per process.
    """
    from kombu.transport.redis import QoS

    # (A Kombu without it restores nothing.)
    _wrap_when_full(QoS, "restore_visible", lambda self, exc, *args, **kwargs: skipped(exc))


def _wrap_when_full(cls: type, name: str, instead: Callable[..., Any]) -> None:
    """Wrap method ``name`` of ``cls`` (once): a full broker's refusal of it runs
    ``instead(self, exc, *args, **kwargs)`` and returns what that returns."""
    from .redis_py import broker_full

    original = getattr(cls, name, None)
    if not callable(original) or getattr(original, _WHILE_FULL, False):
        return

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except Exception as exc:
            if not broker_full(exc):
                raise
            return instead(self, exc, *args, **kwargs)

    method.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(method, _WHILE_FULL, True)
    setattr(cls, name, method)


def _each_priority(channel: Any, queue: str, command: str, client: Any = None) -> list[Any]:
    """``command`` on each of ``queue``'s priority lists, in a pipeline without ``MULTI``."""
    with channel.conn_or_acquire(client=client) as redis:
        pipe = redis.pipeline(transaction=False)
        for pri in channel.priority_steps:
            getattr(pipe, command)(channel._q_for_pri(queue, pri))
        replies: list[Any] = pipe.execute()
    return replies


def declare_while_full(
    sized: Callable[[Exception], None],
    bind_later: Callable[[Any, tuple[Any, ...], Exception], None],
    refresh_skipped: Callable[[Exception], None],
) -> None:
    """Let a Redis channel declare queues when the broker is full (at start, remote control).

    A Redis at its ``maxmemory`` refuses every command queued in ``MULTI``, and
    every ``SADD``: Kombu's ``_size`` (a queue's length, read in a transaction
    when a queue is declared), ``_queue_bind`` (a ``SADD``) and ``_delete`` (a
    reply queue's lists deleted in a transaction) failed, and a worker started
    against a full broker exited.  Lengths are read, and lists deleted, again
    outside a transaction (``sized(exc)``); a binding already there is left
    alone, and a missing one is handed to ``bind_later(channel, args, exc)``,
    to be made by :func:`bind_queue_again` when the broker accepts it.  Where
    Kombu refreshes expiring bindings, a refused refresh waits for the next
    (``refresh_skipped(exc)``).  The class is wrapped, once per process.
    """
    from kombu.transport.redis import Channel

    def size(channel: Any, exc: Exception, queue: str) -> int:
        sized(exc)
        return sum(n for n in _each_priority(channel, queue, "llen") if isinstance(n, int))

    def delete(channel: Any, exc: Exception, queue: str, *args: Any, **kwargs: Any) -> None:
        # Kombu removed the bindings (SREM, allowed when full) and then deletes the
        # queue's lists in MULTI: DEL frees memory, so outside one Redis runs it.
        sized(exc)
        _each_priority(channel, queue, "delete", kwargs.get("client"))

    def bind(channel: Any, exc: Exception, *args: Any) -> None:
        if len(args) != 4:
            raise exc
        exchange, routing_key, pattern, queue = args
        member = channel.sep.join([routing_key or "", pattern or "", queue or ""])
        with channel.conn_or_acquire() as client:
            if client.sismember(channel.keyprefix_queue % (exchange,), member):
                return  # bound already (a worker's own queues, as a rule)
        bind_later(channel, args, exc)

    _wrap_when_full(Channel, "_size", size)
    _wrap_when_full(Channel, "_delete", delete)
    _wrap_when_full(Channel, "_queue_bind", bind)
    # Kombu releases with expiring bindings refresh them by script from the
    # poller; refused when full, Kombu logs a traceback at every try.
    _wrap_when_full(
        Channel, "maybe_refresh_binding_expiry", lambda self, exc, *a, **k: refresh_skipped(exc)
    )


def bind_queue_again(channel: Any, args: tuple[Any, ...]) -> None:
    """Make a binding :func:`declare_while_full` left for later (Kombu's ``_queue_bind``)."""
    bind = type(channel)._queue_bind
    getattr(bind, "__wrapped__", bind)(channel, *args)


def remove_unacked_outside_transaction(qos: Any, delivery_tag: Any) -> None:
    """A Redis QoS's ``_remove_from_indices`` (``ZREM`` + ``HDEL``) without ``MULTI``:
    a Redis at its ``maxmemory`` refuses every command queued in a transaction,
    but runs these two, which only free memory."""
    with qos.channel.conn_or_acquire() as client:
        qos._remove_from_indices(delivery_tag, client.pipeline(transaction=False)).execute()


def forget_delivered(qos: Any, delivery_tag: Any) -> None:
    """Drop a delivered message from a virtual QoS's memory only (the virtual ``ack``)."""
    VirtualQoS.ack(qos, delivery_tag)  # type: ignore[no-untyped-call]


def restore_unacked_message(qos: Any, delivery_tag: Any) -> None:
    """Put a message recorded as unacknowledged back at the head of its queue
    (a Redis QoS's ``restore_by_tag``; a message already restored is left alone)."""
    qos.restore_by_tag(delivery_tag, leftmost=True)


def remove_from_unacked(qos: Any) -> Callable[[Any], Any] | None:
    """``QoS._remove_from_indices`` of a Redis QoS, or None."""
    remove = getattr(qos, "_remove_from_indices", None)
    return remove if callable(remove) else None


def wrap_parse_response(client: Any, hook: Callable[[Any, Any], None]) -> bool:
    """Call ``hook(command_name, response)`` after every reply the client parses."""
    parse = getattr(client, "parse_response", None)
    if not callable(parse):
        return False

    def fair_parse_response(connection: Any, command_name: Any, **options: Any) -> Any:
        response = parse(connection, command_name, **options)
        hook(command_name, response)
        return response

    client.parse_response = fair_parse_response
    return True


def hold_fetch_while(qos: Any, hold: Callable[[], bool]) -> bool:
    """Make a Kombu virtual QoS refuse to fetch while ``hold()`` is true.

    Kombu's virtual transports (Redis, memory) ask ``QoS.can_consume()``
    before each fetch (Redis holds back a pending reply while it is false).
    Used while CoDel finds a buffer stale: otherwise the slot freed by each
    returned message is refilled at once, often with the message just
    returned (on Redis it is first in line).  False, doing nothing, for a
    QoS without ``can_consume`` (RabbitMQ pushes).
    """
    can_consume = getattr(qos, "can_consume", None)
    if can_consume is None:
        return False

    def fair_can_consume() -> bool:
        return not hold() and bool(can_consume())

    qos.can_consume = fair_can_consume
    return True
