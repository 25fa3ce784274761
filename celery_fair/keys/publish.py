"""Keyed queues on the producer: stamp each task's key, publish it to its key's list.

``celery_fair.install(app)`` connects :func:`stamp_key` to Celery's
``before_task_publish`` and wraps four methods of Kombu's Redis channel
class (through :mod:`celery_fair.compat`, probed):

* ``_put``: a message for a keyed queue with a key goes to that key's list
  (the ``ENQUEUE`` script); one without a key goes to the queue's own list,
  as Kombu puts it, and is served as the unkeyed key;
* ``_do_restore_message``: a restored message (visibility timeout, a
  worker's ``restore_unacked``, ``reject(requeue=True)``) goes back to its key;
* ``_size``, ``_purge`` and ``_has_queue``: count, delete and see the
  per-key lists too, so ``celery purge`` and ``queue_declare(passive=True)``
  tell the truth.

Which queues are keyed is process-wide (the Redis channel class is shared
by every app of the process): the union of the installed apps'
``fair_keys``, read when first needed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from kombu.utils.json import dumps as _dumps

from .. import compat
from ..routing.keys import KeySource, parse_key_spec
from . import store
from .layout import KEY_HEADER, KeyedNames

__all__ = ("KeyedQueues", "keyed_queues", "register_app", "stamp_key", "wrap_kombu")

_lock = threading.Lock()
_apps: weakref.WeakSet[Any] = weakref.WeakSet()
_sources: dict[str, KeySource] | None = None
_patched = False


class KeyedQueues(dict[str, KeySource]):
    """Keyed queue name -> where its messages' key is."""


def parse_fair_keys(value: Any) -> KeyedQueues:
    """Check ``fair_keys`` (queue -> key spec, as ``ConsistentHashRouter``'s ``key=``)."""
    from ..worker.settings import FairConfigError

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
            parsed[queue] = parse_key_spec(spec)
        except (TypeError, ValueError) as exc:
            raise FairConfigError(f"fair_keys[{queue!r}]={spec!r}: {exc}") from None
    return parsed


def register_app(app: Any) -> None:
    """Make ``app``'s ``fair_keys`` count; wrap Kombu's Redis channel once, if it has any.

    An app without ``fair_keys`` when ``install`` runs leaves Kombu untouched
    (a worker that finds ``fair_keys`` at start wraps it then).
    """
    global _sources
    with _lock:
        _apps.add(app)
        _sources = None  # read again at the next use
    if app.conf.get("fair_keys"):
        wrap_kombu()


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


def keyed_queues() -> Mapping[str, KeySource]:
    """The keyed queues of every installed app (read from their configuration once)."""
    global _sources
    sources = _sources
    if sources is None:
        with _lock:
            sources = {}
            for app in list(_apps):
                sources.update(parse_fair_keys(app.conf.get("fair_keys")))
            _sources = sources
    return sources


def stamp_key(
    sender: Any = None,
    body: Any = None,
    routing_key: str | None = None,
    headers: dict[str, Any] | None = None,
    properties: Mapping[str, Any] | None = None,
    declare: Sequence[Any] | None = None,
    **kwargs: Any,
) -> None:
    """``before_task_publish``: put the task's key in its :data:`KEY_HEADER`.

    The queue is the routing key (Celery's direct routing, ``queue=`` and
    ``task_routes``) or a declared queue.  A key already in the header (set
    by the caller or by ``ConsistentHashRouter``) is kept when the queue's
    own source finds none.
    """
    sources = keyed_queues()
    if not sources or headers is None:
        return
    source = sources.get(routing_key or "")
    if source is None:
        for queue in declare or ():
            source = sources.get(getattr(queue, "name", None) or "")
            if source is not None:
                break
        else:
            return
    args, kw = _arguments(body)
    options = dict(properties or {})
    options["headers"] = headers
    key = source.extract(str(sender), args, kw, options)
    if key is not None:
        headers[KEY_HEADER] = key.decode() if isinstance(key, bytes) else str(key)


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


def message_key(message: Mapping[str, Any]) -> str | None:
    """The key a Kombu payload carries, or None."""
    headers = message.get("headers")
    key = headers.get(KEY_HEADER) if isinstance(headers, Mapping) else None
    return key if isinstance(key, str) and key else None


def names_for(channel: Any, queue: str) -> KeyedNames:
    """The Redis names of ``queue``'s keyed lists on ``channel``."""
    return KeyedNames(compat.key_prefix(channel) + queue, compat.key_separator(channel))


# -- the wrapped Kombu Redis channel methods ------------------------------------


def _fair_put(original: Any, channel: Any, queue: str, message: Any, **kwargs: Any) -> Any:
    key = message_key(message) if queue in keyed_queues() else None
    if key is None:
        return original(channel, queue, message, **kwargs)
    names = names_for(channel, queue)
    batch = kwargs.pop("_publish_batch", None)  # Kombu >= 5.7 batch publishing
    if batch is not None:
        batch.add("eval", store.ENQUEUE.text, 0, *store.enqueue_args(names, key, dumps(message)))
        return None
    with channel.conn_or_acquire() as client:
        store.enqueue(client, names, key, dumps(message))
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
    sources = keyed_queues()
    key = message_key(payload) if sources else None
    queues = compat.bound_queues(channel, exchange, routing_key) if key is not None else ()
    keyed = [q for q in queues if q in sources]
    if key is None or not keyed:
        return original(channel, payload, exchange, routing_key, pipe, leftmost)
    # As Kombu does: mark it redelivered, then put it back.  Kombu's RPUSH
    # (leftmost=False) puts it first in line, its LPUSH last.
    try:
        payload["headers"]["redelivered"] = True
        payload["properties"]["delivery_info"]["redelivered"] = True
    except (KeyError, TypeError):
        pass
    text = dumps(payload)
    for queue in queues:
        if queue in sources:
            store.enqueue(pipe, names_for(channel, queue), key, text, front=not leftmost)
        else:
            list_key = compat.queue_key(channel, queue, compat.message_priority(channel, payload))
            (pipe.lpush if leftmost else pipe.rpush)(list_key, text)
    return None


def _fair_size(original: Any, channel: Any, queue: str) -> int:
    size = int(original(channel, queue))
    if queue in keyed_queues():
        with channel.conn_or_acquire() as client:
            size += store.backlog(client, names_for(channel, queue)).messages
    return size


def _fair_purge(original: Any, channel: Any, queue: str) -> int:
    purged = int(original(channel, queue))
    if queue in keyed_queues():
        with channel.conn_or_acquire() as client:
            purged += store.purge(client, names_for(channel, queue))
    return purged


def _fair_has_queue(original: Any, channel: Any, queue: str, **kwargs: Any) -> bool:
    if original(channel, queue, **kwargs):
        return True
    if queue not in keyed_queues():
        return False
    with channel.conn_or_acquire() as client:
        return bool(client.exists(names_for(channel, queue).state))
