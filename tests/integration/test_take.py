"""The window fill of FairConsumerMixin on a real Redis: many messages per round trip."""

from __future__ import annotations

import json

import pytest
import redis as redis_lib
from kombu import Connection, Exchange, Producer, Queue

from celery_fair.kombu.take import Take
from celery_fair.parked import NOT_A_MESSAGE, PARKING_SUFFIX

pytestmark = pytest.mark.integration

Q = "take-me"


def test_take_pops_in_kombus_order_records_each_and_parks_what_is_no_message(
    redis_url: str,
) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    with Connection(redis_url, transport_options={"queue_order_strategy": "priority"}) as conn:
        channel = conn.channel()
        queue = Queue(Q, Exchange(Q), Q, max_priority=9)(channel)
        queue.declare()
        producer = Producer(channel, exchange=queue.exchange, routing_key=Q)
        for i in range(4):
            producer.publish({"n": i})
        producer.publish({"n": "urgent"}, priority=9)  # Kombu's Redis: lower number first
        client.lpush(Q, "not json at all")
        channel.basic_qos(0, 10, False)
        take = Take(channel, Q, accept=["json"])
        first = take(3)
        assert [m.decode()["n"] for m in first] == [0, 1, 2]
        rest = take(10)  # the rest, then the priority list, short of the room asked
        assert [m.decode()["n"] for m in rest] == [3, "urgent"]
        parked = client.lrange(Q + PARKING_SUFFIX, 0, -1)
        assert len(parked) == 1 and json.loads(parked[0])["reason"] == NOT_A_MESSAGE
        # Recorded in the same step as the pop, as Kombu's unacked records ...
        tags = {m.delivery_tag for m in first + rest}
        assert {t.decode() for t in client.hkeys("unacked")} == tags
        assert {t.decode() for t in client.zrange("unacked_index", 0, -1)} == tags
        # ... and delivered to the channel's QoS: the window counts them, an ack clears them.
        assert channel.qos.can_consume_max_estimate() == 5
        for message in first + rest:
            message.ack()
        assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0
        assert channel.qos.can_consume_max_estimate() == 10
        assert take(4) == []
