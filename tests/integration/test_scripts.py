"""Each Lua script run by itself on a real ``redis-server``: order, limits, leases, restores.

The scripts (``celery_fair/lua``) are sent as :mod:`celery_fair.keys.scripts`
composes them; these tests call them directly, without Kombu or a worker, and
read the broker's state after each call.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import redis as redis_lib

from celery_fair.keys import scripts, store
from celery_fair.keys.layout import BUCKET, KeyedNames
from celery_fair.keys.store import enqueue_args, release_args
from celery_fair.parked import NOT_A_MESSAGE, decode_record
from celery_fair.wire.replies import Idle, KeyedMessage, Malformed, decode_fetch, decode_fetched
from tests.harness.scripts import (
    LEVELS,
    NAMES,
    SEP,
    Q,
    enqueue,
    fetch,
    fetched,
    message,
    served,
    served_levels,
)

pytestmark = [pytest.mark.integration, pytest.mark.compat]


@pytest.fixture
def client(redis_url: str) -> Iterator[redis_lib.Redis]:
    yield redis_lib.Redis.from_url(redis_url)


def test_enqueue_keeps_keys_apart_and_counts_them(client: redis_lib.Redis) -> None:
    for i in range(3):
        assert enqueue(client, "a", message("a", i)) == i + 1
    enqueue(client, "b", message("b"))
    assert client.llen(NAMES.key_list("a")) == 3 and client.llen(NAMES.key_list("b")) == 1
    assert int(client.hget(NAMES.state, "backlog")) == 4
    assert client.zrange(NAMES.sizes, 0, -1, withscores=True) == [(b"b", 1.0), (b"a", 3.0)]
    assert sorted(client.zrange(NAMES.active, 0, -1)) == [b"a", b"b"]


def test_the_fetch_serves_keys_in_weighted_fair_order_and_records_unacked(
    client: redis_lib.Redis,
) -> None:
    client.hset(NAMES.weights_conf, mapping={"b": "2"})
    for i in range(6):
        enqueue(client, "a", message("a", i))
        enqueue(client, "b", message("b", i))
    order = served(client, 9)
    # b weighs 2: two of b for each of a, from the start.
    assert order.count("b") == 6 and order.count("a") == 3
    assert all(order[i : i + 3].count("b") == 2 for i in range(0, 9, 3)), order
    # Each message is in the unacked hash and index, written with the pop.
    assert client.hlen("unacked") == 9 and client.zcard("unacked_index") == 9
    record = json.loads(next(iter(client.hvals("unacked"))))
    assert record[1:] == [Q, Q] and record[0]["properties"]["delivery_tag"]
    assert int(client.hget(NAMES.state, "backlog")) == 3
    assert client.zscore(NAMES.sizes, "a") == 3.0 and client.zscore(NAMES.sizes, "b") is None


def test_a_key_keeps_publish_order_and_a_restore_goes_first(client: redis_lib.Redis) -> None:
    for i in range(3):
        enqueue(client, "a", message("a", i))
    first = fetch(client)
    assert json.loads(first[1])["headers"]["n"] == 0
    enqueue(client, "a", first[1].decode(), front=True)  # restored: first in line again
    ns = [json.loads(fetch(client)[1])["headers"]["n"] for _ in range(3)]
    assert ns == [0, 1, 2]
    assert fetch(client) is None  # empty: nil, after reading the lengths


def test_unkeyed_messages_are_served_as_one_more_key(client: redis_lib.Redis) -> None:
    client.lpush(Q, message("", 0), message("", 1))  # a producer without celery-fair
    for i in range(2):
        enqueue(client, "a", message("a", i))
    order = served(client, 4)
    assert sorted(order) == ["", "", "a", "a"] and order[:2] in (["", "a"], ["a", ""])


def test_a_concurrency_limit_sets_a_key_aside_until_its_lease_is_released(
    client: redis_lib.Redis,
) -> None:
    client.hset(NAMES.limits_conf, "c:a", "1")
    for i in range(3):
        enqueue(client, "a", message("a", i))
        enqueue(client, "b", message("b", i))
    word = "L1:30"  # limited: a fetched task leases its key's slot for 30 s at most
    order = served(client, 4, word)
    assert order.count("a") == 1 and order.count("b") == 3  # a waits at its limit
    assert client.smembers(NAMES.at_limit) == {b"a"}
    assert client.hget(NAMES.running, "a") == b"1"
    tag = next(t for t, k in client.hgetall(NAMES.lease_keys).items() if k == b"a")
    # Nothing else to serve: the reply is when the lease would expire, in ms.
    due = fetch(client, word)
    assert isinstance(due, int) and 29_000 < due <= 30_001
    # The task finished: its slot is free, the key is back in line.
    assert scripts.RELEASE(client, *release_args(SEP, [(Q, tag.decode())])) == 1
    assert client.scard(NAMES.at_limit) == 0 and client.hget(NAMES.running, "a") is None
    assert served(client, 1, word) == ["a"]
    assert scripts.RELEASE(client, *release_args(SEP, [(Q, "no-such-tag")])) == 0


def test_a_keys_own_limit_comes_before_the_default_and_a_live_one_before_the_configured(
    client: redis_lib.Redis,
) -> None:
    # The order: the key's live limit, its configured one, the live "*", the configured "*".
    client.hset(NAMES.limits_conf, mapping={"c:a": "4", "c:b": "3", "c:*": "6"})
    client.hset(NAMES.limits_live, mapping={"c:a": "2", "c:*": "1"})
    client.hset(NAMES.limits_conf, "r:d", "2")  # d: the live "*" concurrency, its own rate
    for i in range(6):
        for key in ("a", "b", "c", "d"):
            enqueue(client, key, message(key, i))
    word = "L1:30"
    order = served(client, 7, word)
    assert isinstance(fetch(client, word), int)  # every key at its limit now
    assert {k: order.count(k) for k in "abcd"} == {"a": 2, "b": 3, "c": 1, "d": 1}
    assert client.smembers(NAMES.at_limit) == {b"a", b"b", b"c", b"d"}
    assert client.hget(f"{Q}{SEP}{BUCKET}d", "t") is not None  # its rate was read too


def test_a_release_carried_by_the_fetch_frees_the_slot_before_the_pop(
    client: redis_lib.Redis,
) -> None:
    """A finished task's release rides on the next fetch: its key is served in that call."""
    client.hset(NAMES.limits_conf, "c:a", "1")
    for i in range(3):
        enqueue(client, "a", message("a", i))
    word = "L1:30"
    assert served(client, 1, word) == ["a"]
    first = next(iter(client.hkeys(NAMES.lease_keys))).decode()
    assert client.hget(NAMES.lease_keys, first) == b"a"
    assert isinstance(fetch(client, word), int)  # a is at its limit: nothing served
    reply = fetched(client, word, releases=(Q, first, Q, "no-such-tag"))
    assert reply.fair_key == "a"  # freed in the same call, then served
    assert client.hget(NAMES.running, "a") == b"1"
    assert first.encode() not in client.hkeys(NAMES.lease_keys)


