"""Keyed queues on RabbitMQ: the lanes of one logical queue, and the lane each task takes.

RabbitMQ keeps one FIFO per queue and no order between the keys inside it,
so a keyed queue ``jobs`` on RabbitMQ is a fixed set of real queues, its
*lanes*, which every worker consumes together and serves as the one queue
``jobs``, in weighted fair order over the keys (docs/fairness-keys.md):

* ``jobs``: Celery's own queue.  Producers without celery-fair publish here,
  and a task whose key cannot be found; these are served as the unkeyed key
  ``""``, as on Redis.
* ``jobs.fair.s0`` ... ``s15``: :data:`SHARD_LANES` lanes over which the keys
  are hashed (the router's consistent-hash ring): the keys of one shard share
  its first-in, first-out order.
* ``jobs.fair.n0`` ... ``n7``: :data:`NOISY_LANES` lanes for the keys a
  producer finds noisy (more than 10% of its recent publishes to the queue and
  at least 30 of them: the router's
  :class:`~celery_fair.routing.isolation.NoisyKeyDetector`).  A flood leaves
  its shard after about 30 messages, so the keys hashed with it do not wait
  behind it.  One producer gives each of its noisy keys a lane of its own (it
  has at most 1 / 10% = 10 of them at once); two floods from two processes
  may share one.

The lanes are the same for every keyed queue and every process, whatever the
settings: a producer and a worker configured differently (another
``fair_key_weights``, a key added) still agree on where every task waits, and
a worker consumes every lane that can hold a task from its first connection.
Key weights act in the worker, over what the lanes hold.  The choice of lane
is pure (no broker, no Celery); :func:`lane_queue` builds the Kombu ``Queue``.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from time import monotonic
from typing import Any

from ..routing.isolation import IsolationPolicy, NoisyKeyDetector
from ..routing.ring import HashRing

__all__ = (
    "NOISY_LANES",
    "SHARD_LANES",
    "KeyLanes",
    "LaneChooser",
    "consume_lanes",
    "free_lane",
    "key_digest",
    "lane_queue",
)

#: Shard lanes per keyed queue: a flood's first ~30 messages, before it is
#: found noisy, wait in front of the keys of one shard in 16.
SHARD_LANES = 16
#: Lanes for noisy keys per keyed queue: one producer isolates at most
#: 1 / 10% = 10 keys at once, and rarely more than a few.
NOISY_LANES = 8


@dataclass(frozen=True)
class KeyLanes:
    """The lanes of the keyed queues ``keyed`` (the same in every process)."""

    keyed: frozenset[str]

    def shard_lanes(self, queue: str) -> tuple[str, ...]:
        return tuple(f"{queue}.fair.s{i}" for i in range(SHARD_LANES))

    def noisy_lanes(self, queue: str) -> tuple[str, ...]:
        return tuple(f"{queue}.fair.n{i}" for i in range(NOISY_LANES))

    def lanes(self, queue: str) -> tuple[str, ...]:
        """Every lane of keyed ``queue`` but the queue itself."""
        return self.shard_lanes(queue) + self.noisy_lanes(queue)

    @staticmethod
    def backlog_counter(queue: str, key: str, cap: int) -> str:
        """The queue counting ``key``'s tasks waiting in keyed ``queue`` under ``cap``
        (:mod:`celery_fair.keys.backlog_counter`): one name per cap."""
        return f"{queue}.fair.b{cap}.{key_digest(key)}"

    @staticmethod
    def directory(lane: str) -> str:
        """The queue that names the key a producer last gave noisy ``lane`` to (one
        message, the newest: ``x-max-length`` 1, ``drop-head``), for the exporter."""
        return f"{lane}.key"

    def parents(self) -> dict[str, str]:
        """Lane -> its keyed queue, for every keyed queue (the queue itself included)."""
        parents: dict[str, str] = {}
        for queue in sorted(self.keyed):
            parents[queue] = queue
            for lane in self.lanes(queue):
                parents[lane] = queue
        return parents


class LaneChooser:
    """One producer process's choice of lane for each keyed task (thread-safe).

    Per keyed queue: a key the detector finds noisy goes to a noisy lane (one
    per noisy key while there are enough), any other to its shard.
    ``clock``: monotonic seconds, for the detector's decay (injected in tests).
    """

    def __init__(
        self,
        lanes: KeyLanes,
        *,
        policy: IsolationPolicy | None = None,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.lanes = lanes
        self._policy = policy
        self._clock = clock
        self._lock = threading.Lock()
        self._rings: dict[str, HashRing] = {}
        self._detectors: dict[str, NoisyKeyDetector] = {}
        #: Per keyed queue with two-level keys: the detector of noisy users.
        self._user_detectors: dict[str, NoisyKeyDetector] = {}
        #: Per keyed queue: noisy ``(False, key)`` or ``(True, "key/user")`` -> its noisy lane.
        self._noisy: dict[str, dict[tuple[bool, str], str]] = {}

    def lane(self, queue: str, key: str, user: str | None = None) -> str:
        """The lane a task of ``key`` (and ``user``) published now to keyed ``queue`` goes to."""
        return self.choose(queue, key, user)[0]

    def choose(self, queue: str, key: str, user: str | None = None) -> tuple[str, str | None]:
        """:meth:`lane`, and who was given that noisy lane just now (``key`` or
        ``key/user``; None: nobody, the lane was the key's already or is a shard).

        With two-level keys (``user``), a user that is noisy by itself (more
        than 10% of the queue's recent publishes) gets a lane of its own, so
        that its key's other users wait in another lane than its flood; the
        key's other tasks go where the key alone would (its own noisy lane if
        the key is noisy, else its shard).
        """
        with self._lock:
            detector = self._detectors.get(queue)
            if detector is None:
                policy = self._policy or IsolationPolicy(queue=f"{queue}.fair.n*")
                detector = self._detectors[queue] = NoisyKeyDetector(policy, clock=self._clock)
                self._rings[queue] = HashRing(self.lanes.shard_lanes(queue))
                self._noisy[queue] = {}
            if user is not None:
                users = self._user_detectors.get(queue)
                if users is None:
                    users = self._user_detectors[queue] = NoisyKeyDetector(
                        detector.policy, clock=self._clock
                    )
                pair = f"{key}/{user}"
                if users.observe(pair):
                    detector.observe(key)  # the user's publishes count for its key too
                    return self._isolate(queue, (True, pair))
                self._noisy[queue].pop((True, pair), None)
            if detector.observe(key):
                return self._isolate(queue, (False, key))
            self._noisy[queue].pop((False, key), None)
            return self._rings[queue].lookup(key), None

    def _isolate(self, queue: str, noisy_one: tuple[bool, str]) -> tuple[str, str | None]:
        """The noisy lane of ``noisy_one`` (``(False, key)``, or ``(True, "key/user")``),
        given now if it had none."""
        noisy = self._noisy[queue]
        lane = noisy.get(noisy_one)
        if lane is not None:
            return lane, None
        # Forget the keys and users released since; then a lane no other noisy one holds.
        detectors = {False: self._detectors[queue], True: self._user_detectors.get(queue)}
        for gone in list(noisy):
            by = detectors[gone[0]]
            if by is None or not by.is_isolated(gone[1]):
                del noisy[gone]
        name = noisy_one[1]
        lane = noisy[noisy_one] = free_lane(self.lanes.noisy_lanes(queue), name, noisy.values())
        return lane, name


def key_digest(key: str) -> str:
    """A key as it appears in the names of its own queues (16 hex digits: any key,
    any length, in a name RabbitMQ accepts)."""
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def free_lane(candidates: tuple[str, ...], key: str, taken: Iterable[str]) -> str:
    """The first lane from ``key``'s hashed start that is not taken (else the start)."""
    used = set(taken)
    start = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    n = len(candidates)
    for step in range(n):
        lane = candidates[(start + step) % n]
        if lane not in used:
            return lane
    return candidates[start % n]


def lane_queue(parent: Any, lane: str) -> Any:
    """A Kombu ``Queue`` for ``lane`` of keyed queue ``parent`` (a Kombu ``Queue``).

    Declared as the parent is (durable, its arguments: a quorum queue's lanes
    are quorum queues) and reached through the default exchange by its name,
    so a lane needs no exchange or binding of its own.  The default exchange
    carries the delivery mode of the parent's, which Celery gives a task sent
    to the queue without one of its own (``AMQP.send_task_message``).
    """
    from kombu.entity import Exchange, Queue

    mode = getattr(getattr(parent, "exchange", None), "delivery_mode", None)
    return Queue(  # type: ignore[no-untyped-call]
        lane,
        Exchange("", delivery_mode=mode),  # type: ignore[no-untyped-call]
        routing_key=lane,
        durable=parent.durable,
        exclusive=parent.exclusive,
        auto_delete=parent.auto_delete,
        queue_arguments=dict(parent.queue_arguments or {}) or None,
        consumer_arguments=dict(parent.consumer_arguments or {}) or None,
        max_priority=parent.max_priority,
        no_ack=parent.no_ack,
    )


def consume_lanes(app: Any, lanes: KeyLanes) -> list[str]:
    """Add the lanes of every keyed queue the worker of ``app`` consumes to its queues.

    Called before the worker's consumer starts (Celery's ``-Q`` selection is
    made by then): the lanes are consumed from the first connection on, as
    ``select_add`` (``celery control add_consumer``) would add them.  Returns
    the lanes added.
    """
    queues = app.amqp.queues
    consumed = queues.consume_from
    added: list[str] = []
    for name in sorted(lanes.keyed):
        if consumed is not None and name not in consumed:
            continue  # this worker does not consume the keyed queue
        parent = queues[name]
        for lane in lanes.lanes(name):
            queues.select_add(lane_queue(parent, lane))
            added.append(lane)
    return added
