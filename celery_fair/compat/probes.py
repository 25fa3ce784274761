"""The capability registry and the probe a worker runs at start.

Each private part of Celery, Kombu or redis-py celery-fair relies on is a
:class:`Capability`; a :class:`Probe` records what a worker found missing and
either logs the documented fallback once or stops the worker.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ..errors import CompatibilityError

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
            "acknowledging a late ack through the live channel, and settling messages while "
            "the broker is full (QoS._remove_from_indices/restore_by_tag)",
            "the message is left to the visibility timeout (a duplicate run, not a loss); "
            "a full broker's refusal of an acknowledgement stops the worker, as in plain Celery",
        ),
        Capability(
            "kombu.redis.declare_while_full",
            "declaring queues while the broker is full: a worker's start, remote control "
            "(Channel._size/_queue_bind/_delete/_q_for_pri, keyprefix_queue, sep)",
            "a worker started against a full broker exits, as plain Celery does",
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
            "dispatch hooks (WorkController._process_task/process_task, the pool's "
            "on_apply, Request.on_success/on_failure)",
            None,
        ),
        Capability(
            "amqp.channel.consume_hooks",
            "per-queue prefetch windows on RabbitMQ (the channel's basic_consume/basic_qos, "
            "basic_ack/basic_reject/basic_nack for adaptive windows, the consumer QoS's "
            "callback)",
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
            "celery.worker.state_requests",
            "the stall watchdog: the tasks a worker reserved and those its pool started "
            "(celery.worker.state.reserved_requests/active_requests) and the pool's size "
            "(TaskPool.num_processes or limit)",
            "no stall watchdog: a task that waits while a pool process is free is not "
            "logged, counted or repaired",
        ),
        Capability(
            "celery.pool.process_exits",
            "replacing a prefork process whose exit was announced before it could be "
            "joined at once (AsynPool._event_process_exit, read by _track_child_process, "
            "and maintain_pool; celery#9588)",
            "such a process is replaced at the pool's next maintenance, up to 5 s later, "
            "as in plain Celery",
        ),
        Capability(
            "celery.pool.shrink_spares",
            "--autoscale shrinking only prefork processes no job is on its way to "
            "(AsynPool._worker_active, read by _iterinactive, _waiting_to_start, and the "
            "jobs' _write_to/_scheduled_for; celery#2587)",
            "a shrink can terminate a process as a job reaches it, and that task fails "
            "with WorkerLostError (signal 15), as in plain Celery",
        ),
        Capability(
            "celery.worker.pool_slots",
            "the pool's size before the pool exists (WorkController.pool_cls, "
            "concurrency, min_concurrency/max_concurrency set by the Pool bootstep)",
            "the worker's --concurrency is taken as its size (too many for solo, too few "
            "for --autoscale)",
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


def _names_used(code: Any) -> set[str]:
    """Every attribute or global name a function's code (and its nested functions) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names_used(const)
    return names
