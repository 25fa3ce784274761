"""Per-key limits of keyed queues: concurrency and rate, parsed and checked.

``fair_key_concurrency = {"*": 2, "tenant-gold": 8}``: tasks of one key
fetched and not yet finished, across every worker.  ``fair_key_rate_limit =
{"*": "50/s", "tenant-free": "5/s"}``: tasks of one key fetched per second
(Celery's rate syntax: ``"10/s"``, ``"100/m"``, ``"1000/h"`` or a number per
second), a token bucket on the broker's clock.  ``"*"`` is every key without
a limit of its own; a key without either has no limit.

The limits are enforced by the fetch script (``lua/keyed_pop.lua``):
a key at its limit is set aside, its messages stay on the broker, and the
next key is served.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import FairConfigError
from ..grammar import parse_pairs

__all__ = (
    "CONCURRENCY",
    "DEFAULT_KEY",
    "RATE",
    "KeyLimits",
    "limit_field",
    "parse_concurrency",
    "parse_rates",
    "resolve",
)

#: The entry that applies to every key without one of its own.
DEFAULT_KEY = "*"

#: The kinds of limit, as the broker's hash names them (``c:<key>``, ``r:<key>``).
CONCURRENCY, RATE = "c", "r"


def limit_field(kind: str, key: str) -> str:
    """The field of ``key``'s limit of ``kind`` in the broker's limits hash."""
    return f"{kind}:{key}"


@dataclass(frozen=True)
class KeyLimits:
    """Validated per-key limits (``"*"``: every other key)."""

    concurrency: Mapping[str, int] = field(default_factory=dict)
    #: Tasks per second.
    rates: Mapping[str, float] = field(default_factory=dict)
    #: Seconds a fetched task holds its key's slot at most (a crashed worker's
    #: slots come back after this long).
    lease_ttl: float = 300.0

    def __bool__(self) -> bool:
        return bool(self.concurrency or self.rates)

    def as_fields(self) -> dict[str, str]:
        """The limits as the fields of the broker's hash (``c:<key>``, ``r:<key>``)."""
        out = {limit_field(CONCURRENCY, k): str(v) for k, v in self.concurrency.items()}
        out.update({limit_field(RATE, k): repr(v) for k, v in self.rates.items()})
        return out


def resolve(configured: Mapping[str, float], live: Mapping[str, float], key: str) -> float | None:
    """``key``'s limit of one kind: its live one, else its configured one, else the
    live ``"*"``, else the configured ``"*"`` (None: unlimited).

    The fetch script's order on Redis (``lua/prelude.lua``), which the limit
    tokens on RabbitMQ follow too.
    """
    for found in (live.get(key), configured.get(key), live.get(DEFAULT_KEY)):
        if found is not None:
            return found
    return configured.get(DEFAULT_KEY)


def _error(message: str) -> Exception:
    return FairConfigError(message)


def parse_concurrency(value: Any, *, setting: str = "fair_key_concurrency") -> dict[str, int]:
    """``{"*": 2, "gold": 8}`` or ``"*=2,gold=8"``: integers >= 1 per key."""
    pairs = _pairs(value, setting)
    out: dict[str, int] = {}
    for key, limit in pairs.items():
        try:
            number = int(limit) if not isinstance(limit, bool) else None
        except (TypeError, ValueError):
            number = None
        if number is None or number < 1 or (isinstance(limit, float) and limit != number):
            raise _error(f"{setting}[{key!r}] must be an integer >= 1, got {limit!r}")
        out[key] = number
    return out


def parse_rates(value: Any, *, setting: str = "fair_key_rate_limit") -> dict[str, float]:
    """``{"*": "50/s", "free": "5/m"}``: Celery rate strings (or numbers) per key, per second."""
    from celery.utils.time import rate

    pairs = _pairs(value, setting)
    out: dict[str, float] = {}
    for key, limit in pairs.items():
        try:
            per_second = float(rate(limit)) if not isinstance(limit, bool) else math.nan
        except (TypeError, ValueError, KeyError, IndexError):
            per_second = math.nan
        if not per_second > 0 or math.isinf(per_second):
            raise _error(
                f"{setting}[{key!r}] must be a rate like '10/s', '100/m' or '1000/h' "
                f"(or a positive number per second), got {limit!r}"
            )
        out[key] = per_second
    return out


def _pairs(value: Any, setting: str) -> dict[str, Any]:
    return parse_pairs(value, setting=setting, what="KEY=LIMIT")
