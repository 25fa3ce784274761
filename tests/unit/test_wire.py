"""The wire records: the served header and the fetch script's replies (no broker)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from celery_fair.wire import SERVED_HEADER
from celery_fair.wire.replies import Idle, KeyedMessage, Malformed, Message, decode_fetch, text
from celery_fair.wire.served import NOT_SERVED, Served

LEVEL = "\x06\x169"

# -- the served record ---------------------------------------------------------


def test_a_served_record_goes_through_json_and_back_unchanged() -> None:
    served = Served(
        "gold", 0.005, weight=2.0, throttled=0.25, level=LEVEL, user="alice", paused=1.5
    )
    assert Served.from_wire(json.loads(json.dumps(served.to_wire()))) == served


def test_the_header_is_written_as_the_seven_field_list_it_always_was() -> None:
    served = Served("gold", 0.005, weight=2.0, throttled=0.0, level="", user="", paused=0.0)
    assert json.dumps(served.to_wire()) == '["gold", 0.005, 2.0, 0.0, "", "", 0.0]'


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # Before telemetry's schema 2: key and charge only.
        (["gold", 0.5], Served("gold", 0.5)),
        # Weight and held were written as a pair: a lone weight is not read.
        (["gold", 0.5, 2.0], Served("gold", 0.5)),
        (["gold", 0.5, 2.0, 0.1], Served("gold", 0.5, weight=2.0, throttled=0.1)),
        # Before two-level keys: the level, no user, no pause.
        (["gold", 0.5, 2.0, 0.1, LEVEL], Served("gold", 0.5, 2.0, 0.1, LEVEL)),
        (["t", 0.5, 2.0, 0.1, "", "alice"], Served("t", 0.5, 2.0, 0.1, "", "alice")),
        (["t", 0.5, 1, 0, "", "", 3], Served("t", 0.5, 1.0, 0.0, "", "", 3.0)),
        (("gold", 0.5), Served("gold", 0.5)),  # a tuple reads as the list
        (["gold"], Served("gold", None)),  # no charge: nothing to correct
    ],
)
def test_every_older_form_is_read(value: list[Any], expected: Served) -> None:
    assert Served.from_wire(value) == expected


def test_what_is_not_a_field_of_its_kind_reads_as_unknown() -> None:
    served = Served.from_wire([7, "0.5", "2", None, 9, None, "x"])
    # The key as text; the charge as float() reads it; telemetry's numbers
    # only as JSON numbers; level and user only as text.
    assert served == Served("7", 0.5, weight=None, throttled=None, level="", user="", paused=None)
    assert Served.from_wire(["gold", "a lot"]) == Served("gold", None)


@pytest.mark.parametrize("value", [None, "garbage", [], (), {"key": "gold"}, 3])
def test_a_value_that_is_no_record_reads_as_none(value: Any) -> None:
    assert Served.from_wire(value) is None


def test_the_record_is_read_from_headers() -> None:
    headers = {SERVED_HEADER: ["gold", 1.0], "other": 1}
    assert Served.from_headers(headers) == Served("gold", 1.0)
    assert Served.from_headers({"other": 1}) is None
    assert Served.from_headers(None) is None
    assert Served.from_headers([("fair_served", ["gold", 1.0])]) is None


def test_nothing_served_is_no_key_on_the_first_level() -> None:
    assert (NOT_SERVED.key, NOT_SERVED.level, NOT_SERVED.user) == ("", "", "")
    assert NOT_SERVED.charge is NOT_SERVED.weight is None
    assert NOT_SERVED.throttled is NOT_SERVED.paused is None


# -- the fetch script's replies ----------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "due"), [(None, None), ([], None), (0, None), (-1, None), (1501, 1.501)]
)
def test_an_empty_fetch_is_idle_with_the_wait_it_names(reply: Any, due: float | None) -> None:
    assert decode_fetch(reply) == Idle(due)


def test_a_plain_message_and_a_parked_payload() -> None:
    assert decode_fetch([b"jobs", b"{}"]) == Message("jobs", b"{}")
    assert decode_fetch([b"jobs", b"not json", b"malformed"]) == Malformed("jobs", b"not json")


def test_a_keyed_message_names_every_field() -> None:
    # Numbers come as text, or as integers where Lua held a number.
    reply = [b"jobs", b"{}", b"key", b"gold", b"2.5", 0, LEVEL.encode(), b"alice", b"0.25"]
    fetched = decode_fetch(reply)
    assert fetched == KeyedMessage(
        key="jobs",
        item=b"{}",
        fair_key="gold",
        weight=2.5,
        throttled=0.0,
        level=LEVEL,
        user="alice",
        paused=0.25,
    )
    assert isinstance(fetched, KeyedMessage)
    served = fetched.served(0.005)
    assert served.to_wire() == ["gold", 0.005, 2.5, 0.0, LEVEL, "alice", 0.25]
    # What a newer worker stamps reads back as the record it came from.
    assert Served.from_wire(json.loads(json.dumps(served.to_wire()))) == served


def test_replies_are_read_as_text() -> None:
    assert (text(b"a"), text("a"), text(3)) == ("a", "a", "3")
