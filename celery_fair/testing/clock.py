"""A fake clock for pure unit tests: it moves only when the test moves it."""

from __future__ import annotations

__all__ = ("FakeClock",)


class FakeClock:
    """A clock (called, it returns seconds) that moves only when told to.

    Pass it wherever celery-fair takes a ``clock`` (a zero-argument callable
    returning seconds, as :func:`time.monotonic`): the CoDel controller
    (:class:`celery_fair.scheduling.codel.CoDelController`) and the shedding
    policy (:class:`celery_fair.scheduling.shedding.SheddingPolicy`), among
    others.  A test moves it with :meth:`advance` or sets :attr:`now`;
    :attr:`reads` counts the readings.

    >>> clock = FakeClock(100.0)
    >>> clock()
    100.0
    >>> clock.advance(0.5)
    >>> clock(), clock.reads
    (100.5, 2)
    """

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on (a negative step is refused: clocks here are monotonic)."""
        if seconds < 0:
            raise ValueError(f"a FakeClock moves forward only, got {seconds!r}")
        self.now += seconds