def test_an_expired_lease_frees_its_slot(client: redis_lib.Redis) -> None:
    client.hset(NAMES.limits_conf, "c:*", "1")
    for i in range(2):
        enqueue(client, "a", message("a", i))
    assert served(client, 1, "L1:0.2") == ["a"]
    reply = fetch(client, "L1:0.2")
    assert isinstance(reply, int) and 0 < reply <= 201  # ms until the lease expires
    time.sleep(0.3)  # the broker's clock must pass the lease (its expiry is the event)
    assert served(client, 1, "L1:0.2") == ["a"]


def test_a_rate_limit_puts_a_key_to_sleep_and_says_when_it_may_go_on(
    client: redis_lib.Redis,
) -> None:
    client.hset(NAMES.limits_conf, "r:a", "2")  # 2 per second, a burst of 2
    for i in range(5):
        enqueue(client, "a", message("a", i))
    assert served(client, 2, "L1:30") == ["a", "a"]
    due = fetch(client, "L1:30")
    assert isinstance(due, int) and 0 < due <= 501  # the next token, in ms
    assert client.zscore(NAMES.sleep, "a") is not None
    assert client.hexists(NAMES.throttled_since, "a")


def test_purge_deletes_every_keys_messages_the_keys_set_aside_included(
    client: redis_lib.Redis,
) -> None:
    for key in ("a", "b", "c"):
        for i in range(4):
            enqueue(client, key, message(key, i))
    client.zrem(NAMES.active, "b")
    client.sadd(NAMES.at_limit, "b")  # as the fetch sets a key aside at its limit
    deleted, visited = scripts.PURGE(client, Q, SEP, 1000)
    assert (deleted, visited) == (12, 3)
    assert int(client.hget(NAMES.state, "backlog")) == 0
    assert (
        client.zcard(NAMES.active) == client.scard(NAMES.at_limit) == client.zcard(NAMES.sizes) == 0
    )


