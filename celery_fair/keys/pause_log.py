"""Paused keys and live settings on RabbitMQ: the control log read and written, and parked
tasks moved back.

The broker side of :mod:`celery_fair.keys.pause_events`, on a
:class:`~.side_connection.SideConnection` of its own (the worker's consumer
connection is driven by Celery's event loop): nothing reads it between the
worker's timer calls.

* **Reading.**  One channel consumes the stream :data:`PAUSE_LOG` from its
  first retained event (``x-stream-offset: first``).  :meth:`PauseLog.read`
  takes whatever has arrived, without waiting; with ``catch_up`` it first
  appends a marker of its own and reads until the marker comes back, so the
  state is the whole log's at that moment (a worker calls it as its
  consumer connects, before any task is dispatched).
* **Writing.**  An event is published with a publisher confirm: the command
  that paused a key (or made a limit or a weight live) answers only once the broker has
  the event.
* **Parking.**  Before a key is marked paused here, its parked lane is
  declared as the keyed queue is (durable, its arguments), so the worker's
  copies of the key's tasks have somewhere to go (a message published to a
  queue that does not exist is dropped by the default exchange).
* **Moving back.**  When a key is resumed, every reader moves its parked
  tasks back, at most :data:`MOVE_PER_READ` per read so that the worker's
  loop is never held long: each is taken with ``basic.get``, published to
  the key's hashed noisy lane with a confirm, then acknowledged (a crash in
  between leaves a duplicate, never a loss).  The noisy lane, not the shard:
  a resumed backlog must not stand in front of the shard's quiet keys.  A
  worker that had not yet read the resume may park a task after the parked
  lane was emptied, so each reader looks again at the keys resumed in the
  last :data:`RESUME_SWEEP` seconds.
* **Without the queue's declaration** (``celery fair keys`` given a broker URL
  and no app), the lanes are taken as the broker holds them: one that exists
  is used without a declaration of this process's (a declaration without the
  queue's arguments, such as its maximum priority, is refused); a lane that
  does not exist is left to the workers, which declare it as the queue is: a
  parked lane when they read the pause, and the lanes a parked task goes back
  to when they start (such a task stays parked until then).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from time import monotonic, time
from typing import Any

from .lanes import KeyLanes, declared_with_priority, free_lane, lane_queue
from .lanes_admin import declared
from .pause_events import (
    PAUSE_LOG,
    PAUSE_LOG_ARGUMENTS,
    LiveSetting,
    PauseEvent,
    PauseState,
    parked_lane,
)
from .side_connection import SideConnection

__all__ = ("CATCH_UP_TIMEOUT", "MOVE_PER_READ", "RESUME_SWEEP", "PauseLog", "PauseLogUnavailable")

logger = logging.getLogger(__name__)

#: Seconds a reader waits for its own marker before it goes on with what it read.
CATCH_UP_TIMEOUT = 10.0
#: Parked tasks moved back per key and read (one confirmed publish each).
MOVE_PER_READ = 500
#: Seconds after a resume during which readers look for tasks parked late.
RESUME_SWEEP = 60.0
#: Seconds a later read waits for a marker the first catch-up did not reach.
_CATCH_UP_STEP = 0.5
#: Events read per call at most (the stream's unacknowledged window is 2x).
_READ_BATCH = 1000
#: The side connection's channels: one consumes the log, one does the rest, and one
#: looks for lanes (the broker closes it when one is missing).
_READER, _ADMIN, _PROBE = "reader", "admin", "probe"


class PauseLogUnavailable(RuntimeError):
    """The broker cannot keep the pause log (no stream queues)."""


class PauseLog:
    """This process's reader and writer of the pause log, for the keyed queues ``parents``.

    ``connect()``: a new, unconnected Kombu connection to the broker.
    ``parents``: keyed queue name -> its Kombu ``Queue`` (a parked lane is
    declared as it is).  ``as_found``: the parents' declarations are not known
    (a command without the app): lanes are used as the broker holds them, and
    ``prioritised`` names the queues found to have priority levels.
    ``wall``: wall-clock seconds (events are stamped with it); ``clock``:
    monotonic seconds.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        parents: Mapping[str, Any],
        *,
        as_found: bool = False,
        prioritised: Iterable[str] = (),
        wall: Callable[[], float] = time,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.side = SideConnection(connect, "the pause log on RabbitMQ", clock=clock)
        self.parents = dict(parents)
        self.lanes = KeyLanes(
            frozenset(self.parents),
            frozenset(q for q, queue in self.parents.items() if declared_with_priority(queue))
            | frozenset(prioritised),
        )
        self.as_found = as_found
        self.wall = wall
        self._clock = clock
        self._arrived: list[tuple[int, bytes]] = []
        self._awaited: str | None = None
        self._seen = False
        self._declared: set[str] = set()
        self._moving: set[tuple[str, str]] = set()
        self.state = PauseState()
        #: Whether the whole log has been read at least once.
        self.caught_up = False
        #: Why this broker cannot keep the log (None: it can, as far as known).
        self.unsupported: str | None = None
        #: Tasks moved back from parked lanes by this process.
        self.moved = 0
        #: At most this many moved back by this process in all (None: no bound).  A
        #: command that resumes while workers run bounds itself by what was parked:
        #: a worker that has not read the resume yet parks the moved tasks again.
        self.move_budget: int | None = None

    @property
    def errors(self) -> int:
        """Failures of the broker connection."""
        return self.side.errors

    # -- the connection ---------------------------------------------------------

    def _open(self) -> None:
        """Connect and consume the log from its first event, unless already done."""
        if self.unsupported is not None:
            raise PauseLogUnavailable(self.unsupported)
        if self.side.has(_READER):
            return
        admin = self.side.channel(_ADMIN)
        try:
            admin.queue_declare(PAUSE_LOG, durable=True, auto_delete=False,
                                arguments=dict(PAUSE_LOG_ARGUMENTS))  # fmt: skip
        except self.side.errors_of()[1] as exc:
            # A broker without streams (RabbitMQ before 3.9) refuses the declaration.
            self.unsupported = (
                f"pausing keys, and limits and key weights set live on every worker, need "
                f"stream queues on RabbitMQ (3.9 or later) for the control log "
                f"{PAUSE_LOG!r}; the broker refused it: {exc}"
            )
            logger.warning("celery-fair: %s", self.unsupported)
            self.side.close()
            raise PauseLogUnavailable(self.unsupported) from exc
        reader = self.side.channel(_READER)
        reader.basic_qos(0, 2 * _READ_BATCH, False)  # a stream consumer needs a window
        reader.basic_consume(
            PAUSE_LOG, no_ack=False, callback=self._on_event,
            arguments={"x-stream-offset": "first"},
        )  # fmt: skip
        # Replayed from the first event: the state is rebuilt from scratch, and is
        # not to be used before it has been read to the end again.
        self.state = PauseState()
        self.caught_up = False
        self._awaited, self._seen = None, False
        self._arrived.clear()
        self._declared.clear()

    def _on_event(self, message: Any) -> None:
        self._arrived.append((message.delivery_tag, message.body))

    def close(self) -> None:
        self.side.close()

    # -- reading ----------------------------------------------------------------

    def read(self, *, catch_up: bool = False) -> bool:
        """Apply the events that arrived (with ``catch_up``: the whole log, waiting up to
        :data:`CATCH_UP_TIMEOUT` s), then move back what resumed keys left parked.

        Returns whether this process has read the whole log at least once.
        Broker failures are logged, counted and retried at the next call.
        """
        with self.side.lock:
            if self.unsupported is not None:
                return False
            try:
                self._open()
                if catch_up or not self.caught_up:
                    self._catch_up()
                else:
                    self._drain(0.0)
                self._sweep()
            except PauseLogUnavailable:
                return False
            except Exception as exc:  # noqa: BLE001 - any broker failure: reconnect next time
                self.side.failed(exc)
            return self.caught_up

    def _catch_up(self) -> None:
        """Read the log to its end: up to a marker of this reader's, appended now.

        A log too long to read within :data:`CATCH_UP_TIMEOUT` s is read on at
        the next calls, each waiting at most :data:`_CATCH_UP_STEP` s for the same
        marker, so that the worker's loop is never held longer.
        """
        if self._awaited is None or self._seen:
            marker = PauseEvent(uuid.uuid4().hex)
            self._publish(marker)
            budget = CATCH_UP_TIMEOUT
            self._awaited, self._seen = marker.id, False
        else:
            budget = _CATCH_UP_STEP
        if self._read_until(budget):
            self.caught_up = True
        elif budget == CATCH_UP_TIMEOUT:
            logger.warning(
                "celery-fair: the pause log on RabbitMQ was not read to its end within %.0f s; "
                "%d event(s) read so far, the rest at the next reads", CATCH_UP_TIMEOUT,
                self.state.events,
            )  # fmt: skip

    def _read_until(self, budget: float) -> bool:
        """Read until the awaited entry has been applied (False: not within ``budget`` s)."""
        deadline = self._clock() + budget
        while not self._seen:
            left = deadline - self._clock()
            if left <= 0:
                return False
            self._drain(min(left, 0.5))
        return True

    def _drain(self, timeout: float) -> None:
        """Read what the broker sent (waiting up to ``timeout`` s for the first frame)."""
        connection = self.side.connection
        wait = timeout
        while len(self._arrived) < _READ_BATCH:
            try:
                connection.drain_events(timeout=wait)
            except TimeoutError:
                break
            wait = 0.0
        self._apply_arrived()

    def _apply_arrived(self) -> None:
        arrived, self._arrived = self._arrived, []
        for tag, body in arrived:
            try:
                event = PauseEvent.from_body(body)
            except ValueError as exc:
                self.state.malformed += 1
                logger.warning("celery-fair: the pause log holds an entry that is not an event "
                               "(skipped): %s", exc)  # fmt: skip
                event = None
            if event is not None and event.id == self._awaited:
                self._seen = True
            if event is not None and (event.keys or event.settings) and event.queue in self.parents:
                if event.paused:  # declared before the key counts as paused here
                    for key in event.keys:
                        self._declare_parked(event.queue, key)
                for queue, key in self.state.apply(event):
                    if not event.paused:
                        self._moving.add((queue, key))
            self.side.channel(_READER).basic_ack(tag)

    # -- writing ----------------------------------------------------------------

    def append(self, queue: str, keys: Iterable[str], paused: bool) -> int:
        """Pause (or resume) ``keys`` of keyed ``queue`` for every worker; how many changed.

        The parked lanes are declared first; the event is confirmed by the
        broker, then read back, so that this process's state has it in the
        log's order before this returns.  Raises on a broker failure (the
        command's caller is told).
        """
        keys = tuple(dict.fromkeys(keys))
        with self.side.lock:
            before = self.state.paused().get(queue, set())
            self._write(
                PauseEvent(uuid.uuid4().hex, queue, keys, paused, self.wall()),
                parked=[(queue, key) for key in keys] if paused else [],
            )
            return sum((key in before) != paused for key in keys)

    def set_live(self, queue: str, settings: Iterable[LiveSetting]) -> None:
        """Make per-key limits or key weights of keyed ``queue`` live for every worker
        (value None: back to the configured one); written and read back as :meth:`append`."""
        settings = tuple(settings)
        with self.side.lock:
            self._write(PauseEvent(uuid.uuid4().hex, queue, at=self.wall(), settings=settings))

    def _write(self, event: PauseEvent, parked: Iterable[tuple[str, str]] = ()) -> None:
        """Declare the ``parked`` lanes, append ``event`` and read the log up to it."""
        try:
            self._open()
            for queue, key in parked:
                self._declare_parked(queue, key)
            self._publish(event)
            self._awaited, self._seen = event.id, False
            if self._read_until(CATCH_UP_TIMEOUT):
                self.caught_up = True  # read from the first entry to this one
            else:
                raise TimeoutError(
                    f"the pause log: the event was written but not read back within "
                    f"{CATCH_UP_TIMEOUT:.0f} s"
                )
        except Exception as exc:
            self.side.failed(exc)
            raise

    def _publish(self, event: PauseEvent) -> None:
        from amqp import Message

        self.side.channel(_ADMIN).basic_publish_confirm(
            Message(event.to_body(), content_type="application/json", delivery_mode=2),
            exchange="",
            routing_key=PAUSE_LOG,
        )

    # -- parking ----------------------------------------------------------------

    def _declare_parked(self, queue: str, key: str) -> str | None:
        """The parked lane of ``key``, declared; None if it does not exist and this process
        does not know how to declare it (``as_found``): the workers will."""
        lane = parked_lane(queue, key)
        return lane if self._declare(queue, lane) else None

    def _declare(self, queue: str, lane: str) -> bool:
        """Declare ``lane`` of keyed ``queue`` as the queue is (once per connection);
        whether it exists.  ``as_found``: none is declared, and one that does not exist
        is left to the workers (False)."""
        if lane not in self._declared:
            if self.as_found:
                if not self._exists(lane):
                    return False
            else:
                lane_queue(self.parents[queue], lane)(self.side.channel(_ADMIN)).declare()
            self._declared.add(lane)
        return True

    def _exists(self, lane: str) -> bool:
        probe = self.side.channel(_PROBE)
        messages, _, channel = declared(self.side.connection, probe, lane)
        if channel is not probe:  # the broker closed the probe (declared closed it too)
            channel.close()
            self.side.refused(_PROBE)
        return messages is not None

    def destination(self, queue: str, key: str, priority: Any = None) -> str:
        """The lane a resumed key's parked task of ``priority`` goes back to: its hashed
        noisy lane, of the task's level in a queue with levels."""
        return self.lanes.of_level(
            queue, free_lane(self.lanes.noisy_lanes(queue), key, ()), priority
        )

    def _sweep(self) -> None:
        """Move back the parked tasks of keys resumed lately, :data:`MOVE_PER_READ` each."""
        since = self.wall() - RESUME_SWEEP
        due = set(self._moving) | set(self.state.resumed(since, self.parents))
        for queue, key in sorted(due):
            if self._move_back(queue, key) < MOVE_PER_READ:
                self._moving.discard((queue, key))

    def _move_back(self, queue: str, key: str) -> int:
        from amqp import Message

        name = self._declare_parked(queue, key)
        if name is None:
            return 0  # never parked
        admin, moved, targets = self.side.channel(_ADMIN), 0, set()
        budget = MOVE_PER_READ if self.move_budget is None else self.move_budget - self.moved
        while moved < min(MOVE_PER_READ, budget):
            if self.state.paused_since(queue, key) is not None:
                break  # paused again meanwhile
            message = admin.basic_get(name, no_ack=False)
            if message is None:
                break
            priority = message.properties.get("priority")
            target = self.destination(queue, key, priority)
            if not self._declare(queue, target):
                # Not on the broker, and how the queue is declared is not known here:
                # left parked, for a worker (which knows) to move back.
                admin.basic_reject(message.delivery_tag, requeue=True)
                logger.warning("celery-fair: lane %r of %r is not declared: the parked tasks "
                               "of key %r are left for the workers to move back", target, queue,
                               key)  # fmt: skip
                break
            targets.add(target)
            admin.basic_publish_confirm(
                Message(message.body, **message.properties), exchange="", routing_key=target
            )
            admin.basic_ack(message.delivery_tag)
            moved += 1
        if moved:
            self.moved += moved
            logger.info("celery-fair: %d parked task(s) of resumed key %r moved back to %s",
                        moved, key, ", ".join(sorted(targets)))  # fmt: skip
        return moved

    def parked(self, queue: str, key: str) -> int | None:
        """Tasks waiting in the parked lane of ``key`` (None: not readable now)."""
        with self.side.lock:
            try:
                self._open()
                name = self._declare_parked(queue, key)
                if name is None:
                    return 0
                ok = self.side.channel(_ADMIN).queue_declare(name, passive=True)
                return int(ok.message_count)
            except Exception as exc:  # noqa: BLE001 - a count is not worth a failure
                self.side.failed(exc)
                return None
