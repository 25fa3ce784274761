"""The pause log's events and the state they add up to (pure: no broker)."""

from __future__ import annotations

import pytest

from celery_fair.keys.pause_events import PauseEvent, PauseState, parked_lane


def _event(keys: tuple[str, ...], paused: bool, at: float, queue: str = "jobs") -> PauseEvent:
    return PauseEvent(f"id-{at}", queue, keys, paused, at)


def test_replaying_the_log_gives_the_last_word_per_key_and_counts_pauses() -> None:
    state = PauseState()
    assert state.apply(_event(("a", "b"), True, 10.0)) == [("jobs", "a"), ("jobs", "b")]
    assert state.apply(_event(("a",), True, 11.0)) == []  # a repeat keeps the first time
    assert state.paused_since("jobs", "a") == 10.0
    assert state.apply(_event(("a", "never"), False, 15.0)) == [("jobs", "a")]
    assert state.paused() == {"jobs": {"b"}}
    assert state.paused_since("jobs", "a") is None
    assert (state.pauses, state.paused_seconds) == ({"jobs": 2}, {"jobs": 5.0})
    # A resume of a key never paused leaves nothing behind to sweep.
    assert state.resumed(0.0, ["jobs"]) == [("jobs", "a")]
    assert state.resumed(16.0, ["jobs"]) == [] and state.resumed(0.0, ["other"]) == []
    assert state.events == 3


def test_an_event_survives_its_wire_form_and_a_bad_one_is_named() -> None:
    event = _event(("t-1", "t/2"), False, 3.5, queue="q")
    assert PauseEvent.from_body(event.to_body()) == event
    marker = PauseEvent("m")
    assert PauseEvent.from_body(marker.to_body()) == marker and not marker.keys
    with pytest.raises(ValueError, match="not JSON"):
        PauseEvent.from_body(b"{nope")
    with pytest.raises(ValueError, match="not a pause event"):
        PauseEvent.from_body(b'{"id": "x", "queue": "q", "keys": [1], "paused": true, "at": 1}')


def test_each_key_has_its_own_parked_lane_of_its_queue() -> None:
    assert parked_lane("jobs", "a") == parked_lane("jobs", "a")
    assert parked_lane("jobs", "a") != parked_lane("jobs", "b")
    assert parked_lane("jobs", "a").startswith("jobs.fair.p.")
    assert parked_lane("mail", "a").startswith("mail.fair.p.")


def test_settings_made_live_add_up_last_word_per_queue_kind_and_key() -> None:
    state = PauseState()
    first = PauseEvent("1", "jobs", at=1.0, settings=(("c", "a", 1.0), ("c", "*", 3.0)))
    assert state.apply(first) == []  # no key's pause changed
    assert state.live("jobs") == {"c": {"a": 1.0, "*": 3.0}}
    state.apply(PauseEvent("2", "jobs", at=2.0, settings=(("c", "a", 1.0),)))
    assert state.live("jobs") == {"c": {"a": 1.0, "*": 3.0}}  # a repeat changes nothing
    state.apply(PauseEvent("3", "jobs", at=3.0, settings=(("c", "a", None), ("r", "b", 5.0))))
    state.apply(PauseEvent("4", "other", at=4.0, settings=(("c", "a", 7.0),)))
    state.apply(PauseEvent("5", "jobs", at=5.0, settings=(("w", "gold", 4.0),)))
    assert state.live("jobs") == {"c": {"*": 3.0}, "r": {"b": 5.0}, "w": {"gold": 4.0}}
    assert state.live("other") == {"c": {"a": 7.0}}
    assert state.paused() == {}


def test_a_settings_event_survives_its_wire_form_and_reads_as_a_marker_without_them() -> None:
    import json

    event = PauseEvent("x", "jobs", at=2.0, settings=(("c", "a:b", 2.0), ("r", "*", None)))
    assert PauseEvent.from_body(event.to_body()) == event
    # A reader of an earlier version reads the same body as an event without keys: a
    # marker, which changes nothing.
    raw = json.loads(event.to_body())
    assert raw["keys"] == [] and raw["settings"] == [["c", "a:b", 2.0], ["r", "*", None]]
    for bad in ([["c", "a", 0]], [["c", "a", 1.5]], [[1, "a", 1]], [["r", 1, 1]], [["c", "a"]],
                [["r", "a", True]], {"c": 1}):  # fmt: skip
        body = json.dumps({**raw, "settings": bad}).encode()
        with pytest.raises(ValueError, match="settings"):
            PauseEvent.from_body(body)
    # A kind of a later version is left to its readers, the rest applies.
    body = json.dumps({**raw, "settings": [["x", "a", 4], ["w", "a", 0.5]]}).encode()
    assert PauseEvent.from_body(body).settings == (("w", "a", 0.5),)
    body = json.dumps({**raw, "settings": [["r", "a", float("inf")]]}).encode()
    with pytest.raises(ValueError, match="settings"):
        PauseEvent.from_body(body)
