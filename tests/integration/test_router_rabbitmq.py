"""RabbitMQ native mode on the real ``x-consistent-hash`` plugin, compared with our router."""

from __future__ import annotations

import json
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator

import pytest
from celery import Celery
from kombu import Connection
from scipy import stats

from celery_fair.routing import (
    ConsistentHashRouter,
    HashRing,
    MissingRouteKeyError,
    declare_consistent_hash_exchange,
)
from tests.harness.rabbitmq import RabbitMQServer

pytestmark = [pytest.mark.integration, pytest.mark.rabbitmq]

WEIGHTS = {"q1": 1, "q2": 1, "q3": 2, "q4": 2}


@pytest.fixture(scope="module")
def rabbitmq() -> Iterator[RabbitMQServer]:
    with RabbitMQServer() as server:
        yield server


@pytest.fixture
def conn(rabbitmq: RabbitMQServer) -> Iterator[Connection]:
    with Connection(rabbitmq.url) as connection:
        connection.connect()
        yield connection


def unique(weights: dict[str, int]) -> tuple[str, dict[str, int]]:
    """A fresh exchange name and queue names, so tests sharing the broker do not collide."""
    tag = uuid.uuid4().hex[:8]
    return f"fair.hash.{tag}", {f"{name}.{tag}": w for name, w in weights.items()}


def random_keys(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"tenant-{rng.getrandbits(64):016x}" for _ in range(n)]


def publish(conn: Connection, exchange: str, keys: Iterable[str], *, on: str) -> int:
    producer = conn.Producer(serializer="json")
    count = 0
    for key in keys:
        if on == "header":
            producer.publish(
                {"k": key}, exchange=exchange, routing_key="", headers={"fair_key": key}
            )
        elif on == "message_id":
            producer.publish({"k": key}, exchange=exchange, routing_key="", message_id=key)
        else:
            producer.publish({"k": key}, exchange=exchange, routing_key=key)
        count += 1
    return count


def depths(conn: Connection, queues: Iterable[str], expected_total: int) -> dict[str, int]:
    """Queue depths, polled until every published message has been routed (or a deadline)."""
    channel = conn.default_channel
    deadline = time.monotonic() + 60
    while True:
        counts = {q: channel.queue_declare(queue=q, passive=True).message_count for q in queues}
        if sum(counts.values()) >= expected_total or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def drain(conn: Connection, queues: Iterable[str]) -> dict[str, list[str]]:
    """Every message's key, per queue (the header, the message id or the body)."""
    channel = conn.default_channel
    seen: dict[str, list[str]] = {}
    for queue in queues:
        keys = seen.setdefault(queue, [])
        while (message := channel.basic_get(queue=queue, no_ack=True)) is not None:
            headers = message.properties.get("application_headers") or {}
            keys.append(headers.get("fair_key") or json.loads(message.body)["k"])
    return seen


def key_to_queue(drained: dict[str, list[str]]) -> dict[str, str]:
    mapping: dict[str, set[str]] = {}
    for queue, keys in drained.items():
        for key in keys:
            mapping.setdefault(key, set()).add(queue)
    assert all(len(qs) == 1 for qs in mapping.values()), "a key reached two queues"
    return {key: next(iter(qs)) for key, qs in mapping.items()}


