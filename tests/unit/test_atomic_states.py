"""The atomic fetch's states, on a fake Kombu Redis channel: each transition, and a wrong one.

The real broker is in ``tests/integration/test_atomic_fetch.py``; here the
connection is a script of replies, so that every path through
:class:`~celery_fair.kombu.atomic.AtomicFetch`'s states can be driven.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from queue import Empty
from types import SimpleNamespace
from typing import Any

import pytest
from redis.exceptions import ResponseError

from celery_fair.kombu.atomic import TRANSITIONS, AtomicFetch, State

SEP = "\x06\x16"


class FakeConnection:
    """A redis-py connection whose replies are given in advance (an exception is raised)."""

    def __init__(self) -> None:
        self._sock: Any = object()
        self.sent: list[tuple[Any, ...]] = []
        self.replies: list[Any] = []

    def send_command(self, *args: Any) -> None:
        self.sent.append(args)
        if args[:2] == ("SCRIPT", "LOAD"):
            self.replies.insert(0, b"sha")

    def read_response(self) -> Any:
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    def can_read(self, timeout: float = 0) -> bool:
        return bool(self.replies)

    def disconnect(self) -> None:
        self._sock = None


class FakeQueueCycle:
    def __init__(self, queues: list[str]) -> None:
        self.queues = queues
        self.rotated: list[str] = []

    def consume(self, n: int) -> list[str]:
        return list(self.queues)

    def rotate(self, queue: str) -> None:
        self.rotated.append(queue)


class FakeTransport:
    def __init__(self) -> None:
        self.delivered: list[tuple[Any, str]] = []

    def _deliver(self, payload: Any, queue: str) -> None:
        self.delivered.append((payload, queue))


class FakeChannel:
    """The parts of a Kombu Redis channel the atomic fetch uses."""

    connection_errors = (ConnectionError,)

    def __init__(self, in_poll: bool = False) -> None:
        self.client = SimpleNamespace(connection=FakeConnection(), connection_pool=None)
        self._in_poll: Any = self.client.connection if in_poll else None
        self._queue_cycle = FakeQueueCycle(["a"])
        self.active_queues = {"a"}
        self.priority_steps = [0]
        self.sep = SEP
        self.unacked_key, self.unacked_index_key = "unacked", "unacked_index"
        self.brpop_timeout = 1
        self.connection = FakeTransport()

    def _q_for_pri(self, queue: str, pri: int) -> str:
        return f"{queue}{SEP}{pri}" if pri else queue

    @contextmanager
    def conn_or_acquire(self) -> Iterator[Any]:
        yield SimpleNamespace(global_keyprefix="", pipeline=lambda transaction: FakePipe())


class FakePipe:
    def __init__(self) -> None:
        self.pushed: list[str] = []

    def lpush(self, key: str, value: Any) -> FakePipe:
        self.pushed.append(key)
        return self

    def expire(self, key: str, seconds: int) -> FakePipe:
        return self

    def execute(self) -> list[Any]:
        return []


def full_keyed() -> Any:
    """Keyed serving whose only queue, ``a``, is at this worker's capacity."""
    return SimpleNamespace(
        queues={"a"},
        terms=SimpleNamespace(default_weight=1.0, level_weights=lambda steps: None),
        leases=SimpleNamespace(has_room=lambda queue: False),
        releases=SimpleNamespace(confirm=lambda: None),
        fetched_by=lambda fetch: None,
        flush_releases=lambda: None,
    )


def message(tag: str = "t1") -> list[bytes]:
    """A fetch script's reply with a message of queue ``a``."""
    payload = {"body": "", "headers": {}, "properties": {"delivery_tag": tag}}
    return [b"a", json.dumps(payload).encode()]


Moves = list[tuple[State, State]]


def fetch_on(channel: FakeChannel, moves: Moves, keyed: Any = None) -> AtomicFetch:
    """An atomic fetch of ``channel`` whose every move is recorded in ``moves``."""
    fetch = AtomicFetch(channel, SimpleNamespace(moved_aside=lambda queue: None), keyed)
    move = fetch._move

    def recorded(to: State, why: str) -> State:
        moves.append((fetch.state, to))
        return move(to, why)

    fetch._move = recorded  # type: ignore[method-assign]
    return fetch


def sent(channel: FakeChannel) -> list[Any]:
    return [command[0] for command in channel.client.connection.sent]


