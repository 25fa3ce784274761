"""The options of :class:`~celery_fair.kombu.mixin.FairConsumerMixin`, checked once.

:func:`check_options` reads the constructor's arguments into a frozen
:class:`ConsumerOptions`, or raises ValueError naming the first bad option
and its value (``FairConsumerMixin option window=0: ...``), in the one
wording of :func:`~celery_fair.scheduling.shedding.option_error`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kombu.entity import Queue
from kombu.message import Message

from ..grammar import as_positive, as_positive_int
from ..scheduling.codel import CoDelAction
from ..scheduling.cost import MEASURED_COST_MODES, CostMode
from ..scheduling.shedding import CoDelOptions, check_codel, option_error
from .fill import split_window

__all__ = (
    "ERROR_POLICIES",
    "WINDOW_PER_QUEUE",
    "ConsumerOptions",
    "ErrorPolicy",
    "Handler",
    "QueueWeights",
    "check_options",
)

#: ``handler(queue_name, body, message)``; the mixin acks when it returns.
Handler = Callable[[str, Any, Message], None]
ErrorPolicy = Literal["reject", "requeue", "raise"]
#: Queues (names or :class:`kombu.Queue` objects) with their weights.
QueueWeights = Mapping[str, float] | Mapping[Queue, float] | Iterable[tuple[str | Queue, float]]
ERROR_POLICIES: tuple[str, ...] = ("reject", "requeue", "raise")

#: Default total window per consumed queue (split between them by weight).
WINDOW_PER_QUEUE = 25


@dataclass(frozen=True)
class ConsumerOptions:
    """A consumer's checked options; the meaning of each is in the mixin's docstring."""

    queues: Mapping[str, Queue]
    weights: Mapping[str, float]
    windows: Mapping[str, int]
    handler: Handler | None
    cost: CostMode
    runtime_quantum: float
    on_error: ErrorPolicy
    #: None: CoDel is off.
    codel: CoDelOptions | None
    codel_action: CoDelAction
    codel_max_requeues: int
    ack_batch: int
    stop_check_interval: float
    clock: Callable[[], float]
    accept: list[str] | None


def check_options(
    queues: QueueWeights,
    *,
    handler: Handler | None,
    handle_overridden: bool,
    window: int | None,
    windows: Mapping[str, int] | None,
    cost: CostMode,
    runtime_quantum: float,
    on_error: ErrorPolicy,
    codel_target: float | None,
    codel_interval: float | None,
    codel_action: CoDelAction,
    codel_max_requeues: int,
    ack_batch: int,
    stop_check_interval: float,
    clock: Callable[[], float],
    accept: Iterable[str] | None,
) -> ConsumerOptions:
    """Check the constructor's arguments; raise ValueError naming the first bad one.

    ``handle_overridden``: the class overrides ``handle``, so ``handler``
    may be None.
    """
    checked = _check_queues(queues)
    weights = {name: weight for name, (_, weight) in checked.items()}
    if handler is not None and not callable(handler):
        raise _option_error("handler", handler, "must be callable")
    if handler is None and not handle_overridden:
        raise _option_error("handler", handler, "pass a handler or override handle()")
    total = WINDOW_PER_QUEUE * len(checked) if window is None else window
    sizes = split_window(weights, _positive_int("window", total))
    for name, size in (windows or {}).items():
        if name not in checked:
            raise _option_error("windows", name, "is not one of the consumed queues")
        sizes[name] = _positive_int(f"windows[{name!r}]", size)
    if cost not in MEASURED_COST_MODES:
        raise _option_error("cost", cost, f"must be one of {MEASURED_COST_MODES}")
    quantum = _positive_number("runtime_quantum", runtime_quantum)
    if on_error not in ERROR_POLICIES:
        raise _option_error("on_error", on_error, f"must be one of {ERROR_POLICIES}")
    try:
        codel = check_codel(codel_target, codel_interval, codel_action, codel_max_requeues)
    except ValueError as exc:
        raise ValueError(f"FairConsumerMixin option {exc}") from None
    batch = _positive_int("ack_batch", ack_batch)
    interval = _positive_number("stop_check_interval", stop_check_interval)
    if not callable(clock):
        raise _option_error("clock", clock, "must be callable")
    return ConsumerOptions(
        queues={name: queue for name, (queue, _) in checked.items()},
        weights=weights,
        windows=sizes,
        handler=handler,
        cost=cost,
        runtime_quantum=quantum,
        on_error=on_error,
        codel=codel,
        codel_action=codel_action,
        codel_max_requeues=codel_max_requeues,
        ack_batch=batch,
        stop_check_interval=interval,
        clock=clock,
        accept=None if accept is None else list(accept),
    )


def _option_error(option: str, value: object, expected: str) -> ValueError:
    return ValueError(f"FairConsumerMixin option {option_error(option, value, expected)}")


def _positive_number(option: str, value: object) -> float:
    number = as_positive(value)
    if number is None:
        raise _option_error(option, value, "must be a positive number")
    return number


def _positive_int(option: str, value: object) -> int:
    number = as_positive_int(value)
    if number is None:
        raise _option_error(option, value, "must be an integer of at least 1")
    return number


def _check_queues(queues: QueueWeights) -> dict[str, tuple[Queue, float]]:
    pairs = queues.items() if isinstance(queues, Mapping) else queues
    checked: dict[str, tuple[Queue, float]] = {}
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise _option_error("queues", queues, "must map queues to weights")
        queue, weight = item
        if isinstance(queue, str):
            queue = Queue(queue)
        if not isinstance(queue, Queue) or not queue.name:
            raise _option_error("queues", queue, "a queue must be a name or a named kombu.Queue")
        if queue.name in checked:
            raise _option_error("queues", queue.name, "names a queue twice")
        checked[queue.name] = (queue, _positive_number(f"queues[{queue.name!r}]", weight))
    if not checked:
        raise _option_error("queues", queues, "must name at least one queue")
    return checked
