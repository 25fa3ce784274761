"""Tasks that wait for a free pool slot leave in DWRR order, for every pool.

* prefork: Celery parks such tasks in ``LaxBoundedSemaphore``'s FIFO.  The
  semaphore keeps ``_add_waiter``/``_pop_waiter`` as instance attributes, so
  :func:`install_on_semaphore` swaps just those for the scheduler's buffer
  (through :func:`celery_fair.compat.install_waiters`): the semaphore's own
  counting and release paths are untouched.
* threads, solo, gevent and eventlet have no wait (tasks go straight to the
  executor, run inline, or block in the green pool's ``spawn``).
  :class:`FairGate` adds one: at most ``slots`` tasks are in the pool; the
  others wait in the scheduler's buffer.  A slot is freed when the pool
  reports the task done (the thread pool's future, the greenlet's ``link``,
  or the return of the solo pool's inline call).  eventlet's ``on_apply``
  returns no greenlet; it is taken where the pool spawns it
  (:func:`celery_fair.compat.green_spawns`): freed at once, every task
  would go on to eventlet's pool and wait there in arrival order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Protocol

from .. import compat
from ..scheduling.dispatch import Check, SendBack, next_admitted
from ..scheduling.shedding import UNKNOWN_QUEUE
from .roles import SchedulingService

__all__ = (
    "BUSY_DRAIN",
    "FairGate",
    "Gate",
    "Holders",
    "admission",
    "buffer_task",
    "buffered_requests",
    "close_during_drain",
    "gate_request",
    "holding_gate",
    "install_on_semaphore",
    "park_paused",
    "release_waiters",
    "wake_while_busy",
)


class Gate(Protocol):
    """What the event loop's adapters need of a gate (:class:`FairGate`, or the
    :class:`~celery_fair.worker.capacity.ResourceGate`)."""

    service: SchedulingService
    slots: int

    @property
    def free(self) -> int: ...

    def close(self) -> None: ...

    def open(self) -> None: ...


class _WaitingView:
    """Stands in for the semaphore's deque: ``clear()`` and ``len()``."""

    def __init__(self, service: SchedulingService) -> None:
        self.service = service

    def clear(self) -> None:
        with self.service.lock:
            self.service.scheduler.dispatch.clear()

    def __len__(self) -> int:
        return len(self.service.scheduler.dispatch)


def _queue_of(service: SchedulingService, args: tuple[Any, ...]) -> str:
    request = args[0] if args else None
    return service.queue_map.queue_of(request) or UNKNOWN_QUEUE


def buffer_task(service: SchedulingService, args: tuple[Any, ...], entry: Any) -> None:
    """Buffer ``entry`` (whose request is ``args[0]``) under its queue and, if keyed, its key
    and priority level."""
    queue = _queue_of(service, args)
    request = args[0] if args else None
    key, level, user = service.queue_map.key_of(request, queue)
    cost = 1.0
    if key is not None and service.settings.cost == "dominant":
        # The keys' turns in the buffer advance by what each task costs, as on the broker.
        charge = getattr(service.gate, "cost", None)
        cost = 1.0 if charge is None else max(charge(request, queue), 1e-6)
    user_cost = None
    if key is not None and service.queue_map.lanes is not None:
        # RabbitMQ: no fetch script orders the keys, so their weights act here,
        # over what each lane's window holds: a key of weight 4 gets 4 turns to 1,
        # and a user "key/user" of weight 2 two turns to 1 within the key's.
        weights = service.lane_key_weights
        if user is not None:
            user_cost = cost / weights.weight(f"{key}/{user}", queue)
        cost /= weights.weight(key, queue)
    service.scheduler.wait(queue, entry, key, level, user, cost, user_cost)


