"""``celery_fair.testing``: test your own Celery tasks under celery-fair.

A pytest plugin (loaded by the ``pytest11`` entry point, inert until a test
uses a fixture) and the helpers it is made of, usable without pytest too:

* :class:`FairWorker`: a real ``celery worker`` of your app in a subprocess,
  ready when it answers a ping, stopped by its PID; it records each task it
  runs (:class:`TaskRecord`).
* :func:`find_broker`, :class:`Broker`, :func:`use_broker`,
  :class:`RedisServer`: the broker to test on (``$CELERY_FAIR_TEST_BROKER_URL``
  or a throw-away ``redis-server``).
* :func:`assert_shares`, :func:`shares`, :func:`backlogged_window`,
  :func:`assert_concurrency_at_most`, :func:`max_concurrency`: assertions over
  the records.
* :class:`FakeClock`: a clock that moves only when the test moves it.

See docs/testing.md.
"""

from __future__ import annotations

from .assertions import (
    assert_concurrency_at_most,
    assert_shares,
    backlogged_window,
    max_concurrency,
    shares,
)
from .broker import (
    BROKER_URL_ENV,
    REDIS_SERVER_ENV,
    Broker,
    BrokerUnavailable,
    find_broker,
    use_broker,
)
from .clock import FakeClock
from .processes import free_port, poll_until, stop_process
from .records import TaskRecord, read_records
from .redis_server import RedisServer
from .worker import FairWorker, WorkerFailed

__all__ = (
    "BROKER_URL_ENV",
    "REDIS_SERVER_ENV",
    "Broker",
    "BrokerUnavailable",
    "FairWorker",
    "FakeClock",
    "RedisServer",
    "TaskRecord",
    "WorkerFailed",
    "assert_concurrency_at_most",
    "assert_shares",
    "backlogged_window",
    "find_broker",
    "free_port",
    "max_concurrency",
    "poll_until",
    "read_records",
    "shares",
    "stop_process",
    "use_broker",
)
