"""The served record: what a worker stamps on a message it fetched from a keyed queue.

It travels as the :data:`~celery_fair.wire.SERVED_HEADER` header, a JSON list
``[key, charge, weight, throttled, level, user, paused]``.  Messages outlive the
worker that stamped them (a restore, a requeue, a rolling upgrade), so
:meth:`Served.from_wire` reads every shorter form an older worker wrote,
and :meth:`Served.to_wire` writes the list in the same order as always.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import SERVED_HEADER

__all__ = ("NOT_SERVED", "Served")


@dataclass(frozen=True)
class Served:
    """A message served from a keyed queue, as the fetch script served it.

    Fields an older worker did not stamp read as None (numbers) or ``""``
    (text), which is what its tasks were: first level, no user.
    """

    #: The fairness key served.
    key: str
    #: The cost charged to the key at fetch time (run-time mode corrects it
    #: when the task finishes); None when absent or not a number.
    charge: float | None
    #: The key's weight when it was served (absent before telemetry's schema 2).
    weight: float | None = None
    #: Seconds the key spent throttled (set aside by its limits) since its
    #: previous task was served (0 without limits; absent before telemetry's schema 2).
    throttled: float | None = None
    #: The suffix of the priority level it came from: ``""`` is the first
    #: level, the only one before priority levels.
    level: str = ""
    #: The user served within a two-level key; ``""`` for a one-level key
    #: (and for the user of messages sent without one).
    user: str = ""
    #: Seconds the key had been paused since its previous task was served
    #: (absent before two-level keys).
    paused: float | None = None

    def user_or(self, stamped: Any) -> str | None:
        """The task's user within its key for telemetry: the one served (Redis), else
        ``stamped``, the producer's :data:`~celery_fair.wire.USER_HEADER` (RabbitMQ,
        where no fetch script stamps this record); None for a one-level key."""
        if self.user:
            return self.user
        return stamped if isinstance(stamped, str) and stamped else None

    def to_wire(self) -> list[Any]:
        """The header's value: the seven fields in their wire order."""
        return [
            self.key, self.charge, self.weight, self.throttled, self.level, self.user, self.paused,
        ]  # fmt: skip

    @classmethod
    def from_wire(cls, value: Any) -> Served | None:
        """The record a header value holds; None if it is not one (absent, not a list, empty).

        Each form a worker ever wrote is read: ``[key, charge]`` (before
        telemetry's schema 2), then weight and seconds throttled, then the level (before
        two-level keys), then user and paused.  Those two are read only
        as the pair they were always written as.
        """
        if not isinstance(value, (list, tuple)) or not value:
            return None
        n = len(value)
        level = value[4] if n >= 5 else ""
        user = value[5] if n >= 6 else ""
        return cls(
            key=str(value[0]),
            charge=_float(value[1]) if n >= 2 else None,
            weight=_number(value[2]) if n >= 4 else None,
            throttled=_number(value[3]) if n >= 4 else None,
            level=level if isinstance(level, str) else "",
            user=user if isinstance(user, str) else "",
            paused=_number(value[6]) if n >= 7 else None,
        )

    @classmethod
    def from_headers(cls, headers: Any) -> Served | None:
        """The record in a message's (or a request's) headers; None without one."""
        return cls.from_wire(headers.get(SERVED_HEADER)) if isinstance(headers, dict) else None


#: What a message without a readable served header tells: no key, nothing known.
NOT_SERVED = Served(key="", charge=None)


def _number(value: Any) -> float | None:
    # Telemetry's fields: a JSON number only, so that a stray text is left out.
    return float(value) if isinstance(value, (int, float)) else None


def _float(value: Any) -> float | None:
    # The charge is read as float() reads it: the run-time correction has
    # always accepted whatever float() does.
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
