"""What a worker served from its keyed queues, and the run-time corrections it owes.

Run-time corrections are not sent one by one: :class:`KeyCounters` keeps
them until the next fetch script call takes them, so ``fair_cost="runtime"``
costs no extra round trip.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..wire.served import Served
from .layout import UNKEYED

__all__ = ("COUNTED_KEYS", "KeyCounters", "ServedCounts")

#: Served-key counts kept per worker for ``inspect fair_stats`` (the top
#: keys); past this many distinct keys the counts are halved and the
#: smallest dropped (a bounded heavy-hitters summary).
COUNTED_KEYS = 1024

#: Corrections kept while no fetch runs to carry them (oldest dropped first).
MAX_PENDING_CHARGES = 10_000


@dataclass(frozen=True)
class ServedCounts:
    """A reading of :class:`KeyCounters` (the fields of the same names in
    :class:`~celery_fair.keys.serving.KeyStatistics`)."""

    served: dict[str, int]
    unkeyed: dict[str, int]
    top: tuple[tuple[str, str, int], ...]
    pending_charges: int


class KeyCounters:
    """Served keys counted, and run-time corrections kept for the next fetch.

    ``runtime``: keys are charged their tasks' run times (``fair_cost="runtime"``),
    so each finished task corrects what its key was charged at fetch.
    """

    def __init__(self, *, runtime: bool = False) -> None:
        self.runtime = runtime
        self._lock = threading.Lock()
        self._charges: list[tuple[str, str, str, str, float]] = []
        self._served: dict[str, int] = {}
        self._unkeyed: dict[str, int] = {}
        self._counts: dict[tuple[str, str], int] = {}

    def served(self, queue: str, key: str) -> None:
        """The fetch served ``key`` of ``queue``."""
        with self._lock:
            self._served[queue] = self._served.get(queue, 0) + 1
            if key == UNKEYED:
                self._unkeyed[queue] = self._unkeyed.get(queue, 0) + 1
            counts = self._counts
            pair = (queue, key)
            counts[pair] = counts.get(pair, 0) + 1
            if len(counts) > COUNTED_KEYS:
                _halve(counts)

    def finished(self, queue: str, served: Served, runtime: float) -> None:
        """A task of keyed ``queue`` fetched as ``served`` (its served header) ran
        ``runtime`` s."""
        charged = served.charge
        if not self.runtime or charged is None:
            return
        delta = max(0.0, runtime) - charged
        with self._lock:
            if len(self._charges) >= MAX_PENDING_CHARGES:
                del self._charges[0]
            self._charges.append((queue, served.level, served.key, served.user, delta))

    def take_charges(self) -> list[tuple[str, str, str, str, float]]:
        """The corrections not yet sent, ``(queue, level suffix, key, user, delta)``
        (and forget them); ``user`` is ``""`` for a one-level key."""
        with self._lock:
            charges, self._charges = self._charges, []
        return charges

    def reading(self, top: int = 10) -> ServedCounts:
        """The counts now, with the ``top`` most served keys."""
        with self._lock:
            ranked = sorted(self._counts.items(), key=lambda item: -item[1])[:top]
            return ServedCounts(
                served=dict(self._served),
                unkeyed=dict(self._unkeyed),
                top=tuple((q, k, n) for (q, k), n in ranked),
                pending_charges=len(self._charges),
            )


def _halve(counts: dict[tuple[str, str], int]) -> None:
    for pair in list(counts):
        counts[pair] //= 2
        if not counts[pair]:
            del counts[pair]
