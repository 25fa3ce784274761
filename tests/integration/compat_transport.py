"""Kombu Redis transports that differ from the installed one the way a release might.

Used by ``test_compat_worker`` through a broker URL such as
``tests.integration.compat_transport:RenamedParameters+redis://...``.  Each
keeps Kombu working and changes only what celery-fair's probes look at.
"""

from __future__ import annotations

from kombu.transport import redis


class _RenamedParametersChannel(redis.Channel):
    # Kombu calls it positionally; a release that renamed the parameters
    # would still work for Kombu, but no longer means what the probe expects.
    def _q_for_pri(self, name: str, level: int) -> str:  # type: ignore[override]
        return str(super()._q_for_pri(name, level))


class RenamedParameters(redis.Transport):
    """``Channel._q_for_pri(queue, pri)`` renamed: the atomic fetch must fall back."""

    Channel = _RenamedParametersChannel
