"""celery_fair.testing's pure helpers, on records made here: they pass and they fail."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from celery_fair.testing import (
    FairWorker,
    FakeClock,
    assert_concurrency_at_most,
    assert_shares,
    backlogged_window,
    max_concurrency,
    read_records,
    shares,
)
from celery_fair.testing.worker import app_path
from tests.harness.clock import FakeClock as HarnessClock


@dataclass(frozen=True)
class Rec:
    queue: str | None
    started: float
    finished: float
    fair_key: str | None = None


def interleaved(pattern: str, n: int, ms: float = 10.0) -> list[Rec]:
    """``n`` back-to-back tasks whose queues follow ``pattern`` ("aaaab": a 4:1)."""
    step = ms / 1000
    return [
        Rec(f"p{int(pattern[i % len(pattern)] == 'b')}", i * step, (i + 1) * step) for i in range(n)
    ]


def test_shares_in_the_weights_ratio_pass() -> None:
    observed = assert_shares(interleaved("aaaab", 100), {"p0": 4, "p1": 1}, tolerance=0.1)
    assert observed == pytest.approx({"p0": 0.8, "p1": 0.2}, abs=0.02)


def test_shares_out_of_the_weights_ratio_fail_and_say_which() -> None:
    records = interleaved("ab", 100)  # 1:1
    with pytest.raises(AssertionError, match=r"p0: \d+ tasks, share 0\.50\d, expected 0\.800"):
        assert_shares(records, {"p0": 4, "p1": 1}, tolerance=0.2)


def test_only_the_backlogged_window_counts() -> None:
    # 4:1 while both queues had work, then p1 ran dry and p0 took every turn.
    both = interleaved("aaaab", 50)
    tail = [Rec("p0", 1 + i / 100, 1 + (i + 1) / 100) for i in range(100)]
    records = both + tail
    assert backlogged_window(records, ["p0", "p1"]) == (
        0.0,
        max(r.started for r in both if r.queue == "p1"),
    )
    assert_shares(records, {"p0": 4, "p1": 1}, tolerance=0.1)
    with pytest.raises(AssertionError, match="differ from the weights"):
        assert_shares(records, {"p0": 4, "p1": 1}, tolerance=0.1, window=None)
    assert shares(records)["p1"] == pytest.approx(10 / 150)


def test_too_few_tasks_or_a_missing_group_fail() -> None:
    with pytest.raises(AssertionError, match="too few to judge"):
        assert_shares(interleaved("aaaab", 10), {"p0": 4, "p1": 1})
    with pytest.raises(AssertionError, match=r"no task recorded for \['p2'\]"):
        assert_shares(interleaved("aaaab", 100), {"p0": 4, "p2": 1})
    with pytest.raises(ValueError, match="weights > 0"):
        assert_shares(interleaved("aaaab", 100), {"p0": 0})


def test_shares_by_a_function_of_the_record() -> None:
    records = interleaved("aaaab", 100)
    assert_shares(
        records,
        {"A": 4, "B": 1},
        by=lambda r: r.queue.upper().replace("P0", "A").replace("P1", "B"),
    )


def keyed(*spans: tuple[str, float, float]) -> list[Rec]:
    return [Rec("jobs", s, f, key) for key, s, f in spans]


def test_max_concurrency_sweeps_starts_and_finishes() -> None:
    records = keyed(
        ("a", 0, 2), ("a", 1, 3), ("a", 2.5, 4),  # two at once at most (1-2, 2.5-3)
        ("b", 0, 1), ("b", 1, 2), ("b", 2, 3),  # back to back: one at a time
    )  # fmt: skip
    assert max_concurrency(records) == {"a": 2, "b": 1}


def test_concurrency_limits_pass_and_fail() -> None:
    records = keyed(("big", 0, 2), ("big", 1, 3), ("small", 0, 1), ("small", 0.5, 1.5))
    assert assert_concurrency_at_most(records, {"*": 2}) == {"big": 2, "small": 2}
    assert_concurrency_at_most(records, 1, key="nobody")
    with pytest.raises(AssertionError, match=r"'small': 2 at once, limit 1"):
        assert_concurrency_at_most(records, {"*": 1, "big": 2})
    with pytest.raises(AssertionError, match=r"'big': 2 at once, limit 1"):
        assert_concurrency_at_most(records, 1, key="big")
    assert_concurrency_at_most(records, {"big": 2})  # no "*": small is not checked


def test_fake_clock_is_one_class_for_users_and_the_projects_tests() -> None:
    assert HarnessClock is FakeClock
    clock = FakeClock(5.0)
    clock.advance(1.5)
    assert (clock(), clock(), clock.reads) == (6.5, 6.5, 2)
    with pytest.raises(ValueError, match="forward only"):
        clock.advance(-1)


def test_records_are_read_back_whole_lines_only(tmp_path: Path) -> None:
    line = {"id": "t1", "name": "proj.job", "queue": "jobs", "fair_key": "acme", "pid": 7,
            "started": 2.0, "finished": 3.0, "worker": "w@h", "state": "SUCCESS"}  # fmt: skip
    early = {**line, "id": "t0", "started": 1.0}
    (tmp_path / "7.jsonl").write_text(json.dumps(line) + "\n" + json.dumps(early)[:20])
    (tmp_path / "8.jsonl").write_text(json.dumps(early) + "\n")
    records = read_records(tmp_path)
    assert [r.id for r in records] == ["t0", "t1"]  # by start time; the cut line left out
    assert records[1].fair_key == "acme" and records[1].runtime == 1.0


def test_the_worker_command_is_celerys_own(tmp_path: Path) -> None:
    # No worker starts here: --without-mingle only stands for any extra argument,
    # to show that it reaches Celery's command line as given.
    worker = FairWorker(
        "proj.celery:app", "redis://127.0.0.1:1/0", queues=["p0", "p1"], concurrency=2,
        settings={"fair_weights": {"p0": 4, "p1": 1}}, args=["--without-mingle"], workdir=tmp_path,
    )  # fmt: skip
    argv = worker.command()
    assert argv[:8] == [sys.executable, "-m", "celery", "-A", "proj.celery:app", "-b",
                        "redis://127.0.0.1:1/0", "worker"]  # fmt: skip
    assert argv[argv.index("-Q") + 1] == "p0,p1" and argv[argv.index("-c") + 1] == "2"
    assert "-P" not in argv  # Celery's default pool
    assert argv[-2:] == ["--without-mingle", 'fair_weights=(json){"p0": 4, "p1": 1}']
    # Celery parses it back as the setting it was.
    from celery import Celery

    app = Celery(set_as_current=False)
    parsed = app.loader.cmdline_config_parser([argv[-1]], namespace="worker")
    assert parsed == {"fair_weights": {"p0": 4, "p1": 1}}
    assert worker.environment()["PYTHONPATH"].split(":")[0] in sys.path


def test_an_app_object_is_found_by_its_module() -> None:
    from tests.harness import workload

    assert app_path(workload.app) == "tests.harness.workload:app"
    assert app_path("proj:app") == "proj:app"
    from celery import Celery

    with pytest.raises(ValueError, match="pass the app's -A path"):
        app_path(Celery("nowhere", set_as_current=False))


def test_the_apps_own_module_is_preferred_to_a_test_module_holding_it() -> None:
    import types

    from celery import Celery

    app = Celery("real_home", set_as_current=False)
    modules = {name: types.ModuleType(name) for name in ("test_uses_it", "real_home")}
    for module in modules.values():  # the test module first, as an import order may have it
        module.app = app  # type: ignore[attr-defined]
        sys.modules[module.__name__] = module
    try:
        assert app_path(app) == "real_home:app"
    finally:
        for name in modules:
            del sys.modules[name]
