"""The stall watchdog: the worker's count of free pool slots checked against the pool.

Celery and celery-fair count free slots by callbacks (the prefork
semaphore's releases, the gate's), and a callback can be lost.  Every
:data:`LOOK_EVERY` seconds, on the consumer's timer, the watchdog reads what
the pool really holds (Celery's reserved and started tasks, the pool's size,
which ``--autoscale`` moves) and hands it to a
:class:`~celery_fair.scheduling.stalls.StallWatch`.  A task that has waited
``fair_stall_after`` seconds while a process was free is logged once, with
what the worker knows, and counted (``inspect fair_stats`` ``stalls``,
``celery_fair_stalls_total``).  If it waits in celery-fair's buffer and
processes are free with nothing on its way to them, the count is repaired:
the lost slots are given back and the buffered tasks start.  A task the
pool has taken and not started (a child that never came up) cannot be
repaired from the worker's side; it is reported all the same.

A prefork task that Celery counts as running on a process that is gone
(killed as the task started, before the main process learnt which process
had it: billiard never reports it lost, and only its hard time limit ends
it) is reported too (place ``lost``), and its slot counted free.

Keyed queues with per-key limits have a count of their own: the tasks that
hold a key slot here, which stops the fetch at the pool's size.  If it stays
above the tasks of that queue the worker knows of while a process is free,
a release was lost; the count is set to what the worker holds and the fetch
woken (place ``leases``).  The lease on the broker expires by itself.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import compat
from ..scheduling.stalls import BUFFER, LEASES, LOST, POOL, Stall, StallWatch
from .capacity import ResourceGate
from .dispatch import FairGate, buffered_requests, release_waiters
from .roles import SchedulingService

__all__ = ("LOOK_EVERY", "PoolWatchdog")

logger = logging.getLogger(__name__)

#: Seconds between two looks at the pool.
LOOK_EVERY = 1.0


class PoolWatchdog:
    """Looks at one worker's pool and repairs its free-slot count when it drifted."""

    def __init__(
        self,
        service: SchedulingService,
        watch: StallWatch,
        pool: Any,
        *,
        semaphore: Any = None,
        gate: FairGate | ResourceGate | None = None,
    ) -> None:
        self.service = service
        self.watch = watch
        self.pool = pool
        self.semaphore = semaphore
        self.gate = gate

    def look(self) -> list[Stall]:
        """One look: the stalls found now (each logged once), after any repair."""
        try:
            reserved, active, known = compat.worker_requests()
        except RuntimeError:  # changed by a pool thread while copied: look next time
            return []
        size = self.gate.slots if self.gate is not None else compat.pool_processes(self.pool)
        if size is None:
            return []
        buffered = {id(r) for r in buffered_requests(self.service, gated=self.gate is not None)}
        started = {id(r) for r in active}
        if isinstance(self.gate, ResourceGate):
            # Resources: tasks wait for room while pool processes are free by design.
            # The books are set to what Celery counts; while anything runs, what waits
            # in the buffer or for room is not a stall (it starts when room is freed).
            self.gate.reconcile(reserved)
            aside = {id(r) for r in self.gate.waiting()}
            if self.gate.ledger.running:
                started |= buffered | aside
            else:
                buffered |= aside
        tokens = self.service.tokens
        if tokens is not None:
            # Per-key limits on RabbitMQ: a task aside waits for its key's tokens,
            # which tasks on other workers may hold; not a stall of this pool.
            started |= {id(r) for r in tokens.waiting()}
        waiting: dict[Any, str] = {}
        requests: dict[Any, Any] = {}
        for request in reserved:
            if id(request) in started:
                continue
            key = getattr(request, "id", None) or id(request)
            waiting[key] = BUFFER if id(request) in buffered else POOL
            requests[key] = request
        # Started on a process that is gone, yet never reported lost: it holds no
        # process, but Celery counts it running (and its slot busy) until its hard
        # time limit, or for ever without one.
        pids = compat.pool_pids(self.pool) if self.gate is None else None
        ghosts = [] if not pids else [r for r in active if _on_gone_process(r, pids)]
        for request in ghosts:
            key = getattr(request, "id", None) or id(request)
            waiting[key] = LOST
            requests[key] = request
        free = size - len(active) + len(ghosts)
        leases = self._lease_drift(reserved, known)
        waiting.update({(LEASES, queue): LEASES for queue in leases})
        stalls = self.watch.look(self.service.clock(), waiting, free, size)
        if not stalls:
            return stalls
        found = {stall.task: stall for stall in stalls}
        for queue, counts in leases.items():
            stall = found.get((LEASES, queue))
            if stall is not None:
                self._log_leases(stall, queue, counts, self._recount(queue, counts))
        stalls_of_tasks = [s for s in stalls if s.place != LEASES]
        # Processes free with no task on its way to them: slots the count lost.
        room = free - sum(1 for place in waiting.values() if place == POOL)
        given = 0
        if room > 0 and any(s.place == BUFFER for s in stalls_of_tasks):
            if self.gate is not None:
                given = self.gate.repair(room)
            elif self.semaphore is not None:
                given = release_waiters(self.semaphore, self.service, room)
            self.watch.repaired(given)
        for stall in stalls_of_tasks:
            self._log(stall, requests.get(stall.task), given, len(buffered))
        return stalls

    def _lease_drift(self, reserved: list[Any], known: list[Any]) -> dict[str, tuple[int, int]]:
        """Keyed queues with per-key limits whose count of tasks holding a key slot here
        is above what this worker holds, and that fetch nothing for it: ``queue ->
        (counted, held)``."""
        keyed = self.service.attachment.keyed
        if keyed is None or not keyed.limited:
            return {}
        held: dict[str, int] = {}
        seen: set[int] = set()
        for request in (*reserved, *known):
            if id(request) in seen:
                continue
            seen.add(id(request))
            queue = self.service.queue_map.queue_of(request)
            if queue in keyed.queues:
                held[queue] = held.get(queue, 0) + 1
        drift = {}
        for queue in keyed.queues:
            counted = keyed.leases.held(queue)
            if counted > held.get(queue, 0) and not keyed.leases.has_room(queue):
                drift[queue] = (counted, held.get(queue, 0))
        return drift

    def _recount(self, queue: str, counts: tuple[int, int]) -> int:
        keyed = self.service.attachment.keyed
        given = keyed.leases.recount(queue, counts[1]) if keyed is not None else 0
        self.watch.repaired(given)
        return given

    def _log_leases(self, stall: Stall, queue: str, counts: tuple[int, int], given: int) -> None:
        logger.warning(
            "celery-fair: stall: keyed queue %s: this worker counted %d task(s) holding key "
            "slots and holds %d, so it fetched none of %s for %.1f s while %d of %d pool "
            "process(es) were free; the count is repaired (%d slot(s) back)",
            queue, counts[0], counts[1], queue, stall.waited, stall.free, stall.size, given,
        )  # fmt: skip

    def _log(self, stall: Stall, request: Any, given: int, buffered: int) -> None:
        queue = self.service.queue_map.queue_of(request) if request is not None else None
        if stall.place == LOST:
            logger.warning(
                "celery-fair: stall: task %s (%s) of queue %s started on pool process %s, "
                "which is gone, and was never reported lost: Celery counts it running and "
                "its slot busy until its hard time limit (none: until the worker restarts); "
                "%d of %d pool process(es) free",
                stall.task, getattr(request, "name", "?"), queue,
                getattr(request, "worker_pid", "?"), stall.free, stall.size,
            )  # fmt: skip
            return
        if stall.place == BUFFER:
            outcome = (
                f"gave the pool back {given} slot(s) its count had lost"
                if given
                else "no slot to give back"
            )
        else:
            outcome = (
                "the pool took it and has not started it (a pool process that never came "
                "up?); it runs when the pool does"
            )
        logger.warning(
            "celery-fair: stall: task %s (%s) of queue %s waited %.1f s in the %s while "
            "%d of %d pool process(es) were free; %d task(s) in celery-fair's buffer; %s",
            stall.task, getattr(request, "name", "?"), queue, stall.waited,
            "worker's buffer" if stall.place == BUFFER else "pool", stall.free, stall.size,
            buffered, outcome,
        )  # fmt: skip


def _on_gone_process(request: Any, pids: set[int]) -> bool:
    pid = getattr(request, "worker_pid", None)
    return isinstance(pid, int) and pid not in pids
