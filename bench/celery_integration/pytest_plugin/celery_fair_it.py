"""pytest plugin for running Celery's own integration tests with celery-fair.

Loaded with ``-p celery_fair_it`` (its directory on ``PYTHONPATH``) by
``python -m bench.celery_integration``; it imports nothing from the project
unless ``--celery-fair-install`` is given, so the plain run loads it too and
every run records its outcomes the same way.

``--celery-fair-install``
    Calls ``celery_fair.install(app)`` on every Celery app when it is
    finalized (``celery._state.connect_on_app_finalize``; checked on 5.3 to 5.7).
    The embedded test worker (``celery.contrib.testing.worker``) finalizes
    its app before it builds its blueprint, so the worker runs the
    celery-fair bootsteps; a ``celery worker`` subprocess started by a test
    does not load this plugin and runs plain.
``--celery-fair-keys``
    With ``--celery-fair-install``: before ``install``, sets ``fair_keys`` to
    key every task of the app's default queue by its name
    (``celery_fair_it_keys``), on every app whose broker is Redis and on the
    subprocess worker.
``--celery-fair-worker subprocess``
    Replaces the suite's ``celery_session_worker`` (Celery's embedded test
    worker: a thread in this process, mingle, gossip and heartbeat off) with
    a ``celery -A celery_fair_it_worker worker`` subprocess with Celery's
    defaults (``celery_fair_it_subprocess``).  ``embedded`` (the default)
    leaves the suite's fixture alone.
``--celery-fair-worker-dir DIR``
    Where the subprocess worker's spec, status and log (``worker.log``) go.
``--celery-fair-worker-args ARGS``
    More arguments for ``celery worker`` (one shell-quoted string).
``--celery-fair-report PATH``
    Appends one JSON line per test (final outcome after reruns, the number
    of reruns, the failure text) and one ``{"meta": ...}`` line at the end.
``--celery-fair-timeout-cap SECONDS``
    Lowers every ``@pytest.mark.timeout`` above SECONDS to SECONDS, so the
    ``flaky`` tests' 300 s marks cannot outlast ``--timeout``.
``--celery-fair-deselect NODEID``
    Deselects exactly this test (pytest's ``--deselect`` takes a prefix, which
    would also drop ``test_x2`` with ``test_x``).

With ``REDIS_PORT`` set it also makes Celery 5.3's
``t.integration.conftest.get_redis_connection`` (which reads ``REDIS_HOST``
only) use that port, as Celery 5.4+ does.  After each test it gives Celery's
process-wide ``task_join_will_block`` back the value it had before the test
(``_celery_fair_it_join_flag``).
"""

from __future__ import annotations

import inspect
import json
import os
import threading
from typing import Any

import pytest

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {
    "installed_apps": [],
    "keyed_apps": [],
    "workers": [],
    "join_flag_restored": [],
}


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("celery-fair integration")
    group.addoption("--celery-fair-install", action="store_true", default=False)
    group.addoption("--celery-fair-report", default=None)
    group.addoption("--celery-fair-timeout-cap", type=float, default=None)
    group.addoption("--celery-fair-deselect", action="append", default=[])
    group.addoption("--celery-fair-keys", action="store_true", default=False)
    group.addoption("--celery-fair-worker", choices=("embedded", "subprocess"), default="embedded")
    group.addoption("--celery-fair-worker-dir", default=None)
    group.addoption("--celery-fair-worker-args", default="")


def pytest_configure(config: Any) -> None:
    from celery import signals
    from celery.contrib.testing.worker import test_worker_started

    _STATE["report"] = config.getoption("--celery-fair-report")
    _STATE["keyed"] = config.getoption("--celery-fair-keys")
    signals.worker_ready.connect(_on_worker_ready, weak=False)
    test_worker_started.connect(_on_worker_ready, weak=False)
    if config.getoption("--celery-fair-install"):
        from celery._state import connect_on_app_finalize

        import celery_fair

        _STATE["celery_fair"] = os.path.dirname(celery_fair.__file__)
        connect_on_app_finalize(_install)


def _install(app: Any) -> None:
    import celery_fair

    keyed = _STATE["keyed"] and _on_redis(app)
    if keyed:
        from celery_fair_it_keys import fair_keys_for

        app.conf.fair_keys = fair_keys_for(app)
    celery_fair.install(app)
    with _LOCK:
        _STATE["installed_apps"].append(str(app.main or app))
        if keyed:
            _STATE["keyed_apps"].append(str(app.main or app))


