"""The workers' capacities on Redis, summed: the scale of ``fair_cost="dominant"``.

Dominant Resource Fairness equalises each tenant's share of the resources of
the whole system.  Workers of different sizes that charge a task its share
of their own capacity charge it differently, and on a keyed queue those
charges meet in one place (the keys' order on the broker).  So every worker
with resources writes its capacity in one hash on the broker
(:data:`BOARD`: hostname -> ``{"capacity": ..., "at": epoch seconds}``)
every :data:`BEAT_EVERY` seconds, reads the others', and charges against
their sum (:func:`~celery_fair.scheduling.resources.cluster_capacity`).  A
worker not heard from for :data:`FRESH` seconds is left out, and its entry
removed; a worker that stops removes its own.  Until the first reading, and
on RabbitMQ, a worker charges against its own capacity.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from .. import compat
from ..scheduling.resources import Resources, cluster_capacity
from .capacity import ResourceGate

__all__ = ("BEAT_EVERY", "BOARD", "FRESH", "CapacityBoard")

logger = logging.getLogger(__name__)

#: The hash of the workers' capacities (after Kombu's ``global_keyprefix``).
BOARD = "fair.capacities"
#: Seconds between two writes and reads of the board.
BEAT_EVERY = 5.0
#: A capacity older than this (s) is a worker that is gone.
FRESH = 30.0


class CapacityBoard:
    """One worker's entry on the board, and the sum it reads back."""

    def __init__(
        self,
        gate: ResourceGate,
        hostname: str,
        channel: Callable[[], Any],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.gate = gate
        self.hostname = hostname
        self.channel = channel
        self.clock = clock
        self._errors = 0

    def beat(self) -> Resources | None:
        """Write this worker's capacity, read everyone's; the sum goes to the gate."""
        channel = self.channel()
        if channel is None or not compat.is_redis_channel(channel):
            return None
        now = self.clock()
        key = compat.key_prefix(channel) + BOARD
        own = json.dumps({"capacity": dict(self.gate.capacity), "at": now})
        try:
            with compat.redis_client(channel) as client:
                client.hset(key, self.hostname, own)
                entries = client.hgetall(key)
                stale = []
                readings = []
                for name, raw in entries.items():
                    try:
                        entry = json.loads(raw)
                        readings.append(({k: float(v) for k, v in entry["capacity"].items()},
                                         float(entry["at"])))  # fmt: skip
                        if now - float(entry["at"]) > FRESH:
                            stale.append(name)
                    except (ValueError, KeyError, TypeError, AttributeError):
                        stale.append(name)  # not ours to read: never written by a worker
                if stale:
                    client.hdel(key, *stale)
        except Exception as exc:  # noqa: BLE001 - the broker's trouble: keep the last sum
            self._errors += 1
            if self._errors == 1 or self._errors % 100 == 0:
                logger.warning("celery-fair: could not read the workers' capacities: %s", exc)
            return None
        total = cluster_capacity(readings, now, fresh=FRESH)
        self.gate.set_cluster(total)
        return total

    def leave(self) -> None:
        """This worker stops: its capacity no longer counts."""
        channel = self.channel()
        if channel is None or not compat.is_redis_channel(channel):
            return
        try:
            with compat.redis_client(channel) as client:
                client.hdel(compat.key_prefix(channel) + BOARD, self.hostname)
        except Exception:  # noqa: BLE001 - it lapses after FRESH seconds anyway
            logger.debug("celery-fair: could not remove this worker's capacity", exc_info=True)
