"""The green pools on RabbitMQ: the DWRR dispatch decides the shares (issue #31, item 7).

A worker started with Celery's defaults on Celery 5.7 waited 100 ms on its
event connection at every turn of its loop and read about ten deliveries a
second; and eventlet's ``on_apply`` returns no greenlet, so celery-fair's gate
took every task as finished at once and eventlet's own pool ran them in
arrival order.  Either way the pool took each task as it arrived and the
dispatch order never chose: the shares were those of the windows and of the
broker's push.  The last tests check the two workarounds on fakes, without a
broker.
"""

from __future__ import annotations

import inspect
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from celery_fair import compat
from celery_fair.compat import Probe
from tests.harness.harness import run_backlogged

pytestmark = [pytest.mark.integration, pytest.mark.compat]

#: The DWRR article's ten queues and quanta.
QUANTA = {f"p{i}": 4 * (i + 1) for i in range(10)}
WEIGHT_ARG = ",".join(f"{q}={w}" for q, w in QUANTA.items())
WINDOW = 10


@pytest.mark.rabbitmq
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_green_pools_serve_the_article_quanta_from_equal_windows(
    rabbitmq_server: object, pool: str
) -> None:
    # Equal per-queue windows (fair_prefetch=10) take the windows out of the
    # shares: a queue's share can only come from the DWRR dispatch order, which
    # chooses only when deliveries are read ahead of the pool. Without it every
    # queue gets a tenth (p0 10% for 1.8%, p9 10% for 18.2%).
    #
    # Tolerance: consumption is counted at the broker (deliveries), which runs
    # ahead of the dispatch by at most a window per queue, and the harness
    # samples every 5 ms (a few tasks): (10 + 5) / 2,200 is 0.7 points of share
    # at each end of the interval; 1.5 points allowed, against the 8.2-point
    # error of flattened shares. 2,200 tasks are ten DWRR rounds of 220.
    result = run_backlogged(
        rabbitmq_server.url,  # type: ignore[attr-defined]
        dict.fromkeys(QUANTA, 800),
        target=2200,
        warmup=300,  # past the start, when every window fills at once (100)
        pool=pool,
        args=(100,),
        env={"CELERY_FAIR_PREFETCH": str(WINDOW)},
        extra_args=["--fair-weights", WEIGHT_ARG],
        timeout=150,
    )
    total = sum(QUANTA.values())
    shares = result.shares()
    for queue, quantum in QUANTA.items():
        assert shares[queue] == pytest.approx(quantum / total, abs=0.015), shares


# -- the workarounds, on fakes --------------------------------------------------------


class FakeEventConnection:
    """A Kombu connection as the event dispatcher holds it: its socket, its drains."""

    supports_heartbeats = True

    def __init__(self, sock: Any) -> None:
        self.connection = SimpleNamespace(sock=sock)
        self.drains: list[float | None] = []

    def drain_events(self, timeout: float | None = None) -> None:
        self.drains.append(timeout)


def _green_consumer(connection: Any) -> Any:
    return SimpleNamespace(
        hub=None,
        pool=SimpleNamespace(is_green=True),
        amqheartbeat=120,
        event_dispatcher=SimpleNamespace(connection=connection),
    )


@pytest.fixture
def socket_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, broker = socket.socketpair()
    with ours, broker:
        yield ours, broker


def test_the_event_connection_is_read_only_when_bytes_wait(
    socket_pair: tuple[socket.socket, socket.socket],
) -> None:
    from celery.worker import loops

    if "event_dispatcher" not in inspect.getsource(loops.synloop):
        pytest.skip("this Celery's loop does not drain the event connection (before 5.7)")
    ours, broker = socket_pair
    connection = FakeEventConnection(ours)
    consumer = _green_consumer(connection)
    assert compat.drain_events_without_wait(consumer, Probe())
    assert compat.drain_events_without_wait(consumer, Probe())  # once, not twice
    with pytest.raises(TimeoutError):
        connection.drain_events(timeout=0.1)  # as Celery's loop calls it: nothing there
    assert connection.drains == []
    broker.sendall(b"\x08\x00\x00\x00\x00\x00\x00\xce")  # a heartbeat frame
    connection.drain_events(timeout=0.1)
    assert connection.drains == [0]  # read, without waiting for more
    connection.drain_events()  # no timeout: Kombu's own, untouched
    assert connection.drains == [0, None]


def test_without_the_event_connections_socket_the_fallback_is_logged() -> None:
    from celery.worker import loops

    if "event_dispatcher" not in inspect.getsource(loops.synloop):
        pytest.skip("this Celery's loop does not drain the event connection (before 5.7)")
    logged: list[str] = []
    connection = FakeEventConnection(None)
    assert not compat.drain_events_without_wait(
        _green_consumer(connection), Probe(log=logged.append)
    )
    assert len(logged) == 1 and "100 ms" in logged[0]


class FakeEventletPool:
    """Celery's eventlet pool in outline: spawns with ``_quick_put``, returns nothing."""

    _quick_put: Any = None

    def on_start(self) -> None:
        self._quick_put = lambda *args, **kwargs: SimpleNamespace(args=args)

    def on_apply(self, target: Any, args: Any = None, **_: Any) -> None:
        self._quick_put(target, args)


FakeEventletPool.__module__ = "celery.concurrency.eventlet"


def test_eventlets_greenlet_is_taken_where_the_pool_spawns_it() -> None:
    pool = FakeEventletPool()
    taken = compat.green_spawns(pool, Probe())
    assert taken is not None
    pool.on_start()  # after the gate was installed, as the Pool bootstep does
    assert pool.on_apply("task", (1,)) is None
    greenlet = taken()
    assert greenlet is not None and greenlet.args == ("task", (1,))
    assert taken() is None


def test_an_eventlet_pool_that_spawns_otherwise_takes_the_fallback() -> None:
    class Elsewhere(FakeEventletPool):
        def on_apply(self, target: Any, args: Any = None, **_: Any) -> None:
            pass

    Elsewhere.__module__ = FakeEventletPool.__module__
    logged: list[str] = []
    assert compat.green_spawns(Elsewhere(), Probe(log=logged.append)) is None
    assert len(logged) == 1 and "arrival order" in logged[0]
