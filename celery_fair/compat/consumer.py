"""Celery's consumer: its QoS, its bad-input handlers, acks and the connection's drain."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .probes import Probe, _callable_with, _lacks, _names_used

logger = logging.getLogger(__name__)


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


def wrap_drain_events(connection: Any, wrapper: Callable[..., Any]) -> None:
    """Route a Kombu connection's ``drain_events`` through ``wrapper(drain, timeout, **kw)``."""
    drain = connection.drain_events

    def fair_drain_events(timeout: float | None = None, **kwargs: Any) -> Any:
        return wrapper(drain, timeout, **kwargs)

    connection.drain_events = fair_drain_events
