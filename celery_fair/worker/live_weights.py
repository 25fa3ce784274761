"""Queue weights changed at run time (``control fair_weights``), kept on the broker.

A live weight is an override: it lapses after ``fair_live_weights_ttl``
seconds (an hour by default), or the ``ttl=SECONDS`` of the command, and the
worker goes back to its settings' weight and logs it once.  ``keep`` (or
``ttl=0``, or ``fair_live_weights_ttl = 0``) makes one that lasts until it is
cleared.

On Redis a live weight is stored in one hash under Kombu's key prefix
(:data:`LIVE_WEIGHTS`), and the time it lapses, on the broker's clock, in a
second one (:data:`LIVE_WEIGHTS_EXPIRY`; a kept weight has no field there).
A worker that starts later, or the same worker after a redeploy, finds them:
it applies the weights that have not lapsed, for the time they have left
(docs/operations.md).  On other brokers live weights are kept by each worker
only, until they lapse or the worker stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from time import monotonic
from typing import Any

from .. import compat
from ..keys.store import text
from ..scheduling.scheduler import FairScheduler
from .attachment import Attachment
from .settings import FairSettings, parse_weights

__all__ = (
    "LIVE_WEIGHTS",
    "LIVE_WEIGHTS_EXPIRY",
    "LIVE_WEIGHTS_RECHECK",
    "LaneKeyWeights",
    "LiveWeights",
)

logger = logging.getLogger(__name__)

#: Redis hash (under Kombu's key prefix) of queue weights set by ``control fair_weights``.
LIVE_WEIGHTS = "_fair.queue_weights"
#: Redis hash: queue -> when its live weight lapses (Unix seconds, the broker's clock).
LIVE_WEIGHTS_EXPIRY = "_fair.queue_weights.expires"
#: Seconds between two looks for live weights that have lapsed (the consumer's timer).
LIVE_WEIGHTS_RECHECK = 1.0


def _broker_now(client: Any) -> float:
    seconds, micros = client.time()
    return float(seconds) + float(micros) / 1e6


class LiveWeights:
    """Applies weights to the scheduler at once, lets them lapse, and stores them on Redis."""

    def __init__(
        self,
        settings: FairSettings,
        scheduler: FairScheduler,
        lock: threading.RLock,
        attachment: Attachment,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.lock = lock
        self.attachment = attachment
        self.clock = clock
        #: Queue -> when (on :attr:`clock`) its live weight lapses; kept weights are absent.
        self.deadlines: dict[str, float] = {}

    def configured(self, queue: str) -> float:
        """The queue's weight by the settings."""
        return self.settings.weights.get(queue, self.settings.default_weight)

    def expires_in(self) -> dict[str, float]:
        """Seconds left of each live weight that lapses (``inspect fair_stats``)."""
        now = self.clock()
        with self.lock:
            return {q: max(0.0, round(d - now, 3)) for q, d in sorted(self.deadlines.items())}

    def set(
        self, weights: Mapping[str, float], *, reset: Iterable[str] = (), ttl: float | None = None
    ) -> None:
        """Change weights; they act on the very next fetch.

        ``reset``: queues that go back to their configured weight.  ``ttl``:
        seconds until ``weights`` lapse (None: ``fair_live_weights_ttl``;
        0: never).  On Redis the change is also stored on the broker
        (:data:`LIVE_WEIGHTS`, :data:`LIVE_WEIGHTS_EXPIRY`).
        """
        if ttl is None:
            ttl = self.settings.live_weights_ttl
        back = {q: self.configured(q) for q in reset}
        with self.lock:
            self.scheduler.set_weights({**weights, **back})
            for q in list(weights) + list(back):
                self.deadlines.pop(q, None)
            if ttl > 0:
                deadline = self.clock() + ttl
                self.deadlines.update(dict.fromkeys(weights, deadline))
        channel = self.attachment.channel
        if channel is not None and compat.is_redis_channel(channel):
            prefix = compat.key_prefix(channel)
            key, expiry = prefix + LIVE_WEIGHTS, prefix + LIVE_WEIGHTS_EXPIRY
            with compat.redis_client(channel) as client:
                until = _broker_now(client) + ttl if weights and ttl > 0 else None
                pipe = client.pipeline(transaction=True)
                if weights:
                    pipe.hset(key, mapping={q: repr(float(w)) for q, w in weights.items()})
                    if until is not None:
                        pipe.hset(expiry, mapping=dict.fromkeys(weights, repr(until)))
                    else:
                        pipe.hdel(expiry, *weights)
                if back:
                    pipe.hdel(key, *back)
                    pipe.hdel(expiry, *back)
                pipe.execute()

    def clear(self) -> None:
        """Every queue back to its configured weight; on Redis, the stored live weights go."""
        with self.lock:
            live = set(self.scheduler.queues) | set(self.settings.weights) | set(self.deadlines)
            self.scheduler.set_weights({q: self.configured(q) for q in live})
            self.deadlines.clear()
        channel = self.attachment.channel
        if channel is not None and compat.is_redis_channel(channel):
            prefix = compat.key_prefix(channel)
            with compat.redis_client(channel) as client:
                client.delete(prefix + LIVE_WEIGHTS, prefix + LIVE_WEIGHTS_EXPIRY)

    def expire(self) -> list[str]:
        """Live weights whose time is up go back to the settings' weights (a timer calls this).

        Logged once per lapse; on Redis the lapsed entries are removed from
        the broker, unless a later command set them again.  Returns the
        queues that went back.
        """
        now = self.clock()
        with self.lock:
            due = sorted(q for q, d in self.deadlines.items() if d <= now)
            if not due:
                return []
            was = {q: self.scheduler.weight(q) for q in due}
            back = {q: self.configured(q) for q in due}
            self.scheduler.set_weights(back)
            for q in due:
                del self.deadlines[q]
        logger.info(
            "celery-fair: live weight(s) expired, back to the configured weights: %s",
            ", ".join(f"{q}={back[q]:g} (was {was[q]:g})" for q in due),
        )
        channel = self.attachment.channel
        if channel is not None and compat.is_redis_channel(channel):
            try:
                self._remove_lapsed(channel, due)
            except Exception as exc:  # the timer must go on; a later start skips them anyway
                logger.warning(
                    "celery-fair: could not remove lapsed live weights from the broker: %r", exc
                )
        return due

    def _remove_lapsed(self, channel: Any, queues: list[str]) -> None:
        """Remove ``queues``' live weights from Redis if they have lapsed there too."""
        prefix = compat.key_prefix(channel)
        key, expiry = prefix + LIVE_WEIGHTS, prefix + LIVE_WEIGHTS_EXPIRY

        def remove(pipe: Any) -> None:
            until = pipe.hmget(expiry, queues)
            now = _broker_now(pipe)
            lapsed = [
                q for q, u in zip(queues, until, strict=True) if u is not None and _lapsed(u, now)
            ]
            pipe.multi()
            if lapsed:
                pipe.hdel(key, *lapsed)
                pipe.hdel(expiry, *lapsed)

        with compat.redis_client(channel) as client:
            client.transaction(remove, key, expiry)

    def adopt(self, channel: object) -> None:
        """Redis: apply the weights set live earlier, kept on the broker, that have not lapsed."""
        prefix = compat.key_prefix(channel)
        key, expiry = prefix + LIVE_WEIGHTS, prefix + LIVE_WEIGHTS_EXPIRY
        with compat.redis_client(channel) as client:
            # No MULTI: Redis refuses every command queued in a transaction while
            # it is over maxmemory, and a worker must start against a full broker
            # (docs/operations.md).  Three reads need no atomicity here.
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(key)
            pipe.hgetall(expiry)
            pipe.time()
            stored, until, (seconds, micros) = pipe.execute()
        if not stored:
            return
        now = float(seconds) + float(micros) / 1e6
        live = parse_weights(
            {text(q): text(w) for q, w in stored.items()}, setting=f"{key} (Redis)"
        )
        left = {}
        for q, u in until.items():
            name = text(q)
            if name in live:
                try:
                    left[name] = float(text(u)) - now
                except ValueError:
                    left[name] = 0.0  # unreadable: treated as lapsed
        lapsed = sorted(q for q, s in left.items() if s <= 0)
        for q in lapsed:
            del live[q]
        clock = self.clock()
        with self.lock:
            self.scheduler.set_weights(live)
            # A weight in force here but not on the broker (lost with its data)
            # keeps its deadline; one the broker has is timed by the broker.
            for q in live:
                self.deadlines.pop(q, None)
            self.deadlines.update({q: clock + s for q, s in left.items() if s > 0})
        if live:
            logger.info(
                "celery-fair: weights set live earlier, from the broker: %s%s",
                live,
                "".join(f"; {q} lapses in {left[q]:.0f} s" for q in sorted(live) if q in left),
            )
        if lapsed:
            logger.info(
                "celery-fair: live weight(s) on the broker had expired, not applied: %s",
                ", ".join(lapsed),
            )
            try:
                self._remove_lapsed(channel, lapsed)
            except Exception as exc:
                logger.warning(
                    "celery-fair: could not remove lapsed live weights from the broker: %r", exc
                )