def admission(
    service: SchedulingService, request_of: Callable[[Any], Any], *, stale: bool = True
) -> Callable[[], tuple[str, Any] | None]:
    """The admission loop on the worker's wait buffer: the next entry to run, or None.

    The checks, in order: a paused key (its tasks go back, none starts), then
    CoDel (a stale task goes back; ``stale=False`` leaves CoDel to the caller,
    which checks as the task starts).  Entries sent back are skipped and the
    next one is considered at once (:func:`~celery_fair.scheduling.dispatch.next_admitted`).
    """
    pauses, shedder = service.pauses, service.shedder

    def paused(queue: str, entry: Any, backlog: int) -> SendBack | None:
        if not pauses.any():
            return None
        key, _, _ = service.queue_map.key_of(request_of(entry), queue)
        return pauses.check(queue, key)

    def stale_check(queue: str, entry: Any, backlog: int) -> SendBack | None:
        assert shedder is not None
        return shedder.check(request_of(entry), backlog)

    def send_back(queue: str, entry: Any, back: SendBack) -> bool:
        if back.key is not None:
            _send_back_key(service, queue, back, entry, request_of)
            return True
        assert shedder is not None
        return shedder.send_back(request_of(entry), back)

    codel = shedder is not None and stale
    checks: list[Check[Any]] = [paused, stale_check] if codel else [paused]
    return partial(
        next_admitted, service.scheduler.dispatch, service.lock, checks, send_back,
        empty=shedder.empty if codel and shedder is not None else None,
    )  # fmt: skip


def park_paused(service: SchedulingService, receive: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """RabbitMQ: a task of a paused key goes to its parked lane as it is received.

    On Redis the fetch serves nothing of a paused key, so only tasks already
    buffered need checking (:func:`admission`).  On RabbitMQ the lanes keep
    delivering the key's tasks, and one that finds a free pool slot never
    waits in the buffer: it is checked here, before it can start.  A task
    that cannot be parked (the broker refused the copy) is passed on: running
    it beats losing it.
    """
    pauses = service.pauses
    if pauses.park is None:
        return receive
    from celery.worker.state import task_ready

    def fair_receive(request: Any) -> Any:
        if pauses.any():
            queue = service.queue_map.queue_of(request)
            if queue is not None:
                key, _, _ = service.queue_map.key_of(request, queue)
                back = pauses.check(queue, key)
                if back is not None and not pauses.send_back([request], back, _itself, task_ready):
                    return None
        return receive(request)

    return fair_receive


def _itself(request: Any) -> Any:
    return request


def _send_back_key(
    service: SchedulingService, queue: str, back: SendBack, entry: Any,
    request_of: Callable[[Any], Any],
) -> None:  # fmt: skip
    """``entry``'s key is paused: it and the key's other buffered tasks go back, in order."""
    from celery.worker.state import task_ready

    key = back.key or ""
    dispatch = service.scheduler.dispatch
    with service.lock:
        others = dispatch.take_key(queue, key)
    kept = service.pauses.send_back([entry, *others], back, request_of, task_ready)
    if kept:
        _, level, _ = service.queue_map.key_of(request_of(entry), queue)
        with service.lock:
            for item in kept:
                _, _, user = service.queue_map.key_of(request_of(item), queue)
                dispatch.put(queue, item, key, level, user)


def _semaphore_request(entry: tuple[Any, tuple[Any, ...], dict[str, Any]]) -> Any:
    return entry[1][0]


def gate_request(entry: tuple[Any, Any]) -> Any:
    """The request of a gate's buffered entry ``(run, request)``."""
    return entry[1]


def buffered_requests(service: SchedulingService, *, gated: bool) -> list[Any]:
    """The requests waiting in the dispatch buffer for a slot: the gate's (``gated``)
    or the prefork semaphore's."""
    request_of: Callable[[Any], Any] = gate_request if gated else _semaphore_request
    with service.lock:
        return [request_of(entry) for entry in service.scheduler.dispatch]


def release_waiters(semaphore: Any, service: SchedulingService, slots: int) -> int:
    """Repair a prefork worker's count: let up to ``slots`` buffered tasks go to the pool.

    For pool processes that are free while the semaphore counts them busy (a
    release that never came).  ``release`` hands a waiter the slot without
    counting it again.  Returns how many went.
    """
    given = 0
    while given < slots and len(service.scheduler.dispatch):
        semaphore.release()
        given += 1
    return given


def install_on_semaphore(semaphore: Any, service: SchedulingService) -> None:
    """Make a ``LaxBoundedSemaphore`` release its waiters in DWRR order."""
    lock = service.lock

    def add_waiter(entry: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]) -> None:
        with lock:
            buffer_task(service, entry[1], entry)

    admit = admission(service, _semaphore_request)

    def pop_waiter() -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        taken = admit()
        if taken is None:
            raise IndexError("no task is waiting")
        entry: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] = taken[1]
        return entry

    compat.install_waiters(semaphore, add_waiter, pop_waiter, _WaitingView(service))


