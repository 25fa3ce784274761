"""Tenant controls in the scripts, on a real ``redis-server``: two-level keys, pause, caps.

As ``test_scripts.py``: each script is called directly, without Kombu or a
worker, and the broker's state is read after each call.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
import redis as redis_lib

from celery_fair.keys import scripts, store
from celery_fair.keys.store import enqueue_args

from .test_scripts import LEVELS, NAMES, SEP, Q, client, fetch, fetched, message

pytestmark = [pytest.mark.integration, pytest.mark.compat]

__all__ = ("client",)  # the fixture, re-exported for pytest


def put(client: Any, key: str, user: str | None, n: int = 0, **kw: Any) -> Any:
    return scripts.ENQUEUE(client, *enqueue_args(NAMES, key, message(key, n), user=user, **kw))


def served(client: Any, n: int, word: str = "1") -> list[tuple[str, str]]:
    """The (key, user) of the next ``n`` messages served."""
    out = []
    for _ in range(n):
        reply = fetched(client, word)
        out.append((reply.fair_key, reply.user))
    return out


def test_two_level_keys_share_by_tenant_then_by_user_weights(client: redis_lib.Redis) -> None:
    # Two tenants 1:1; within t1 users weighted 1:3; t2 has one user.
    client.hset(NAMES.weights_conf, mapping={"t1/u1": "1", "t1/u3": "3"})
    for i in range(300):
        put(client, "t1", "u1", i)
        put(client, "t1", "u3", i)
        put(client, "t2", "v", i)
    order = served(client, 400)
    tenants = Counter(k for k, _ in order)
    assert tenants == {"t1": 200, "t2": 200}
    users = Counter(u for k, u in order if k == "t1")
    assert users == {"u1": 50, "u3": 150}
    # Interleaved from the start, not in runs: every 8 fetches hold 4 of each tenant.
    assert all(Counter(k for k, _ in order[i : i + 8]) == {"t1": 4, "t2": 4}
               for i in range(0, 400, 8))  # fmt: skip
    # The backlog counts the tenant's messages over its users.
    assert client.zscore(NAMES.sizes, "t1") == 400.0
    assert int(client.hget(NAMES.state, "backlog")) == 500


def test_a_flooding_user_does_not_delay_the_other_users_of_its_tenant(
    client: redis_lib.Redis,
) -> None:
    for i in range(1000):
        put(client, "t1", "flood", i)
    for i in range(5):
        put(client, "t1", "quiet", i)
        put(client, "t2", "other", i)
    order = served(client, 20)
    # quiet's five come among t1's first ten; t2 is served every other fetch.
    t1 = [u for k, u in order if k == "t1"]
    assert t1[:10].count("quiet") == 5, t1
    assert [k for k, _ in order[:10]].count("t2") == 5


def test_a_users_messages_keep_publish_order_and_a_restore_goes_first(
    client: redis_lib.Redis,
) -> None:
    for i in range(3):
        put(client, "t", "u", i)
    first = fetch(client)
    assert first[7] == b"u"
    # Restored: first in line in its user's list.
    scripts.ENQUEUE(client, *enqueue_args(NAMES, "t", first[1].decode(), front=True, user="u"))
    got = [fetch(client)[1] for _ in range(3)]
    assert got[0] == first[1]
    assert [Counter(g.decode().split('"n": ')[1][0]) for g in got[1:]] == [{"1": 1}, {"2": 1}]


def test_an_emptied_tenant_leaves_no_user_state(client: redis_lib.Redis) -> None:
    put(client, "t", "a")
    put(client, "t", "b")
    served(client, 2)
    leftovers = [k for k in client.keys("*") if b"fair.u" in k or b"fair.k." in k]
    assert leftovers == []
    assert client.zcard(NAMES.active) == 0


def test_a_runtime_charge_moves_the_users_tag_within_its_tenant(client: redis_lib.Redis) -> None:
    for i in range(3):
        put(client, "t", "slow", i)
        put(client, "t", "fast", i)
    before = client.zscore(NAMES.users("t"), "slow")
    assert scripts.CHARGE(client, SEP, "1.0", Q, "", "t", "slow", "5.0") == 1
    assert client.zscore(NAMES.users("t"), "slow") == before + 5.0
    assert [u for _, u in served(client, 3)] == ["fast", "fast", "fast"]


def test_a_paused_key_is_not_served_until_resumed_and_keeps_its_place(
    client: redis_lib.Redis,
) -> None:
    for i in range(4):
        put(client, "a", None, i)
        put(client, "b", None, i)
    assert store.pause(client, SEP, [(Q, "a")]) == 1
    assert store.pause(client, SEP, [(Q, "a")]) == 0  # already paused
    assert [k for k, _ in served(client, 4)] == ["b"] * 4
    assert fetch(client) is None  # a waits, nothing else to serve
    assert client.llen(NAMES.key_list("a")) == 4
    # A publish while paused does not put it back in line.
    put(client, "a", None, 9)
    assert fetch(client) is None
    deadline = time.monotonic() + 5
    while float(client.hget(NAMES.paused_since, "a") or 0) + 0.05 > time.time():
        assert time.monotonic() < deadline
    assert store.pause(client, SEP, [(Q, "a")], paused=False) == 1
    reply = fetched(client)
    assert reply.fair_key == "a" and reply.paused >= 0.05  # the paused seconds it reports
    assert fetched(client).paused == 0.0  # reported once
    assert float(client.hget(NAMES.state, "paused_s")) >= 0.05
    assert client.scard(NAMES.paused) == 0


def test_pause_holds_a_two_level_key_and_the_unkeyed_key_in_every_level(
    client: redis_lib.Redis,
) -> None:
    put(client, "t", "u", 0, level=LEVELS[0])
    put(client, "t", "u", 1)
    client.lpush(Q, message("", 0))  # a plain producer's message: the unkeyed key
    store.pause(client, SEP, [(Q, "t"), (Q, "")])
    assert fetch(client) is None
    store.pause(client, SEP, [(Q, "t")], paused=False)
    assert [fetch(client)[6] for _ in range(2)] == [b"", LEVELS[0].encode()]
    assert fetch(client) is None
    store.pause(client, SEP, [(Q, "")], paused=False)
    assert fetch(client)[3] == b""


def test_a_backlog_cap_refuses_exactly_the_excess_and_never_a_restore(
    client: redis_lib.Redis,
) -> None:
    replies = [put(client, "k", None, i, cap=3) for i in range(5)]
    assert [store.refused(r) for r in replies] == [None, None, None, 3, 3]
    assert client.llen(NAMES.key_list("k")) == 3
    # Other levels and users count towards the key's cap too.
    assert store.refused(put(client, "k", None, 9, cap=3, level=LEVELS[0])) == 3
    assert store.refused(put(client, "t", "a", 0, cap=2)) is None
    assert store.refused(put(client, "t", "b", 0, cap=2)) is None
    assert store.refused(put(client, "t", "a", 1, cap=2)) == 2
    # A restore is never refused: nothing is lost.
    assert store.refused(put(client, "k", None, 10, cap=3, front=True)) is None
    assert client.llen(NAMES.key_list("k")) == 4
    # Served messages free room.
    fetch(client)
    fetch(client)
    assert store.refused(put(client, "k", None, 11, cap=4)) is None


def test_purge_and_unkey_cover_users_and_paused_keys(client: redis_lib.Redis) -> None:
    for i in range(3):
        put(client, "t", "a", i)
        put(client, "t", "b", i)
        put(client, "p", None, i)
    store.pause(client, SEP, [(Q, "p")])
    fetch(client)  # sets p aside (paused) if it came first; serves one of t
    assert store.purge(client, NAMES) == 8
    assert int(client.hget(NAMES.state, "backlog")) == 0
    assert [k for k in client.keys("*") if b"fair.k." in k or b"fair.u." in k] == []
    assert client.sismember(NAMES.paused, "p")  # still paused
    for i in range(2):
        put(client, "t", "a", i)
        put(client, "p", None, i)
    suffixes = ("", tuple(f"{SEP}{p}" if p else "" for p in range(10)))
    moved = sum(n for n, _ in store.unkey(client, NAMES, suffixes))
    assert moved == 4 and client.llen(Q) == 4
    assert [k for k in client.keys("*") if b"fair.k." in k or b"fair.u." in k] == []


def test_controls_name_paused_keys_the_largest_backlogs_and_their_top_users(
    client: redis_lib.Redis,
) -> None:
    for i in range(6):
        put(client, "big", "heavy", i)
    for i in range(2):
        put(client, "big", "light", i)
        put(client, "small", None, i)
    store.pause(client, SEP, [(Q, "small")])
    state = store.controls(client, NAMES, top=2)
    assert set(state.paused) == {"small"} and state.pauses == 1
    assert state.largest == (("big", 8), ("small", 2))
    assert state.top_users == {"big": (("heavy", 6), ("light", 2))}


def test_the_keys_command_pauses_resumes_and_shows_them(
    client: redis_lib.Redis, redis_url: str
) -> None:
    import subprocess
    import sys

    def keys(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery_fair.cli", "keys", *args, "-b", redis_url],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    for i in range(3):
        put(client, "t", "alice", i)
    put(client, "t", "bob", 0)
    done = keys("pause", Q, "t", "u")
    assert done.returncode == 0 and f"{Q}: paused 2 of 2 key(s)" in done.stdout, done
    assert client.smembers(NAMES.paused) == {b"t", b"u"}
    shown = keys("backlog", Q)
    assert "paused: " in shown.stdout and "t (" in shown.stdout, shown
    assert "t top users: alice: 3, bob: 1" in shown.stdout, shown.stdout
    assert fetch(client) is None
    assert keys("resume", Q, "t").returncode == 0
    assert fetch(client)[3] == b"t"
    bad = keys("pause", Q)
    assert bad.returncode == 2 and "name the keys" in bad.stderr
