"""Every access to a private part of Celery, Kombu or redis-py, in one place.

celery-fair acts where Celery and Kombu keep no public hook: the Redis
channel's fetch (``_brpop_start``/``_brpop_read``/``_queue_cycle``), the
prefork semaphore's waiters, a request's header dict.  Users run Celery 5.3
to 5.7, Kombu 5.3 to 5.7 and redis-py 4.6 to 8, and those private parts move
between releases (``Channel.brpop_timeout`` appeared in Kombu 5.6,
``Consumer.qos_global`` in Celery 5.7).

So the adapters never touch a private name themselves: they call the
functions here.  Each function belongs to a :class:`Capability`, and every
capability is *probed* when the worker starts (:func:`probe_worker`,
:func:`probe_consumer`, :func:`probe_redis_channel`): a missing one either
takes the documented fallback, logged once on one line, or stops the worker
with a :class:`CompatibilityError` naming the versions.  Nothing here may
fail later, at the first poll.
"""

from __future__ import annotations

import inspect
import logging
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from .errors import CompatibilityError

__all__ = (
    "CAPABILITIES",
    "Capability",
    "CompatibilityError",
    "Probe",
    "versions",
)

logger = logging.getLogger(__name__)

#: Kombu's BRPOP timeout before it became ``Channel.brpop_timeout`` (5.6).
KOMBU_BRPOP_TIMEOUT = 1.0


@dataclass(frozen=True)
class Capability:
    """One private part of a dependency that celery-fair relies on.

    ``fallback`` says what celery-fair does without it; None means it cannot
    keep its promise without it and the worker does not start.
    """

    name: str
    needed_for: str
    fallback: str | None


