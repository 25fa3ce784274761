"""Keyed queues on the producer: stamp each task's key, publish it to its key's list.

``celery_fair.install(app)``, for an app with ``fair_keys``, wraps that
app's task sender (``app.amqp.send_task_message``): a task for a keyed queue
gets its key in the :data:`KEY_HEADER` header and the queue's name in
:data:`KEYED_HEADER`.  It also wraps five methods of Kombu's Redis channel
class once per process (through :mod:`celery_fair.compat`, probed):

* ``_put``: a message whose :data:`KEYED_HEADER` names the queue it is put
  to, with a key, goes to that key's list in the level of its priority (the
  ``ENQUEUE`` script); any other
  goes to the queue's own list, as Kombu puts it (served as the unkeyed key);
  a message stamped with a due time still ahead (:data:`DUE_HEADER`, an app
  with ``fair_eta="broker"``: :mod:`celery_fair.keys.eta`), keyed or not, goes
  to its queue's schedule instead (the ``SCHEDULE`` script);
* ``_do_restore_message``: a restored message (visibility timeout, a
  worker's ``restore_unacked``, ``reject(requeue=True)``) goes back to its
  key in its level, and frees its key's slot (per-key limits);
* ``_size``, ``_purge`` and ``_has_queue``: count, delete and see the
  per-key lists too, so ``celery purge`` and ``queue_declare(passive=True)``
  tell the truth (``_purge`` deletes the queue's schedule too; ``_size``
  counts only what can be fetched now).

The decision travels with each message, so several apps in one process, with
and without ``fair_keys``, publish each as configured.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from time import time
from typing import Any

from kombu.utils.json import dumps as _dumps

from .. import compat
from ..errors import BrokerMemoryHigh, FairConfigError, KeyBacklogFull
from ..grammar import as_positive_int, boolean, parse_pairs
from ..routing.keys import KeySource, key_of, parse_key_spec
from ..wire import (
    ADMIT_HEADER,
    DUE_HEADER,
    KEY_HEADER,
    KEYED_HEADER,
    MAX_BACKLOG_HEADER,
    USER_HEADER,
)
from . import store
from .backlog_counter import BacklogCounter
from .lanes import KeyLanes, LaneChooser, declared_with_priority, lane_queue, level_lane
from .layout import KeyedNames

__all__ = (
    "KeyedQueues",
    "backlog_cap",
    "parse_fair_keys",
    "parse_max_backlog",
    "producer_settings",
    "register_app",
    "take_admission",
    "wrap_kombu",
)

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_patched = False
#: (task name, queue) pairs already warned about a missing key.
_warned: set[tuple[str, str, str]] = set()


class KeyedQueues(dict[str, KeySource]):
    """Keyed queue name -> where its messages' key is.

    ``users``: the queues with two-level keys -> where the user within the key is.
    """

    def __init__(self) -> None:
        super().__init__()
        self.users: dict[str, KeySource] = {}


def parse_fair_keys(value: Any) -> KeyedQueues:
    """Check ``fair_keys`` (queue -> key spec, as ``ConsistentHashRouter``'s ``key=``).

    A pair of specs, ``("tenant_id", "user_id")``, gives the queue two-level
    keys: the key, then the user within it.
    """

    if value is None:
        return KeyedQueues()
    if not isinstance(value, Mapping):
        raise FairConfigError(
            f"fair_keys must map queue names to where the key is (for example "
            f"{{'jobs': 'tenant_id'}}), got {value!r}"
        )
    parsed = KeyedQueues()
    for queue, spec in value.items():
        if not isinstance(queue, str) or not queue:
            raise FairConfigError(
                f"fair_keys: a queue name must be a non-empty string, got {queue!r}"
            )
        try:
            if isinstance(spec, (tuple, list)):
                if len(spec) != 2:
                    raise ValueError(
                        "a two-level key is a pair (key, user within the key), "
                        f"got {len(spec)} items"
                    )
                parsed[queue] = parse_key_spec(spec[0])
                parsed.users[queue] = parse_key_spec(spec[1])
            else:
                parsed[queue] = parse_key_spec(spec)
        except (TypeError, ValueError) as exc:
            raise FairConfigError(f"fair_keys[{queue!r}]={spec!r}: {exc}") from None
    return parsed


#: The name in ``fair_key_max_backlog`` of the cap of every key not named.
ANY_KEY = "*"


def parse_max_backlog(value: Any) -> dict[str, int]:
    """Check ``fair_key_max_backlog``: key (or ``"*"``) -> the most messages it may have waiting."""
    caps: dict[str, int] = {}
    for key, raw in parse_pairs(value, setting="fair_key_max_backlog", what="KEY=N").items():
        cap = as_positive_int(raw, text=True)
        if cap is None:
            raise FairConfigError(
                f"fair_key_max_backlog: the cap of key {key!r} must be an integer of at "
                f"least 1, got {raw!r}"
            )
        caps[key] = cap
    return caps


def cap_for(caps: Mapping[str, int], key: str) -> int | None:
    """The backlog cap of ``key`` (its own, else ``"*"``'s), or None."""
    return caps.get(key, caps.get(ANY_KEY))


def producer_settings(conf: Any) -> tuple[KeyedQueues, dict[str, int], bool]:
    """What a producer reads of ``conf``: ``fair_keys``, ``fair_key_max_backlog``
    and ``fair_key_max_backlog_durable``.  Raises the first bad one's
    :class:`~celery_fair.errors.FairConfigError`."""
    keyed = parse_fair_keys(conf.get("fair_keys"))
    caps = parse_max_backlog(conf.get("fair_key_max_backlog"))
    # None is the default, as the worker reads every setting (settings._value).
    durable = conf.get("fair_key_max_backlog_durable")
    return keyed, caps, boolean("fair_key_max_backlog_durable")(durable or False)


def register_app(app: Any) -> None:
    """Publish ``app``'s tasks for keyed queues to their keys.

    ``fair_keys`` is read when ``install`` runs: set it before.  An app
    without it leaves Kombu and its sender untouched; an invalid one makes
    every send raise the :class:`~celery_fair.worker.settings.FairConfigError`.
    """

    try:
        keyed, caps, durable = producer_settings(app.conf)
    except FairConfigError as exc:
        # Not here, while the app module is imported (Celery would print a long
        # "Unable to load celery application" traceback): a worker stops at start
        # with one "Error:" line, and the producer's first send raises this.
        compat.wrap_task_sender(app, _refusing_sender(exc))
        return
    if not keyed:
        compat.wrap_task_sender(app, None)  # fair_keys unset since an earlier install
        return
    wrap_kombu()
    lanes = LaneChooser(KeyLanes(frozenset(keyed)))
    counter = None
    if caps:
        # Used on RabbitMQ only (Redis counts in its push script); connects when
        # first used.
        counter = BacklogCounter(app.connection_for_write)
    compat.wrap_task_sender(
        app, _stamping_sender(app, keyed, caps, lanes, counter, durable_counts=durable)
    )


def _refusing_sender(error: Exception) -> Callable[..., Any]:
    """A hook around ``app.amqp.send_task_message`` that raises ``error`` (a bad setting)."""

    def send(original: Callable[..., Any], *args: Any, **options: Any) -> Any:
        raise error

    return send


def wrap_kombu() -> None:
    """Wrap Kombu's Redis channel methods for keyed queues (once per process)."""
    global _patched
    with _lock:
        if not _patched:
            compat.wrap_redis_publishing(
                put=_fair_put,
                restore=_fair_restore,
                size=_fair_size,
                purge=_fair_purge,
                exists=_fair_has_queue,
            )
            _patched = True


def _stamping_sender(
    app: Any,
    keyed: KeyedQueues,
    caps: Mapping[str, int] | None = None,
    lanes: LaneChooser | None = None,
    counter: BacklogCounter | None = None,
    *,
    durable_counts: bool = False,
) -> Callable[..., Any]:
    """A hook around ``app.amqp.send_task_message`` that stamps keyed tasks.

    On RabbitMQ (``lanes``) a keyed task also goes to its key's lane
    (:mod:`celery_fair.keys.lanes`) rather than to the queue itself, and a
    capped one is counted first in its key's ``counter``
    (:mod:`celery_fair.keys.backlog_counter`), which may refuse it; with
    ``durable_counts`` (``fair_key_max_backlog_durable``) by a persistent
    marker when the task itself outlives a broker restart.
    """
    lane_queues: dict[str, Any] = {}

    def send(original: Callable[..., Any], producer: Any, name: str, message: Any,
             *args: Any, **options: Any) -> Any:  # fmt: skip
        queue = queue_name(app, options)
        source = keyed.get(queue) if queue is not None else None
        if queue is not None and source is not None:
            task = _task(app, name)
            stamp_key(source, name, queue, message, options.get("headers"), task,
                      user=keyed.users.get(queue), caps=caps)  # fmt: skip
            if lanes is not None and _is_amqp(producer):
                key = _stamped_key(message, options.get("headers"))
                if key:
                    user = _stamped_user(message, options.get("headers"))
                    lane, given = lanes.choose(queue, key, user)
                    parent = app.amqp.queues[queue]
                    if given is not None:
                        _name_lane(producer, lane, given, durable=parent.durable)
                    if declared_with_priority(parent):  # the queue has lanes per level
                        lane = level_lane(queue, lane, options.get("priority"))
                    target = lane_queues.get(lane)
                    if target is None:
                        target = lane_queues[lane] = lane_queue(parent, lane)
                    # The lane, through the default exchange: the router's exchange
                    # and routing key were the queue's.
                    for option in ("exchange", "routing_key", "exchange_type"):
                        options.pop(option, None)
                    options["queue"] = target
                if counter is not None:
                    ttl = options.get("expiration")
                    persistent = durable_counts and _persistent(app, options)
                    counted = _count(counter, queue, key or "", message, ttl, persistent=persistent)
                    if counted is not None:
                        try:
                            return original(producer, name, message, *args, **options)
                        except BaseException:
                            counter.release(*counted)
                            raise
        return original(producer, name, message, *args, **options)

    return send


def _count(
    counter: BacklogCounter,
    queue: str,
    key: str,
    message: Any,
    expiration: Any = None,
    *,
    persistent: bool = False,
) -> tuple[str, str, int] | None:
    """Count a capped task in its key's counter: (queue, key, cap) if counted.

    ``expiration``: the task's time to live in the broker (seconds), from its
    ``expires``: its marker gets it too.  ``persistent``: a persistent marker,
    for a task that outlives a broker restart (:func:`_persistent`) when
    ``fair_key_max_backlog_durable`` is on.

    Raises :class:`~celery_fair.errors.KeyBacklogFull` at the cap.  A task the
    broker could not count goes out without its cap, so that no worker frees
    a place it never took.
    """
    headers = message[0] if isinstance(message[0], dict) else {}
    cap = backlog_cap(headers.get(MAX_BACKLOG_HEADER))
    if cap is None:
        return None
    ttl = float(expiration) if isinstance(expiration, (int, float)) else None
    if counter.claim(queue, key, cap, expires_in=ttl, persistent=persistent):
        return queue, key, cap
    del headers[MAX_BACKLOG_HEADER]
    return None


def _persistent(app: Any, options: Mapping[str, Any]) -> bool:
    """Whether the task ``options`` describe outlives a broker restart: a message
    in a quorum queue or a stream (which keep every message), or a persistent
    message in a durable queue.

    Celery's rule for the delivery mode (``AMQP.send_task_message``): the one
    given, else the queue's exchange's, else ``task_default_delivery_mode``.
    """
    from kombu.entity import maybe_delivery_mode

    target = options.get("queue")
    arguments = getattr(target, "queue_arguments", None) or {}
    if arguments.get("x-queue-type") in ("quorum", "stream"):
        return True
    if target is not None and not getattr(target, "durable", True):
        return False
    exchange = getattr(target, "exchange", None)
    mode = (
        options.get("delivery_mode")
        or getattr(exchange, "delivery_mode", None)
        or app.conf.task_default_delivery_mode
    )
    return bool(maybe_delivery_mode(mode) == 2)  # type: ignore[no-untyped-call]


def _name_lane(producer: Any, lane: str, key: str, *, durable: bool) -> None:
    """Write ``key`` as the key of noisy ``lane`` (:meth:`KeyLanes.directory`): the
    exporter reports the lane's backlog as the key's.  Once per isolation; a failure
    costs the exporter a name, never the task."""
    from kombu.entity import Exchange, Queue

    name = KeyLanes.directory(lane)
    directory = Queue(  # type: ignore[no-untyped-call]
        name, Exchange(""), routing_key=name, durable=durable,  # type: ignore[no-untyped-call]
        queue_arguments={"x-max-length": 1, "x-overflow": "drop-head"},
    )  # fmt: skip
    try:
        producer.publish(
            key, exchange="", routing_key=name, declare=[directory], serializer="json",
            delivery_mode=2 if durable else 1,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the task's own publish must go on
        logger.warning("celery-fair: could not name the key of lane %s: %r", lane, exc)


def _is_amqp(producer: Any) -> bool:
    """Whether ``producer`` publishes to an AMQP broker (RabbitMQ)."""
    connection = getattr(producer, "connection", None)
    transport = getattr(connection, "transport", None)
    return getattr(transport, "driver_type", None) == "amqp"


def _stamped_key(message: Any, extra_headers: Mapping[str, Any] | None) -> str | None:
    """The key :func:`stamp_key` found (a ``fair_key`` header given by the caller wins)."""
    headers = message[0] if isinstance(message[0], dict) else {}
    key = (extra_headers or {}).get(KEY_HEADER, headers.get(KEY_HEADER))
    return _text(key) if key is not None else None


def _stamped_user(message: Any, extra_headers: Mapping[str, Any] | None) -> str | None:
    """The user :func:`stamp_key` found for a two-level key (None: a one-level key)."""
    headers = message[0] if isinstance(message[0], dict) else {}
    user = (extra_headers or {}).get(USER_HEADER, headers.get(USER_HEADER))
    return _text(user) if user is not None else None


def _task(app: Any, name: str) -> Any:
    """The registered task ``name`` of ``app`` (its signature places positional keys)."""
    try:
        return app.tasks.get(name)
    except RuntimeError:  # an app that may not finalize itself yet
        return None


def queue_name(app: Any, options: Mapping[str, Any]) -> str | None:
    """The queue a task is sent to, as Celery's sender resolves it."""
    queue = options.get("queue")
    if isinstance(queue, str):
        return queue
    name = getattr(queue, "name", None) if queue is not None else None
    if name is None and queue is None and options.get("exchange") is None:
        name = options.get("routing_key") or app.conf.task_default_queue
    return name if isinstance(name, str) else None


def stamp_key(
    source: KeySource,
    name: str,
    queue: str,
    message: Any,
    extra_headers: Mapping[str, Any] | None = None,
    task: Any = None,
    *,
    user: KeySource | None = None,
    caps: Mapping[str, int] | None = None,
) -> None:
    """Put a task's key in its :data:`KEY_HEADER` and its keyed queue in :data:`KEYED_HEADER`.

    ``message`` is Celery's task message (headers, properties, body, ...);
    ``extra_headers`` the caller's ``apply_async(headers=...)`` (and the
    router's), which Celery merges into the message after this: a
    ``fair_key`` header given there wins, as it is explicit.  ``task``, the
    registered task, places a keyword key passed by position
    (:func:`~celery_fair.routing.keys.key_of`).  A task whose key cannot be
    found is published under the unkeyed key, with a warning once per task
    name and queue.  ``user``: for two-level keys, where the user within the
    key is (:data:`USER_HEADER`; a user that cannot be found is ``""``).
    ``caps``: ``fair_key_max_backlog``, stamped as :data:`MAX_BACKLOG_HEADER`.
    """
    headers, properties, body = message[0], message[1], message[2]
    if not isinstance(headers, dict):
        return
    args, kw = _arguments(body)
    options = dict(properties or {})
    options["headers"] = {**headers, **(extra_headers or {})}
    key = key_of(source, name, args, kw, options, task)
    if key is not None:
        headers[KEY_HEADER] = _text(key)
    elif KEY_HEADER not in options["headers"]:
        _warn_missing(source, name, queue, task)
    headers[KEYED_HEADER] = queue
    if user is not None:
        found = key_of(user, name, args, kw, options, task)
        if found is None and USER_HEADER not in options["headers"]:
            _warn_missing(user, name, queue, task)
        headers[USER_HEADER] = "" if found is None else _text(found)
    if caps:
        cap = cap_for(caps, headers.get(KEY_HEADER) or options["headers"].get(KEY_HEADER) or "")
        if cap is not None:
            headers[MAX_BACKLOG_HEADER] = cap


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _warn_missing(source: KeySource, name: str, queue: str, task: Any) -> None:
    if (name, queue, source.describe()) in _warned:
        return
    _warned.add((name, queue, source.describe()))
    why = (
        ""
        if task is not None
        else (
            " (the task is not registered in this app: an argument passed by position "
            "cannot be placed)"
        )
    )
    logger.warning(
        "celery-fair: task %r sent to keyed queue %r without a key: %s is missing%s; "
        "it is served as the unkeyed key, with no fairness between its senders "
        "(this warning is given once per task and queue)",
        name, queue, source.describe(), why,
    )  # fmt: skip


def _arguments(body: Any) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """A task body's positional and keyword arguments (protocol 2, or 1)."""
    if isinstance(body, (tuple, list)) and len(body) >= 2:
        args, kw = body[0], body[1]
        return (args if isinstance(args, (list, tuple)) else ()), (
            kw if isinstance(kw, Mapping) else {}
        )
    if isinstance(body, Mapping):
        return body.get("args") or (), body.get("kwargs") or {}
    return (), {}


def dumps(payload: Any) -> str:
    """A payload as Kombu's Redis transport stores it."""
    text: str = _dumps(payload)  # type: ignore[no-untyped-call]
    return text


def message_key(message: Mapping[str, Any], queue: str) -> str | None:
    """The key of a Kombu payload published for keyed ``queue``, or None (a plain message)."""
    headers = message.get("headers")
    if not isinstance(headers, Mapping) or headers.get(KEYED_HEADER) != queue:
        return None
    key = headers.get(KEY_HEADER)
    return key if isinstance(key, str) and key else None


def message_user(message: Mapping[str, Any]) -> str | None:
    """The user within its key of a keyed payload (None: a one-level key)."""
    headers = message.get("headers")
    user = headers.get(USER_HEADER) if isinstance(headers, Mapping) else None
    return user if isinstance(user, str) else None


def message_cap(message: Mapping[str, Any]) -> int | None:
    """The backlog cap a keyed payload was published under (None: not capped)."""
    headers = message.get("headers")
    return backlog_cap(headers.get(MAX_BACKLOG_HEADER) if isinstance(headers, Mapping) else None)


def backlog_cap(value: Any) -> int | None:
    """A :data:`MAX_BACKLOG_HEADER` value as the cap it states (None: none, or malformed)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def names_for(channel: Any, queue: str) -> KeyedNames:
    """The Redis names of ``queue``'s keyed lists on ``channel``."""
    return KeyedNames(compat.key_prefix(channel) + queue, compat.key_separator(channel))


def level_of(channel: Any, payload: Any) -> str:
    """The priority level of a Kombu payload: the suffix of Kombu's list for its priority.

    As Kombu's Redis transport, priority 0 (and a message without one) is the
    first level, served first; ``""`` names it.
    """
    return compat.queue_key(channel, "", compat.message_priority(channel, payload))


# -- the wrapped Kombu Redis channel methods ------------------------------------


def _fair_put(original: Any, channel: Any, queue: str, message: Any, **kwargs: Any) -> Any:
    admit = take_admission(message)
    key = message_key(message, queue)
    due = message_due(message)
    if due is not None:
        return _schedule(channel, queue, message, key, due, admit, kwargs)
    if key is None:
        return original(channel, queue, message, **kwargs)
    names = names_for(channel, queue)
    level = level_of(channel, message)
    user, cap = message_user(message), message_cap(message)
    ceiling = admit[0] if admit is not None else None
    limit = min((c for c in (cap, ceiling) if c is not None), default=None)
    batch = kwargs.pop("_publish_batch", None)  # Kombu >= 5.7 batch publishing
    if batch is not None:
        if limit is None:
            args = store.enqueue_args(names, key, dumps(message), level=level, user=user)
            batch.add("eval", store.ENQUEUE.text, 0, *args)
            return None
        # A capped publish must be able to refuse this message: the batch's
        # replies are never read, so its earlier messages go first, then this one alone.
        batch.flush()
    with compat.redis_client(channel) as client:
        reply = store.enqueue(
            client, names, key, dumps(message), level=level, user=user, cap=limit
        )  # fmt: skip
    _raise_if_refused(reply, queue, key, cap, admit)
    return None


def _raise_if_refused(
    reply: Any, queue: str, key: str, cap: int | None, admit: tuple[int, int, int] | None
) -> None:
    """Raise the producer's error when a push script refused the message at its cap."""
    full = store.refused(reply)
    if full is None:
        return
    if admit is None or (cap is not None and full >= cap):
        raise KeyBacklogFull(queue, key, cap or 0, full)
    raise BrokerMemoryHigh(queue, key, full, *admit)


def message_due(message: Any) -> float | None:
    """When a payload stamped by ``fair_eta="broker"`` is due, if that is still ahead; else None."""
    headers = message.get("headers") if isinstance(message, dict) else None
    due = headers.get(DUE_HEADER) if isinstance(headers, Mapping) else None
    if isinstance(due, (int, float)) and not isinstance(due, bool) and due > time():
        return float(due)
    return None


def _schedule(
    channel: Any,
    queue: str,
    message: Any,
    key: str | None,
    due: float,
    admit: tuple[int, int, int] | None,
    kwargs: dict[str, Any],
) -> None:
    """Put a message with a future eta in its queue's schedule (:mod:`celery_fair.keys.eta`)."""
    batch = kwargs.pop("_publish_batch", None)  # Kombu >= 5.7 batch publishing
    if batch is not None:
        batch.flush()  # the batch's earlier messages go first
    names = names_for(channel, queue)
    level = level_of(channel, message)
    user = message_user(message) if key is not None else None
    cap = message_cap(message) if key is not None else None
    ceiling = admit[0] if admit is not None and key is not None else None
    limit = min((c for c in (cap, ceiling) if c is not None), default=None)
    with compat.redis_client(channel) as client:
        reply = store.schedule(
            client, names, due, dumps(message), level=level, key=key, user=user, cap=limit
        )  # fmt: skip
    if key is not None:
        _raise_if_refused(reply, queue, key, cap, admit)


def take_admission(message: Any) -> tuple[int, int, int] | None:
    """Take :data:`ADMIT_HEADER` off a Kombu payload: ``(ceiling, used, maxmemory)``, or None."""
    headers = message.get("headers") if isinstance(message, dict) else None
    found = headers.pop(ADMIT_HEADER, None) if isinstance(headers, dict) else None
    if (
        isinstance(found, (list, tuple))
        and len(found) == 3
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in found)
    ):
        return found[0], found[1], found[2]
    return None


def _fair_restore(
    original: Any,
    channel: Any,
    payload: Any,
    exchange: Any,
    routing_key: Any,
    pipe: Any,
    leftmost: bool = False,
) -> Any:
    queues = compat.bound_queues(channel, exchange, routing_key)
    keyed = {q: k for q in queues if (k := message_key(payload, q)) is not None}
    if not keyed:
        return original(channel, payload, exchange, routing_key, pipe, leftmost)
    # As Kombu does: mark it redelivered, then put it back.  Kombu's RPUSH
    # (leftmost=False) puts it first in line, its LPUSH last.
    try:
        payload["headers"]["redelivered"] = True
        payload["properties"]["delivery_info"]["redelivered"] = True
    except (KeyError, TypeError):
        pass
    text = dumps(payload)
    try:
        tag = payload["properties"]["delivery_tag"]
    except (KeyError, TypeError):
        tag = None
    for queue in queues:
        if queue in keyed:
            names = names_for(channel, queue)
            level = level_of(channel, payload)
            store.enqueue(
                pipe, names, keyed[queue], text, front=not leftmost, level=level,
                user=message_user(payload),
            )  # fmt: skip
            if isinstance(tag, str):
                # Back in line: the key's slot it held (per-key limits) is free.
                store.release(pipe, names.sep, [(names.base, tag)])
        else:
            list_key = compat.queue_key(channel, queue, compat.message_priority(channel, payload))
            (pipe.lpush if leftmost else pipe.rpush)(list_key, text)
    return None


# A queue is keyed if its keyed state exists on the broker: no process-wide list.


def _fair_size(original: Any, channel: Any, queue: str) -> int:
    size = int(original(channel, queue))
    with compat.redis_client(channel) as client:
        size += store.backlog(client, names_for(channel, queue)).messages
    return size


def _fair_purge(original: Any, channel: Any, queue: str) -> int:
    purged = int(original(channel, queue))
    names = names_for(channel, queue)
    with compat.redis_client(channel) as client:
        purged += store.purge(client, names)
        purged += store.purge_schedule(client, names)
    return purged


def _fair_has_queue(original: Any, channel: Any, queue: str, **kwargs: Any) -> bool:
    if original(channel, queue, **kwargs):
        return True
    with compat.redis_client(channel) as client:
        return bool(client.exists(names_for(channel, queue).state))