def test_a_payload_that_is_not_a_message_is_parked_by_the_fetch(client: redis_lib.Redis) -> None:
    client.lpush("plain", "this is not json")
    reply = fetch(client, "-", "plain")
    assert decode_fetch(reply) == Malformed("plain", b"this is not json")
    parked = decode_record(client.lindex("plain.fair-malformed", 0), "plain")
    assert parked.reason == NOT_A_MESSAGE and parked.raw == "this is not json"
    assert client.hlen("unacked") == 0 and client.llen("plain") == 0


def test_runtime_charges_move_a_keys_tag(client: redis_lib.Redis) -> None:
    for i in range(2):
        enqueue(client, "slow", message("slow", i))
        enqueue(client, "fast", message("fast", i))
    before = client.zscore(NAMES.active, "slow")
    assert scripts.CHARGE(client, SEP, "1.0", Q, "", "slow", "", "5.0") == 1
    assert client.zscore(NAMES.active, "slow") == before + 5.0
    assert served(client, 2) == ["fast", "fast"]  # slow owes 5 units of cost


def test_unkey_moves_messages_to_kombus_lists_by_priority(client: redis_lib.Redis) -> None:
    plain = json.loads(message("a"))
    urgent = {**plain, "properties": {**plain["properties"], "priority": 5}}
    enqueue(client, "a", json.dumps(plain))
    enqueue(client, "a", json.dumps(urgent))
    enqueue(client, "b", message("b"))
    suffixes = ["" if p < 3 else f"{SEP}{3 * (p // 3)}" for p in range(10)]
    moved, left = scripts.UNKEY(client, Q, SEP, 1000, "", *suffixes)
    assert (moved, left) == (3, 0)
    assert client.llen(Q) == 2 and client.llen(f"{Q}{SEP}3") == 1
    assert client.hget(NAMES.state, "unkeyed") == b"1"
    # After the move, a keyed publish goes to the queue's own list.
    assert enqueue(client, "c", message("c")) == 0 and client.llen(Q) == 3


# -- priority levels --------------------------------------------------------------


def test_levels_are_served_strictly_in_order_and_keys_fairly_within_each(
    client: redis_lib.Redis,
) -> None:
    client.hset(NAMES.weights_conf, mapping={"b": "2"})
    for i in range(6):  # batch work in the last level, two keys weighted 1:2
        enqueue(client, "a", message("a", i), level=LEVELS[2])
        enqueue(client, "b", message("b", i), level=LEVELS[2])
    assert client.smembers(NAMES.levels) == {LEVELS[2].encode()}
    assert client.zcard(NAMES.active) == 0 and client.zcard(NAMES.level(LEVELS[2]).active) == 2
    assert int(client.hget(NAMES.state, "backlog")) == 12  # the queue's, every level
    first = served_levels(client, 3)
    assert [k for k, _ in first].count("b") == 2 and {lv for _, lv in first} == {LEVELS[2]}
    # Urgent work arrives in the first level (priority 0): served next, before the batch.
    enqueue(client, "u", message("u", 0))
    client.lpush(Q, message("", 1))  # and a plain producer's, at priority 0 too
    assert sorted(served_levels(client, 2)) == [("", ""), ("u", "")]
    rest = served(client, 9)
    assert rest.count("b") == 4 and rest.count("a") == 5  # b's 6 were done first, 2:1
    assert fetch(client) is None


def test_weighted_levels_share_the_fetches_by_weight(client: redis_lib.Redis) -> None:
    for i in range(60):
        enqueue(client, f"t{i % 3}", message(f"t{i % 3}", i))  # the first level
        enqueue(client, f"t{i % 3}", message(f"t{i % 3}", i), level=LEVELS[0])
    weights = {"": 4.0, LEVELS[0]: 1.0, LEVELS[1]: 1.0, LEVELS[2]: 1.0}
    levels = [lv for _, lv in served_levels(client, 50, level_weights=weights)]
    assert levels.count("") == 40 and levels.count(LEVELS[0]) == 10
    # Every window of five fetches holds one of the second level: shared, not in bursts.
    assert all(levels[i : i + 5].count(LEVELS[0]) == 1 for i in range(0, 50, 5)), levels


