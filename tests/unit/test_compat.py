"""The start-up probes of :mod:`celery_fair.compat`, on fakes of the probed objects.

Each capability, found missing, either takes its documented fallback (one
log line, and the adapters stop using it) or raises CompatibilityError, a
FairConfigError that ``celery worker`` prints on one line at start.  The
version matrix (``make test-matrix``) runs the real versions.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from celery_fair import compat
from celery_fair.compat import CAPABILITIES, Probe
from celery_fair.errors import CompatibilityError, FairConfigError


class FakeTransport:
    driver_type = "redis"

    def _deliver(self, payload: Any, queue: str) -> None:
        self.delivered = (payload, queue)


class FakeQoS:
    def append(self, message: Any, tag: Any) -> None: ...
    def ack(self, tag: Any) -> None: ...
    def reject(self, tag: Any, requeue: bool = False) -> None: ...
    def can_consume(self) -> bool:
        return True

    def _remove_from_indices(self, tag: Any) -> Any: ...
    def restore_by_tag(self, tag: Any, client: Any = None, leftmost: bool = False) -> None: ...


class FakeConnection:
    _sock = None

    def can_read(self, timeout: float = 0) -> bool:
        return False


class FakeClient:
    connection = FakeConnection()
    connection_pool = type("Pool", (), {"connection_class": FakeConnection})()

    def parse_response(self, connection: Any, command_name: Any, **options: Any) -> Any:
        return ("q", b"item")


class FakeChannel:
    """Everything a Kombu 5.7 Redis channel offers to celery-fair."""

    def __init__(self) -> None:
        self._queue_cycle: Any = None
        self._in_poll: Any = False
        self.handlers: dict[str, Any] = {"BRPOP": None}
        self.client = FakeClient()
        self.priority_steps = [0]
        self.unacked_key, self.unacked_index_key = "unacked", "unacked_index"
        self.active_queues = {"a"}
        self.brpop_timeout = 1
        self.connection = FakeTransport()
        self.qos = FakeQoS()
        self.sep = "\x06\x16"
        self.keyprefix_queue = "_kombu.binding.%s"

    def _size(self, queue: str) -> int: ...
    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None: ...
    def _delete(self, queue: str, *args: Any) -> None: ...
    def _brpop_start(self, timeout: Any = None) -> None: ...
    def _brpop_read(self, **options: Any) -> None: ...
    def _q_for_pri(self, queue: str, pri: int) -> str:
        return queue

    def _get_message_priority(self, message: Any, reverse: bool = False) -> int:
        return 0

    def conn_or_acquire(self) -> Any: ...


def probe(channel: Any) -> tuple[Probe, list[str]]:
    logged: list[str] = []
    found = Probe(log=logged.append)
    compat.probe_redis_channel(channel, found)
    return found, logged


def test_a_complete_channel_has_every_capability() -> None:
    found, logged = probe(FakeChannel())
    assert found.missing == {} and logged == []


def test_kombu_before_5_6_has_no_brpop_timeout_and_falls_back_to_one_second() -> None:
    channel = FakeChannel()
    del channel.brpop_timeout
    found, logged = probe(channel)
    assert not found.has("kombu.redis.brpop_timeout")
    assert len(logged) == 1 and "Channel.brpop_timeout" in logged[0] and "1 s" in logged[0]
    assert compat.brpop_timeout(channel) == compat.KOMBU_BRPOP_TIMEOUT
    # Every other capability is still there: the atomic fetch stays on.
    assert found.has("kombu.redis.fetch_hooks")


@pytest.mark.parametrize("missing", ["_brpop_start", "unacked_index_key", "handlers"])
def test_missing_fetch_hooks_fall_back_to_kombus_brpop(missing: str) -> None:
    channel = FakeChannel()
    if missing in vars(channel):
        delattr(channel, missing)
    else:  # a method: an older class without it
        channel = type("Older", (FakeChannel,), {missing: property(_no_such)})()
    found, logged = probe(channel)
    assert not found.has("kombu.redis.fetch_hooks")
    assert "Kombu's own BRPOP fetch" in logged[0] and missing in logged[0]


def test_a_connection_that_cannot_tell_a_waiting_reply_falls_back_to_kombus_brpop() -> None:
    channel = FakeChannel()
    channel.client = FakeClient()
    channel.client.connection_pool = type("Pool", (), {"connection_class": object})()
    found, logged = probe(channel)
    assert not found.has("kombu.redis.fetch_hooks")
    assert "Connection.can_read(timeout)" in logged[0]


def _no_such(self: Any) -> Any:
    raise AttributeError("not in this version")


def test_a_changed_signature_counts_as_missing() -> None:
    class Renamed(FakeChannel):
        def _q_for_pri(self, name: str, level: int) -> str:  # type: ignore[override]
            return name

    found, logged = probe(Renamed())
    assert not found.has("kombu.redis.fetch_hooks")
    assert "_q_for_pri(queue, pri)" in logged[0]


def test_no_queue_cycle_stops_the_worker_naming_the_versions() -> None:
    channel = FakeChannel()
    del channel._queue_cycle
    with pytest.raises(CompatibilityError) as raised:
        probe(channel)
    message = str(raised.value)
    assert "celery " in message and "kombu " in message and "redis " in message
    assert "_queue_cycle" in message
    # A FairConfigError: `celery worker` prints it on one line and exits 1.
    assert isinstance(raised.value, FairConfigError)


def test_each_fallback_is_logged_once() -> None:
    logged: list[str] = []
    found = Probe(log=logged.append)
    for _ in range(3):
        found.missing_capability("kombu.redis.requeue_front", "Channel._get_message_priority")
    assert len(logged) == 1


def test_every_capability_says_what_it_is_for() -> None:
    for capability in CAPABILITIES.values():
        assert capability.needed_for
        assert capability.fallback is None or len(capability.fallback) > 10


def test_qos_hooks_are_required() -> None:
    class NoCanConsume(FakeQoS):
        can_consume = None  # type: ignore[assignment]

    with pytest.raises(CompatibilityError, match="can_consume"):
        compat.probe_virtual_qos(NoCanConsume(), Probe(log=lambda _: None))


class FakePool:
    def on_apply(self, *args: Any, **kwargs: Any) -> None: ...


class FakeWorker:
    def __init__(self, semaphore: Any) -> None:
        # What the Pool bootstep sets before the pool exists.
        self.pool_cls: Any = FakePool
        self.concurrency = self.min_concurrency = self.max_concurrency = 2
        self.semaphore = semaphore
        self.pool = FakePool()
        self.process_task = self._process_task_sem

    def _process_task(self, request: Any) -> None: ...
    def _process_task_sem(self, request: Any) -> None: ...


class FakeSemaphore:
    def __init__(self) -> None:
        self._waiting: deque[Any] = deque()

    def _add_waiter(self, entry: Any) -> None: ...
    def _pop_waiter(self) -> Any: ...


def test_a_semaphore_without_its_waiter_hooks_stops_the_worker() -> None:
    semaphore = FakeSemaphore()
    compat.probe_worker(FakeWorker(semaphore), Probe())  # complete: no error
    del semaphore._waiting
    with pytest.raises(CompatibilityError, match="_waiting"):
        compat.probe_worker(FakeWorker(semaphore), Probe())


def test_a_pool_without_on_apply_stops_the_worker() -> None:
    worker = FakeWorker(FakeSemaphore())
    worker.pool = object()
    with pytest.raises(CompatibilityError, match=r"missing \(WorkController\.pool\.on_apply\)"):
        compat.probe_worker(worker, Probe())


def test_a_worker_without_its_pool_settings_counts_concurrency_and_says_so() -> None:
    worker = FakeWorker(FakeSemaphore())
    del worker.pool_cls
    logged: list[str] = []
    probe = Probe(log=logged.append)
    compat.probe_worker(worker, probe)
    assert not probe.has("celery.worker.pool_slots")
    assert "WorkController.pool_cls" in logged[-1] and "--concurrency" in logged[-1]
    assert compat.pool_slots(worker) == 2  # its concurrency
    complete = Probe(log=logged.append)
    compat.probe_worker(FakeWorker(FakeSemaphore()), complete)
    assert complete.has("celery.worker.pool_slots")


class FakeAmqpChannel:
    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> str:
        return f"consumed {queue}"

    def basic_qos(self, *args: Any) -> None: ...
    def basic_ack(self, delivery_tag: Any) -> str:
        return f"acked {delivery_tag}"

    def basic_reject(self, delivery_tag: Any, requeue: bool) -> None: ...


def test_amqp_consume_hooks_are_probed_and_wrapped() -> None:
    channel, calls = FakeAmqpChannel(), []
    compat.probe_amqp_channel(channel, None, Probe(), settlements=True)  # complete
    compat.wrap_basic_consume(channel, lambda queue, kwargs: calls.append(("before", queue)))
    compat.follow_settlements(channel, lambda tag: calls.append(("settled", tag)))
    assert channel.basic_consume("q") == "consumed q"
    assert channel.basic_ack(7) == "acked 7"
    assert calls == [("before", "q"), ("settled", 7)]
    del FakeAmqpChannel.basic_reject
    with pytest.raises(CompatibilityError, match=r"missing \(Channel\.basic_reject\)"):
        compat.probe_amqp_channel(FakeAmqpChannel(), None, Probe(), settlements=True)
    # Fixed windows follow no settlement: basic_reject is not needed then.
    compat.probe_amqp_channel(FakeAmqpChannel(), None, Probe(), settlements=False)


def test_prefork_waits_in_the_semaphore_other_pools_dispatch_directly() -> None:
    worker = FakeWorker(FakeSemaphore())
    assert not compat.dispatches_directly(worker)
    worker.process_task = worker._process_task
    assert compat.dispatches_directly(worker)


@pytest.mark.parametrize(
    ("pool", "autoscale", "slots"),
    [
        ("prefork", None, 4),
        ("prefork", "8,2", 8),
        ("threads", None, 4),
        ("threads", "8,2", 2),  # its executor never grows past the minimum
        ("solo", None, 1),  # whatever --concurrency says
        ("solo", "8,2", 1),
        ("gevent", None, 4),
        ("gevent", "8,2", 8),
        ("eventlet", "8,2", 8),
    ],
)
def test_pool_slots_are_the_most_tasks_the_pool_runs_at_once(
    pool: str, autoscale: str | None, slots: int
) -> None:
    from types import SimpleNamespace

    from celery.concurrency import get_implementation
    from celery.worker.components import Pool

    worker = SimpleNamespace(concurrency=4, optimization=None, pool_cls=get_implementation(pool))
    Pool(worker, autoscale=autoscale)  # sets the worker's min and max concurrency, as Celery does
    assert compat.pool_slots(worker) == slots


class FakeConsumerConnection:
    def __init__(self, spec: bool) -> None:
        self.qos_semantics_matches_spec = spec
        self.transport = FakeTransport()


class FakeConsumer:
    def __init__(self, spec: bool) -> None:
        self.connection = FakeConsumerConnection(spec)
        self.app = type("App", (), {"conf": {}})()


def test_celery_before_5_7_global_qos_is_derived_as_celery_does() -> None:
    # RabbitMQ does not follow the spec's per-consumer semantics: global.
    assert compat.consumer_qos_global(FakeConsumer(spec=False)) is True
    assert compat.consumer_qos_global(FakeConsumer(spec=True)) is False
    recorded = FakeConsumer(spec=False)
    recorded.qos_global = False  # type: ignore[attr-defined]  # Celery 5.7 records it
    assert compat.consumer_qos_global(recorded) is False


def test_pool_completion_is_followed_for_futures_greenlets_and_inline_pools() -> None:
    done: list[str] = []

    class Future:
        def add_done_callback(self, fn: Any) -> None:
            self.fn = fn

    class Result:
        f = Future()

    class Greenlet:
        def link(self, fn: Any) -> None:
            self.fn = fn

    result, greenlet = Result(), Greenlet()
    compat.on_pool_done(result, lambda: done.append("thread"))
    compat.on_pool_done(greenlet, lambda: done.append("green"))
    compat.on_pool_done(None, lambda: done.append("inline"))
    assert done == ["inline"]  # the others finish later
    result.f.fn(result.f)
    greenlet.fn(greenlet)
    assert done == ["inline", "thread", "green"]


class _SynloopConsumer:
    """Celery < 5.7's consumer, as far as acknowledgements go: deferred without a hub."""

    hub = None

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def call_soon(self, callback: Any, *args: Any) -> None:
        self.pending.append((callback, args))

    def create_task_handler(self) -> Any:
        call_soon = self.call_soon

        def on_task_received(ack: Any) -> None:
            call_soon(ack, "done")

        return on_task_received


