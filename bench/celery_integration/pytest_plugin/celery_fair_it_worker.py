"""The app module of the suite's shared worker in ``--worker subprocess`` mode.

``celery -A celery_fair_it_worker worker`` (started by the ``celery_session_worker``
fixture of ``celery_fair_it``) loads this module.  It builds the app a deployment
would have, configured as the suite's session app is (``TestApp``, Celery's test app:
a ``Celery`` with a few test defaults under the suite's ``celery_config``; the suite's
``test_conf`` reads them back from the worker), the suite's task modules imported and
its class-based tasks registered, and in the celery-fair runs
``celery_fair.install(app)`` (after ``fair_keys`` in the keyed run), as a user's
``proj/celery.py`` does.  Everything comes from the JSON file named by
``CELERY_FAIR_IT_WORKER``, written by the fixture:

``main``, ``config``, ``includes`` (module names), ``class_tasks`` (``module:qualname``),
``fair`` and ``keyed`` (bools), ``status`` (a path).

When the worker is ready it writes ``status``: its steps (the celery-fair bootsteps,
and Mingle, Gossip and Heart, which Celery's defaults keep on), pool and concurrency.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

from celery import signals
from celery.contrib.testing.app import TestApp

__all__ = ("app",)

with open(os.environ["CELERY_FAIR_IT_WORKER"], encoding="utf-8") as _fh:
    SPEC: dict[str, Any] = json.load(_fh)

# As celery.contrib.pytest builds the session app; logging on, as the suite asks
# (celery_enable_logging), or `celery worker -l INFO` would log nothing.
# TestApp imports celery.contrib.testing.tasks: celery.ping, which the fixture sends.
app = TestApp(name=SPEC["main"], config=SPEC["config"], enable_logging=True, set_as_current=True)
for _module in SPEC["includes"]:
    importlib.import_module(_module)
for _path in SPEC["class_tasks"]:
    _module, _, _qualname = _path.partition(":")
    _obj: Any = importlib.import_module(_module)
    for _part in _qualname.split("."):
        _obj = getattr(_obj, _part)
    app.register_task(_obj)
if SPEC["keyed"]:
    from celery_fair_it_keys import fair_keys_for

    app.conf.fair_keys = fair_keys_for(app)
if SPEC["fair"]:
    import celery_fair

    celery_fair.install(app)


@signals.worker_ready.connect(weak=False)
def _write_status(sender: Any = None, **kwargs: Any) -> None:
    """Record what this worker runs (``sender`` is its consumer)."""
    controller = sender.controller
    worker_steps = [str(name) for name in controller.blueprint.steps]
    # The step instances, after Blueprint.apply: enabled says whether each one runs.
    enabled = {str(n): bool(getattr(s, "enabled", True)) for n, s in sender.blueprint.steps.items()}
    consumer_steps = sorted(enabled)
    status = {
        "kind": "subprocess",
        "hostname": controller.hostname,
        "pid": os.getpid(),
        "pool": type(controller.pool).__module__,
        "concurrency": controller.concurrency,
        "worker_steps": worker_steps,
        "consumer_steps": consumer_steps,
        "fair_step": any("celery_fair" in name for name in worker_steps),
        "fair_service": hasattr(controller, "fair"),
        "fair_keys": {q: repr(src) for q, src in (app.conf.get("fair_keys") or {}).items()},
        # Celery's defaults, which the embedded test worker switches off.
        "mingle": enabled.get("celery.worker.consumer.mingle.Mingle", False),
        "gossip": enabled.get("celery.worker.consumer.gossip.Gossip", False),
        "heart": enabled.get("celery.worker.consumer.heart.Heart", False),
    }
    tmp = SPEC["status"] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(status, fh)
    os.replace(tmp, SPEC["status"])