def answer(fetch: AtomicFetch, reply: Any) -> None:
    """``reply`` comes, and is read as one that delivers nothing."""
    fetch.channel.client.connection.replies.append(reply)
    with pytest.raises(Empty):
        fetch.read()


def gone_idle(channel: FakeChannel, moves: Moves) -> AtomicFetch:
    """An atomic fetch of ``channel`` whose first fetch found nothing."""
    fetch = fetch_on(channel, moves)
    fetch.start()
    answer(fetch, None)
    assert fetch.state is State.IDLE
    return fetch


# -- one scenario per path through the states (each takes some transitions) --


def fetch_then_deliver(moves: Moves) -> None:
    channel = FakeChannel()
    fetch = fetch_on(channel, moves)
    fetch.start()  # armed on the new connection, then the script
    assert fetch.state is State.FETCHING and sent(channel)[-1] == "EVALSHA"
    channel.client.connection.replies.append(message())
    assert fetch.read() is True
    assert fetch.state is State.READY and fetch.fetches == 1
    assert channel.connection.delivered[0][1] == "a" and channel._in_poll is None


def idle_wait_woken(moves: Moves) -> None:
    channel = FakeChannel()
    fetch = gone_idle(channel, moves)
    fetch.start()  # nothing there: the wait
    assert fetch.state is State.WAITING and sent(channel)[-1] == "BLPOP"
    answer(fetch, [b"wake", b"1"])
    assert fetch.state is State.READY and fetch.waits == 1


def full_worker_waits(moves: Moves) -> None:
    channel = FakeChannel()
    fetch = fetch_on(channel, moves, keyed=full_keyed())
    fetch.start()  # every queue at capacity: no fetch, a wait
    assert fetch.state is State.WAITING and "EVALSHA" not in sent(channel)


def kombu_brpop_left_in_flight(moves: Moves) -> None:
    channel = FakeChannel(in_poll=True)
    fetch = fetch_on(channel, moves)
    assert fetch.state is State.KOMBU_BRPOP
    payload = {"body": "", "properties": {"delivery_tag": "k"}}
    channel.client.connection.replies.append([b"a", json.dumps(payload).encode()])
    assert fetch.read() is True  # delivered as Kombu's own read would
    assert fetch.state is State.READY and channel.connection.delivered[0][0] == payload


def kombu_reply_while_ready(moves: Moves) -> None:
    fetch = fetch_on(FakeChannel(), moves)
    answer(fetch, None)  # a BRPOP of Kombu's timed out
    assert fetch.state is State.READY


def kombu_reply_while_idle(moves: Moves) -> None:
    fetch = gone_idle(FakeChannel(), moves)
    answer(fetch, None)
    assert moves[-2:] == [(State.IDLE, State.KOMBU_BRPOP), (State.KOMBU_BRPOP, State.READY)]


def rearmed_while_idle(moves: Moves) -> None:
    channel = FakeChannel()
    fetch = gone_idle(channel, moves)
    # A new connection: the wait starts over with a fetch.
    channel.client.connection._sock = object()
    fetch.start()
    assert (State.IDLE, State.READY) in moves and fetch.state is State.FETCHING


def connection_replaced_under_a_wait(moves: Moves) -> None:
    # Kombu's health check drops a connection whose reply is overdue; its poller
    # then sends again, on a new one: what was in flight went with the old one.
    channel = FakeChannel()
    fetch = fetch_on(channel, moves, keyed=full_keyed())
    fetch.start()
    assert fetch.state is State.WAITING
    channel.client.connection._sock = object()
    fetch.start()
    assert moves[-3:] == [
        (State.WAITING, State.READY),
        (State.READY, State.READY),
        (State.READY, State.WAITING),
    ]


def script_flushed(moves: Moves) -> None:
    fetch = fetch_on(FakeChannel(), moves)
    fetch.start()
    answer(fetch, ResponseError("NOSCRIPT No matching script"))
    assert fetch.state is State.READY and fetch._armed_sock is None


def connection_lost_under_a_fetch(moves: Moves) -> None:
    channel = FakeChannel()
    fetch = fetch_on(channel, moves)
    fetch.start()
    channel.client.connection.replies.append(ConnectionError("gone"))
    with pytest.raises(ConnectionError):
        fetch.read()
    assert fetch.state is State.READY and channel.client.connection._sock is None
    assert channel._in_poll is None


