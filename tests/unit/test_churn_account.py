"""The churn soak's books (``tests.harness.churn.account``): what the churn explains.

A hard time limit ends a quick task only when the churn caused it: its process was
killed as it started (with or without the start noted) or a revoke with terminate
hit it as it ran.  A ``WorkerLostError`` naming SIGTERM is explained only by an
autoscale shrink of its worker just before.  Anything else stays unexplained, and
fails the soak.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from tests.harness.churn import (
    KILLED_AS_STARTED,
    SHRUNK_AS_STARTED,
    WORKER_TIME_LIMIT,
    Outcome,
    Published,
    Spec,
    account,
    log_around,
    log_times,
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


def _lost(message: str, *, starts: list[dict[str, Any]],
          shrinks: dict[str, list[float]]) -> dict[str, Any]:  # fmt: skip
    published = [Published("t1", Spec("jobs", "quick", "t0"), 0, DONE - 5)]
    results = {"t1": Outcome("FAILURE", "WorkerLostError", message, DONE)}
    return account(published, starts, [], results, [], set(), shrinks)


SIGTERM = "['Worker exited prematurely: signal 15 (SIGTERM) Job: 179.']"


def test_a_shrink_of_its_worker_just_before_explains_a_sigterm() -> None:
    start = {"id": "t1", "worker": "a@host", "pid": 8, "started": DONE - 0.1}
    books = _lost(SIGTERM, starts=[start], shrinks={"a@host": [DONE - 0.09], "b@host": []})
    assert books["unexplained_count"] == 0
    assert books["outcomes"][SHRUNK_AS_STARTED] == 1
    # With no start noted, a shrink of any worker.
    assert _lost(SIGTERM, starts=[], shrinks={"a@host": [DONE - 0.09]})["unexplained_count"] == 0


def test_a_sigterm_without_a_shrink_of_its_worker_is_unexplained() -> None:
    start = {"id": "t1", "worker": "a@host", "pid": 8, "started": DONE - 0.1}
    for shrinks in ({"a@host": []}, {"a@host": [DONE - 10.0]}, {"a@host": [DONE + 0.5]},
                    {"b@host": [DONE - 0.09]}):  # fmt: skip
        books = _lost(SIGTERM, starts=[start], shrinks=shrinks)
        assert books["unexplained_count"] == 1, shrinks
        assert books["unexplained"][0]["why"] == "WorkerLostError without a kill"
    # A shrink terminates with SIGTERM: a SIGKILL needs a kill of the churn's.
    sigkill = SIGTERM.replace("15 (SIGTERM)", "9 (SIGKILL)")
    assert (
        _lost(sigkill, starts=[start], shrinks={"a@host": [DONE - 0.09]})["unexplained_count"] == 1
    )


def test_a_workers_log_gives_its_records_times() -> None:
    log = "\n".join([
        "[2026-11-29 18:13:49,098: INFO/MainProcess] Terminating 6020ae5b (15)",
        "[2026-11-29 18:13:49,386: INFO/MainProcess] Scaling down 1 processes.",
        "[2026-11-29 18:13:49,400: INFO/MainProcess] Task prod.churn[ab-12] received",
        "[2026-11-29 18:13:49,479: ERROR/MainProcess] Task handler raised error: WorkerLostError",
        "Traceback (most recent call last):",
        "[2026-11-29 18:13:55,000: INFO/MainProcess] Scaling down 1 processes.",
    ])  # fmt: skip
    at = datetime(2026, 11, 29, 18, 13, 49, 386000).timestamp()
    assert log_times(log, "Scaling down") == [at, at + 5.614]
    around = log_around(log, at + 0.093, before=1.0, after=0.5)
    # The records in the window and the traceback after one; not the task's "received".
    assert [line.split("]")[0] for line in around] == [
        "[2026-11-29 18:13:49,098: INFO/MainProcess",
        "[2026-11-29 18:13:49,386: INFO/MainProcess",
        "[2026-11-29 18:13:49,479: ERROR/MainProcess",
        "Traceback (most recent call last):",
    ]
