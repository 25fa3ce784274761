"""CoDel (RFC 8289) as a pure controller: one drop decision per dequeued task.

CoDel watches the *sojourn time* of what leaves a buffer.  While the
sojourn stays below ``target`` nothing happens; once it has stayed at or
above ``target`` for a whole ``interval`` (so the minimum over the interval
is above target: a standing queue, not a burst), the controller enters the
*dropping state*, drops the head, and schedules the next drop with the
control law ``drop_next = t + interval / sqrt(count)`` (RFC 8289 §3.3,
§5.6), so that drops come faster while the queue refuses to drain.  It
leaves the dropping state at the first sojourn below target.

In the RFC (§5.5) ``dequeue()`` owns the queue and loops: drop the head,
dequeue the next packet, drop again while the next drop is due.  Here the
queue belongs to the caller (the worker's buffer of prefetched tasks), so
the loop is driven from outside:

* the caller takes the head task and asks :meth:`CoDelController.should_drop`
  with its sojourn; ``False`` means dispatch it, ``True`` means drop it (send
  it back to the broker);
* after a ``True`` the caller asks again about the *next* head with the same
  ``now``: that call is the RFC's "dequeue the next packet" step, and
  :meth:`CoDelController.empty` replaces it when the buffer has run dry;
* whenever the caller looks for a task and finds none, it calls
  :meth:`~CoDelController.empty` (RFC §5.6: dodequeue of an empty queue).

Fed that way the controller makes exactly the decisions, and passes
through exactly the states, of the RFC's pseudo-code (the unit tests replay
traces through both).

The RFC does not drop when at most one MTU is left in the queue (§5.3,
§5.6: ``bytes() <= maxpacket``) so that the link is never starved.  Tasks
are counted, not measured in bytes: ``backlog`` is the number of tasks that
still wait once the head is taken, and a sojourn counts as good while
``backlog < min_backlog``.  The default ``min_backlog=1`` never drops the
last buffered task, so a drop always leaves a task for the free pool slot;
``min_backlog=2`` is the literal reading with one task as one MTU, and
``0`` turns the test off.

The controller reads no clock of its own: time is ``now``, or the clock
injected at construction when ``now`` is omitted.  It imports nothing from
Celery or Kombu.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ("CODEL_ACTIONS", "CoDelAction", "CoDelController", "CoDelStatistics")

#: What happens to a task CoDel drops: sent back to its queue (with a count),
#: or rejected without requeue (dead-lettered where the broker does that).
CoDelAction = Literal["requeue", "reject"]
CODEL_ACTIONS: tuple[CoDelAction, ...] = ("requeue", "reject")

# RFC 8289 §5.5: re-entering the dropping state less than this many
# intervals after the last scheduled drop resumes the previous drop rate.
RESUME_WINDOW_INTERVALS: Final = 16

# What the next should_drop() call means, after a True answer (see module doc).
_FRESH: Final = 0  # a new dequeue()
_AFTER_ENTRY: Final = 1  # the dequeue that follows the drop entering the dropping state
_IN_LOOP: Final = 2  # the dequeue that follows a drop inside the dropping state


@dataclass(frozen=True)
class CoDelStatistics:
    """A snapshot of a :class:`CoDelController`.

    ``first_above_time``, ``dropping``, ``count``, ``lastcount`` and
    ``drop_next`` are the RFC 8289 §5.2 state (``None`` where the RFC uses 0
    for "not set"); the rest are counters since construction, kept across
    :meth:`CoDelController.reset`.
    """

    target: float
    interval: float
    min_backlog: int
    first_above_time: float | None
    dropping: bool
    count: int
    lastcount: int
    drop_next: float | None
    decisions: int
    drops: int
    dropping_entries: int
    resets: int

    def as_dict(self) -> dict[str, object]:
        """Return the record as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    seconds = float(value)
    if not 0 < seconds < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


