"""``fair_eta``: the setting's checks and the sender's stamp (no broker: the hook alone)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery import Celery

from celery_fair.errors import FairConfigError
from celery_fair.keys.eta import _scheduling_sender, due_time, parse_eta_mode
from celery_fair.wire import DUE_HEADER
from celery_fair.worker.settings import FairSettings


def test_the_setting_takes_worker_or_broker_and_names_itself_otherwise() -> None:
    assert parse_eta_mode(None) == "worker"
    assert FairSettings.from_conf({}).eta == "worker"
    assert FairSettings.from_conf({"fair_eta": "broker"}).eta == "broker"
    with pytest.raises(FairConfigError, match="fair_eta must be one of 'worker', 'broker'"):
        FairSettings.from_conf({"fair_eta": "later"})
    with pytest.raises(FairConfigError, match="fair_eta='broker' needs fair_atomic_fetch"):
        FairSettings.from_conf({"fair_eta": "broker", "fair_atomic_fetch": False})


def _sent(app: Celery, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The headers and options a send with ``options`` reaches Celery's sender with."""
    extra = options.pop("headers", None)
    message = app.amqp.as_task_v2("id-1", "t", **options)
    seen: dict[str, Any] = {}

    def original(producer: Any, name: str, message: Any, **kw: Any) -> None:
        seen.update(kw)

    kwargs = {"headers": extra} if extra is not None else {}
    _scheduling_sender(app)(original, None, "t", message, **kwargs)
    return message.headers, seen


def test_a_future_eta_is_stamped_with_its_due_time_and_a_past_one_is_not() -> None:
    app = Celery("eta_unit", set_as_current=False)
    before = time.time()
    headers, _ = _sent(app, countdown=30)
    assert headers[DUE_HEADER] == pytest.approx(due_time(headers["eta"]))
    assert before + 29 < headers[DUE_HEADER] < time.time() + 31
    headers, _ = _sent(app)
    assert DUE_HEADER not in headers
    headers, _ = _sent(app, countdown=-5)
    assert headers["eta"] is not None and DUE_HEADER not in headers


def test_a_retry_does_not_bring_back_its_first_runs_due_time() -> None:
    # Celery merges the request's headers (options["headers"]) over the message's after
    # the hook: a stale fair_due there would win over the retry's own.
    app = Celery("eta_unit", set_as_current=False)
    headers, seen = _sent(app, countdown=30, headers={DUE_HEADER: 1.0, "other": 1})
    assert seen["headers"] == {"other": 1}
    assert headers[DUE_HEADER] > time.time()
