"""Tasks start by what they hold: a worker's capacity, shared in fair order, for every pool.

With ``fair_capacity``, ``fair_queue_concurrency`` or ``fair_cost="dominant"``
every task reaches the pool through a :class:`ResourceGate`, for prefork
too (before Celery's semaphore, which then rarely has a waiter).  A task
holds what it declares (:data:`~celery_fair.wire.RESOURCES_HEADER`, or the
task's ``fair_resources`` attribute on this worker, else one pool slot),
plus one unit of its queue's own resource when ``fair_queue_concurrency``
names the queue.  The gate takes tasks from the dispatch buffer in DWRR
order and starts the first that fits what is free
(:class:`~celery_fair.scheduling.resources.Admission`): a large task does not
hold up the smaller ones behind it, and after ``patience`` of them have
passed it, it is reserved and starts next.  At most ``lookahead`` tasks are
taken out of the fair order to wait for room, so a task that does not fit
does not pull the whole buffer behind it; but every queue with tasks buffered
has one among them.  Under ``fair_cost="dominant"`` the tasks taken are tried
by DRF's rule: the queue whose running tasks hold the least dominant share
(by its weight) first.

The books follow what the worker really holds, not only callbacks: a task's
holding ends when its request finishes (the tracker's observer), when the
hand-over returns and Celery no longer counts the request (revoked,
rejected), and at each look of the watchdog for every request Celery no
longer counts (:meth:`ResourceGate.reconcile`).  The pool's size is read at
every choice, so ``--autoscale`` moves the ``slots`` capacity.

A task that can never fit this worker (a resource it does not have, or more
than it has) is parked with its reason: it is neither run over capacity nor
held for ever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import compat
from ..errors import FairConfigError
from ..scheduling.estimate import Ewma
from ..scheduling.resources import (
    QUEUE_RESOURCE,
    SLOTS,
    Admission,
    Ledger,
    Resources,
    demand_of,
    dominant_cost,
    parse_capacity,
    parse_demand,
    queue_resource,
    unfit_reason,
)
from ..wire import RESOURCES_HEADER
from .dispatch import Holders, admission, buffer_task, gate_request, holding_gate
from .roles import SchedulingService

__all__ = (
    "LOOKAHEAD",
    "PATIENCE",
    "CapacityStatistics",
    "Demands",
    "ResourceGate",
    "check_declared",
    "worker_capacity",
)

logger = logging.getLogger(__name__)

#: Tasks that may start before one that does not fit, before it is reserved.  A
#: reservation idles what the others could use while it waits for room: with 8,
#: two workers of different sizes gave the small tasks' tenant 10% less than its
#: dominant share; with 32, within 2% (the keyed DRF example in docs/resources.md).
PATIENCE = 32
#: Tasks at most taken out of the fair order to wait for room.
LOOKAHEAD = 8


def worker_capacity(
    capacity: Mapping[str, float], queue_concurrency: Mapping[str, int], slots: int
) -> dict[str, float]:
    """The worker's whole capacity: ``fair_capacity``, its pool slots, and each limited
    queue's own resource."""
    whole = parse_capacity(dict(capacity), slots=slots)
    for queue, count in queue_concurrency.items():
        whole[queue_resource(queue)] = float(count)
    return whole


class Demands:
    """What each request holds: its header, else its task's attribute, else one slot;
    plus its queue's own resource.  Bad declarations found here are reasons to park."""

    def __init__(self, queue_concurrency: Mapping[str, int]) -> None:
        self.limited = frozenset(queue_concurrency)

    def of(self, queue: str, request: Any) -> tuple[dict[str, float], str | None]:
        """``(demand, error)``: ``error`` says why the declaration cannot be read."""
        declared = compat.request_headers(request).get(RESOURCES_HEADER)
        setting = f"{RESOURCES_HEADER} header"
        if declared is None:
            declared = getattr(getattr(request, "task", None), "fair_resources", None)
            setting = "fair_resources attribute"
        try:
            demand = demand_of(
                None if declared is None else parse_demand(declared, setting=setting)
            )
        except FairConfigError as exc:
            return demand_of(None), str(exc)
        if queue in self.limited:
            demand[queue_resource(queue)] = 1.0
        return demand, None