#: Every capability, by name.  docs/compatibility.md lists the same table.
CAPABILITIES: dict[str, Capability] = {
    c.name: c
    for c in (
        Capability(
            "kombu.redis.queue_cycle",
            "DWRR fetch order on Redis (Channel._queue_cycle)",
            None,
        ),
        Capability(
            "kombu.redis.fetch_hooks",
            "the atomic fetch (Channel._brpop_start/_brpop_read, handlers, _in_poll, "
            "_q_for_pri, priority_steps, unacked keys, Transport._deliver, "
            "Connection.can_read)",
            "Kombu's own BRPOP fetch, still in DWRR order; the unacked record is "
            "written after the pop, as plain Celery does (a broker crash between the "
            "two can lose that message)",
        ),
        Capability(
            "kombu.redis.brpop_timeout",
            "the idle wait's server-side timeout (Channel.brpop_timeout, Kombu >= 5.6)",
            f"Kombu's earlier fixed timeout of {KOMBU_BRPOP_TIMEOUT:g} s",
        ),
        Capability(
            "kombu.redis.parse_response",
            "keeping undecodable payloads on Kombu's BRPOP path (client.parse_response)",
            "an undecodable payload is handled as Kombu does (logged, lost)",
        ),
        Capability(
            "kombu.redis.requeue_front",
            "CoDel's requeue to the front of a Redis list (Message._raw, "
            "Channel._q_for_pri, Channel._get_message_priority)",
            "the returned copy is published again, to the back of the queue",
        ),
        Capability(
            "kombu.redis.unacked_indices",
            "acknowledging a late ack through the live channel (QoS._remove_from_indices)",
            "the message is left to the visibility timeout (a duplicate run, not a loss)",
        ),
        Capability(
            "kombu.redis.publish_hooks",
            "keyed queues (fair_keys): publishing to a key's list, restoring to it, "
            "sizes and purges (Channel._put/_do_restore_message/_size/_purge/_has_queue/_lookup)",
            None,
        ),
        Capability(
            "kombu.qos.hooks",
            "per-queue held counts and credit (virtual QoS append/ack/reject/can_consume)",
            None,
        ),
        Capability(
            "redis.connection.socket",
            "noticing a reconnection of the fetch connection (Connection._sock)",
            None,
        ),
        Capability(
            "celery.worker.semaphore",
            "DWRR order of tasks waiting for a prefork slot (LaxBoundedSemaphore "
            "_add_waiter/_pop_waiter/_waiting)",
            None,
        ),
        Capability(
            "celery.worker.process_task",
            "dispatch hooks (WorkController._process_task)",
            None,
        ),
        Capability(
            "celery.request.headers",
            "CoDel requeue counts and telemetry stamps (Request._request_dict)",
            None,
        ),
        Capability(
            "celery.consumer.bad_input",
            "keeping bad input: the consumer's on_decode_error/on_invalid_task/"
            "on_unknown_message/on_unknown_task, read when its task handler is built",
            "bad input is handled as Celery does: an undecodable message is acknowledged "
            "and an unknown task rejected (on Redis both are lost)",
        ),
        Capability(
            "celery.consumer.immediate_acks",
            "green pools on Celery < 5.7: acknowledging a task when it finishes, as 5.7's "
            "Consumer.call_soon_ack does (create_task_handler's call_soon)",
            "acknowledgements wait for the next turn of Celery's event loop, as in plain "
            "Celery < 5.7 (small per-queue windows on RabbitMQ then starve the pool)",
        ),
        Capability(
            "celery.consumer.event_drain",
            "green pools on RabbitMQ with Celery 5.7: reading the event connection's "
            "broker heartbeats without a 100 ms wait at each turn of Celery's loop "
            "(synloop's _quick_drain of event_dispatcher.connection; the AMQP "
            "connection's sock)",
            "Celery's wait of up to 100 ms per turn: about ten deliveries a second, "
            "as plain Celery (the shares then follow the windows alone)",
        ),
        Capability(
            "celery.pool.eventlet_spawn",
            "-P eventlet: the greenlet of each task, whose end frees its slot in "
            "celery-fair's gate (TaskPool.on_apply spawns with self._quick_put and "
            "returns None)",
            "a slot counts as free as soon as eventlet's pool took the task: tasks wait "
            "in eventlet's pool in arrival order, not in DWRR order (on RabbitMQ the "
            "shares then follow the windows alone)",
        ),
        Capability(
            "celery.request.on_timeout",
            "telemetry of a task killed at its hard time limit on Celery < 5.7, which sends "
            "no task_failure then (Request.on_timeout, read by execute_using_pool)",
            "such a task has no telemetry record",
        ),
        Capability(
            "celery.consumer.qos",
            "adaptive prefetch on Redis (the consumer QoS's value/_mutex/update)",
            "fair_prefetch='auto' keeps Celery's fixed window on Redis",
        ),
    )
}


def versions() -> str:
    """The installed Celery, Kombu and redis-py versions, for messages."""
    found = []
    for dist in ("celery", "kombu", "redis"):
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:  # pragma: no cover - always installed with us
            found.append(f"{dist} (not installed)")
    return ", ".join(found)


class Probe:
    """The outcome of the start-up probes: what is missing, and what was given up.

    ``missing`` maps capability names to what was found wrong.  A probe that
    finds a capability missing calls :meth:`missing_capability`, which logs
    the fallback once or raises :class:`CompatibilityError` when there is none.
    """

    def __init__(self, *, log: Callable[[str], None] | None = None) -> None:
        self.missing: dict[str, str] = {}
        self._log = log or logger.warning

    def missing_capability(self, name: str, detail: str) -> None:
        capability = CAPABILITIES[name]
        first = name not in self.missing
        self.missing[name] = detail
        if capability.fallback is None:
            raise CompatibilityError(
                f"celery-fair cannot run with {versions()}: {capability.needed_for} is "
                f"missing ({detail}). Supported: Celery 5.3-5.7, Kombu 5.3-5.7, "
                f"redis-py 4.6-8 (see docs/compatibility.md)."
            )
        if first:
            self._log(
                f"celery-fair: {capability.needed_for} not available with {versions()} "
                f"({detail}); instead: {capability.fallback}"
            )

    def has(self, name: str) -> bool:
        """Whether capability ``name`` was found (or never probed)."""
        return name not in self.missing


