"""Admission before the broker fills: which publishes to refuse, from the broker's memory.

A Redis broker at its ``maxmemory`` (with ``noeviction``, the policy a broker
needs) refuses every write, the acknowledgements that would free memory
among them: one tenant's flood stops every tenant.  Producers with
``fair_broker_memory_high`` refuse messages before that, and refuse the
largest backlogs first:

* below ``high`` (a fraction of ``maxmemory``) every publish is admitted;
* from ``high`` to ``hard`` a publish is refused when its backlog (the
  messages its key waits with, in a keyed queue; its queue's, otherwise) is
  at least a ceiling that falls from the largest backlog at ``high`` to
  nothing at ``hard``: the flood is refused first, and it is let in again
  as the workers drain it and memory falls, so its backlog settles where
  memory stays under ``hard``; quiet keys publish until then;
* from ``hard`` every publish is refused, before Redis refuses them itself.

The ceiling is at least 1 below ``hard``: a key or queue with nothing waiting
is never refused there, even when memory is held by something else.  Pure:
the adapter reads the broker and keeps the readings
(:mod:`celery_fair.kombu.admission`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import FairConfigError
from ..grammar import as_positive

__all__ = (
    "DEFAULT_HARD",
    "AdmissionLimits",
    "BrokerMemory",
    "backlog_ceiling",
    "parse_admission",
)

#: ``fair_broker_memory_hard`` unless set: every publish is refused from this
#: fraction of ``maxmemory`` on, leaving the rest for acknowledgements,
#: results and the workers' own bookkeeping.
DEFAULT_HARD = 0.95


@dataclass(frozen=True)
class AdmissionLimits:
    """``fair_broker_memory_high`` and ``fair_broker_memory_hard``, fractions of ``maxmemory``."""

    high: float
    hard: float = DEFAULT_HARD


@dataclass(frozen=True)
class BrokerMemory:
    """The broker's memory in use and its ``maxmemory`` (bytes; 0: no limit)."""

    used: int
    maxmemory: int

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> BrokerMemory:
        """From the fields of Redis' ``INFO memory`` reply."""
        return cls(int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)))

    @property
    def fraction(self) -> float | None:
        """``used`` as a fraction of ``maxmemory`` (None: the broker has no limit)."""
        return self.used / self.maxmemory if self.maxmemory > 0 else None


def backlog_ceiling(memory: BrokerMemory, limits: AdmissionLimits, largest: int) -> int | None:
    """The backlog from which a publish is refused (None: every publish is admitted).

    ``largest``: the largest backlog (of a key or a queue) the broker holds.
    0 refuses every publish.
    """
    fraction = memory.fraction
    if fraction is None or fraction < limits.high:
        return None
    if fraction >= limits.hard:
        return 0
    share = (limits.hard - fraction) / (limits.hard - limits.high)
    return max(1, math.ceil(largest * share))


def parse_admission(high: Any, hard: Any = None) -> AdmissionLimits | None:
    """Check ``fair_broker_memory_high`` (None: off) and ``fair_broker_memory_hard``."""
    if high is None:
        if hard is not None:
            raise FairConfigError(
                f"fair_broker_memory_hard={hard!r} needs fair_broker_memory_high: "
                "set the fraction of maxmemory from which the largest backlogs are refused"
            )
        return None
    low = _fraction(high, "fair_broker_memory_high")
    top = DEFAULT_HARD if hard is None else _fraction(hard, "fair_broker_memory_hard")
    if low >= top:
        raise FairConfigError(
            f"fair_broker_memory_high={high!r} must be below fair_broker_memory_hard "
            f"({top!r}): between them the largest backlogs are refused first"
        )
    return AdmissionLimits(low, top)


def _fraction(value: Any, setting: str) -> float:
    number = as_positive(value, text=True)
    if number is None or number > 1:
        raise FairConfigError(
            f"{setting} must be a fraction of the broker's maxmemory, above 0 and at "
            f"most 1 (for example 0.8), got {value!r}"
        )
    return number
