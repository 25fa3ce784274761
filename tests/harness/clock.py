"""The tests' one fake clock: it moves only when the test moves it."""

from __future__ import annotations

__all__ = ("FakeClock",)


class FakeClock:
    """A clock (called, it returns seconds) that moves only when told to.

    A test moves it with :meth:`advance` or sets :attr:`now`; :attr:`reads`
    counts the readings.
    """

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