def _lacks(obj: Any, names: Iterable[str]) -> list[str]:
    return [name for name in names if not hasattr(obj, name)]


def _callable_with(function: Any, *params: str) -> bool:
    """Whether ``function`` is callable and accepts every keyword in ``params``."""
    if not callable(function):
        return False
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return True  # a builtin: cannot tell, assume it does
    accepted = signature.parameters
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return True
    return all(p in accepted for p in params)


def _names_parameter(cls: type, name: str) -> bool:
    """Whether some ``__init__`` in ``cls``'s MRO names parameter ``name`` explicitly."""
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        try:
            if name in inspect.signature(init).parameters:
                return True
        except (TypeError, ValueError):
            continue
    return False


# -- Kombu's Redis channel ------------------------------------------------------

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
    if not callable(getattr(qos, "_remove_from_indices", None)):
        probe.missing_capability("kombu.redis.unacked_indices", "QoS._remove_from_indices")
    probe_virtual_qos(qos, probe)
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


def wrap_task_sender(app: Any, hook: Callable[..., Any]) -> None:
    """Wrap ``app.amqp.send_task_message`` (every task the app sends goes through it).

    ``hook(original, producer, name, message, *args, **options)``.  Probed:
    it must take ``(producer, name, message)`` as Celery 5.3-5.7's does.
    """
    amqp = app.amqp
    original = amqp.send_task_message
    if not _callable_with(original, "producer", "name", "message"):
        raise CompatibilityError(
            f"celery-fair cannot run with {versions()}: fair_keys needs the app's task "
            "sender (app.amqp.send_task_message(producer, name, message, ...)), which is "
            "not as expected"
        )
    if getattr(original, "__wrapped__", None) is not None:
        return  # install() called twice

    def send_task_message(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    send_task_message.__wrapped__ = original  # type: ignore[attr-defined]
    amqp.send_task_message = send_task_message


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


# -- redis-py --------------------------------------------------------------------


def socket_of(connection: Any) -> Any:
    """The socket of a redis-py connection (None when disconnected)."""
    return getattr(connection, "_sock", None)


def plain_connection(pool: Any) -> Any:
    """A new RESP2 connection to the server of a redis-py ``pool``, outside the pool.

    Built from the pool's public ``connection_class`` and
    ``connection_kwargs`` (Sentinel pools put themselves there, so it reaches
    the current master).  RESP2 because a RESP3 connection receives
    invalidations as push messages that redis-py's parsers route elsewhere.
    """
    # redis-py 8's maintenance notifications need RESP3: not for this connection.
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if not k.startswith("maint_")}
    cls = pool.connection_class
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


# -- Celery's worker ---------------------------------------------------------------


def probe_worker(worker: Any, probe: Probe) -> None:
    """Check the worker's dispatch hooks (after the Pool bootstep created them)."""
    if not callable(getattr(worker, "_process_task", None)):
        probe.missing_capability("celery.worker.process_task", "WorkController._process_task")
    semaphore = getattr(worker, "semaphore", None)
    if semaphore is not None:
        lacking = _lacks(semaphore, ("_add_waiter", "_pop_waiter", "_waiting"))
        if lacking:
            probe.missing_capability(
                "celery.worker.semaphore", "LaxBoundedSemaphore." + "/".join(lacking)
            )
    from celery.worker.request import Request

    if "__slots__" in vars(Request) and "_request_dict" not in Request.__slots__:
        probe.missing_capability("celery.request.headers", "Request._request_dict")


def dispatch_of(worker: Any) -> Callable[[Any], Any]:
    """The worker's pool dispatch (``_process_task``)."""
    process: Callable[[Any], Any] = worker._process_task
    return process


