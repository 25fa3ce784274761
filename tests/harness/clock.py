"""The tests' one fake clock: :class:`celery_fair.testing.FakeClock`, which users get too."""

from __future__ import annotations

from celery_fair.testing.clock import FakeClock

__all__ = ("FakeClock",)