def test_a_restore_and_a_charge_go_back_to_the_level_the_task_came_from(
    client: redis_lib.Redis,
) -> None:
    for i in range(2):
        enqueue(client, "a", message("a", i), level=LEVELS[1])
        enqueue(client, "b", message("b", i), level=LEVELS[1])
    reply = fetched(client)
    key, level = reply.fair_key, reply.level
    assert level == LEVELS[1]
    other = "b" if key == "a" else "a"
    # Restored (a visibility timeout, a CoDel return): first in line in its own level.
    enqueue(client, key, reply.item.decode(), front=True, level=level)
    assert client.llen(NAMES.level(LEVELS[1]).key_list(key)) == 2
    assert client.exists(NAMES.key_list(key)) == 0
    # A run-time charge moves the key's tag in that level, not in the first.
    lv = NAMES.level(LEVELS[1])
    before = client.zscore(lv.active, key)
    fetch(client, "1", charges=(Q, level, key, "", "7.0"))  # served: the other key, tag lower
    assert client.zscore(lv.active, key) == before + 7.0
    assert client.zscore(NAMES.active, key) is None
    assert [k for k, _ in served_levels(client, 1)] == [other]


def test_a_key_at_its_limit_in_one_level_is_held_in_every_level(client: redis_lib.Redis) -> None:
    client.hset(NAMES.limits_conf, "c:a", "1")
    enqueue(client, "a", message("a", 0), level=LEVELS[2])
    enqueue(client, "a", message("a", 1))  # urgent, in the first level
    enqueue(client, "b", message("b", 0), level=LEVELS[2])
    word = "L1:30"
    assert served_levels(client, 1, word) == [("a", "")]
    # a's urgent task runs: its batch task waits, b's is served.
    assert served_levels(client, 1, word) == [("b", LEVELS[2])]
    assert isinstance(fetch(client, word), int)  # a is at its limit: nothing but a wait
    tag = next(iter(client.hkeys(NAMES.lease_keys))).decode()
    lease_key = client.hget(NAMES.lease_keys, tag)
    assert lease_key == b"a"
    scripts.RELEASE(client, *release_args(SEP, [(Q, tag)]))
    # Released: a rejoins the level it has messages in, and only that one.
    assert client.zscore(NAMES.level(LEVELS[2]).active, "a") is not None
    assert client.zscore(NAMES.active, "a") is None
    assert served_levels(client, 1, word) == [("a", LEVELS[2])]


def test_purge_and_unkey_cover_every_level(client: redis_lib.Redis) -> None:
    urgent = json.loads(message("a"))
    batch = {**urgent, "properties": {**urgent["properties"], "priority": 9}}
    enqueue(client, "a", json.dumps(urgent))
    enqueue(client, "a", json.dumps(batch), level=LEVELS[2])
    enqueue(client, "b", message("b"), level=LEVELS[2])
    suffixes = ["" if p < 3 else f"{SEP}{3 * (p // 3)}" for p in range(10)]
    moved, left = scripts.UNKEY(client, Q, SEP, 1000, "", *suffixes)
    assert (moved, left) == (3, 0)
    assert client.llen(Q) == 2 and client.llen(f"{Q}{SEP}9") == 1  # b has no priority: first
    assert client.zcard(NAMES.level(LEVELS[2]).active) == 0 and client.zcard(NAMES.sizes) == 0
    client.hdel(NAMES.state, "unkeyed")
    for i in range(3):
        enqueue(client, "c", message("c", i), level=LEVELS[i])
    assert scripts.PURGE(client, Q, SEP, 1000) == [3, 1]
    assert all(client.exists(NAMES.level(s).key_list("c")) == 0 for s in LEVELS)
    assert int(client.hget(NAMES.state, "backlog")) == 0


def test_levels_follow_the_transports_steps_and_separator(client: redis_lib.Redis) -> None:
    """Ten priority steps and another separator: the levels still go lowest step first."""
    sep = "::"
    names = KeyedNames(Q, sep)
    levels = [f"{sep}{p}" for p in range(1, 10)]
    for p in (9, 4, 0, 9, 4):
        level = "" if p == 0 else f"{sep}{p}"
        scripts.ENQUEUE(client, *enqueue_args(names, f"k{p}", message(f"k{p}"), level=level))
    order = []
    for _ in range(5):
        reply = client.eval(
            scripts.FETCH.text, 4, Q, Q + ".fair-malformed", "unacked", "unacked_index",
            *store.fetch_args(["1"], sep=sep, now=time.time(), suffixes=levels),
        )  # fmt: skip
        keyed = decode_fetch(reply)
        assert isinstance(keyed, KeyedMessage), keyed
        order.append(keyed.level)
    assert order == ["", f"{sep}4", f"{sep}4", f"{sep}9", f"{sep}9"]
    assert client.smembers(names.levels) == {f"{sep}4".encode(), f"{sep}9".encode()}