def set_dispatch(worker: Any, process: Callable[[Any], Any]) -> None:
    worker._process_task = process


def dispatches_directly(worker: Any) -> bool:
    """Whether received tasks go straight to the pool, with no semaphore wait.

    True for threads, solo, gevent and eventlet; prefork's ``process_task`` is
    ``_process_task_sem``, which waits in the semaphore.
    """
    return getattr(worker.process_task, "__func__", None) is type(worker)._process_task


def install_waiters(
    semaphore: Any, add: Callable[[Any], None], pop: Callable[[], Any], waiting: Any
) -> None:
    """Replace a ``LaxBoundedSemaphore``'s FIFO of waiters (its counting stays)."""
    semaphore._add_waiter = add
    semaphore._pop_waiter = pop
    semaphore._waiting = waiting


def request_headers(request: Any) -> dict[str, Any]:
    """A worker request's header dict, which Celery hands to the pool as it is."""
    headers = getattr(request, "_request_dict", None)
    return headers if isinstance(headers, dict) else {}


def delivery_tag(request: Any) -> Any:
    """The delivery tag of a request's message (``Request.message``, public since 5.3)."""
    message = getattr(request, "message", None)
    return getattr(message, "delivery_tag", None)


def runs_inline(pool: Any) -> bool:
    """Whether the pool runs each task inside the delivery callback (``-P solo``)."""
    return type(pool).__module__ == "celery.concurrency.solo"


def on_pool_done(result: Any, callback: Callable[[], None]) -> None:
    """Call ``callback()`` when the pool has finished the task of ``result``.

    ``result`` is what the pool's ``on_apply`` returned: a future (threads),
    a greenlet (gevent, eventlet: both have ``link``), or anything else when
    the task already ran inline (solo).
    """
    future = getattr(result, "f", None)
    if future is not None and hasattr(future, "add_done_callback"):
        future.add_done_callback(lambda _future: callback())
    elif callable(getattr(result, "link", None)):
        result.link(lambda *_args: callback())
    else:
        callback()


def green_spawns(pool: Any, probe: Probe) -> Callable[[], Any] | None:
    """The greenlet of each task, for a green pool whose ``on_apply`` returns none.

    Celery's eventlet pool (5.3 to 5.7) spawns each task with
    ``self._quick_put`` (``GreenPool.spawn``, set by ``on_start``) and its
    ``on_apply`` returns None, where the gevent pool's returns the greenlet.
    Given None, :func:`on_pool_done` can only take the task as finished at
    once: celery-fair's gate then passes every task on, eventlet's own pool
    makes them wait in arrival order, and the DWRR dispatch never chooses.

    ``_quick_put`` is followed on the pool instance, now if the pool has
    started, else when it starts.  Returns ``taken()``, which gives the
    greenlet spawned since its last call (None if none); returns None for
    other pools, and when ``on_apply`` does not spawn through ``_quick_put``
    (checked in its code: the fallback is logged once).
    """
    if type(pool).__module__ != "celery.concurrency.eventlet":
        return None
    code = getattr(getattr(type(pool), "on_apply", None), "__code__", None)
    if code is None or "_quick_put" not in _names_used(code) or not hasattr(pool, "_quick_put"):
        probe.missing_capability(
            "celery.pool.eventlet_spawn", "TaskPool.on_apply (self._quick_put)"
        )
        return None
    spawned: list[Any] = []

    def follow() -> None:
        put = pool._quick_put
        if put is None or getattr(put, "fair_follows", False):
            return

        def fair_quick_put(*args: Any, **kwargs: Any) -> Any:
            greenlet = put(*args, **kwargs)
            spawned.append(greenlet)
            return greenlet

        fair_quick_put.fair_follows = True  # type: ignore[attr-defined]
        pool._quick_put = fair_quick_put

    follow()
    on_start = pool.on_start

    def fair_on_start(*args: Any, **kwargs: Any) -> Any:
        result = on_start(*args, **kwargs)
        follow()
        return result

    pool.on_start = fair_on_start

    def taken() -> Any:
        return spawned.pop() if spawned else None

    return taken