@dataclass(frozen=True)
class CapacityStatistics:
    """``inspect fair_stats`` ``resources``: what the worker holds against its capacity."""

    capacity: Mapping[str, float]
    held: Mapping[str, float]
    running: int
    #: Tasks taken in fair order that wait for room, and the one reserved.
    waiting_for_room: int
    reserved: str | None
    parked: int
    repaired: int
    #: Every worker's capacity summed, as read from the broker (empty: not read).
    cluster: Mapping[str, float]

    def as_dict(self) -> dict[str, object]:
        return {
            "capacity": dict(self.capacity),
            "cluster": dict(self.cluster),
            "held": {name: round(self.held.get(name, 0.0), 6) for name in self.capacity},
            "running": self.running,
            "waiting_for_room": self.waiting_for_room,
            "reserved": self.reserved,
            "parked": self.parked,
            "repaired": self.repaired,
        }


def _ident(request: Any) -> object:
    """A request's key in the ledger: the request object (see :class:`~.dispatch.Holders`)."""
    return Holders.key(request)


class ResourceGate:
    """Tasks go to the pool when what they hold fits what is free, in fair order.

    ``pool_size()`` is the pool's processes now (None: unknown, the
    concurrency is kept); ``park(request, reason)`` keeps a task that can
    never fit on the broker; ``direct`` says whether the pool takes tasks
    with no wait of its own (every pool but prefork).
    """

    def __init__(
        self,
        service: SchedulingService,
        capacity: Mapping[str, float],
        demands: Demands,
        *,
        pool_size: Callable[[], int | None],
        park: Callable[[Any, str], None],
        direct: bool,
        patience: int = PATIENCE,
        lookahead: int | None = None,
    ) -> None:
        self.service = service
        self.ledger = Ledger(dict(capacity))
        self.demands = demands
        self.admission = Admission(patience)
        self.lookahead = max(1, LOOKAHEAD if lookahead is None else lookahead)
        self.pool_size = pool_size
        self.park_request = park
        self.direct = direct
        self.slots = max(1, int(capacity.get(SLOTS, 1)))
        #: Taken from the fair order, waiting for room: (ident, demand, queue, entry).
        self.aside: list[tuple[object, dict[str, float], str, tuple[Any, Any]]] = []
        #: The queue of each running task (for the dominant shares each queue holds).
        self._running_queue: dict[object, str] = {}
        self._holders = Holders()
        self._lock = service.lock
        # CoDel is asked as a task starts, not as it is taken: its sojourn then
        # includes the wait for room (RFC 8289 measures at dequeue).
        self._admit = admission(service, gate_request, stale=False)
        self._closed = False
        self._pumping = False
        self._again = False
        self._parked = 0
        self._repaired = 0
        #: Every worker's capacity summed (:mod:`.cluster`); empty until read.
        self.cluster: dict[str, float] = {}
        #: Tasks running as each task starts, averaged: how many fit at once.
        self._at_once = Ewma(alpha=0.05)

    # -- what the other parts read ---------------------------------------------

    @property
    def free(self) -> int:
        """Pool slots not held (the watchdog and the event loop read it)."""
        return int(self.ledger.free(SLOTS) + 1e-9)

    @property
    def capacity(self) -> Mapping[str, float]:
        return self.ledger.capacity

    def waiting(self) -> list[Any]:
        """The requests taken in fair order that wait for room."""
        with self._lock:
            return [entry[1] for _, _, _, entry in self.aside]

    def cost(self, request: Any, queue: str) -> float:
        """A request's dominant cost (``fair_cost="dominant"``): its share of every
        worker's capacity (:meth:`set_cluster`; this worker's until known), in pool slots."""
        return dominant_cost(self.holding(request, queue), self.cluster or self.ledger.capacity)

    def holding(self, request: Any, queue: str) -> Resources:
        """What ``request`` holds, or will hold once it starts (read once, as it starts)."""
        held = self.ledger.running.get(_ident(request))
        return held if held is not None else self.demands.of(queue, request)[0]

    def set_cluster(self, capacity: Resources) -> None:
        """What every worker can hold together (read from the broker)."""
        self.cluster = dict(capacity)

    # -- the flow --------------------------------------------------------------

    def submit(self, run: Callable[[Any], Any], request: Any) -> None:
        """Buffer ``request`` in fair order and start what fits."""
        with self._lock:
            buffer_task(self.service, (request,), (run, request))
        self.pump()

    def finished(self, request: Any) -> None:
        """``request`` no longer holds anything here (finished, revoked, lost)."""
        with self._lock:
            released = self.ledger.release(_ident(request))
            self._running_queue.pop(_ident(request), None)
            self._holders.release(Holders.key(request))
        if released:
            self.pump()

    def release(self) -> None:
        """Compatibility with the slot gate's interface: look for room."""
        self.pump()

    def close(self) -> None:
        self._closed = True

    def open(self) -> None:
        self._closed = False
        self.pump()

    def pump(self) -> None:
        """Start, in fair order, every task that fits.

        One thread pumps at a time; a call while another pumps (a task ended
        in a pool thread) makes that one look again before it stops, so room
        freed meanwhile is never left unused.
        """
        with self._lock:
            if self._closed:
                return
            if self._pumping:
                self._again = True
                return
            self._pumping = True
        try:
            while True:
                with self._lock:
                    self._again = False
                self._start_what_fits()
                with self._lock:
                    if not self._again or self._closed:
                        self._pumping = False
                        return
        except BaseException:
            with self._lock:
                self._pumping = False
            raise

    def _start_what_fits(self) -> None:
        drained = False
        while True:
            with self._lock:
                self._resize()
                reserved = self.admission.reserved is not None
                hidden = not drained and not reserved and self._hidden()
                chosen = None if hidden else self._choose()
                full = reserved or (not hidden and self._waiting_for_room() >= self.lookahead)
            if chosen is not None:
                run, request = chosen
                if not self._stale(request):
                    self._fit_window()
                    run(request)
                continue
            if full:
                return
            taken = self._admit()
            if taken is None:
                if hidden:  # what was buffered went back: choose among what is aside
                    drained = True
                    continue
                return
            queue, entry = taken
            request = entry[1]
            demand, error = self.demands.of(queue, request)
            reason = error or unfit_reason(demand, self.ledger.capacity)
            if reason is not None:
                self._park(request, reason)
                continue
            with self._lock:
                self.aside.append((_ident(request), demand, queue, entry))

    def _waiting_for_room(self) -> int:
        """Under the lock: the tasks aside that wait for room, not for their queue's limit.

        A queue at its ``fair_queue_concurrency`` must not fill the look-ahead
        and hold up the other queues' tasks behind it (the fetch polls such a
        queue last, which bounds how many of its tasks wait here).
        """
        ledger = self.ledger
        return sum(
            1
            for _, demand, _, _ in self.aside
            if not any(
                name.startswith(QUEUE_RESOURCE) and ledger.free(name) < amount - 1e-9
                for name, amount in demand.items()
            )
        )

    def _hidden(self) -> bool:
        """Under the lock: whether a queue has tasks in the buffer and none aside.

        Then the gate takes before it chooses, beyond the look-ahead if need be:
        every queue with tasks here has one among those the gate chooses from, and
        tasks of one queue that wait for room never hide another queue's that would
        fit.  This adds to the look-ahead at most what one round of the DWRR serves
        before it reaches every queue.  On RabbitMQ one queue's window can arrive
        before the others' and fill the look-ahead with tasks that do not fit.
        """
        counts = self.service.scheduler.dispatch.counts()
        if not any(counts.values()):
            return False
        aside = {queue for _, _, queue, _ in self.aside}
        return any(n and queue not in aside for queue, n in counts.items())

    def _fit_window(self) -> None:
        """A task starts: the tasks running now, averaged, are what fits at once, and the
        prefetch window follows (:meth:`~.windows.PrefetchWindows.fit_to_running`)."""
        with self._lock:
            at_once = self._at_once.update(len(self.ledger.running))
        self.service.prefetch.fit_to_running(at_once)

    def _stale(self, request: Any) -> bool:
        """CoDel on: whether ``request`` went back to the broker instead of starting."""
        shedder = self.service.shedder
        if shedder is None:
            return False
        with self._lock:
            backlog = len(self.aside) + len(self.service.scheduler.dispatch)
        verdict = shedder.check(request, backlog)
        if verdict is None:
            if not backlog:
                shedder.empty()
            return False
        if not shedder.send_back(request, verdict):
            return False  # running it beats losing it
        queue = self.service.queue_map.queue_of(request)
        with self._lock:
            self.ledger.release(_ident(request))
            self._running_queue.pop(_ident(request), None)
            self._holders.release(Holders.key(request))
            if queue is not None:
                self.service.scheduler.dispatch.refund(queue)
        return True

    def _choose(self) -> tuple[Any, Any] | None:
        """Under the lock: the entry to start now, held in the ledger, or None."""
        if not self.aside:
            return None
        order = self._fair_order()
        index = self.admission.choose(
            [(self.aside[i][0], self.aside[i][1]) for i in order], self.ledger
        )
        if index is None:
            return None
        ident, demand, queue, entry = self.aside.pop(order[index])
        self.ledger.hold(ident, demand)
        self._holders.hold(entry[1])
        self._running_queue[ident] = queue
        return entry

    def _fair_order(self) -> list[int]:
        """Under the lock: the indexes of the tasks aside, in the order they are tried.

        Under ``fair_cost="dominant"``, DRF's progressive filling: the queue whose
        running tasks hold the least dominant share of the worker, divided by its
        weight, first (Ghodsi et al., section 4); the order they were taken in
        among equals.  The order of the takes alone is stale: a queue's tasks taken
        while no other queue had any here would go first after the others' arrive,
        and hold more than its share until they had all run.  Otherwise, the order
        they were taken in.
        """
        order = list(range(len(self.aside)))
        if self.service.settings.cost != "dominant" or len(self.aside) < 2:
            return order
        held = self._held_shares()
        weight = self.service.scheduler.weight

        def share(index: int) -> float:
            queue = self.aside[index][2]
            return held.get(queue, 0.0) / weight(queue)

        return sorted(order, key=share)

    def _held_shares(self) -> dict[str, float]:
        """Under the lock: each queue's running tasks' dominant cost summed (:meth:`cost`)."""
        capacity = self.cluster or self.ledger.capacity
        held: dict[str, float] = {}
        for ident, demand in self.ledger.running.items():
            queue = self._running_queue.get(ident)
            if queue is not None:
                held[queue] = held.get(queue, 0.0) + dominant_cost(demand, capacity)
        return held

    def _resize(self) -> None:
        """Under the lock: the pool's size now is the ``slots`` capacity."""
        size = self.pool_size()
        if size is not None and size != self.slots:
            self.slots = size
            capacity = dict(self.ledger.capacity)
            capacity[SLOTS] = float(size)
            self.ledger.capacity = capacity

    def _park(self, request: Any, reason: str) -> None:
        self._parked += 1
        self.park_request(request, f"cannot start on this worker: {reason}")

    # -- repair ----------------------------------------------------------------

    def reconcile(self, counted: Iterable[Any]) -> int:
        """Celery counts ``counted`` (its reserved requests): whatever the ledger holds
        for a request not among them ended unseen, and is released.  Returns how many."""
        alive = {_ident(request) for request in counted}
        with self._lock:
            running = {i: d for i, d in self.ledger.running.items() if i in alive}
            lost = self.ledger.reset(running) if len(running) != len(self.ledger.running) else []
            for ident in lost:
                self._running_queue.pop(ident, None)
                self._holders.release(str(ident))
            self._repaired += len(lost)
        if lost:
            logger.warning(
                "celery-fair: resources: %d task(s) ended without their end being seen; what "
                "they held is free again",
                len(lost),
            )
            self.pump()
        return len(lost)

    def repair(self, free: int) -> int:
        """The watchdog found pool processes free while tasks wait: look again at what
        Celery counts (see :meth:`reconcile`)."""
        try:
            reserved, _, _ = compat.worker_requests()
        except RuntimeError:
            return 0
        return self.reconcile(reserved)

    def statistics(self) -> CapacityStatistics:
        with self._lock:
            reserved = self.admission.reserved
            return CapacityStatistics(
                capacity=dict(self.ledger.capacity),
                held=dict(self.ledger.held),
                running=len(self.ledger.running),
                waiting_for_room=len(self.aside),
                reserved=None if reserved is None else Holders.task_id(str(reserved)),
                parked=self._parked,
                repaired=self._repaired,
                cluster=dict(self.cluster),
            )

    # -- wiring ----------------------------------------------------------------

    def wrap(self, process: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Gate ``process`` (the worker's hand-over to the pool, or to prefork's semaphore)."""
        return holding_gate(process, self.submit, self.finished)


def check_declared(tasks: Mapping[str, Any], capacity: Resources) -> None:
    """At worker start: every registered task's ``fair_resources`` reads and can fit.

    Raises :class:`FairConfigError` naming the task, the value and why.
    """
    for name, task in sorted(tasks.items()):
        declared = getattr(task, "fair_resources", None)
        if declared is None:
            continue
        demand = parse_demand(declared, setting=f"fair_resources of task {name!r}")
        reason = unfit_reason(demand, capacity)
        if reason is not None:
            raise FairConfigError(
                f"fair_resources of task {name!r} ({declared!r}) can never start on this "
                f"worker: {reason} (fair_capacity={dict(capacity)!r})"
            )