def test_the_backlog_counts_every_level_and_names_the_next_keys_in_order(
    client: redis_lib.Redis,
) -> None:
    from celery_fair.keys.store import backlog

    enqueue(client, "a", message("a"), level=LEVELS[2])
    enqueue(client, "b", message("b"), level=LEVELS[2])
    enqueue(client, "b", message("b"), level=LEVELS[2])
    enqueue(client, "u", message("u"))
    found = backlog(client, NAMES, top=5)
    assert (found.messages, found.keys, found.next_keys) == (4, 3, (("u", 1),))
    fetch(client)  # u, the first level: empty now
    found = backlog(client, NAMES, top=5)
    assert (found.messages, found.keys, found.next_keys) == (3, 2, (("a", 1), ("b", 2)))


def test_the_limits_state_counts_a_held_keys_messages_in_every_level(
    client: redis_lib.Redis,
) -> None:
    from celery_fair.keys.throttling import limits_state

    client.hset(NAMES.limits_conf, "c:a", "1")
    enqueue(client, "a", message("a", 0))
    enqueue(client, "a", message("a", 1))
    enqueue(client, "a", message("a", 2), level=LEVELS[2])
    assert served(client, 1, "L1:30") == ["a"]
    assert isinstance(fetch(client, "L1:30"), int)  # a is at its limit: set aside
    state = limits_state(client, NAMES)
    assert state.at_limit == 1 and state.throttled_tasks == 2  # one in each level


def _fill_three_keys(client: redis_lib.Redis, per_key: int) -> None:
    client.hset(NAMES.weights_conf, mapping={"b": "2", "c": "4"})
    for i in range(per_key):
        for key in ("a", "b", "c"):
            enqueue(client, key, message(key, i))


def test_a_batch_serves_the_same_keys_in_the_same_order_as_single_fetches(
    client: redis_lib.Redis,
) -> None:
    _fill_three_keys(client, 20)
    singles = [(r.fair_key, json.loads(r.item)["headers"]["n"]) for r in
               (fetched(client) for _ in range(28))]  # fmt: skip
    client.flushdb()
    _fill_three_keys(client, 20)
    batched: list[tuple[str, int]] = []
    for size in (7, 1, 13, 7):
        entries = decode_fetched(fetch(client, batch=size))
        assert isinstance(entries, tuple) and len(entries) == size
        batched += [(e.fair_key, json.loads(e.item)["headers"]["n"]) for e in entries
                    if isinstance(e, KeyedMessage)]  # fmt: skip
    assert batched == singles
    # Every message of a batch is recorded as unacknowledged with its pop.
    assert client.hlen("unacked") == 28 and client.zcard("unacked_index") == 28
    assert int(client.hget(NAMES.state, "backlog")) == 60 - 28


def test_a_batch_stops_at_the_keys_limits_and_at_an_empty_queue(
    client: redis_lib.Redis,
) -> None:
    client.hset(NAMES.limits_conf, "c:*", "2")
    for i in range(5):
        enqueue(client, "a", message("a", i))
        enqueue(client, "b", message("b", i))
    entries = decode_fetched(fetch(client, "L1:30", batch=16))
    assert isinstance(entries, tuple)
    keys = [e.fair_key for e in entries if isinstance(e, KeyedMessage)]
    assert sorted(keys) == ["a", "a", "b", "b"]  # two slots per key, then both set aside
    assert client.hget(NAMES.running, "a") == b"2" and client.hget(NAMES.running, "b") == b"2"
    assert client.zcard(NAMES.leases) == 4
    # A plain list: the batch takes what is there, and stops.
    client.lpush("plain", message("", 0), message("", 1))
    entries = decode_fetched(fetch(client, "-", "plain", batch=16))
    assert isinstance(entries, tuple) and len(entries) == 2
    assert isinstance(decode_fetched(fetch(client, "-", "plain", batch=16)), Idle)