def test_declares_the_exchange_and_one_weighted_binding_per_queue(
    rabbitmq: RabbitMQServer, conn: Connection
) -> None:
    exchange, queues = unique({"t0": 10, "t1": 10, "t2": 20})
    topology = declare_consistent_hash_exchange(conn, exchange, queues, hash_header="fair_key")
    assert topology.bindings == queues
    listed = rabbitmq.ctl(
        "rabbitmqctl", "list_bindings", "source_name", "destination_name", "routing_key",
        "--formatter", "json",
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    bound = {b["destination_name"]: b["routing_key"] for b in json.loads(listed.stdout)
             if b["source_name"] == exchange}  # fmt: skip
    assert bound == {q: str(w) for q, w in queues.items()}
    exchanges = rabbitmq.ctl("rabbitmqctl", "list_exchanges", "name", "type", "arguments")
    line = next(ln for ln in exchanges.stdout.splitlines() if ln.startswith(exchange))
    assert "x-consistent-hash" in line and "fair_key" in line


def test_declaring_twice_is_idempotent(conn: Connection) -> None:
    exchange, queues = unique(WEIGHTS)
    first = declare_consistent_hash_exchange(conn.default_channel, exchange, queues)
    second = declare_consistent_hash_exchange(conn.default_channel, exchange, queues)
    assert first.bindings == second.bindings


def test_plugin_distribution_compared_with_our_router(conn: Connection) -> None:
    exchange, queues = unique(WEIGHTS)
    declare_consistent_hash_exchange(conn, exchange, queues, hash_header="fair_key")
    keys = random_keys(30_000, seed=5)
    sent = publish(conn, exchange, keys, on="header")
    plugin = depths(conn, queues, sent)
    # Our ring over the plain names (the tagged names change every run; the seeded keys don't).
    ring = HashRing(WEIGHTS)
    ours = Counter(ring.lookup(k) for k in keys)
    names = sorted(queues)
    total_weight = sum(queues.values())
    expected = [sent * queues[q] / total_weight for q in names]
    observed_plugin = [plugin[q] for q in names]
    observed_ours = [ours[q] for q in sorted(WEIGHTS)]
    p_plugin = stats.chisquare(observed_plugin, expected).pvalue
    p_ours = stats.chisquare(observed_ours, expected).pvalue
    print(f"\nshares of {sent} keys (weight share / plugin / router):")
    for q, mine, e in zip(names, observed_ours, expected, strict=True):
        print(f"  {q}: {e / sent:.4f} / {plugin[q] / sent:.4f} / {mine / sent:.4f}")
    print(f"  chi-square p: plugin {p_plugin:.3f}, router {p_ours:.3f}")
    assert sum(observed_plugin) == sent
    assert p_ours > 0.01
    for e, theirs, mine in zip(expected, observed_plugin, observed_ours, strict=True):
        share = e / sent
        band = 4.5 * math.sqrt(share * (1 - share) / sent) * sent  # binomial, p < 1e-5 outside
        assert abs(mine - e) < band
        assert abs(theirs - e) < band


def test_plugin_routes_one_message_id_to_one_queue(conn: Connection) -> None:
    exchange, queues = unique(WEIGHTS)
    declare_consistent_hash_exchange(conn, exchange, queues, hash_property="message_id")
    keys = random_keys(400, seed=9)
    sent = publish(conn, exchange, keys * 3, on="message_id")
    depths(conn, queues, sent)
    channel = conn.default_channel
    mapping: dict[str, set[str]] = {}
    for queue in queues:
        while (message := channel.basic_get(queue=queue, no_ack=True)) is not None:
            mapping.setdefault(message.properties["message_id"], set()).add(queue)
    assert len(mapping) == 400
    assert all(len(qs) == 1 for qs in mapping.values())


def test_removing_a_middle_queue_plugin_moves_others_keys_router_does_not(
    conn: Connection,
) -> None:
    exchange, queues = unique(WEIGHTS)
    declare_consistent_hash_exchange(conn, exchange, queues, hash_header="fair_key")
    keys = random_keys(3000, seed=13)
    depths(conn, queues, publish(conn, exchange, keys, on="header"))
    before = key_to_queue(drain(conn, queues))

    middle = sorted(queues)[1]
    conn.default_channel.queue_unbind(
        queue=middle, exchange=exchange, routing_key=str(queues[middle])
    )
    rest = [q for q in queues if q != middle]
    depths(conn, rest, publish(conn, exchange, keys, on="header"))
    after = key_to_queue(drain(conn, rest))

    ring = HashRing(queues)
    smaller = ring.without_queue(middle)
    plugin_moved = sum(before[k] != after[k] for k in keys) / len(keys)
    router_moved = sum(ring.lookup(k) != smaller.lookup(k) for k in keys) / len(keys)
    own_share = sum(before[k] == middle for k in keys) / len(keys)
    router_own = sum(ring.lookup(k) == middle for k in keys) / len(keys)
    print(f"\nremove {middle}: plugin moved {plugin_moved:.3f} (own share {own_share:.3f}); "
          f"router moved {router_moved:.3f} (own share {router_own:.3f})")  # fmt: skip
    assert router_moved == router_own
    # The plugin renumbers the buckets after the removed one: far more than its own keys move.
    assert plugin_moved > own_share * 1.5


def test_celery_router_in_exchange_mode_publishes_through_the_plugin(
    rabbitmq: RabbitMQServer, conn: Connection
) -> None:
    exchange, queues = unique({"t0": 10, "t1": 10, "t2": 20})
    declare_consistent_hash_exchange(conn, exchange, queues, hash_header="fair_key")
    router = ConsistentHashRouter(queues, key="tenant_id", exchange=exchange)
    app = Celery("router_native", broker=rabbitmq.url, set_as_current=False)
    app.conf.task_routes = (router,)

    @app.task(name="native.work", shared=False)
    def work(n: int, tenant_id: str | None = None) -> int:
        return n

    tenants = [f"tenant-{i}" for i in range(60)]
    for n in range(5):
        for tenant in tenants:
            work.apply_async((n,), {"tenant_id": tenant})
    with pytest.raises(MissingRouteKeyError, match="native.work"):
        work.delay(0)
    app.close()

    depths(conn, queues, 5 * len(tenants))
    mapping = key_to_queue(drain(conn, queues))
    assert set(mapping) == set(tenants)
    assert set(mapping.values()) == set(queues)


def test_exchange_arguments_are_validated(conn: Connection) -> None:
    with pytest.raises(ValueError, match="mutually exclusive"):
        declare_consistent_hash_exchange(
            conn, "x", WEIGHTS, hash_header="h", hash_property="message_id"
        )
    with pytest.raises(ValueError, match="hash_property='user_id'"):
        declare_consistent_hash_exchange(conn, "x", WEIGHTS, hash_property="user_id")
    with pytest.raises(ValueError, match="'a'"):
        declare_consistent_hash_exchange(conn, "x", {"a": 1.5})