class LaneKeyWeights:
    """Key weights of the keyed queues on RabbitMQ, where this worker's buffer applies them.

    On Redis the fetch script reads key weights from the broker, so a live
    weight reaches every worker.  On RabbitMQ the keys' turns are taken in each
    worker's buffer (:func:`celery_fair.worker.dispatch.buffer_task`): a weight
    set live (``control fair_key_weights``) is an event of the control log
    (:mod:`celery_fair.keys.pause_log`), which every worker reads, one started
    later too, and follows (:meth:`replace_live`) until it is set back
    (``KEY=default``).  A broker without stream queues keeps no log: there the
    workers that answer the command apply it (:meth:`set`) until they stop.
    """

    def __init__(self, configured: Mapping[str, float], default: float) -> None:
        self.configured = dict(configured)
        self.default = default
        # Replaced whole, never changed in place: readers on other threads
        # (the event loop's buffer) see one map or the other.
        self._live: dict[str, float] = {}
        self._logged: dict[str, dict[str, float]] = {}

    def weight(self, key: str, queue: str | None = None) -> float:
        """The key's weight in keyed ``queue``: live (from the control log, else set in
        this worker), else configured, else ``fair_default_key_weight``."""
        logged = self._logged.get(queue) if queue is not None else None
        if logged:
            found = logged.get(key)
            if found is not None:
                return found
        live = self._live.get(key)
        if live is not None:
            return live
        return self.configured.get(key, self.default)

    def replace_live(self, per_queue: Mapping[str, Mapping[str, float]]) -> None:
        """The weights the control log holds, per keyed queue (key -> weight)."""
        self._logged = {q: dict(weights) for q, weights in per_queue.items() if weights}

    def set(self, weights: Mapping[str, float | None]) -> None:
        """Live weights in this worker alone; a key with None goes back to its configured
        weight."""
        live = dict(self._live)
        for key, weight in weights.items():
            if weight is None:
                live.pop(key, None)
            else:
                live[key] = float(weight)
        self._live = live

    def live(self) -> dict[str, float]:
        """The weights in force live in this worker (``inspect fair_stats``)."""
        found = dict(self._live)
        for weights in self._logged.values():
            found.update(weights)
        return dict(sorted(found.items()))


def _lapsed(until: Any, now: float) -> bool:
    try:
        return float(text(until)) <= now
    except ValueError:
        return True
