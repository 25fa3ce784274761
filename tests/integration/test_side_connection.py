"""The side connection of the limit tokens, backlog counters and pause log, on RabbitMQ."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest
from kombu.connection import Connection

from celery_fair.keys.side_connection import RETRY_AFTER, SideConnection
from tests.harness.clock import FakeClock
from tests.harness.redis import free_port

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]


@pytest.fixture
def amqp_url(rabbitmq_server: Any) -> str:
    return str(rabbitmq_server.url)


def test_heartbeats_are_off_whatever_the_connection_asked(amqp_url: str) -> None:
    # Celery's connections ask for broker_heartbeat (120 s); nothing reads this one
    # between calls, so the broker would close it.
    side = SideConnection(lambda: Connection(amqp_url, heartbeat=120), "test")
    try:
        side.channel("a")
        assert side.connection.heartbeat == 0
        assert side.connection.connection.heartbeat == 0  # as negotiated with the broker
    finally:
        side.close()


def test_a_refused_channel_is_replaced_and_reported_the_connection_kept(amqp_url: str) -> None:
    dropped: list[frozenset[str]] = []
    side = SideConnection(lambda: Connection(amqp_url), "test", on_drop=dropped.append)
    try:
        first, other = side.channel("a"), side.channel("b")
        assert side.channel("a") is first
        _, chan_errors = side.errors_of()
        with pytest.raises(chan_errors):
            first.queue_declare(f"missing-{uuid.uuid4().hex}", passive=True)  # 404
        side.refused("a")
        assert dropped == [frozenset({"a"})] and not side.has("a") and side.has("b")
        again = side.channel("a")
        assert again is not first and side.connections == 1
        again.queue_declare(f"q-{uuid.uuid4().hex}", auto_delete=True)  # it works
        other.queue_declare(f"q-{uuid.uuid4().hex}", auto_delete=True)  # untouched
        assert side.errors == 0
    finally:
        side.close()
    assert dropped == [frozenset({"a"})]  # a close is no loss to report


def test_a_broker_away_is_counted_and_not_tried_again_before_retry_after(amqp_url: str) -> None:
    port = free_port()  # nothing listens there
    urls = iter([f"amqp://guest:guest@127.0.0.1:{port}//", amqp_url])
    connects: list[str] = []

    def connect() -> Connection:
        connects.append(next(urls, amqp_url))
        return Connection(connects[-1], connect_timeout=2)

    clock = FakeClock(100.0)
    side = SideConnection(connect, "test", clock=clock)
    try:
        assert side.ready("a") is None and side.errors == 1 and len(connects) == 1
        clock.advance(RETRY_AFTER / 2)
        assert side.ready("a") is None and len(connects) == 1  # not tried again yet
        clock.advance(RETRY_AFTER)
        channel = side.ready("a")
        assert channel is not None and len(connects) == 2 and side.errors == 1
        assert side.ready("a") is channel
    finally:
        side.close()


def test_a_failure_drops_every_channel_and_the_next_call_reconnects(amqp_url: str) -> None:
    dropped: list[frozenset[str]] = []
    side = SideConnection(lambda: Connection(amqp_url), "test", on_drop=dropped.append)
    try:
        side.channel("a"), side.channel("b")
        side.failed(ConnectionResetError("gone"))
        assert dropped == [frozenset({"a", "b"})] and side.connection is None
        assert side.errors == 1
        side.channel("a").queue_declare(f"q-{uuid.uuid4().hex}", auto_delete=True)
        assert side.connections == 2
    finally:
        side.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_forgets_the_connection_without_closing_the_parents(amqp_url: str) -> None:
    side = SideConnection(lambda: Connection(amqp_url), "test")
    try:
        name = f"q-{uuid.uuid4().hex}"
        side.channel("a").queue_declare(name, exclusive=True)
        pid = os.fork()
        if pid == 0:  # the child: as a prefork pool process after the worker forked it
            forgot = side.connection is None and not side.has("a")
            os._exit(0 if forgot else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # The child closed its copy of the socket only: the parent's connection, and
        # its exclusive queue, are still there.
        declared = side.channel("a").queue_declare(name, passive=True)
        assert declared.queue == name and side.errors == 0
    finally:
        side.close()
