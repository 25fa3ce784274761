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
* ``jobs.fair.pri3.s0`` ... and ``jobs.fair.pri3.n0`` ..., the same for ``pri6``
  and ``pri9``: a keyed queue declared with a maximum priority has these lanes
  per priority level (:data:`LEVEL_STEPS`; the first level's are the lanes
  above).  RabbitMQ delivers a queue's highest priority first, so in one lane a
  level behind a stream of more urgent tasks would never reach a worker; in
  lanes of its own each level reaches the worker's buffer, which serves the
  levels strictly or by weight (``fair_priority``).

The lanes follow from the queue's declaration alone, whatever the fairness
settings: a producer and a worker configured differently (another
``fair_key_weights``, a key added, another ``fair_priority``) still agree on
where every task waits, and a worker consumes every lane that can hold a task
from its first connection.  (A queue declared differently by two processes is
refused by RabbitMQ itself.)
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
    "LEVEL_STEPS",
    "NOISY_LANES",
    "SHARD_LANES",
    "KeyLanes",
    "LaneChooser",
    "consume_lanes",
    "declared_with_priority",
    "every_lane",
    "first_level",
    "free_lane",
    "is_lane",
    "key_digest",
    "lane_queue",
    "level_lane",
    "level_step",
    "priority_rank",
    "prioritised",
)

#: Shard lanes per keyed queue: a flood's first ~30 messages, before it is
#: found noisy, wait in front of the keys of one shard in 16.
SHARD_LANES = 16
#: Lanes for noisy keys per keyed queue: one producer isolates at most
#: 1 / 10% = 10 keys at once, and rarely more than a few.
NOISY_LANES = 8
#: The priority levels of a keyed queue declared with a maximum priority: a task's
#: level is the highest step at or below its Celery priority (RabbitMQ serves the
#: highest priority first).  The steps of Kombu's default ``priority_steps``, the
#: Redis levels; fixed, as every process must agree whatever its transport options.
LEVEL_STEPS = (0, 3, 6, 9)
_SEPARATOR = ".fair."
#: A level's lanes: ``<queue>.fair.pri<step>.<first-level lane>``.
_LEVEL = "pri"


@dataclass(frozen=True)
class KeyLanes:
    """The lanes of the keyed queues ``keyed`` (the same in every process)."""

    keyed: frozenset[str]
    #: The keyed queues declared with a maximum priority: lanes per level each.
    prioritised: frozenset[str] = frozenset()

    def shard_lanes(self, queue: str) -> tuple[str, ...]:
        """The first level's shard lanes: the ring's, which every level's mirror."""
        return tuple(f"{queue}{_SEPARATOR}s{i}" for i in range(SHARD_LANES))

    def noisy_lanes(self, queue: str) -> tuple[str, ...]:
        """The first level's noisy lanes (a level's own: :func:`level_lane`)."""
        return tuple(f"{queue}{_SEPARATOR}n{i}" for i in range(NOISY_LANES))

    def levels(self, queue: str) -> tuple[int, ...]:
        """The priority levels of keyed ``queue`` with lanes of their own."""
        return LEVEL_STEPS if queue in self.prioritised else LEVEL_STEPS[:1]

    def lanes(self, queue: str) -> tuple[str, ...]:
        """Every lane of keyed ``queue`` but the queue itself, every level's."""
        first = self.shard_lanes(queue) + self.noisy_lanes(queue)
        return tuple(level_lane(queue, lane, step) for step in self.levels(queue) for lane in first)

    def of_level(self, queue: str, lane: str, priority: Any) -> str:
        """The lane a task of ``priority`` takes for first-level ``lane`` of keyed
        ``queue``: its level's if the queue has levels, else ``lane``."""
        return level_lane(queue, lane, priority) if queue in self.prioritised else lane

    def is_shard(self, queue: str, lane: str) -> bool:
        """Whether ``lane`` of keyed ``queue`` is a shard lane, of any level."""
        return first_level(queue, lane) in self.shard_lanes(queue)

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


def level_step(priority: Any) -> int:
    """The level of a Celery ``priority`` in a keyed queue with levels (:data:`LEVEL_STEPS`);
    none, or one that is not a whole number, is RabbitMQ's 0."""
    value = priority if isinstance(priority, int) and not isinstance(priority, bool) else 0
    return max(step for step in LEVEL_STEPS if step <= max(value, 0))


def priority_rank(priority: Any) -> int:
    """A RabbitMQ task's level as the worker's buffer ranks it (the lowest first, and
    RabbitMQ serves the highest priority first): its step, negated."""
    return -level_step(priority)


def level_lane(queue: str, lane: str, priority: Any) -> str:
    """The lane of ``priority``'s level that mirrors first-level ``lane`` of ``queue``
    (``jobs.fair.s3`` at priority 7: ``jobs.fair.pri6.s3``); the first level's is ``lane``."""
    step = level_step(priority)
    if not step:
        return lane
    prefix = queue + _SEPARATOR
    return f"{prefix}{_LEVEL}{step}.{lane[len(prefix) :]}"


def first_level(queue: str, lane: str) -> str:
    """The first-level lane that ``lane`` of ``queue`` mirrors (itself if first-level)."""
    prefix = queue + _SEPARATOR
    rest = lane[len(prefix) :] if lane.startswith(prefix) else ""
    level, dot, name = rest.partition(".")
    if dot and level.startswith(_LEVEL) and level[len(_LEVEL) :].isdigit():
        return prefix + name
    return lane


def every_lane(queue: str) -> tuple[str, ...]:
    """Every lane keyed ``queue`` can have, every priority level's (only a queue declared
    with a maximum priority has the levels' lanes): for what need not know how it was
    declared to find every task."""
    return KeyLanes(frozenset((queue,)), frozenset((queue,))).lanes(queue)


def is_lane(queue: str, name: str) -> bool:
    """Whether ``name`` is a lane of keyed ``queue``, of any level (a task delivered
    from it goes back to it: :func:`celery_fair.kombu.requeue.return_copy`)."""
    return name.startswith(queue + _SEPARATOR) and name in every_lane(queue)


def declared_with_priority(queue: Any) -> bool:
    """Whether a Kombu ``Queue`` is declared with a maximum priority (RabbitMQ's own)."""
    arguments = getattr(queue, "queue_arguments", None) or {}
    return bool(getattr(queue, "max_priority", None) or arguments.get("x-max-priority"))


def prioritised(app: Any, keyed: Iterable[str]) -> frozenset[str]:
    """The keyed queues of ``app`` declared with a maximum priority.

    A queue the app does not list is declared as Celery would create it:
    with ``task_queue_max_priority``, if set.
    """
    queues = app.amqp.queues
    default = bool(app.conf.task_queue_max_priority)
    return frozenset(
        name for name in keyed
        if (declared_with_priority(queues[name]) if name in queues else default)
    )  # fmt: skip


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
