"""Celery's worker: its dispatch, the pool's semaphore and a request's parts and timeouts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .probes import Probe, _lacks, _names_used


def probe_worker(worker: Any, probe: Probe) -> None:
    """Check the worker's dispatch hooks (after the Pool bootstep created them)."""
    from celery.worker.request import Request

    lacking = _lacks(worker, ("_process_task", "process_task"))
    lacking += [f"pool.{n}" for n in _lacks(getattr(worker, "pool", None), ("on_apply",))]
    lacking += [f"Request.{n}" for n in _lacks(Request, ("on_success", "on_failure"))]
    if lacking:
        probe.missing_capability(
            "celery.worker.process_task", "WorkController." + "/".join(lacking)
        )
    semaphore = getattr(worker, "semaphore", None)
    if semaphore is not None:
        lacking = _lacks(semaphore, ("_add_waiter", "_pop_waiter", "_waiting"))
        if lacking:
            probe.missing_capability(
                "celery.worker.semaphore", "LaxBoundedSemaphore." + "/".join(lacking)
            )
    from celery.worker import state

    lacking = _lacks(state, ("reserved_requests", "active_requests"))
    if pool_processes(getattr(worker, "pool", None)) is None:
        lacking.append("TaskPool.num_processes/limit")
    if lacking:
        probe.missing_capability("celery.worker.state_requests", "/".join(lacking))
    lacking = _lacks(worker, ("pool_cls", "concurrency", "min_concurrency", "max_concurrency"))
    if lacking:
        probe.missing_capability("celery.worker.pool_slots", "WorkController." + "/".join(lacking))
    if "__slots__" in vars(Request) and "_request_dict" not in Request.__slots__:
        probe.missing_capability("celery.request.headers", "Request._request_dict")


def dispatch_of(worker: Any) -> Callable[[Any], Any]:
    """The worker's pool dispatch (``_process_task``)."""
    process: Callable[[Any], Any] = worker._process_task
    return process


def set_dispatch(worker: Any, process: Callable[[Any], Any]) -> None:
    worker._process_task = process


def wrap_process_task(
    worker: Any, wrapper: Callable[[Callable[[Any], Any]], Callable[[Any], Any]]
) -> None:
    """Replace the worker's ``process_task`` (what the consumer calls per task) by
    ``wrapper(process_task)``; set before the consumer bootstep captures it."""
    worker.process_task = wrapper(worker.process_task)