def test_green_pools_on_older_celery_acknowledge_at_once() -> None:
    consumer = _SynloopConsumer()
    assert compat.backport_immediate_acks(consumer, compat.Probe())
    acked: list[str] = []
    handler = consumer.create_task_handler()
    handler(acked.append)
    assert acked == ["done"] and consumer.pending == []
    # Other users of call_soon (remote control) still defer.
    consumer.call_soon(acked.append, "later")
    assert consumer.pending and acked == ["done"]
    # Installed once, however often the consumer restarts.
    assert compat.backport_immediate_acks(consumer, compat.Probe())
    consumer.create_task_handler()(acked.append)
    assert acked == ["done", "done"]


def test_immediate_acks_are_left_to_an_event_loop_or_to_celery_5_7() -> None:
    with_hub = _SynloopConsumer()
    with_hub.hub = object()  # type: ignore[assignment]
    assert not compat.backport_immediate_acks(with_hub, compat.Probe())

    class Celery57(_SynloopConsumer):
        def call_soon_ack(self, callback: Any, *args: Any) -> None:
            callback(*args)

    assert not compat.backport_immediate_acks(Celery57(), compat.Probe())
    from celery.worker.consumer.consumer import Consumer

    real = Consumer.__new__(Consumer)
    real.hub = None
    probe = compat.Probe(log=lambda line: None)
    installed = compat.backport_immediate_acks(real, probe)
    # This Celery either acks at once itself (5.7) or reads call_soon in create_task_handler.
    assert installed == (not hasattr(Consumer, "call_soon_ack")) and probe.missing == {}


