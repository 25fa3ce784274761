"""Keys throttled by their limits (set aside at a concurrency limit or by their rate),
read from the broker: the one read the worker (``inspect fair_stats``, its
``/metrics``) and the exporter share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..wire.replies import text
from .layout import THROTTLED_COUNT, THROTTLED_SECONDS, UNKEYED, KeyedNames

__all__ = (
    "THROTTLED_SCAN",
    "KeyedLimitsState",
    "Throttled",
    "broker_clock",
    "limits_state",
    "read_throttled",
)


@dataclass(frozen=True)
class Throttled:
    """A keyed queue's keys throttled now (set aside by their limits), as the broker has them."""

    #: Keys set aside at their concurrency limit, and by their rate.
    at_limit: int
    sleeping: int
    #: Key -> since when it is throttled, on the broker's clock (up to
    #: :data:`THROTTLED_SCAN` keys).
    since: dict[str, float]

    def seconds(self, now: float) -> dict[str, float]:
        """Key -> seconds it has been throttled at ``now`` (the broker's clock)."""
        return {key: max(0.0, now - t) for key, t in self.since.items()}

    def longest(self, now: float) -> float | None:
        """Seconds the key throttled longest has been, at ``now`` (None: no key is)."""
        return max(self.seconds(now).values(), default=None)


#: How many of the keys throttled now are read (their time, their waiting messages).
THROTTLED_SCAN = 1000


def read_throttled(pipe: Any, names: KeyedNames) -> Callable[[Iterator[Any]], Throttled]:
    """Queue on ``pipe`` the reads of the keys throttled now; returns the reader of the
    replies (an iterator positioned at them).

    The one read of these records: the worker's ``limits_state`` and the
    exporter (several queues in one pipeline) both go through it.
    """
    pipe.scard(names.at_limit).zcard(names.sleep)
    pipe.hscan(names.throttled_since, 0, count=THROTTLED_SCAN)

    def reader(replies: Iterator[Any]) -> Throttled:
        at_limit, sleeping, since = next(replies), next(replies), next(replies)
        return Throttled(
            at_limit=int(at_limit),
            sleeping=int(sleeping),
            since={text(k): float(v) for k, v in since[1].items()},
        )

    return reader


def broker_clock(reply: Any) -> float:
    """The broker's ``TIME`` reply as seconds (the clock of every throttling record)."""
    seconds, micros = reply
    return int(seconds) + int(micros) / 1e6


@dataclass(frozen=True)
class KeyedLimitsState:
    """Per-key limits of a keyed queue as the broker holds them now."""

    #: Limits in force: the configured fields with the live ones over them.
    limits: dict[str, str]
    #: Tasks holding a slot, per key (the keys with any).
    running: dict[str, int]
    #: Keys set aside at their concurrency limit, and by their rate.
    at_limit: int
    sleeping: int
    #: Times a key was throttled by its limits, since the queue's state began.
    throttled_count: int = 0
    #: Seconds keys spent throttled, the ones still throttled until now included.
    throttled_seconds: float = 0.0
    #: Messages waiting in the keys throttled now, every priority level (counted for
    #: up to THROTTLED_SCAN keys).
    throttled_tasks: int = 0
    #: The keys that spent longest throttled, and their seconds (the top few).
    top_throttled: list[tuple[str, float]] = field(default_factory=list)


def limits_state(client: Any, names: KeyedNames, top: int = 10) -> KeyedLimitsState:
    """The limits in force, running counts and keys throttled, from the broker."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(names.limits_conf).hgetall(names.limits_live).hgetall(names.running)
    throttled = read_throttled(pipe, names)
    pipe.hmget(names.state, THROTTLED_COUNT, THROTTLED_SECONDS)
    pipe.zrevrange(names.throttled, 0, top - 1, withscores=True).time().smembers(names.levels)
    replies = pipe.execute()
    conf, live, running = replies[:3]
    totals, longest, clock, others = replies[-4:]
    aside = throttled(iter(replies[3:-4]))
    for_seconds = aside.seconds(broker_clock(clock))
    levels = [names, *(names.level(text(s)) for s in others)]
    limits = {text(k): text(v) for k, v in conf.items()}
    limits.update({text(k): text(v) for k, v in live.items()})
    # The keys still throttled count too: the totals grow only when a key goes on.
    seconds = {text(k): float(v) for k, v in longest}
    for key, extra in for_seconds.items():
        seconds[key] = seconds.get(key, 0.0) + extra
    lengths = client.pipeline(transaction=False)
    for key in for_seconds:
        if key != UNKEYED:  # every level and user of the key: fair.sizes
            lengths.zscore(names.sizes, key)
            continue
        for level in levels:
            lengths.llen(level.base)
    waiting = [n or 0 for n in lengths.execute()] if for_seconds else []
    return KeyedLimitsState(
        limits=limits,
        running={text(k): int(v) for k, v in running.items()},
        at_limit=aside.at_limit,
        sleeping=aside.sleeping,
        throttled_count=int(totals[0] or 0),
        throttled_seconds=float(totals[1] or 0.0) + sum(for_seconds.values()),
        throttled_tasks=sum(int(n) for n in waiting),
        top_throttled=sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))[:top],
    )
