"""Admission before the broker fills: the pure decision and the setting's checks."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_fair import BrokerMemoryHigh, FairConfigError, KeyBacklogFull, PublishRefused
from celery_fair.scheduling.admission import (
    DEFAULT_HARD,
    AdmissionLimits,
    BrokerMemory,
    backlog_ceiling,
    parse_admission,
)

LIMITS = AdmissionLimits(0.8, 0.95)
MAX = 1_000_000


def memory(fraction: float) -> BrokerMemory:
    return BrokerMemory(int(fraction * MAX), MAX)


def test_below_high_everything_is_admitted() -> None:
    assert backlog_ceiling(memory(0.79), LIMITS, largest=5000) is None


def test_at_high_only_the_largest_backlog_is_refused() -> None:
    ceiling = backlog_ceiling(memory(0.8), LIMITS, largest=5000)
    assert ceiling == 5000  # the flood (5000 waiting) is refused, 4999 is not


def test_the_ceiling_falls_to_one_before_hard_and_to_zero_at_hard() -> None:
    halfway = backlog_ceiling(memory(0.875), LIMITS, largest=5000)
    assert halfway is not None and 2400 <= halfway <= 2600
    assert backlog_ceiling(memory(0.9499), LIMITS, largest=5000) == 4
    assert backlog_ceiling(memory(0.95), LIMITS, largest=5000) == 0
    assert backlog_ceiling(memory(1.2), LIMITS, largest=5000) == 0


def test_nothing_waiting_is_never_refused_below_hard() -> None:
    # Memory held by something else (results, say): a key with nothing waiting goes on.
    assert backlog_ceiling(memory(0.9), LIMITS, largest=0) == 1


def test_a_broker_without_maxmemory_admits_everything() -> None:
    assert backlog_ceiling(BrokerMemory(10**12, 0), LIMITS, largest=10**6) is None


@given(st.floats(0.0, 1.5), st.floats(0.0, 1.5), st.integers(0, 10**7), st.integers(0, 10**7))
def test_more_memory_never_admits_more(a: float, b: float, largest: int, backlog: int) -> None:
    lo, hi = sorted((a, b))

    def admitted(fraction: float) -> bool:
        ceiling = backlog_ceiling(memory(fraction), LIMITS, largest)
        return ceiling is None or backlog < ceiling

    assert admitted(lo) or not admitted(hi)


def test_parse_admission() -> None:
    assert parse_admission(None) is None
    assert parse_admission(0.8) == AdmissionLimits(0.8, DEFAULT_HARD)
    assert parse_admission("0.7", "0.9") == AdmissionLimits(0.7, 0.9)
    for bad in (0, 1.5, -0.1, "lots", True, float("nan")):
        with pytest.raises(FairConfigError, match="fair_broker_memory_high"):
            parse_admission(bad)
    with pytest.raises(FairConfigError, match="must be below fair_broker_memory_hard"):
        parse_admission(0.96)
    with pytest.raises(FairConfigError, match="needs fair_broker_memory_high"):
        parse_admission(None, 0.9)


def test_the_refusal_names_the_key_the_backlog_and_the_memory() -> None:
    exc = BrokerMemoryHigh("jobs", "noisy", 4210, 3100, 34_000_000, 40_000_000)
    assert isinstance(exc, PublishRefused) and not isinstance(exc, KeyBacklogFull)
    text = str(exc)
    assert "key 'noisy' of queue 'jobs' has 4210 messages waiting" in text
    assert "85% of its maxmemory" in text and "refused from 3100" in text
    hard = BrokerMemoryHigh("hi", None, 0, 0, 39_000_000, 40_000_000)
    assert "every publish is refused" in str(hard) and "queue 'hi'" in str(hard)
    again = pickle.loads(pickle.dumps(exc))
    assert (again.key, again.backlog, again.ceiling) == ("noisy", 4210, 3100)
    assert (again.used, again.maxmemory) == (34_000_000, 40_000_000)
    assert issubclass(KeyBacklogFull, PublishRefused)
