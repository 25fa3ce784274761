"""The throw-away RabbitMQ broker: persistence across restarts, plugin enabled, loopback only."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import pytest
from kombu import Connection, Exchange, Queue

from tests.harness.rabbitmq import RabbitMQServer

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]


@pytest.fixture(scope="module")
def rabbitmq() -> Iterator[RabbitMQServer]:
    server = RabbitMQServer()
    try:
        server.start()
        yield server
    finally:
        server.close()


def _drain(url: str, queue: Queue, expected: int) -> list[object]:
    bodies: list[object] = []
    with Connection(url) as conn:
        bound = queue(conn.default_channel)
        for _ in range(expected + 1):
            msg = bound.get(no_ack=False)
            if msg is None:
                break
            bodies.append(msg.payload)
            msg.ack()
    return bodies


def test_listens_on_loopback_only(rabbitmq: RabbitMQServer) -> None:
    assert rabbitmq.url == f"amqp://guest:guest@127.0.0.1:{rabbitmq.port}//"
    assert len({rabbitmq.port, rabbitmq.dist_port, rabbitmq.epmd_port}) == 3
    result = rabbitmq.ctl("rabbitmq-diagnostics", "-q", "listeners")
    assert result.returncode == 0, result.stderr
    assert f"127.0.0.1, port: {rabbitmq.port}" in result.stdout
    assert f"127.0.0.1, port: {rabbitmq.dist_port}" in result.stdout
    assert "::" not in result.stdout and "0.0.0.0" not in result.stdout


def test_consistent_hash_exchange_plugin_is_enabled(rabbitmq: RabbitMQServer) -> None:
    name = f"test-chx-{uuid.uuid4().hex[:8]}"
    with Connection(rabbitmq.url) as conn:
        channel = conn.default_channel
        exchange = Exchange(name, type="x-consistent-hash", durable=False, auto_delete=True)
        exchange(channel).declare()
        queue = Queue(f"{name}-q", exchange=exchange, routing_key="10", auto_delete=True)
        queue(channel).declare()
        producer = conn.Producer(serializer="json")
        for i in range(20):
            producer.publish({"i": i}, exchange=exchange, routing_key=f"key-{i}")
    # With a single bound queue every message lands in it.
    assert len(_drain(rabbitmq.url, queue, 20)) == 20
    with Connection(rabbitmq.url) as conn:
        queue(conn.default_channel).delete()


@pytest.mark.parametrize("kill", [False, True], ids=["clean-restart", "kill-restart"])
def test_durable_queue_survives_restart(rabbitmq: RabbitMQServer, kill: bool) -> None:
    name = f"test-durable-{uuid.uuid4().hex[:8]}"
    exchange = Exchange(name, type="direct", durable=True)
    queue = Queue(name, exchange=exchange, routing_key=name, durable=True)
    port, dist_port = rabbitmq.port, rabbitmq.dist_port
    # confirm_publish: each publish waits for the broker's confirm, which RabbitMQ
    # sends once a persistent message is on disk, so a kill cannot lose it.
    with Connection(rabbitmq.url, transport_options={"confirm_publish": True}) as conn:
        channel = conn.default_channel
        queue(channel).declare()
        producer = conn.Producer(channel, serializer="json")
        for i in range(10):
            producer.publish(
                {"i": i}, exchange=exchange, routing_key=name, delivery_mode="persistent"
            )

    rabbitmq.restart(kill=kill)

    assert (rabbitmq.port, rabbitmq.dist_port) == (port, dist_port)
    assert _drain(rabbitmq.url, queue, 10) == [{"i": i} for i in range(10)]
    with Connection(rabbitmq.url) as conn:
        queue(conn.default_channel).delete()
        exchange(conn.default_channel).delete()


def test_stop_leaves_no_listener(rabbitmq: RabbitMQServer) -> None:
    rabbitmq.stop()
    try:
        for port in (rabbitmq.port, rabbitmq.dist_port, rabbitmq.epmd_port):
            with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), 1):
                pass
    finally:
        rabbitmq.start()
    assert rabbitmq.ping()