def _on_redis(app: Any) -> bool:
    """Whether ``app``'s broker is Redis: the only broker ``fair_keys`` is for.

    A few tests build apps on the ``memory://`` transport (the Django fix-up tests
    of ``test_worker.py``); nobody keys those, and celery-fair refuses to build a
    worker for them with ``fair_keys`` (FairConfigError), as documented.
    """
    try:
        with app.connection_for_write() as conn:  # builds the transport, no connection yet
            return bool(conn.transport.driver_type == "redis")
    except Exception:
        return False


def _on_worker_ready(sender: Any = None, worker: Any = None, **kwargs: Any) -> None:
    """Record whether a worker that became ready runs the celery-fair steps.

    ``worker_ready`` comes from ``celery worker`` (sender: the consumer), the
    embedded test worker sends ``test_worker_started`` (``worker=``).
    """
    controller = worker if worker is not None else getattr(sender, "controller", None)
    steps = getattr(getattr(controller, "blueprint", None), "steps", {}) or {}
    with _LOCK:
        _STATE["workers"].append(
            {
                "kind": "embedded" if worker is not None else "in-process",
                "hostname": getattr(controller, "hostname", None),
                "fair_step": any("celery_fair" in str(name) for name in steps),
                "fair_service": hasattr(controller, "fair"),
            }
        )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: Any, parser: Any, args: Any) -> None:
    """The worker mode, known before the suite's conftest is imported (before pytest_configure)."""
    namespace = early_config.known_args_namespace
    _STATE["worker_mode"] = getattr(namespace, "celery_fair_worker", "embedded")


@pytest.hookimpl(tryfirst=True)
def pytest_plugin_registered(plugin: Any, manager: Any) -> None:
    """Patch ``t/integration/conftest.py`` as it is registered, before pytest reads its fixtures.

    In subprocess mode its ``celery_session_worker`` (imported there from
    ``celery.contrib.pytest``) becomes ours: a conftest's fixture wins over a
    plugin's, so the replacement has to be the conftest's own.  ``tryfirst``:
    older pytest reads a conftest's fixtures in its own ``pytest_plugin_registered``
    (pytest 9 waits until the conftest's directory is collected).
    """
    if getattr(plugin, "__name__", "") != "t.integration.conftest":
        return
    if _STATE.get("worker_mode") == "subprocess":
        from celery_fair_it_subprocess import subprocess_session_worker

        plugin.celery_session_worker = subprocess_session_worker
        _STATE["fixture_replaced"] = True
    _redis_port_for_celery_5_3(plugin)


def _redis_port_for_celery_5_3(plugin: Any) -> None:
    """Celery 5.3: give ``get_redis_connection`` the port of our private Redis."""
    original = getattr(plugin, "get_redis_connection", None)
    port = os.environ.get("REDIS_PORT")
    if original is None or port is None:
        return
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return
    if "REDIS_PORT" in source:
        return

    def get_redis_connection() -> Any:
        from redis import StrictRedis

        return StrictRedis(host=os.environ.get("REDIS_HOST", "localhost"), port=int(port))

    plugin.get_redis_connection = get_redis_connection


@pytest.fixture(autouse=True)
def _celery_fair_it_join_flag(request: Any) -> Any:
    """Give Celery's process-wide ``task_join_will_block`` back after each test.

    Building a worker sets it (``worker.components.Pool.create``), and the suite's
    tests that build one in the pytest process (the Django fix-up tests of
    ``test_worker.py``) leave it set: every later ``result.get()`` of the session
    then raises "Never call result.get() within a task!"
    (``test_pidbox_reset_after_repeated_control_errors``), in every run.  The tests
    that left it set are named in the result.
    """
    from celery import _state

    before = _state.task_join_will_block()
    yield
    if _state.task_join_will_block() != before:
        _state._set_task_join_will_block(before)
        with _LOCK:
            _STATE["join_flag_restored"].append(request.node.nodeid)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    exact = set(config.getoption("--celery-fair-deselect"))  # pytest's --deselect is a prefix
    if exact:
        deselected = [item for item in items if item.nodeid in exact]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item.nodeid not in exact]
    cap = config.getoption("--celery-fair-timeout-cap")
    if cap is None:
        return
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is None:
            continue
        value = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
        if value is not None and float(value) > cap:
            item.add_marker(pytest.mark.timeout(cap), append=False)


