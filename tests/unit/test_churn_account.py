"""The churn soak's books (``tests.harness.churn.account``): what the churn explains.

A hard time limit ends a quick task only when the churn caused it: its process was
killed as it started (with or without the start noted) or a revoke with terminate
hit it as it ran.  Anything else stays unexplained, and fails the soak.
"""

from __future__ import annotations

from typing import Any

from tests.harness.churn import (
    KILLED_AS_STARTED,
    WORKER_TIME_LIMIT,
    Outcome,
    Published,
    Spec,
    account,
)

DONE = 1000.0


def _books(*, starts: list[dict[str, Any]], kills: list[dict[str, Any]],
           revoked: frozenset[str] = frozenset()) -> dict[str, Any]:  # fmt: skip
    published = [Published("t1", Spec("hi", "quick", "t0"), 0, DONE - 5)]
    results = {"t1": Outcome("FAILURE", "TimeLimitExceeded", "[1.5]", DONE)}
    return account(published, starts, [], results, kills, set(revoked))


def _kill(at: float) -> dict[str, Any]:
    return {"worker": "w@host", "pid": 7, "at": at}


def test_a_kill_one_time_limit_before_explains_a_task_that_noted_no_start() -> None:
    books = _books(starts=[], kills=[_kill(DONE - WORKER_TIME_LIMIT - 0.04)])
    assert books["unexplained_count"] == 0
    assert books["outcomes"][KILLED_AS_STARTED] == 1


def test_a_time_limit_with_no_start_and_no_kill_is_unexplained() -> None:
    books = _books(starts=[], kills=[_kill(DONE - 10.0), _kill(DONE - 0.5)])
    assert books["unexplained_count"] == 1
    assert books["unexplained"][0]["why"] == "time limit of a task within its limit"


def test_a_revoke_as_it_ran_explains_its_time_limit() -> None:
    start = {"id": "t1", "worker": "w@host", "pid": 8, "started": DONE - 1.5}
    books = _books(starts=[start], kills=[], revoked=frozenset({"t1"}))
    assert books["unexplained_count"] == 0
    assert books["outcomes"]["revoked while running, ended by its time limit"] == 1
    assert _books(starts=[start], kills=[])["unexplained_count"] == 1  # not revoked