SCENARIOS: list[Callable[[Moves], None]] = [
    fetch_then_deliver,
    idle_wait_woken,
    full_worker_waits,
    kombu_brpop_left_in_flight,
    kombu_reply_while_ready,
    kombu_reply_while_idle,
    rearmed_while_idle,
    connection_replaced_under_a_wait,
    script_flushed,
    connection_lost_under_a_fetch,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_each_path_takes_allowed_transitions_only(
    scenario: Callable[[Moves], None], caplog: pytest.LogCaptureFixture
) -> None:
    moves: Moves = []
    scenario(moves)
    assert moves and all(to in TRANSITIONS[was] for was, to in moves), moves
    assert "never should" not in caplog.text


def test_every_allowed_transition_is_taken() -> None:
    moves: Moves = []
    for scenario in SCENARIOS:
        scenario(moves)
    allowed = {(was, to) for was, tos in TRANSITIONS.items() for to in tos}
    assert allowed - set(moves) == set()


def test_an_impossible_transition_is_logged_once_and_taken(
    caplog: pytest.LogCaptureFixture,
) -> None:
    channel = FakeChannel()
    fetch = fetch_on(channel, [])
    fetch.start()
    assert fetch.state is State.FETCHING
    # Kombu's poller sends again on the same connection, the script's reply due:
    # the worker's loop goes on (no exception), the state says what was sent.
    with caplog.at_level(logging.WARNING, logger="celery_fair.kombu.atomic"):
        fetch.start()
        assert fetch.state is State.FETCHING and sent(channel).count("EVALSHA") == 2
        fetch.start()
    warnings = [r for r in caplog.records if "never should" in r.getMessage()]
    assert len(warnings) == 1 and "FETCHING to FETCHING" in warnings[0].getMessage()
    assert warnings[0].levelno == logging.WARNING


@pytest.mark.parametrize(
    ("state", "follows"),
    [
        (State.READY, True),
        (State.FETCHING, True),
        (State.KOMBU_BRPOP, True),
        (State.IDLE, False),
        (State.WAITING, False),
    ],
)
def test_a_release_rides_on_a_fetch_only_when_one_follows(state: State, follows: bool) -> None:
    fetch = fetch_on(FakeChannel(), [])
    assert fetch.will_fetch() is False  # no fetch sent yet: no loop thread known
    fetch.start()
    fetch.state = state
    assert fetch.will_fetch() is follows
    elsewhere: list[bool] = []
    thread = threading.Thread(target=lambda: elsewhere.append(fetch.will_fetch()))
    thread.start()
    thread.join()
    assert elsewhere == [False]
    fetch.stopped = True
    assert fetch.will_fetch() is False


def test_a_full_worker_releasing_on_its_loop_sends_nothing() -> None:
    # Slots are freed on the loop's thread: the fetch after the next release carries it.
    channel = FakeChannel()
    fetch = fetch_on(channel, [], keyed=full_keyed())
    fetch.start()
    answer(fetch, None)  # the wait ended
    assert fetch.will_fetch() is True
    count = len(channel.client.connection.sent)
    fetch.start()
    assert fetch.state is State.READY and len(channel.client.connection.sent) == count


def test_one_wake_up_per_command_sent() -> None:
    channel = FakeChannel()
    fetch = fetch_on(channel, [])
    fetch.start()
    first, second = FakePipe(), FakePipe()
    fetch.wake(first)
    fetch.wake(second)  # the first ends the wait after this fetch already
    assert first.pushed == [fetch._wake_key] and second.pushed == [] and fetch.wakeups == 2
    answer(fetch, None)
    fetch.start()  # the wait: a wake-up must push again
    third = FakePipe()
    fetch.wake(third)
    assert third.pushed == [fetch._wake_key]


def test_the_alarm_rings_once_at_its_deadline_and_not_after_a_cancel() -> None:
    import threading
    import time as clock

    from celery_fair.kombu.wakeup import Alarm
    from celery_fair.testing import poll_until

    rang: list[float] = []
    done = threading.Event()

    def ring() -> None:
        rang.append(clock.monotonic())
        done.set()

    alarm = Alarm(ring)
    try:
        alarm.set(3600.0)
        alarm.cancel()  # replaced: the one below rings, this one never does
        set_at = clock.monotonic()
        alarm.set(0.05)
        assert done.wait(10), "the alarm rang"
        assert rang[0] - set_at >= 0.05
        # A second deadline rings again; the first rang once only.
        alarm.set(0.0)
        assert poll_until(lambda: len(rang) == 2, 10)
        assert alarm.rung == 2
    finally:
        alarm.close()