def test_a_handler_that_reads_no_call_soon_is_reported() -> None:
    class Other(_SynloopConsumer):
        def create_task_handler(self) -> Any:
            return lambda ack: None

    probe = compat.Probe(log=lambda line: None)
    assert not compat.backport_immediate_acks(Other(), probe)
    assert "celery.consumer.immediate_acks" in probe.missing


def test_a_hard_timeout_is_followed_after_celery_handled_it() -> None:
    calls: list[str] = []

    class Request:
        def on_timeout(self, soft: bool, timeout: float) -> None:
            calls.append(f"celery soft={soft}")

    request = Request()
    compat.on_hard_timeout(request, lambda: calls.append("recorded"))
    request.on_timeout(True, 1.0)  # soft: Celery only warns, the task runs on
    request.on_timeout(False, 2.0)
    assert calls == ["celery soft=True", "celery soft=False", "recorded"]


def test_hard_timeouts_are_followed_only_where_celery_sends_no_task_failure() -> None:
    from celery.worker.request import Request

    probe = Probe(log=lambda line: None)
    sends = "task_failure" in Request.on_timeout.__code__.co_names  # Celery >= 5.7
    assert compat.can_follow_hard_timeouts(probe) is not sends
    assert probe.missing == {}


class _PoolLike:
    """A redis-py pool's public parts, as :func:`compat.plain_connection` reads them."""

    def __init__(self, connection_class: type) -> None:
        self.connection_class = connection_class
        self.connection_kwargs = {"host": "127.0.0.1", "port": 6379, "db": 0}


