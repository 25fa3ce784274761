"""Fixtures of the example: the worker of ``proj``, started by ``celery_fair.testing``.

With celery-fair installed, its pytest plugin is loaded already (the ``pytest11``
entry point); its fixtures (``fair_worker``, ``fair_broker_url``, ``fair_clock``)
do nothing until a test asks for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from celery_fair.testing import FairWorker, use_broker


@pytest.fixture
def app(fair_broker_url: str) -> Iterator[Celery]:
    """The project's app, publishing to the test broker for the test's duration."""
    import proj

    with use_broker(proj.app, fair_broker_url):
        yield proj.app


@pytest.fixture
def proj_worker(app: Celery, fair_worker: Callable[..., FairWorker]) -> Callable[..., FairWorker]:
    """Start ``celery -A proj worker`` with these options, on the test broker; it is
    stopped at the end of the test (or of its ``with`` block)."""

    def start(**options: Any) -> FairWorker:
        return fair_worker(app, **options)

    return start
