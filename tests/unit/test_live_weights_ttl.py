"""Live weights lapse on an injected clock; ``ttl=``/``keep`` words; the TTL setting."""

from __future__ import annotations

import logging
import threading

import pytest

from celery_fair.errors import FairConfigError
from celery_fair.scheduling.scheduler import FairScheduler
from celery_fair.worker.attachment import Attachment
from celery_fair.worker.control import _live_ttl
from celery_fair.worker.live_weights import LiveWeights
from celery_fair.worker.settings import FairSettings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _live(ttl: float = 60.0) -> tuple[LiveWeights, FairScheduler, Clock]:
    settings = FairSettings.from_conf({"fair_weights": {"a": 2}, "fair_live_weights_ttl": ttl})
    scheduler = FairScheduler(settings.weights)
    scheduler.set_queues(["a", "b"])
    clock = Clock()
    live = LiveWeights(settings, scheduler, threading.RLock(), Attachment(), clock=clock)
    return live, scheduler, clock


def test_a_live_weight_lapses_at_its_time_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    live, scheduler, clock = _live(ttl=60)
    live.set({"a": 5, "b": 3})
    live.set({"b": 4}, ttl=120)
    assert scheduler.weights == {"a": 5.0, "b": 4.0}
    assert live.expires_in() == {"a": 60.0, "b": 120.0}
    clock.now += 59.9
    assert live.expire() == []
    clock.now += 0.1
    with caplog.at_level(logging.INFO, logger="celery_fair.worker.live_weights"):
        assert live.expire() == ["a"]
        assert live.expire() == []
    assert scheduler.weights == {"a": 2.0, "b": 4.0}
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "celery-fair: live weight(s) expired, back to the configured weights: a=2 (was 5)"
    ]
    clock.now += 60
    assert live.expire() == ["b"] and scheduler.weights == {"a": 2.0, "b": 1.0}


def test_kept_and_reset_weights_do_not_lapse() -> None:
    live, scheduler, clock = _live(ttl=60)
    live.set({"a": 5}, ttl=0)
    live.set({"b": 3})
    live.set({}, reset=["b"])
    clock.now += 10_000
    assert live.expire() == [] and scheduler.weights == {"a": 5.0, "b": 1.0}
    live.clear()
    assert scheduler.weights == {"a": 2.0, "b": 1.0} and live.expires_in() == {}


def test_a_setting_of_zero_keeps_every_live_weight() -> None:
    live, scheduler, clock = _live(ttl=0)
    live.set({"a": 5})
    clock.now += 10_000
    assert live.expire() == [] and scheduler.weights["a"] == 5.0


@pytest.mark.parametrize(
    ("words", "ttl", "rest"),
    [
        (["a=2", "b=3"], None, ["a=2", "b=3"]),
        (["a=2,ttl=60"], 60.0, ["a=2"]),
        (["a=2", "keep"], 0.0, ["a=2"]),
        (["a=2", "keep=true"], 0.0, ["a=2"]),
        (["a=2", "KEEP=yes"], 0.0, ["a=2"]),
        (["a=2", "keep=false"], None, ["a=2"]),
        (["ttl=0", "a=2"], 0.0, ["a=2"]),
        (["a=default", "ttl=1.5"], 1.5, ["a=default"]),
    ],
)
def test_ttl_and_keep_words(words: list[str], ttl: float | None, rest: list[str]) -> None:
    assert _live_ttl(words) == (ttl, rest)


@pytest.mark.parametrize("words", [["a=2", "ttl=-1"], ["ttl=soon"], ["keep=maybe"], ["ttl="]])
def test_bad_ttl_and_keep_words_are_errors(words: list[str]) -> None:
    with pytest.raises(FairConfigError):
        _live_ttl(words)


@pytest.mark.parametrize(("value", "read"), [(None, 3600.0), (0, 0.0), ("0", 0.0), ("90", 90.0)])
def test_the_ttl_setting(value: object, read: float) -> None:
    assert FairSettings.from_conf({"fair_live_weights_ttl": value}).live_weights_ttl == read


@pytest.mark.parametrize("value", [-1, "soon", True, False, float("inf"), float("nan")])
def test_a_bad_ttl_setting_names_itself(value: object) -> None:
    with pytest.raises(FairConfigError, match="fair_live_weights_ttl"):
        FairSettings.from_conf({"fair_live_weights_ttl": value})