def test_a_listener_connection_is_never_of_kombus_class_that_tells_its_poller() -> None:
    import redis

    disconnects: list[Any] = []

    class KombuAsyncConnection(redis.Connection):  # as Kombu's _connparams defines it
        def disconnect(self, *args: Any) -> None:
            super().disconnect(*args)
            disconnects.append(self)  # Kombu < 5.7: takes its poll off the loop

    KombuAsyncConnection.__module__ = "kombu.transport.redis"
    conn = compat.plain_connection(_PoolLike(KombuAsyncConnection))
    assert type(conn) is redis.Connection
    conn.disconnect()
    assert disconnects == []

    class UserConnection(redis.Connection):  # a user's own class is kept
        pass

    assert type(compat.plain_connection(_PoolLike(UserConnection))) is UserConnection


def test_prefork_before_celery_5_6_3_forgets_the_tasks_running_at_a_connection_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import celery

    prefork = type("TaskPool", (), {"__module__": "celery.concurrency.prefork"})()
    threads = type("TaskPool", (), {"__module__": "celery.concurrency.thread"})()
    monkeypatch.setattr(celery, "VERSION", (5, 3, 6, "", ""))
    assert compat.pool_forgets_running_tasks(prefork)
    assert not compat.pool_forgets_running_tasks(threads)
    monkeypatch.setattr(celery, "VERSION", (5, 6, 3, "", ""))
    assert not compat.pool_forgets_running_tasks(prefork)


