"""The pytest plugin of ``celery_fair.testing`` (entry point ``pytest11``).

Inert until a test asks for one of its fixtures: nothing starts at import,
nothing is autouse.

* ``fair_broker`` (session): the :class:`~celery_fair.testing.Broker` to test
  against: ``$CELERY_FAIR_TEST_BROKER_URL``, or a ``redis-server`` started on
  a free loopback port; the tests that ask for it are skipped, with the reason,
  when there is neither.
* ``fair_broker_url``: its URL, for one test; a Redis the session started is
  emptied after the test (a broker you run is never touched).
* ``fair_worker``: a factory of real ``celery worker`` subprocesses on that
  broker (:class:`~celery_fair.testing.FairWorker`); each is started ready and
  stopped at the end of the test.
* ``fair_clock``: a :class:`~celery_fair.testing.FakeClock` at 0.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .broker import BROKER_URL_ENV, Broker, BrokerUnavailable, find_broker, use_broker
from .clock import FakeClock
from .worker import FairWorker

__all__ = ("fair_broker", "fair_broker_url", "fair_clock", "fair_worker")


@pytest.fixture(scope="session")
def fair_broker() -> Iterator[Broker]:
    """The session's broker (a Redis it starts, or ``$CELERY_FAIR_TEST_BROKER_URL``).

    Without either, the tests that need it are skipped with the reason; a
    ``$CELERY_FAIR_TEST_BROKER_URL`` that nothing answers at is an error.
    """
    found = find_broker()
    try:
        broker = found.__enter__()
    except BrokerUnavailable as exc:
        if os.environ.get(BROKER_URL_ENV, "").strip():
            pytest.fail(f"celery_fair.testing: {exc}", pytrace=False)
        pytest.skip(f"celery_fair.testing: {exc}")
    try:
        yield broker
    finally:
        found.__exit__(None, None, None)


@pytest.fixture
def fair_broker_url(fair_broker: Broker) -> Iterator[str]:
    """The broker's URL for one test; a Redis the session started is emptied after it."""
    yield fair_broker.url
    fair_broker.flush()


@pytest.fixture
def fair_worker(
    fair_broker_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., FairWorker]]:
    """Start real ``celery worker`` processes: ``fair_worker(app, queues=[...], ...)``.

    Takes :class:`~celery_fair.testing.FairWorker`'s arguments (the broker
    is the fixture's).  Returns the worker, started and answering pings; use
    it as a context manager to stop it inside the test, or let the fixture
    stop it.  Given the app object (not its ``-A`` string), the app in the
    test's process is pointed at the same broker until the end of the test,
    so ``task.delay()`` publishes where the worker consumes.
    """
    workers: list[FairWorker] = []
    with contextlib.ExitStack() as stack:

        def start(app: Any, **options: Any) -> FairWorker:
            if not isinstance(app, str):
                stack.enter_context(use_broker(app, fair_broker_url))
            options.setdefault("workdir", tmp_path_factory.mktemp("fair-worker"))
            worker = FairWorker(app, fair_broker_url, **options)
            workers.append(worker)
            return worker.start()

        try:
            yield start
        finally:
            for worker in reversed(workers):
                worker.stop()


@pytest.fixture
def fair_clock() -> FakeClock:
    """A :class:`~celery_fair.testing.FakeClock` at 0, for the pure core's ``clock=``."""
    return FakeClock()