class FairGate:
    """At most ``slots`` tasks in the pool; the rest wait in DWRR order.

    ``close()``/``open()`` bracket a burst of deliveries (one event-loop drain)
    so that tasks delivered together are ordered before the first one runs:
    the solo pool runs a task inline, so without it there is never a choice.
    """

    def __init__(self, service: SchedulingService, slots: int) -> None:
        self.service = service
        self.slots = max(1, slots)
        self.free = self.slots
        self._closed = False
        self._pumping = False
        self._lock = service.lock
        self._admit = admission(service, gate_request)

    def submit(self, run: Callable[[Any], Any], request: Any) -> None:
        """Run ``request`` now if a slot is free and nothing waits, else buffer it."""
        with self._lock:
            buffer_task(self.service, (request,), (run, request))
        self.pump()

    def release(self) -> None:
        """A task left the pool: its slot is free."""
        with self._lock:
            self.free = min(self.slots, self.free + 1)
        self.pump()

    def repair(self, free: int) -> int:
        """The pool has ``free`` slots with nothing on its way to them: count at least
        that many free (a release that never came), and start waiting tasks.

        Returns how many slots the gate had lost.
        """
        with self._lock:
            lost = max(0, min(self.slots, free) - self.free)
            self.free += lost
        if lost:
            self.pump()
        return lost

    def close(self) -> None:
        """Start nothing until :meth:`open` (a burst of deliveries is being collected)."""
        self._closed = True

    def open(self) -> None:
        self._closed = False
        self.pump()

    def pump(self) -> None:
        """Start waiting tasks, in DWRR order, while slots are free."""
        with self._lock:
            if self._pumping or self._closed:
                return
            self._pumping = True
        try:
            while True:
                with self._lock:
                    if self.free <= 0:
                        return
                    self.free -= 1
                taken = self._admit()
                if taken is None:
                    with self._lock:
                        self.free += 1
                    return
                run, request = taken[1]
                run(request)
        finally:
            with self._lock:
                self._pumping = False

    def wrap(self, process: Callable[[Any], Any], pool: Any) -> Callable[[Any], Any]:
        """Gate ``process`` (the worker's ``_process_task``) on ``pool``'s slots."""
        applied = threading.local()
        gate = self
        # eventlet's on_apply returns no greenlet: found where it was spawned.
        spawned = compat.green_spawns(pool, self.service.probe)

        def follow_apply(on_apply: Callable[..., Any]) -> Callable[..., Any]:
            def fair_on_apply(*args: Any, **kwargs: Any) -> Any:
                applied.flag = True
                result = on_apply(*args, **kwargs)
                handle = spawned() if result is None and spawned is not None else result
                compat.on_pool_done(handle, gate.release)
                return result

            return fair_on_apply

        compat.wrap_pool_apply(pool, follow_apply)

        def run(request: Any) -> None:
            applied.flag = False
            try:
                process(request)
            finally:
                if not getattr(applied, "flag", False):
                    # Never reached the pool (revoked, rejected): free the slot.
                    gate.release()

        def gated(request: Any) -> None:
            gate.submit(run, request)

        return gated


