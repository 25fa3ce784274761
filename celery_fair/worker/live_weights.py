"""Queue weights changed at run time (``control fair_weights``), kept on the broker.

On Redis a live weight is stored in one hash under Kombu's key prefix, where
a worker that starts later, or the same worker after a redeploy, finds it:
live weights beat the settings until they are cleared (docs/operations.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from .. import compat
from ..keys.store import text
from ..scheduling.scheduler import FairScheduler
from .attachment import Attachment
from .settings import FairSettings, parse_weights

__all__ = ("LIVE_WEIGHTS", "LiveWeights")

logger = logging.getLogger(__name__)

#: Redis hash (under Kombu's key prefix) of queue weights set by ``control fair_weights``.
LIVE_WEIGHTS = "_fair.queue_weights"


class LiveWeights:
    """Applies weights to the scheduler at once and stores them on a Redis broker."""

    def __init__(
        self,
        settings: FairSettings,
        scheduler: FairScheduler,
        lock: threading.RLock,
        attachment: Attachment,
    ) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.lock = lock
        self.attachment = attachment

    def set(self, weights: dict[str, float], *, reset: Iterable[str] = ()) -> None:
        """Change weights; they act on the very next fetch.

        ``reset``: queues that go back to their configured weight.  On Redis
        the change is also stored on the broker (:data:`LIVE_WEIGHTS`).
        """
        settings = self.settings
        back = {q: settings.weights.get(q, settings.default_weight) for q in reset}
        with self.lock:
            self.scheduler.set_weights({**weights, **back})
        channel = self.attachment.channel
        if channel is not None and compat.is_redis_channel(channel):
            key = compat.key_prefix(channel) + LIVE_WEIGHTS
            with compat.redis_client(channel) as client:
                pipe = client.pipeline(transaction=True)
                if weights:
                    pipe.hset(key, mapping={q: repr(float(w)) for q, w in weights.items()})
                if back:
                    pipe.hdel(key, *back)
                pipe.execute()

    def clear(self) -> None:
        """Every queue back to its configured weight; on Redis, the stored live weights go."""
        settings = self.settings
        with self.lock:
            live = set(self.scheduler.queues) | set(settings.weights)
            self.scheduler.set_weights(
                {q: settings.weights.get(q, settings.default_weight) for q in live}
            )
        channel = self.attachment.channel
        if channel is not None and compat.is_redis_channel(channel):
            with compat.redis_client(channel) as client:
                client.delete(compat.key_prefix(channel) + LIVE_WEIGHTS)

    def adopt(self, channel: object) -> None:
        """Redis: apply the weights set live earlier, kept on the broker."""
        key = compat.key_prefix(channel) + LIVE_WEIGHTS
        with compat.redis_client(channel) as client:
            stored = client.hgetall(key)
        if not stored:
            return
        live = parse_weights(
            {text(q): text(w) for q, w in stored.items()}, setting=f"{key} (Redis)"
        )
        with self.lock:
            self.scheduler.set_weights(live)
        logger.info("celery-fair: weights set live earlier, from the broker: %s", live)
