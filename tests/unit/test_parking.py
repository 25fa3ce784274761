"""Parked-message records, the settings of bad input, and the consumer probe."""

from __future__ import annotations

import json
from typing import Any

import pytest
from celery.worker.consumer.consumer import Consumer

from celery_fair import compat
from celery_fair.cli import build_parser
from celery_fair.errors import FairConfigError
from celery_fair.parked import (
    NOT_A_MESSAGE,
    ParkedMessage,
    decode_record,
    encode_record,
    parking_queue,
)
from celery_fair.parking.cli import format_age
from celery_fair.worker.quarantine import returns_of
from celery_fair.worker.settings import FairSettings


def test_a_record_keeps_the_message_reason_and_time() -> None:
    payload = {"body": "e30=", "headers": {"task": "t.add", "id": "abc"}, "properties": {}}
    item = encode_record(payload, reason="body does not decode", parked_at=12.5, queue="q")
    parked = decode_record(item.encode(), "q")
    assert parked == ParkedMessage(
        reason="body does not decode", parked_at=12.5, queue="q", task="t.add",
        task_id="abc", payload=payload,
    )  # fmt: skip
    assert parked.age(20.0) == 7.5


def test_raw_bytes_that_are_not_utf8_survive_a_round_trip() -> None:
    raw = b"\xff\xfe not json \x00".decode("utf-8", "surrogateescape")
    item = encode_record(None, reason=NOT_A_MESSAGE, parked_at=1.0, queue="q", raw=raw)
    parked = decode_record(item, "q")
    assert parked.raw is not None
    assert parked.raw.encode("utf-8", "surrogateescape") == b"\xff\xfe not json \x00"
    assert parked.payload is None and parked.reason == NOT_A_MESSAGE


def test_the_fetch_scripts_record_and_bare_items_decode() -> None:
    # The atomic fetch script writes cjson with the raw item (and no queue).
    lua = json.dumps({"fair_parked": 1, "reason": NOT_A_MESSAGE, "parked_at": 3, "raw": "x"})
    assert decode_record(lua, "jobs") == ParkedMessage(
        reason=NOT_A_MESSAGE, parked_at=3.0, queue="jobs", raw="x"
    )
    # An item moved aside as it was (older releases): kept, reason and age unknown.
    bare = decode_record(b'{"no": "mark"}', "jobs")
    assert bare.raw == '{"no": "mark"}' and bare.parked_at is None and bare.age(9.0) is None


def test_parking_queue_name() -> None:
    assert parking_queue("jobs") == "jobs.fair-malformed"


@pytest.mark.parametrize(
    ("headers", "count"),
    [(None, 0), ({}, 0), ({"fair_unknown_returns": 4}, 4), ({"fair_unknown_returns": "x"}, 0),
     ({"fair_unknown_returns": -2}, 0), ("garbage", 0)],
)  # fmt: skip
def test_returns_of(headers: Any, count: int) -> None:
    assert returns_of(headers) == count


def test_bad_input_settings_default_and_validate() -> None:
    settings = FairSettings.from_conf({})
    assert (settings.unknown_task_delay, settings.unknown_task_max_returns) == (10.0, 30)
    settings = FairSettings.from_conf(
        {"fair_unknown_task_delay": 0.5, "fair_unknown_task_max_returns": "0"}
    )
    assert (settings.unknown_task_delay, settings.unknown_task_max_returns) == (0.5, 0)
    with pytest.raises(FairConfigError, match=r"fair_unknown_task_delay .* got -1"):
        FairSettings.from_conf({"fair_unknown_task_delay": -1})
    with pytest.raises(FairConfigError, match=r"fair_unknown_task_max_returns .* got 2.5"):
        FairSettings.from_conf({"fair_unknown_task_max_returns": 2.5})


@pytest.mark.parametrize(
    ("seconds", "text"), [(None, "?"), (4.2, "4s"), (90, "2m"), (7200, "2h"), (3 * 86400, "3d")]
)
def test_format_age(seconds: float | None, text: str) -> None:
    assert format_age(seconds) == text


def test_cli_refuses_a_bad_limit_and_two_actions(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser(("celery_fair.parking.cli",))
    with pytest.raises(SystemExit):
        parser.parse_args(["parked", "q", "-b", "redis://", "--limit", "0"])
    assert "argument --limit: must be an integer of at least 1, not '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["parked", "q", "-b", "redis://", "--replay", "--purge"])


class _TaskConsumer:
    on_decode_error = None


def _consumer(cls: type) -> Any:
    consumer = cls.__new__(cls)
    consumer.task_consumer = _TaskConsumer()
    return consumer


def test_probe_accepts_this_celery_and_replaces_the_handlers() -> None:
    probe = compat.Probe()
    consumer = _consumer(Consumer)
    assert compat.probe_bad_input_handlers(consumer, probe)
    assert probe.missing == {}

    def handler(*args: Any) -> None:
        return None

    names = compat.BAD_INPUT_HANDLERS
    compat.set_bad_input_handlers(consumer, {name: handler for name in names})
    assert all(getattr(consumer, name) is handler for name in names)
    assert consumer.task_consumer.on_decode_error is handler


def test_probe_reports_a_consumer_that_reads_its_handlers_elsewhere() -> None:
    class Elsewhere(Consumer):  # type: ignore[misc]
        def create_task_handler(self, promise: Any = None) -> Any:
            return lambda message: None  # never reads on_unknown_task & co.

    logged: list[str] = []
    probe = compat.Probe(log=logged.append)
    assert not compat.probe_bad_input_handlers(_consumer(Elsewhere), probe)
    assert "celery.consumer.bad_input" in probe.missing
    assert any("create_task_handler" in line for line in logged)


def test_probe_reports_a_consumer_without_a_task_consumer() -> None:
    consumer = _consumer(Consumer)
    del consumer.task_consumer
    assert not compat.probe_bad_input_handlers(consumer, compat.Probe(log=lambda line: None))
