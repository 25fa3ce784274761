"""Adaptive prefetch: the window that keeps the pool busy, and no more.

"Some queuing theory: throughput, latency and bandwidth": a consumer needs
about round trip / processing time messages in flight to never wait for the
broker (104 ms / 4 ms = 26).  More only makes prefetched messages wait in the
worker, where no other worker can take them; when processing slows down the
right window shrinks.  :class:`AdaptivePrefetch` keeps moving estimates of
both times, fed by the caller (no clock), and answers
``slots * ceil(round_trip / service) + headroom`` within bounds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .estimate import Ewma

__all__ = ("AdaptivePrefetch", "PrefetchStatistics")


@dataclass(frozen=True)
class PrefetchStatistics:
    """The estimates and the window they give."""

    round_trip: float | None
    service: float | None
    window: int
    minimum: int
    maximum: int
    changes: int


class AdaptivePrefetch:
    """Window = ``slots * ceil(round_trip / service) + headroom``, bounded.

    The round trip is the *minimum* of the recent fetch times (a fetch that
    found the queue empty waited for a message, which is not round trip),
    the service time a moving average of task run times.
    """

    def __init__(
        self, *, slots: int, minimum: int, maximum: int, headroom: int | None = None
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots!r}")
        if not 1 <= minimum <= maximum:
            raise ValueError(f"need 1 <= minimum <= maximum, got {minimum!r} and {maximum!r}")
        self.slots = slots
        self.minimum = minimum
        self.maximum = maximum
        self.headroom = slots if headroom is None else max(0, headroom)
        self._fetches: deque[float] = deque(maxlen=64)
        self._service = Ewma(alpha=0.1)
        self._window = maximum
        self.changes = 0

    def observe_fetch(self, seconds: float) -> None:
        """One fetch from the broker took ``seconds``."""
        if seconds >= 0:
            self._fetches.append(seconds)

    def observe_service(self, seconds: float) -> None:
        """One task ran for ``seconds``."""
        if seconds >= 0:
            self._service.update(seconds)

    @property
    def round_trip(self) -> float | None:
        return min(self._fetches) if self._fetches else None

    def window(self) -> int:
        """The window the estimates call for (the maximum until both exist)."""
        rtt, service = self.round_trip, self._service.value
        if rtt is None or service is None:
            wanted = self.maximum
        else:
            per_slot = math.ceil(rtt / max(service, 1e-6)) if rtt > 0 else 1
            wanted = self.slots * max(1, per_slot) + self.headroom
        wanted = max(self.minimum, min(self.maximum, wanted))
        if wanted != self._window:
            self._window = wanted
            self.changes += 1
        return wanted

    def statistics(self) -> PrefetchStatistics:
        return PrefetchStatistics(
            round_trip=self.round_trip,
            service=self._service.value,
            window=self._window,
            minimum=self.minimum,
            maximum=self.maximum,
            changes=self.changes,
        )