class Holders:
    """The requests a gate let through while they hold something, by request object.

    A gate's book is keyed by :meth:`key`, the request object's identity, never
    by its task id alone: when the consumer's connection closes, Celery drops
    the requests that had not reached a pool process, with no finish reported,
    and their messages come back on the new channel with the same task ids, as
    new requests.  By task id, the book would count a dropped request's holding
    as the new one's, its repair would never come, and the new one would wait
    for what its own ghost holds.  A strong reference to each request held is
    kept until it is released, so no later request can take its identity.
    """

    def __init__(self) -> None:
        self._requests: dict[str, Any] = {}

    @staticmethod
    def key(request: Any) -> str:
        """``request``'s key in a gate's book: its task id (for people) and its identity."""
        return f"{getattr(request, 'id', None)}@{id(request):x}"

    def hold(self, request: Any) -> str:
        key = self.key(request)
        self._requests[key] = request
        return key

    def release(self, key: str) -> None:
        self._requests.pop(key, None)

    def keep(self, keys: Iterable[str]) -> None:
        """Forget every request but those of ``keys`` (the book let go of the others)."""
        kept = set(keys)
        for key in [k for k in self._requests if k not in kept]:
            del self._requests[key]

    def keys_of(self, requests: Iterable[Any]) -> set[str]:
        """The keys of ``requests`` (those Celery still counts, for a repair)."""
        return {self.key(request) for request in requests}

    @staticmethod
    def task_id(key: str) -> str:
        return key.rsplit("@", 1)[0]


def holding_gate(
    process: Callable[[Any], Any],
    submit: Callable[[Callable[[Any], Any], Any], None],
    finished: Callable[[Any], None],
) -> Callable[[Any], Any]:
    """``process`` (the worker's hand-over to the pool, or to prefork's semaphore) behind
    a gate whose tasks hold something until they end: ``submit(run, request)`` runs
    or holds back each task, ``finished(request)`` frees what it held.

    A task revoked or rejected on the way (Celery's ``task_ready`` ran) runs
    nowhere: what it held is freed as ``process`` returns.  A task still waiting
    for prefork's semaphore, or running, is still counted, and is freed when it ends.
    """

    def run(request: Any) -> None:
        try:
            process(request)
        finally:
            if not compat.request_counted(request):
                finished(request)

    def gated(request: Any) -> None:
        submit(run, request)

    return gated


def close_during_drain(connection: Any, gate: Gate) -> None:
    """Collect every delivery already received before dispatching any.

    The solo pool runs a task inline, inside the delivery callback; without
    this the first delivery of a burst would always run first.
    """

    def collect(drain: Any, timeout: float | None, **kwargs: Any) -> Any:
        gate.close()
        try:
            result = drain(timeout=timeout, **kwargs)
            for _ in range(1000):
                try:
                    drain(timeout=0)
                except (TimeoutError, OSError):
                    break
            return result
        finally:
            gate.open()

    compat.wrap_drain_events(connection, collect)


#: Seconds the consumer's drain may block while the gate has tasks (green pools, Redis).
BUSY_DRAIN = 0.01


def wake_while_busy(connection: Any, gate: Gate) -> None:
    """Green pools on Redis: do not sleep in the event loop while tasks free prefetch credit.

    With ``-P gevent``/``eventlet`` Celery's loop blocks in ``drain_events(timeout=2.0)``
    between deliveries.  Plain Celery rarely gets there while busy: a full green pool
    blocks the loop in ``spawn`` instead.  With the gate the loop goes back to the
    drain, and on Redis, once the prefetch window is full, Kombu stops polling the
    fetch connection and waits on its other sockets: the credit that each finished
    task returns goes unseen until the timeout.  Tasks that yield (I/O, sleep) then ran
    at about 5 a second whatever their length (measured with 5 ms tasks, against 280 a
    second here).  While a task is in the pool or waits for a slot, the drain returns
    after :data:`BUSY_DRAIN` at most; an idle worker keeps Celery's timeout.
    """
    waiting = gate.service.scheduler.dispatch

    def drain_briefly_while_busy(drain: Any, timeout: float | None, **kwargs: Any) -> Any:
        if gate.free < gate.slots or len(waiting):
            timeout = BUSY_DRAIN if timeout is None else min(timeout, BUSY_DRAIN)
        return drain(timeout=timeout, **kwargs)

    compat.wrap_drain_events(connection, drain_briefly_while_busy)