def wrap_pool_apply(pool: Any, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace the pool's ``on_apply`` (its hand-over of one task) by ``wrapper(on_apply)``."""
    pool.on_apply = wrapper(pool.on_apply)


def request_callbacks(request: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A request's ``on_success`` and ``on_failure``, which the pool calls when it is done."""
    return request.on_success, request.on_failure


def set_request_callbacks(
    request: Any, on_success: Callable[..., Any], on_failure: Callable[..., Any]
) -> None:
    """Override ``request``'s completion callbacks on this instance only.

    A ``Request`` has a ``__dict__``, so instance attributes override its
    methods; :func:`reset_request_callbacks` drops them again.
    """
    request.on_success, request.on_failure = on_success, on_failure


def reset_request_callbacks(request: Any) -> None:
    """Drop the overrides of :func:`set_request_callbacks` (the methods are back)."""
    attrs = getattr(request, "__dict__", None)
    if attrs is not None:
        attrs.pop("on_success", None)
        attrs.pop("on_failure", None)


def dispatches_directly(worker: Any) -> bool:
    """Whether received tasks go straight to the pool, with no semaphore wait.

    True for threads, solo, gevent and eventlet; prefork's ``process_task`` is
    ``_process_task_sem``, which waits in the semaphore.
    """
    return getattr(worker.process_task, "__func__", None) is type(worker)._process_task


def install_waiters(
    semaphore: Any, add: Callable[[Any], None], pop: Callable[[], Any], waiting: Any
) -> None:
    """Replace a ``LaxBoundedSemaphore``'s FIFO of waiters (its counting stays)."""
    semaphore._add_waiter = add
    semaphore._pop_waiter = pop
    semaphore._waiting = waiting


def request_headers(request: Any) -> dict[str, Any]:
    """A worker request's header dict, which Celery hands to the pool as it is."""
    headers = getattr(request, "_request_dict", None)
    return headers if isinstance(headers, dict) else {}


def delivery_tag(request: Any) -> Any:
    """The delivery tag of a request's message (``Request.message``, public since 5.3)."""
    message = getattr(request, "message", None)
    return getattr(message, "delivery_tag", None)


#: The first Celery whose prefork pool reports the tasks that were running when
#: the broker connection was lost (celery#8541, fixed in 5.6.3).
POOL_REPORTS_RUNNING_FROM = (5, 6, 3)


def pool_forgets_running_tasks(pool: Any) -> bool:
    """Whether the pool never reports the finish of tasks running at a connection loss.

    Celery's prefork pool before 5.6.3: at every connection loss the consumer
    calls ``AsynPool.flush``, which clears the pool's job cache when no write
    is under way; the results that come afterwards find no job, and no
    request's ``on_success``/``on_failure`` runs (celery#8541).
    """
    if type(pool).__module__ != _PREFORK_POOL:
        return False
    from celery import VERSION

    return tuple(VERSION[:3]) < POOL_REPORTS_RUNNING_FROM


def worker_requests() -> tuple[list[Any], list[Any], list[Any]]:
    """This worker's tasks, from ``celery.worker.state``: those it reserved (received,
    not finished), those a pool process started, and every one it knows (with
    Celery >= 5.7 the ones waiting for an ETA too), copied.

    The sets are weak and, with ``-P threads``, changed by the pool's threads:
    a copy that meets a change raises RuntimeError (the caller looks again later).
    """
    from celery.worker import state

    known = list(state.requests.values()) if hasattr(state, "requests") else []
    return list(state.reserved_requests), list(state.active_requests), known


def request_counted(request: Any) -> bool:
    """Whether Celery still counts ``request`` as this worker's (received, not finished:
    ``celery.worker.state.reserved_requests``)."""
    from celery.worker import state

    return request in state.reserved_requests


def pool_processes(pool: Any) -> int | None:
    """How many tasks the pool runs at once now (prefork: its processes, which
    ``--autoscale`` grows and shrinks); None if the pool does not say."""
    for name in ("num_processes", "limit"):
        try:
            value = getattr(pool, name, None)
        except (AttributeError, TypeError):  # num_processes before the pool started
            value = None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def pool_pids(pool: Any) -> set[int] | None:
    """The pids of a prefork pool's processes now (its public ``info``), or None for
    other pools, whose tasks run in the worker's own process."""
    if type(pool).__module__ != _PREFORK_POOL:
        return None
    try:
        processes = pool.info.get("processes")
    except (AttributeError, TypeError):  # not started yet, or stopped
        return None
    if not isinstance(processes, list):
        return None
    return {pid for pid in processes if isinstance(pid, int)}


#: How often a prefork process whose exit was announced before it could be joined is
#: looked at again, and for how long at most (then the pool's own maintenance).
EXIT_LOOK_AGAIN = 0.01
EXIT_LOOK_FOR = 2.0


def follow_process_exits(pool: Any, probe: Probe) -> bool:
    """Replace a prefork process as soon as it can be joined, not at the next maintenance.

    Celery's ``AsynPool`` learns that a process exited when the process's
    sentinel (a pipe only the child holds open) becomes readable: it stops
    watching the sentinel and joins the exited processes, forking their
    replacements (``_event_process_exit``, then ``maintain_pool``).  The kernel
    closes the pipe while the child exits, a moment before the parent may reap
    it; an event loop that reads the sentinel in that moment joins nothing and
    no longer watches the process.  The replacement then waits for the pool's
    5 s maintenance timer, and when every process exits at once (their
    ``--max-tasks-per-child`` reached together) no task runs meanwhile
    (celery#9588).  Here such a process is looked at again every
    :data:`EXIT_LOOK_AGAIN` seconds until it can be joined.  Wraps the pool's
    ``_event_process_exit`` on this instance, which ``_track_child_process``
    reads for every process it watches; call before the pool joins the event
    loop.  False for other pools, or without those parts (the probe says so).
    """
    if type(pool).__module__ != _PREFORK_POOL:
        return False
    asyn = getattr(pool, "_pool", None)
    if asyn is None:  # not started
        return False
    original: Callable[[Any, Any], None] | None = getattr(asyn, "_event_process_exit", None)
    if getattr(original, "celery_fair_follows", False):
        return True
    lacking = _lacks(asyn, ("_event_process_exit", "maintain_pool", "_track_child_process"))
    track = getattr(getattr(type(asyn), "_track_child_process", None), "__code__", None)
    if not lacking and (track is None or "_event_process_exit" not in _names_used(track)):
        lacking.append("_track_child_process (self._event_process_exit)")
    if lacking or original is None:
        probe.missing_capability("celery.pool.process_exits", "AsynPool." + "/".join(lacking))
        return False
    original_exit, maintain = original, asyn.maintain_pool

    def look_again(hub: Any, proc: Any, left: int) -> None:
        if proc.exitcode is None and left > 0:  # exitcode reaps the process when it can
            hub.call_later(EXIT_LOOK_AGAIN, look_again, hub, proc, left - 1)
        else:
            maintain()

    def event_process_exit(hub: Any, proc: Any) -> None:
        original_exit(hub, proc)
        if proc.exitcode is None:
            hub.call_later(
                EXIT_LOOK_AGAIN, look_again, hub, proc, round(EXIT_LOOK_FOR / EXIT_LOOK_AGAIN)
            )

    event_process_exit.celery_fair_follows = True  # type: ignore[attr-defined]
    asyn._event_process_exit = event_process_exit
    return True


def spare_processes_given_a_job(pool: Any, probe: Probe) -> bool:
    """Keep ``--autoscale`` from terminating a prefork process a job is on its way to.

    When the autoscaler shrinks the pool, billiard's ``Pool.shrink`` terminates
    (SIGTERM) the processes ``_worker_active`` finds idle: those no pending job
    names (``job.worker_pids()``).  A job names its process only once the process
    has acknowledged it, and the event loop reads that acknowledgement later; a
    process the loop has just written a job to counts idle until then.  The shrink
    kills it as the job starts, and the task fails with ``WorkerLostError: Worker
    exited prematurely: signal 15 (SIGTERM)`` (celery#2587, billiard#323; in the
    churn soak, 1 or 2 tasks in about one run of five, plain Celery as well).  Here
    a process also counts busy while a pending job is being written or is to be
    written to it: ``AsynPool`` records that on the job (``_write_to``,
    ``_scheduled_for``) to recover the job if the process dies.  A process that
    has not reported itself up (``_waiting_to_start``) counts busy as well.
    Wraps the pool's ``_worker_active`` on this instance, which ``_iterinactive``
    (``shrink``'s choice) reads.  False for other pools, or without those parts
    (the probe says so).
    """
    if type(pool).__module__ != _PREFORK_POOL:
        return False
    asyn = getattr(pool, "_pool", None)
    if asyn is None:  # not started
        return False
    original: Callable[[Any], bool] | None = getattr(asyn, "_worker_active", None)
    if getattr(original, "celery_fair_spares", False):
        return True
    lacking = _lacks(asyn, ("_worker_active", "_iterinactive", "_cache", "_waiting_to_start"))
    choice = getattr(getattr(type(asyn), "_iterinactive", None), "__code__", None)
    if not lacking and (choice is None or "_worker_active" not in _names_used(choice)):
        lacking.append("_iterinactive (self._worker_active)")
    from billiard.pool import ApplyResult  # the prefork pool's, loaded with it

    if not lacking and _lacks(ApplyResult, ("_write_to", "_scheduled_for", "ready")):
        lacking.append("ApplyResult._write_to/_scheduled_for")
    if lacking or original is None:
        probe.missing_capability("celery.pool.shrink_spares", "AsynPool." + "/".join(lacking))
        return False
    acknowledged, cache, starting = original, asyn._cache, asyn._waiting_to_start

    def worker_active(worker: Any) -> bool:
        # A process not up yet is spared too: shrunk before its "up" message, it
        # trips Celery's check of processes that never came up, which stops the worker.
        if acknowledged(worker) or worker in starting:
            return True
        return any(
            worker in (job._write_to, job._scheduled_for) and not job.ready()
            for job in list(cache.values())
        )

    worker_active.celery_fair_spares = True  # type: ignore[attr-defined]
    asyn._worker_active = worker_active
    return True


def runs_inline(pool: Any) -> bool:
    """Whether the pool runs each task inside the delivery callback (``-P solo``)."""
    return type(pool).__module__ == _SOLO_POOL


_PREFORK_POOL = "celery.concurrency.prefork"
_SOLO_POOL = "celery.concurrency.solo"
_THREADS_POOL = "celery.concurrency.thread"


def pool_slots(worker: Any) -> int:
    """The most tasks the worker's pool runs at once, known before the pool is created.

    ``--autoscale`` lets prefork, gevent and eventlet grow to its maximum, so
    that is the count.  solo runs one task whatever ``--concurrency`` says
    (Celery keeps the option's value; the solo pool's ``limit`` is 1), and
    the threads pool's executor keeps the size it was made with, the
    ``--autoscale`` minimum (it has no ``grow``).
    """
    module = getattr(getattr(worker, "pool_cls", None), "__module__", None)
    if module == _SOLO_POOL:
        return 1
    most = "min_concurrency" if module == _THREADS_POOL else "max_concurrency"
    slots = getattr(worker, most, None) or getattr(worker, "concurrency", 1)
    return max(1, int(slots or 1))


def on_pool_done(result: Any, callback: Callable[[], None]) -> None:
    """Call ``callback()`` when the pool has finished the task of ``result``.

    ``result`` is what the pool's ``on_apply`` returned: a future (threads),
    a greenlet (gevent, eventlet: both have ``link``), or anything else when
    the task already ran inline (solo).
    """
    future = getattr(result, "f", None)
    if future is not None and hasattr(future, "add_done_callback"):
        future.add_done_callback(lambda _future: callback())
    elif callable(getattr(result, "link", None)):
        result.link(lambda *_args: callback())
    else:
        callback()


def green_spawns(pool: Any, probe: Probe) -> Callable[[], Any] | None:
    """The greenlet of each task, for a green pool whose ``on_apply`` returns none.

    Celery's eventlet pool (5.3 to 5.7) spawns each task with
    ``self._quick_put`` (``GreenPool.spawn``, set by ``on_start``) and its
    ``on_apply`` returns None, where the gevent pool's returns the greenlet.
    Given None, :func:`on_pool_done` can only take the task as finished at
    once: celery-fair's gate then passes every task on, eventlet's own pool
    makes them wait in arrival order, and the DWRR dispatch never chooses.

    ``_quick_put`` is followed on the pool instance, now if the pool has
    started, else when it starts.  Returns ``taken()``, which gives the
    greenlet spawned since its last call (None if none); returns None for
    other pools, and when ``on_apply`` does not spawn through ``_quick_put``
    (checked in its code: the fallback is logged once).
    """
    if type(pool).__module__ != "celery.concurrency.eventlet":
        return None
    code = getattr(getattr(type(pool), "on_apply", None), "__code__", None)
    if code is None or "_quick_put" not in _names_used(code) or not hasattr(pool, "_quick_put"):
        probe.missing_capability(
            "celery.pool.eventlet_spawn", "TaskPool.on_apply (self._quick_put)"
        )
        return None
    spawned: list[Any] = []

    def follow() -> None:
        put = pool._quick_put
        if put is None or getattr(put, "fair_follows", False):
            return

        def fair_quick_put(*args: Any, **kwargs: Any) -> Any:
            greenlet = put(*args, **kwargs)
            spawned.append(greenlet)
            return greenlet

        fair_quick_put.fair_follows = True  # type: ignore[attr-defined]
        pool._quick_put = fair_quick_put

    follow()
    on_start = pool.on_start

    def fair_on_start(*args: Any, **kwargs: Any) -> Any:
        result = on_start(*args, **kwargs)
        follow()
        return result

    pool.on_start = fair_on_start

    def taken() -> Any:
        return spawned.pop() if spawned else None

    return taken


def can_follow_hard_timeouts(probe: Probe) -> bool:
    """Whether :func:`on_hard_timeout` is needed and works with this Celery.

    Celery 5.7 sends ``task_failure`` for a task killed at its hard time
    limit; earlier releases only mark it failed in the result backend, so
    the telemetry follows each request's ``on_timeout`` (an instance
    attribute: ``execute_using_pool`` reads ``self.on_timeout`` per call).
    """
    from celery.worker.request import Request

    sends = getattr(Request.on_timeout, "__code__", None)
    if sends is not None and "task_failure" in sends.co_names:
        return False
    execute = getattr(Request.execute_using_pool, "__code__", None)
    if execute is None or "on_timeout" not in execute.co_names:
        probe.missing_capability(
            "celery.request.on_timeout", "Request.execute_using_pool (self.on_timeout)"
        )
        return False
    return True


def on_hard_timeout(request: Any, callback: Callable[[], None]) -> None:
    """Call ``callback()`` after Celery handled ``request``'s hard time limit."""
    original = request.on_timeout

    def on_timeout(soft: bool, timeout: float) -> Any:
        try:
            return original(soft, timeout)
        finally:
            if not soft:
                callback()

    request.on_timeout = on_timeout
