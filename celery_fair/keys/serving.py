"""The worker's side of keyed queues: fetch charges, run-time corrections, counts.

One :class:`KeyedServing` per worker, shared by the atomic fetch (which asks
what to charge and reports each key it served) and the task tracker (which
reports run times).  Run-time corrections are not sent one by one: they ride
on the next fetch script call, so ``fair_cost="runtime"`` costs no extra
round trip.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .layout import SERVED_HEADER

__all__ = ("KeyStatistics", "KeyedServing")

#: Served-key counts kept per worker for ``inspect fair_stats`` (the top
#: keys); past this many distinct keys the counts are halved and the
#: smallest dropped (a bounded heavy-hitters summary).
COUNTED_KEYS = 1024

#: Corrections kept while no fetch runs to carry them (oldest dropped first).
MAX_PENDING_CHARGES = 10_000


@dataclass(frozen=True)
class KeyStatistics:
    """What one worker served from its keyed queues."""

    queues: tuple[str, ...]
    default_weight: float
    cost: str
    #: Messages served per keyed queue.
    served: dict[str, int]
    #: The most served keys, ``(queue, key, count)``, most first.
    top: tuple[tuple[str, str, int], ...]
    pending_charges: int


class KeyedServing:
    """Keyed queues on one worker.

    ``estimate(queue)`` is the charge at fetch in run-time mode (the
    worker's moving average of the queue's run time); in count mode every
    message is charged 1 and nothing is corrected.
    """

    def __init__(
        self,
        queues: Iterable[str],
        *,
        default_weight: float = 1.0,
        runtime: bool = False,
        estimate: Callable[[str], float] = lambda queue: 1.0,
    ) -> None:
        self.queues = frozenset(queues)
        self.default_weight = default_weight
        self.runtime = runtime
        self.estimate = estimate
        self._lock = threading.Lock()
        self._charges: list[tuple[str, str, float]] = []
        self._served: dict[str, int] = {}
        self._counts: dict[tuple[str, str], int] = {}

    def charge_at_fetch(self, queue: str) -> float:
        """What a message of keyed ``queue`` is charged when fetched."""
        return float(self.estimate(queue)) if self.runtime else 1.0

    def served(self, queue: str, key: str) -> None:
        """The fetch served ``key`` of ``queue``."""
        with self._lock:
            self._served[queue] = self._served.get(queue, 0) + 1
            counts = self._counts
            pair = (queue, key)
            counts[pair] = counts.get(pair, 0) + 1
            if len(counts) > COUNTED_KEYS:
                _halve(counts)

    def finished(self, queue: str, served: Any, runtime: float) -> None:
        """A task fetched with header ``served`` (:data:`SERVED_HEADER`) ran ``runtime`` s."""
        if not self.runtime or queue not in self.queues:
            return
        try:
            key, charged = str(served[0]), float(served[1])
        except (TypeError, ValueError, IndexError, KeyError):
            return
        with self._lock:
            if len(self._charges) >= MAX_PENDING_CHARGES:
                del self._charges[0]
            self._charges.append((queue, key, max(0.0, runtime) - charged))

    def take_charges(self) -> list[tuple[str, str, float]]:
        """The corrections not yet sent (and forget them)."""
        with self._lock:
            charges, self._charges = self._charges, []
        return charges

    def statistics(self, top: int = 10) -> KeyStatistics:
        with self._lock:
            ranked = sorted(self._counts.items(), key=lambda item: -item[1])[:top]
            return KeyStatistics(
                queues=tuple(sorted(self.queues)),
                default_weight=self.default_weight,
                cost="runtime" if self.runtime else "count",
                served=dict(self._served),
                top=tuple((q, k, n) for (q, k), n in ranked),
                pending_charges=len(self._charges),
            )


def served_header(request_headers: Any) -> Any:
    """The :data:`SERVED_HEADER` of a request's headers, or None."""
    return request_headers.get(SERVED_HEADER) if isinstance(request_headers, dict) else None


def _halve(counts: dict[tuple[str, str], int]) -> None:
    for pair in list(counts):
        counts[pair] //= 2
        if not counts[pair]:
            del counts[pair]
