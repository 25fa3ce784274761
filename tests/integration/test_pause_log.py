"""The pause log on a real RabbitMQ: every reader agrees, a later one too; parked tasks go back."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
from kombu.connection import Connection
from kombu.entity import Queue

from celery_fair.keys.pause_events import PAUSE_LOG, PauseEvent, parked_lane
from celery_fair.keys.pause_log import MOVE_PER_READ, PauseLog
from tests.harness.harness import poll_until

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]


@pytest.fixture
def amqp_url(rabbitmq_server: Any) -> str:
    return str(rabbitmq_server.url)


@pytest.fixture
def queue() -> str:
    return f"paused-{uuid.uuid4().hex[:6]}"


def _log(url: str, queue: str) -> PauseLog:
    # Heartbeats off, as the worker's (see celery_fair.keys.pause_log).
    return PauseLog(lambda: Connection(url), {queue: Queue(queue, durable=True)})


def _count(url: str, name: str) -> int:
    with Connection(url) as conn:
        return int(conn.default_channel.queue_declare(name, passive=True).message_count)


def test_a_pause_reaches_every_reader_and_one_started_later(amqp_url: str, queue: str) -> None:
    one, two = _log(amqp_url, queue), _log(amqp_url, queue)
    try:
        assert one.read(catch_up=True) and two.read(catch_up=True)
        assert one.state.paused() == {} and two.state.paused() == {}
        assert one.append(queue, ["t1", "t2"], True) == 2
        assert one.append(queue, ["t1"], True) == 0  # already paused
        assert one.state.paused() == {queue: {"t1", "t2"}}  # at once, where it was written
        # The other reader sees it at a later read (live, without catching up again).
        assert poll_until(lambda: (two.read(), two.state.paused())[1] == {queue: {"t1", "t2"}}, 10)
        assert two.append(queue, ["t2"], False) == 1
        # A reader started now replays the log: t1 paused, t2 resumed.
        later = _log(amqp_url, queue)
        try:
            assert later.read(catch_up=True)
            assert later.state.paused() == {queue: {"t1"}}
        finally:
            later.close()
        # The parked lane of a paused key exists before any task is sent to it.
        assert _count(amqp_url, parked_lane(queue, "t1")) == 0
    finally:
        one.close()
        two.close()


def test_a_resume_moves_the_parked_tasks_back_in_order_in_bounded_steps(
    amqp_url: str, queue: str
) -> None:
    log = _log(amqp_url, queue)
    try:
        assert log.read(catch_up=True)
        log.append(queue, ["big"], True)
        parked = parked_lane(queue, "big")
        total = MOVE_PER_READ + 100
        with Connection(amqp_url) as conn:
            producer = conn.Producer()
            for i in range(total):
                producer.publish({"n": i}, exchange="", routing_key=parked,
                                 headers={"fair_key": "big"}, priority=3)  # fmt: skip
        assert _count(amqp_url, parked) == total
        log.append(queue, ["big"], False)
        target = log.destination(queue, "big")
        assert target.startswith(f"{queue}.fair.n")  # a noisy lane: not in front of a shard
        log.read()
        assert log.moved == MOVE_PER_READ  # one read moves a bounded step
        log.read()
        assert log.moved == total and _count(amqp_url, parked) == 0
        with Connection(amqp_url) as conn:
            got = []
            with conn.SimpleQueue(target, no_ack=True) as simple:  # type: ignore[no-untyped-call]
                for _ in range(total):
                    message = simple.get(timeout=5)
                    got.append(message.payload["n"])
                    assert message.headers["fair_key"] == "big"
                    assert message.properties["priority"] == 3
        assert got == list(range(total))  # in the order they were parked
    finally:
        log.close()


def test_a_resumed_keys_tasks_go_back_to_their_levels_lanes(amqp_url: str, queue: str) -> None:
    """A keyed queue with a maximum priority has lanes per level: a resumed key's
    parked tasks go back each to its own level's lane, not all into one."""
    log = PauseLog(
        lambda: Connection(amqp_url), {queue: Queue(queue, durable=True, max_priority=10)}
    )
    try:
        assert log.read(catch_up=True)
        log.append(queue, ["big"], True)
        parked = parked_lane(queue, "big")
        priorities = [0, 4, 9, 9, 7, 1]
        with Connection(amqp_url) as conn:
            producer = conn.Producer()
            for i, priority in enumerate(priorities):
                producer.publish({"n": i}, exchange="", routing_key=parked,
                                 headers={"fair_key": "big"}, priority=priority)  # fmt: skip
        log.append(queue, ["big"], False)
        log.read()
        assert log.moved == len(priorities) and _count(amqp_url, parked) == 0
        first = log.destination(queue, "big")
        by_level = {p: log.destination(queue, "big", p) for p in (4, 7, 9)}
        expected = {first: 2, by_level[4]: 1, by_level[7]: 1, by_level[9]: 2}
        assert len(expected) == 4
        assert log.destination(queue, "big", 9) == first.replace(".fair.", ".fair.pri9.")
        assert {lane: _count(amqp_url, lane) for lane in expected} == expected
    finally:
        log.close()


def test_a_malformed_entry_is_skipped_and_counted(amqp_url: str, queue: str) -> None:
    with Connection(amqp_url) as conn:
        # The stream exists once a log has opened it.
        log = _log(amqp_url, queue)
        try:
            assert log.read(catch_up=True)
            channel = conn.default_channel
            channel.basic_publish(
                channel.prepare_message(b"{not json"), exchange="", routing_key=PAUSE_LOG
            )
            event = PauseEvent(uuid.uuid4().hex, queue, ("k",), True, 1.0)
            conn.default_channel.basic_publish(
                conn.default_channel.prepare_message(event.to_body()), exchange="",
                routing_key=PAUSE_LOG,
            )  # fmt: skip
            assert poll_until(lambda: (log.read(), log.state.paused())[1] == {queue: {"k"}}, 10)
            assert log.state.malformed >= 1
        finally:
            log.close()


def test_a_log_not_read_to_its_end_in_time_is_read_on_at_the_next_reads(
    amqp_url: str, queue: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The first catch-up runs out of time (the injected clock jumps past it): the
    reader says so once, is not caught up, and reaches the end at the next read."""
    times = iter([0.0, 100.0])

    def clock() -> float:
        return next(times, 100.0)

    log = PauseLog(
        lambda: Connection(amqp_url), {queue: Queue(queue, durable=True)},
        clock=clock,
    )  # fmt: skip
    caplog.set_level(logging.WARNING, logger="celery_fair.keys.pause_log")
    try:
        assert not log.read(catch_up=False)
        assert "was not read to its end within 10 s" in caplog.text
        assert log.read() and log.caught_up
        assert caplog.text.count("was not read to its end") == 1
    finally:
        log.close()
