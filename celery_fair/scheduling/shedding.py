"""The CoDel shedding policy shared by the worker and the Kombu mixin.

What to do with a buffered task about to be served, given its sojourn:
run it, or send it back to the broker (``requeue``) or dead-letter it
(``reject``).  The decision is :class:`~celery_fair.scheduling.codel.CoDelController`'s
(RFC 8289); this module adds what both adapters need around it and nothing
that does I/O:

* the requeue cap: a task already sent back ``max_requeues`` times runs
  here (``keep``), so a task cannot bounce between slow consumers for ever;
* the counters, per queue, of what was returned and what was kept;
* the one validation of the CoDel options (:func:`check_codel`), used by
  ``FairSettings`` (``fair_codel_*``) and by ``FairConsumerMixin``
  (``codel_*``), which name the options their own way.

:meth:`SheddingPolicy.check` says a stale task goes back as the one
:class:`~celery_fair.scheduling.dispatch.SendBack` verdict of the admission
loop; the adapters carry it out (publish a copy, or reject) and report a
failure to do so with :meth:`SheddingPolicy.failed`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from ..grammar import as_positive
from ..wire import REQUEUE_HEADER
from .codel import CODEL_ACTIONS, CoDelAction, CoDelController, CoDelStatistics
from .dispatch import SendBack

__all__ = (
    "UNKNOWN_QUEUE",
    "CoDelOptions",
    "SheddingPolicy",
    "SheddingStatistics",
    "Verdict",
    "check_codel",
    "option_error",
)

#: The queue name counters use for a task whose queue is not known.
UNKNOWN_QUEUE = "<unknown>"

#: ``run``: serve it; ``keep``: stale but at the requeue cap, serve it here;
#: ``requeue``/``reject``: send it back to the broker that way.
Verdict = Literal["run", "keep", "requeue", "reject"]


def option_error(option: str, value: object, expected: str) -> ValueError:
    """The one wording of a bad option: its name, its value, what it must be."""
    return ValueError(f"{option}={value!r}: {expected}")


def _seconds(option: str, value: object) -> float:
    seconds = as_positive(value)
    if seconds is None:
        raise option_error(option, value, "must be a positive number of seconds")
    return seconds


@dataclass(frozen=True)
class CoDelOptions:
    """Validated CoDel options (:func:`check_codel`)."""

    target: float
    interval: float
    action: CoDelAction = "requeue"
    max_requeues: int = 3


def check_codel(
    target: object,
    interval: object,
    action: object = "requeue",
    max_requeues: object = 3,
    *,
    name: Callable[[str], str] = lambda option: option,
) -> CoDelOptions | None:
    """Validate the CoDel options; None when CoDel is off (neither time set).

    ``name`` maps ``"codel_target"`` (and the others) to the caller's own
    name for the option, so that an error names what the user wrote.
    Raises ValueError with the option, its value and what it must be.
    """
    if action not in CODEL_ACTIONS:
        raise option_error(name("codel_action"), action, f"must be one of {CODEL_ACTIONS}")
    if isinstance(max_requeues, bool) or not isinstance(max_requeues, int) or max_requeues < 0:
        raise option_error(name("codel_max_requeues"), max_requeues, "must be an integer >= 0")
    if target is None and interval is None:
        return None
    if target is None or interval is None:
        if target is None:
            missing, other, given = "codel_target", "codel_interval", interval
        else:
            missing, other, given = "codel_interval", "codel_target", target
        raise option_error(
            name(missing), None, f"must be set with {name(other)}={given!r} (CoDel needs both)"
        )
    target_s = _seconds(name("codel_target"), target)
    interval_s = _seconds(name("codel_interval"), interval)
    if not target_s < interval_s:
        raise option_error(
            name("codel_target"), target, f"must be below {name('codel_interval')}={interval!r}"
        )
    assert action in CODEL_ACTIONS  # for the type checker: checked above
    return CoDelOptions(target_s, interval_s, action, max_requeues)


class SheddingPolicy:
    """CoDel's verdict on each task served from a buffer, with the requeue cap.

    ``clock`` times sojourns and the controller (monotonic seconds).
    Only :meth:`verdict` runs per served task; the counters are touched
    only when a task is stale.
    """

    def __init__(self, options: CoDelOptions, *, clock: Callable[[], float]) -> None:
        self.options = options
        self.clock = clock
        self.controller = CoDelController(options.target, options.interval, clock=clock)
        self.returned: dict[str, dict[str, int]] = {"requeue": {}, "reject": {}}
        self.kept: dict[str, int] = {}
        self.errors = 0

    @property
    def action(self) -> CoDelAction:
        return self.options.action

    @property
    def dropping(self) -> bool:
        """Whether CoDel finds the buffer stale now (fetch nothing more)."""
        return self.controller.dropping

    def verdict(
        self, queue: str, received: float, backlog: int, requeues: Callable[[], int]
    ) -> Verdict:
        """What to do with a task of ``queue`` received at ``received``.

        ``backlog``: tasks still buffered behind it.  ``requeues()`` reads
        how often it was sent back already; it is called only for a stale
        task.  After a ``requeue`` or ``reject`` verdict ask again about the
        next task at once (RFC 8289 §5.5: drop, then dequeue the next).
        """
        now = self.clock()
        if not self.controller.should_drop(now - received, now, backlog=backlog):
            return "run"
        if self.options.action == "requeue" and requeues() >= self.options.max_requeues:
            self.kept[queue] = self.kept.get(queue, 0) + 1
            return "keep"
        counts = self.returned[self.options.action]
        counts[queue] = counts.get(queue, 0) + 1
        return self.options.action

    def check(
        self,
        queue: str,
        received: float,
        backlog: int,
        requeues: Callable[[], int],
        *,
        destination: str | None,
    ) -> SendBack | None:
        """:meth:`verdict` as the admission loop's check: None runs the task.

        A ``requeue`` goes to ``destination`` (None: the exchange and routing
        key it came with) at the front, its :data:`REQUEUE_HEADER` one more
        than ``requeues()``; a ``reject`` is dead-lettered.
        """
        verdict = self.verdict(queue, received, backlog, requeues)
        if verdict in ("run", "keep"):
            return None
        if verdict == "reject":
            return SendBack("codel-reject", destination, dead_letter=True)
        return SendBack("codel-requeue", destination, {REQUEUE_HEADER: requeues() + 1})

    def failed(self, queue: str, back: SendBack) -> None:
        """Sending a task back failed: it runs here instead (counted once, as an error)."""
        counts = self.returned["reject" if back.dead_letter else "requeue"]
        counts[queue] -= 1
        self.errors += 1

    def empty(self) -> None:
        """The buffer was found empty (RFC 8289 §5.6: CoDel leaves its dropping state)."""
        self.controller.empty(self.clock())

    def reset(self) -> None:
        """The buffered tasks went back to the broker (a reconnection)."""
        self.controller.reset()

    def statistics(self) -> SheddingStatistics:
        """A frozen snapshot: the CoDel state and what was sent back, per queue."""
        return SheddingStatistics(
            controller=self.controller.statistics(),
            action=self.options.action,
            max_requeues=self.options.max_requeues,
            requeued=sum(self.returned["requeue"].values()),
            rejected=sum(self.returned["reject"].values()),
            requeued_by_queue=dict(self.returned["requeue"]),
            rejected_by_queue=dict(self.returned["reject"]),
            kept_by_queue=dict(self.kept),
            kept_at_cap=sum(self.kept.values()),
            errors=self.errors,
        )


@dataclass(frozen=True)
class SheddingStatistics:
    """A snapshot of a :class:`SheddingPolicy` (``inspect fair_stats`` -> ``codel``)."""

    controller: CoDelStatistics
    action: str
    max_requeues: int
    requeued: int
    rejected: int
    requeued_by_queue: Mapping[str, int]
    rejected_by_queue: Mapping[str, int]
    kept_by_queue: Mapping[str, int]
    kept_at_cap: int
    errors: int

    @property
    def dropping(self) -> bool:
        """Whether CoDel finds the buffer stale now."""
        return self.controller.dropping

    def as_dict(self) -> dict[str, Any]:
        """The CoDel state and these counters, flat, as JSON-friendly data."""
        stats: dict[str, Any] = dict(self.controller.as_dict())
        for name in (f.name for f in fields(self) if f.name != "controller"):
            value = getattr(self, name)
            stats[name] = dict(value) if isinstance(value, Mapping) else value
        return stats
