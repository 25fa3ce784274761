"""The fetch script's unacknowledged record, for every shape a payload may take.

The script reads a Kombu message's ``properties`` from the payload's tail
(lua/unacked.lua): these payloads check that any other layout falls back to
decoding the whole message and never records the wrong delivery tag.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis as redis_lib
from kombu import Connection, Exchange, Producer, Queue

from celery_fair.wire.replies import Malformed, Popped, decode_fetch
from tests.harness.scripts import fetch

pytestmark = pytest.mark.integration


def _fetch_one(client: Any, payload: str) -> Popped:
    client.lpush("plain", payload)
    reply = decode_fetch(fetch(client, "-", "plain"))
    assert isinstance(reply, Popped), reply
    return reply


def _record(client: Any, tag: str) -> list[Any]:
    raw = client.hget("unacked", tag)
    assert raw is not None, f"no unacked record for {tag!r}: {client.hkeys('unacked')}"
    assert client.zscore("unacked_index", tag) is not None
    record = json.loads(raw)
    assert isinstance(record, list)
    return record


def test_a_message_kombu_published_is_recorded_as_kombu_records_it(redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    with Connection(redis_url) as conn:
        queue = Queue("plain", Exchange("jobs"), routing_key="plain")
        Producer(conn.channel()).publish(
            {"n": 1}, exchange=queue.exchange, routing_key="plain", declare=[queue],
            headers={"properties": {"delivery_tag": "not-this-one"}},
        )  # fmt: skip
    payload = client.lindex("plain", 0).decode()
    tag = json.loads(payload)["properties"]["delivery_tag"]
    _fetch_one(client, client.rpop("plain").decode())
    # kombu.transport.redis QoS.append: [payload, exchange, routing key].
    assert _record(client, tag) == [json.loads(payload), "jobs", "plain"]
    assert client.hlen("unacked") == 1


def _message(tag: str, **extra: Any) -> dict[str, Any]:
    return {
        "body": "",
        "headers": {"n": 1},
        "properties": {
            "delivery_tag": tag,
            "delivery_info": {"exchange": "ex", "routing_key": "rk"},
        },
        **extra,
    }


@pytest.mark.parametrize(
    "shape",
    [
        "properties-first",
        "headers-last-with-properties",
        "headers-last-nested-deeper",
        "compact",
        "trailing-newline",
        "properties-twice-in-headers",
    ],
)
def test_any_other_layout_records_the_messages_own_tag(redis_url: str, shape: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    tag, decoy = str(uuid.uuid4()), str(uuid.uuid4())
    fake = {"delivery_tag": decoy, "delivery_info": {"exchange": "x", "routing_key": "y"}}
    msg = _message(tag)
    if shape == "properties-first":
        payload = json.dumps({"properties": msg["properties"], "body": "", "headers": {}})
    elif shape == "headers-last-with-properties":
        payload = json.dumps(
            {"body": "", "properties": msg["properties"], "headers": {"properties": fake}}
        )
    elif shape == "headers-last-nested-deeper":
        payload = json.dumps(
            {"body": "", "properties": msg["properties"], "headers": {"a": [{"properties": fake}]}}
        )
    elif shape == "compact":
        payload = json.dumps(msg, separators=(",", ":"))
    elif shape == "trailing-newline":
        payload = json.dumps(msg) + "\n"
    else:
        msg["headers"] = {"properties": fake, "x": {"properties": fake}}
        payload = json.dumps(msg)
    _fetch_one(client, payload)
    record = _record(client, tag)
    assert record[1:] == ["ex", "rk"], record
    assert client.hget("unacked", decoy) is None


def test_a_payload_that_is_no_kombu_message_is_parked(redis_url: str) -> None:
    client = redis_lib.Redis.from_url(redis_url)
    for payload in ('{"body": "", "properties": 5}', '{"properties": {"delivery_tag": 7}}'):
        client.lpush("plain", payload)
        assert isinstance(decode_fetch(fetch(client, "-", "plain")), Malformed)
    assert client.hlen("unacked") == 0
    assert client.llen("plain.fair-malformed") == 2