class CoDelController:
    """The CoDel drop decision for a buffer owned by the caller.

    ``target`` is the sojourn (seconds) a task may spend in the buffer,
    ``interval`` the window (seconds) over which the sojourn must stay above
    ``target`` before anything is dropped, about the longest normal task;
    ``target < interval``.  ``min_backlog`` is the least number of tasks
    that must still wait behind a task for it to be dropped.  ``clock``
    gives the time when a call omits ``now``.
    """

    __slots__ = (
        "target",
        "interval",
        "min_backlog",
        "_clock",
        "_first_above_time",
        "_dropping",
        "_count",
        "_lastcount",
        "_drop_next",
        "_next_call",
        "_decisions",
        "_drops",
        "_dropping_entries",
        "_resets",
    )

    def __init__(
        self,
        target: float,
        interval: float,
        *,
        min_backlog: int = 1,
        clock: Callable[[], float],
    ) -> None:
        self.target: Final = _check_seconds("target", target)
        self.interval: Final = _check_seconds("interval", interval)
        if not self.target < self.interval:
            raise ValueError(
                f"target must be below interval, got target={target!r} interval={interval!r}"
            )
        if isinstance(min_backlog, bool) or not isinstance(min_backlog, int) or min_backlog < 0:
            raise ValueError(f"min_backlog must be an integer >= 0, got {min_backlog!r}")
        self.min_backlog: Final = min_backlog
        self._clock = clock
        self._decisions = 0
        self._drops = 0
        self._dropping_entries = 0
        self._resets = 0
        self._clear()

    def _clear(self) -> None:
        self._first_above_time: float | None = None
        self._dropping = False
        self._count = 0
        self._lastcount = 0
        self._drop_next: float | None = None
        self._next_call = _FRESH

    # -- decisions --------------------------------------------------------

    def should_drop(
        self, sojourn: float, now: float | None = None, *, backlog: int | None = None
    ) -> bool:
        """Decide about the task just taken from the head of the buffer.

        ``sojourn`` is how long it waited (``now`` minus its arrival),
        ``now`` the time of the decision (the injected clock when omitted),
        ``backlog`` the number of tasks still waiting behind it (``None``:
        unknown, the ``min_backlog`` test is skipped).  ``True`` means drop
        it, and the caller must then ask about the next head with the same
        ``now``, or call :meth:`empty` if there is none.
        """
        if now is None:
            now = self._clock()
        self._decisions += 1
        return self._dequeued(now, self._ok_to_drop(sojourn, now, backlog))

    def empty(self, now: float | None = None) -> None:
        """The buffer was found empty at ``now``: no task to decide about.

        Call it whenever a free slot finds nothing to dispatch, and after a
        drop that took the last task: it is the RFC's dequeue of an empty
        queue, which forgets the above-target episode and ends any dropping.
        """
        if now is None:
            now = self._clock()
        self._first_above_time = None
        # Nothing can be dropped: the result is always False.
        self._dequeued(now, False)

    def reset(self) -> None:
        """Return to the initial state (after a reconnect the buffer is gone).

        The counters of :meth:`statistics` are kept.
        """
        self._resets += 1
        self._clear()

    # RFC 8289 §5.6, dodequeue(): tracks whether the sojourn has stayed at or
    # above target for a whole interval, i.e. the minimum over the interval.
    def _ok_to_drop(self, sojourn: float, now: float, backlog: int | None) -> bool:
        if sojourn < self.target or (backlog is not None and backlog < self.min_backlog):
            self._first_above_time = None
            return False
        if self._first_above_time is None:
            self._first_above_time = now + self.interval
            return False
        return now >= self._first_above_time

    # RFC 8289 §5.5, dequeue(), cut at each drop: `_next_call` records where
    # the RFC's code would resume when the next packet has been dequeued.
    def _dequeued(self, now: float, ok_to_drop: bool) -> bool:
        step, self._next_call = self._next_call, _FRESH
        if step == _AFTER_ENTRY:
            self._enter_dropping(now)
            return False
        if step == _IN_LOOP:
            if ok_to_drop:
                assert self._drop_next is not None
                self._drop_next = self._control_law(self._drop_next)
            else:
                self._dropping = False
            return self._drop_if_due(now)
        if self._dropping:
            if not ok_to_drop:
                self._dropping = False
            return self._drop_if_due(now)
        if ok_to_drop:
            # The drop state is entered once the next packet is dequeued.
            self._drops += 1
            self._dropping_entries += 1
            self._next_call = _AFTER_ENTRY
            return True
        return False

    def _drop_if_due(self, now: float) -> bool:
        if not self._dropping:
            return False
        assert self._drop_next is not None
        if now < self._drop_next:
            return False
        self._count += 1
        self._drops += 1
        self._next_call = _IN_LOOP
        return True

    def _enter_dropping(self, now: float) -> None:
        self._dropping = True
        # RFC 8289 §5.5 (the Linux form): if the queue needs dropping again
        # soon after the last episode, start from the drop rate that episode
        # reached beyond its own start, not from one drop per interval.
        # The difference is signed (drop_next may lie ahead of now).
        delta = self._count - self._lastcount
        self._count = 1
        if (
            delta > 1
            and self._drop_next is not None
            and now - self._drop_next < RESUME_WINDOW_INTERVALS * self.interval
        ):
            self._count = delta
        self._drop_next = self._control_law(now)
        self._lastcount = self._count

    # RFC 8289 §5.6, control_law(): drops spaced interval / sqrt(count) apart
    # give a drop rate growing as sqrt(count), which TCP-like senders answer
    # with a linear decrease in rate (§3.3).
    def _control_law(self, t: float) -> float:
        return t + self.interval / math.sqrt(self._count)

    # -- introspection ----------------------------------------------------

    @property
    def dropping(self) -> bool:
        """Whether the controller is in the dropping state."""
        return self._dropping

    def statistics(self) -> CoDelStatistics:
        """A frozen snapshot of the state and the counters."""
        return CoDelStatistics(
            target=self.target,
            interval=self.interval,
            min_backlog=self.min_backlog,
            first_above_time=self._first_above_time,
            dropping=self._dropping,
            count=self._count,
            lastcount=self._lastcount,
            drop_next=self._drop_next,
            decisions=self._decisions,
            drops=self._drops,
            dropping_entries=self._dropping_entries,
            resets=self._resets,
        )

    def __repr__(self) -> str:
        return (
            f"<CoDelController target={self.target} interval={self.interval}"
            f" dropping={self._dropping} count={self._count}>"
        )
