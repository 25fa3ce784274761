"""The test ledger's write: tasks record each run exactly once, even when a write
is sent again after its reply was lost (real ``redis-server``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis as redis_lib

from tests.harness import ledger as ledger_module
from tests.harness.ledger import Ledger, record_entry

SCRIPT = Path(ledger_module.__file__).with_name("ledger_record.lua").read_text()


def test_an_entry_is_recorded_with_its_count(redis_url: str) -> None:
    record_entry(redis_url, "ledger", {"id": "a", "n": 1}, count=("ledger:tenants", "t1"))
    record_entry(redis_url, "ledger:started", {"id": "a"})
    client = redis_lib.Redis.from_url(redis_url)
    assert [json.loads(e) for e in client.lrange("ledger", 0, -1)] == [{"id": "a", "n": 1}]
    assert client.hgetall("ledger:tenants") == {b"t1": b"1"}
    assert client.llen("ledger:started") == 1
    Ledger(redis_url).reset()
    assert not client.exists("ledger", "ledger:tenants", "ledger:recorded")


def test_a_write_sent_again_records_once_and_a_new_run_records_again(redis_url: str) -> None:
    """A retried write carries its first attempt's token: the second is a no-op.
    A redelivered task's run is a new write, with a token of its own."""
    client = redis_lib.Redis.from_url(redis_url)
    keys = ["ledger:recorded", "ledger", "ledger:tenants"]
    entry = json.dumps({"id": "a"})
    assert client.eval(SCRIPT, 3, *keys, "token-1", entry, "t1") == 1
    assert client.eval(SCRIPT, 3, *keys, "token-1", entry, "t1") == 0
    assert client.llen("ledger") == 1 and client.hget("ledger:tenants", "t1") == b"1"
    assert client.eval(SCRIPT, 3, *keys, "token-2", entry, "t1") == 1
    assert client.llen("ledger") == 2 and client.hget("ledger:tenants", "t1") == b"2"


def test_a_write_whose_reply_is_lost_is_sent_again_and_recorded_once(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first attempt lands on the server, then its connection fails (as a timed-out
    read does): ``record_entry`` sends it again, and the run is still one entry."""
    real = ledger_module.client_for(redis_url)
    failures = []

    class LosesTheFirstReply:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def evalsha(self, *args: object) -> object:
            result = real.evalsha(*args)
            if not failures:
                failures.append(result)
                raise redis_lib.ConnectionError("the reply was lost")
            return result

    monkeypatch.setattr(ledger_module, "client_for", lambda url: LosesTheFirstReply())
    record_entry(redis_url, "ledger", {"id": "a"}, count=("ledger:tenants", "t1"))
    client = redis_lib.Redis.from_url(redis_url)
    assert failures == [1]  # the first attempt was recorded
    assert client.llen("ledger") == 1 and client.hget("ledger:tenants", "t1") == b"1"