# Outcomes --------------------------------------------------------------------

_TESTS: dict[str, dict[str, Any]] = {}


def _record(nodeid: str) -> dict[str, Any]:
    return _TESTS.setdefault(
        nodeid,
        {"outcome": None, "reruns": 0, "duration": 0.0, "subtests_failed": [], "rerun_why": []},
    )


def _text(report: Any, limit: int = 3000) -> str:
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    return text[-limit:]


def pytest_runtest_logreport(report: Any) -> None:
    rec = _record(report.nodeid)
    subtest = hasattr(report, "context") and type(report).__name__.lower().startswith("subtest")
    if not subtest:  # a subtest's time is part of its test's call
        rec["duration"] += getattr(report, "duration", 0.0) or 0.0
    if report.outcome == "rerun":  # pytest-rerunfailures: this attempt is discarded
        rec["reruns"] += 1
        rec["rerun_why"].append(_first_error_line(_text(report)))
        rec.update(outcome=None, subtests_failed=[], longrepr=None, pending_rerun=True)
        return
    if rec.get("pending_rerun"):  # the rest of a discarded attempt (its teardown)
        return
    if subtest:
        if report.failed:
            context = report.context
            label = getattr(context, "msg", None) or json.dumps(
                getattr(context, "kwargs", {}), default=str, sort_keys=True
            )
            rec["subtests_failed"].append(str(label))
            rec["longrepr"] = _text(report)
        return
    xfail = hasattr(report, "wasxfail")
    if report.when == "setup":
        if report.failed:
            rec.update(outcome="error", longrepr=_text(report))
        elif report.skipped:
            rec.update(outcome="xfailed" if xfail else "skipped", longrepr=_text(report, 500))
    elif report.when == "call":
        if report.passed:
            rec["outcome"] = "xpassed" if xfail else "passed"
        elif report.failed:
            rec["outcome"] = "failed"
            if not rec["subtests_failed"]:  # else "contains N failed subtests": keep theirs
                rec["longrepr"] = _text(report)
        else:
            rec.update(outcome="xfailed" if xfail else "skipped", longrepr=_text(report, 500))
    elif report.when == "teardown" and report.failed and rec["outcome"] in (None, "passed"):
        rec.update(outcome="error", longrepr=_text(report))


def _first_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("E ")]
    return (lines[0] if lines else text.strip().splitlines()[-1] if text.strip() else "")[:300]


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    rec = _TESTS.get(nodeid)
    if rec is None:
        return
    if rec.pop("pending_rerun", False):  # pytest-rerunfailures runs it again
        return
    del _TESTS[nodeid]
    if rec["subtests_failed"] and rec["outcome"] in ("passed", None):
        rec["outcome"] = "failed"
    if rec["outcome"] is None:
        rec["outcome"] = "error"
    _write({"nodeid": nodeid, **rec})


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _write(
            {
                "nodeid": report.nodeid,
                "outcome": "error",
                "phase": "collect",
                "longrepr": _text(report),
                "reruns": 0,
                "duration": 0.0,
            }
        )


def pytest_sessionfinish(session: Any, exitstatus: Any) -> None:
    workers = list(_STATE["workers"])
    if _STATE.get("worker_mode") == "subprocess":
        from celery_fair_it_subprocess import WORKERS

        workers = [*WORKERS, *workers]
    with _LOCK:
        meta = {
            "exitstatus": int(exitstatus),
            "celery_fair_install": bool(session.config.getoption("--celery-fair-install")),
            "celery_fair_keys": bool(_STATE.get("keyed")),
            "celery_fair_path": _STATE.get("celery_fair"),
            "installed_apps": len(_STATE["installed_apps"]),
            "keyed_apps": len(_STATE["keyed_apps"]),
            "worker_mode": _STATE.get("worker_mode", "embedded"),
            "session_worker_fixture_replaced": bool(_STATE.get("fixture_replaced")),
            "workers": workers,
            "join_flag_restored_after": list(_STATE["join_flag_restored"]),
        }
    _write({"meta": meta})


def _write(line: dict[str, Any]) -> None:
    target = _STATE.get("report")
    if not target:
        return
    with _LOCK, open(target, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(line, default=str) + "\n")