# -- Celery's consumer -------------------------------------------------------------------


def consumer_qos_global(consumer: Any) -> bool:
    """Whether Celery applies its prefetch window channel-wide (``global=True``).

    Celery 5.7 records it as ``Consumer.qos_global``; earlier releases compute
    it in ``Tasks.start`` the same way and keep it local, so it is derived here
    (``celery.worker.consumer.tasks``): global unless the broker follows the
    AMQP spec's per-consumer semantics, and never with quorum queues.
    """
    recorded = getattr(consumer, "qos_global", None)
    if isinstance(recorded, bool):
        return recorded
    connection = getattr(consumer, "connection", None)
    if connection is None:
        return False
    qos_global = not connection.qos_semantics_matches_spec
    conf = consumer.app.conf
    if qos_global and conf.get("worker_detect_quorum_queues", False):
        try:
            from celery.utils.quorum_queues import detect_quorum_queues
        except ImportError:  # Celery < 5.5: no quorum queue detection
            return qos_global
        using, _ = detect_quorum_queues(consumer.app, connection.transport.driver_type)
        if using:
            return False
    return qos_global


def probe_consumer_qos(qos: Any, probe: Probe) -> None:
    if qos is None or _lacks(qos, ("value", "_mutex", "update")):
        probe.missing_capability("celery.consumer.qos", "QoS.value/_mutex/update")


def move_qos_window(qos: Any, base: int, wanted: int) -> None:
    """Move Celery's QoS window from ``base`` to ``wanted``, keeping its own additions.

    Celery re-applies its QoS *value* whenever it differs from what was last
    set; ETA tasks add to it.  Under the QoS's own lock, as Celery does.
    """
    with qos._mutex:
        current = int(qos.value or base)
        qos.value = max(1, current + wanted - base)
        qos.update()


#: The consumer's bad-input handlers, with the parameters Celery calls them with.
BAD_INPUT_HANDLERS: dict[str, tuple[str, ...]] = {
    "on_decode_error": ("message", "exc"),
    "on_invalid_task": ("body", "message", "exc"),
    "on_unknown_message": ("body", "message"),
    "on_unknown_task": ("body", "message", "exc"),
}