def test_a_pools_size_before_it_started_is_its_limit() -> None:
    from celery_fair.compat import pool_processes

    class GreenPoolNotStarted:
        """Celery 5.3's gevent pool: ``num_processes`` is ``len(self._pool)``, None before
        the pool starts."""

        limit = 4
        _pool = None

        @property
        def num_processes(self) -> int:
            return len(self._pool)  # type: ignore[arg-type]

    assert pool_processes(GreenPoolNotStarted()) == 4
    assert pool_processes(object()) is None


def _prefork_pool(asyn_cls: type) -> Any:
    """A started prefork ``TaskPool`` as far as :func:`compat.follow_process_exits`
    reads it (no process forked)."""
    from celery.concurrency import prefork

    pool = object.__new__(prefork.TaskPool)
    pool._pool = object.__new__(asyn_cls)
    return pool


def test_process_exits_are_followed_on_the_installed_celerys_pool() -> None:
    from celery.concurrency.asynpool import AsynPool

    probe = Probe(log=lambda line: None)
    pool = _prefork_pool(AsynPool)
    assert compat.follow_process_exits(pool, probe)
    wrapped = pool._pool._event_process_exit
    assert compat.follow_process_exits(pool, probe)  # once: a consumer restart keeps it
    assert pool._pool._event_process_exit is wrapped and probe.missing == {}


def test_a_pool_that_tracks_exits_otherwise_keeps_celerys_maintenance() -> None:
    from celery.concurrency.asynpool import AsynPool

    class Elsewhere(AsynPool):  # type: ignore[misc]
        def _track_child_process(self, proc: Any, hub: Any) -> None:
            hub.add_reader(proc.sentinel, self.maintain_pool)

    lines: list[str] = []
    probe = Probe(log=lines.append)
    assert not compat.follow_process_exits(_prefork_pool(Elsewhere), probe)
    assert "celery.pool.process_exits" in probe.missing and len(lines) == 1
    assert not compat.follow_process_exits(object(), probe)  # other pools: nothing to follow


def test_a_shrink_spares_the_process_a_job_is_on_its_way_to() -> None:
    """billiard's ``shrink`` counts a process idle until it acknowledges its job, and
    terminates it as the job starts (celery#2587); celery-fair counts it busy."""
    from billiard.pool import ApplyResult
    from celery import Celery
    from celery.concurrency.prefork import TaskPool

    app = Celery("shrink", set_as_current=False)
    # Celery's process_initializer (the pool's) takes the app and the node name.
    pool = TaskPool(limit=2, initargs=(app, "shrink@test"))
    pool.start()
    try:
        asyn = pool._pool
        # Without an event loop the pool is billiard's own; Celery's AsynPool adds
        # the set of processes not up yet.
        asyn._waiting_to_start = set()
        probe = Probe(log=lambda line: None)
        assert compat.spare_processes_given_a_job(pool, probe) and probe.missing == {}
        assert compat.spare_processes_given_a_job(pool, probe)  # once: a restart keeps it
        first, second = list(asyn._pool)
        job = ApplyResult(asyn._cache, None)
        job._write_to = first  # written to ``first``, not acknowledged yet
        # billiard alone counts ``first`` idle, and would terminate it first.
        assert not type(asyn)._worker_active(asyn, first)
        assert asyn._worker_active(first) and not asyn._worker_active(second)
        asyn._waiting_to_start.add(second)  # not up yet: spared too
        assert asyn._worker_active(second)
        asyn._waiting_to_start.clear()
        asyn.shrink(1)
        second.join(10)
        assert second.exitcode is not None and first.is_alive()
        asyn._cache.pop(job._job)
    finally:
        pool.terminate()
    assert not compat.spare_processes_given_a_job(object(), probe)  # other pools


def test_a_pool_that_chooses_otherwise_shrinks_as_celery_does() -> None:
    from celery.concurrency.asynpool import AsynPool

    class Elsewhere(AsynPool):  # type: ignore[misc]
        def _iterinactive(self) -> Any:
            return iter(self._pool)

    lines: list[str] = []
    probe = Probe(log=lines.append)
    pool = _prefork_pool(Elsewhere)
    pool._pool._cache, pool._pool._waiting_to_start = {}, set()
    assert not compat.spare_processes_given_a_job(pool, probe)
    assert "celery.pool.shrink_spares" in probe.missing and len(lines) == 1
    assert "_iterinactive" in lines[0]
