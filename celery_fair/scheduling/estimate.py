"""Exponentially weighted moving averages, fed by the caller (no clock)."""

from __future__ import annotations

__all__ = ("Ewma",)


class Ewma:
    """An exponentially weighted moving average.

    The first sample initialises the average, later ones move it by
    ``alpha`` of the difference (alpha 0.2 forgets a sample's weight to
    below 1% after about 20 samples).
    """

    __slots__ = ("alpha", "value", "count")

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self.value: float | None = None
        self.count = 0

    def update(self, sample: float) -> float:
        """Add a sample and return the new average."""
        self.count += 1
        if self.value is None:
            self.value = float(sample)
        else:
            self.value += self.alpha * (float(sample) - self.value)
        return self.value