def _names_used(code: Any) -> set[str]:
    """Every attribute or global name a function's code (and its nested functions) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names_used(const)
    return names


def probe_bad_input_handlers(consumer: Any, probe: Probe) -> bool:
    """Whether the consumer's bad-input handlers can be replaced on the instance.

    Celery's ``create_task_handler`` reads them from the consumer when the
    event loop starts (``self.on_unknown_task`` ...), and the task consumer
    keeps ``on_decode_error``: checked in its code, not assumed.
    """
    cls = type(consumer)
    build = getattr(cls, "create_task_handler", None)
    lacking = [
        name
        for name, params in BAD_INPUT_HANDLERS.items()
        if not _callable_with(getattr(cls, name, None), *params)
    ]
    if build is None or not hasattr(build, "__code__"):
        lacking.append("create_task_handler")
    elif not set(BAD_INPUT_HANDLERS) <= _names_used(build.__code__):
        lacking.append("create_task_handler (reads the handlers elsewhere)")
    if not hasattr(getattr(consumer, "task_consumer", None), "on_decode_error"):
        lacking.append("task_consumer.on_decode_error")
    if lacking:
        probe.missing_capability("celery.consumer.bad_input", "Consumer." + "/".join(lacking))
        return False
    return True


def set_bad_input_handlers(consumer: Any, handlers: dict[str, Callable[..., Any]]) -> None:
    """Use ``handlers`` (named as in :data:`BAD_INPUT_HANDLERS`) for this consumer.

    Call after the Tasks bootstep created the task consumer and before the
    event loop builds the task handler (a consumer bootstep's ``start``).
    """
    for name, handler in handlers.items():
        setattr(consumer, name, handler)
    consumer.task_consumer.on_decode_error = handlers["on_decode_error"]


def backport_immediate_acks(consumer: Any, probe: Probe) -> bool:
    """Green pools on Celery < 5.7: acknowledge at once, as Celery 5.7 does.

    Without a hub (gevent, eventlet: Celery's ``synloop``), Celery < 5.7
    defers a task's ack to ``_pending_operations``, run only when
    ``drain_events`` returns: the broker cannot deliver the next message of a
    full window until some unrelated frame arrives (Celery 5.7's
    ``Consumer.call_soon_ack`` docstring: 50-400 ms between tasks).  With
    celery-fair's per-queue windows on RabbitMQ every window is small, and a
    gevent worker ran at about a quarter of plain Celery's rate.

    ``create_task_handler`` reads ``self.call_soon`` once, for the ack and
    reject promises only (checked in its code): while it builds the handler,
    the consumer's ``call_soon`` runs the callback at once.  Other users of
    ``call_soon`` (remote control) keep the deferred one.  Returns whether it
    was installed.
    """
    cls = type(consumer)
    if getattr(consumer, "hub", None) is not None or hasattr(cls, "call_soon_ack"):
        return False  # an event loop runs acks soon; Celery >= 5.7 acks at once
    if getattr(consumer, "_fair_immediate_acks", False):
        return True
    build = getattr(cls, "create_task_handler", None)
    code = getattr(build, "__code__", None)
    if code is None or "call_soon" not in code.co_names:
        probe.missing_capability(
            "celery.consumer.immediate_acks", "Consumer.create_task_handler (call_soon)"
        )
        return False
    original = consumer.create_task_handler

    def immediate(callback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return callback(*args, **kwargs)
        except Exception:  # noqa: BLE001 - as Celery 5.7's call_soon_ack: log, go on
            logger.exception("celery-fair: acknowledgement failed")
            return None

    def create_task_handler(*args: Any, **kwargs: Any) -> Any:
        consumer.call_soon = immediate
        try:
            return original(*args, **kwargs)
        finally:
            del consumer.call_soon

    consumer.create_task_handler = create_task_handler
    consumer._fair_immediate_acks = True
    return True


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


def can_follow_hard_timeouts(probe: Probe) -> bool:
    """Whether :func:`on_hard_timeout` is needed and works with this Celery.

    Celery 5.7 sends ``task_failure`` for a task killed at its hard time
    limit; earlier releases only mark it failed in the result backend, so
    the telemetry follows each request's ``on_timeout`` (an instance
    attribute: ``execute_using_pool`` reads ``self.on_timeout`` per call).
    """
    from celery.worker.request import Request

    sends = getattr(Request.on_timeout, "__code__", None)
    if sends is not None and "task_failure" in sends.co_names:
        return False
    execute = getattr(Request.execute_using_pool, "__code__", None)
    if execute is None or "on_timeout" not in execute.co_names:
        probe.missing_capability(
            "celery.request.on_timeout", "Request.execute_using_pool (self.on_timeout)"
        )
        return False
    return True


def on_hard_timeout(request: Any, callback: Callable[[], None]) -> None:
    """Call ``callback()`` after Celery handled ``request``'s hard time limit."""
    original = request.on_timeout

    def on_timeout(soft: bool, timeout: float) -> Any:
        try:
            return original(soft, timeout)
        finally:
            if not soft:
                callback()

    request.on_timeout = on_timeout


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


def wrap_drain_events(connection: Any, wrapper: Callable[..., Any]) -> None:
    """Route a Kombu connection's ``drain_events`` through ``wrapper(drain, timeout, **kw)``."""
    drain = connection.drain_events

    def fair_drain_events(timeout: float | None = None, **kwargs: Any) -> Any:
        return wrapper(drain, timeout, **kwargs)

    connection.drain_events = fair_drain_events
