"""Limit tokens on a real RabbitMQ: minted once, held across refusals, back with a closed socket."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from kombu.connection import Connection

from celery_fair.keys.limits import CONCURRENCY, RATE
from celery_fair.keys.token_client import TokenClient
from celery_fair.keys.tokens import HeldToken, TokenSpec
from tests.harness.harness import poll_until

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]


@pytest.fixture
def amqp_url(rabbitmq_server: Any) -> str:
    return str(rabbitmq_server.url)


def _client(url: str) -> TokenClient:
    return TokenClient(lambda: Connection(url))


def _ready(url: str, name: str) -> int:
    with Connection(url) as conn:
        return int(conn.default_channel.queue_declare(name, passive=True).message_count)


def _spec(kind: str = CONCURRENCY, count: int = 3, period: float = 0.0) -> TokenSpec:
    return TokenSpec(f"q-{uuid.uuid4().hex[:6]}", "tenant", kind, count, period)


def _take(client: TokenClient, spec: TokenSpec, timeout: float = 10.0) -> HeldToken | None:
    """A token, once the client's minter has found (or minted) the set; None if none is
    free within ``timeout``."""
    found: list[HeldToken] = []

    def taken() -> bool:
        token = client.take(spec)
        if token is not None:
            found.append(token)
        return bool(found)

    poll_until(taken, timeout)
    return found[0] if found else None


def test_clients_racing_to_mint_make_one_set(amqp_url: str) -> None:
    spec = _spec(count=3)
    clients = [_client(amqp_url) for _ in range(4)]
    held: list[Any] = []
    barrier = threading.Barrier(len(clients))

    def take_all(client: TokenClient) -> None:
        barrier.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            token = client.take(spec)
            if token is not None:
                held.append(token)
            time.sleep(0.01)

    threads = [threading.Thread(target=take_all, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(held) == 3  # one set of 3, taken between them
    assert sum(c.mints for c in clients) == 1
    for c in clients:
        c.close()
    # Closed connections: the broker took every token back.
    assert poll_until(lambda: _ready(amqp_url, spec.name) == 3, 10)


def test_a_refused_check_keeps_the_tokens_held_and_give_back_returns_one(amqp_url: str) -> None:
    spec, other = _spec(count=1), _spec(count=1)
    client = _client(amqp_url)
    try:
        token = _take(client, spec)
        assert token is not None and client.take(spec) is None
        # A key seen for the first time: its marker is not found (RabbitMQ closes
        # the checking channel), and it is minted; the first token stays held.
        assert _take(client, other) is not None
        assert _ready(amqp_url, spec.name) == 0
        assert client.give_back(token) and _ready(amqp_url, spec.name) == 1
        assert client.take(spec) is not None  # known now: at once
    finally:
        client.close()


def test_a_spent_rate_token_comes_back_after_its_period(amqp_url: str) -> None:
    spec = _spec(RATE, count=2, period=0.3)
    client = _client(amqp_url)
    try:
        assert _take(client, spec) is not None and client.take(spec) is not None
        assert client.take(spec) is None  # both spent, waiting out the period
        # A spent token is not held: there is nothing to give back.
        assert not client.give_back(HeldToken(spec, 1, client.generation))
        assert poll_until(lambda: _ready(amqp_url, spec.name) == 2, 5)
    finally:
        client.close()


def test_after_a_lost_connection_old_tokens_are_not_given_back_twice(amqp_url: str) -> None:
    spec = _spec(count=1)
    client = _client(amqp_url)
    lost: list[int] = []
    client.on_lost = lost.append
    try:
        token = _take(client, spec)
        assert token is not None
        client.close()  # as a broker restart would: the token went back
        assert poll_until(lambda: _ready(amqp_url, spec.name) == 1, 10)
        again = _take(client, spec)
        assert again is not None and again.generation != token.generation
        assert not client.give_back(token)  # an old tag: not sent on the new channel
        assert _ready(amqp_url, spec.name) == 0
    finally:
        client.close()
