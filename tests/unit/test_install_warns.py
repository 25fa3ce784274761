"""``install(app)`` warns of invalid settings in any process, a producer too, and boots."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
from celery import Celery

import celery_fair
from celery_fair.errors import FairConfigWarning


def _installed(app: Celery) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        celery_fair.install(app)
        celery_fair.install(app)  # twice: still once
        app.finalize()
    return [str(w.message) for w in caught if issubclass(w.category, FairConfigWarning)]


def _app(**conf: object) -> Celery:
    app = Celery("producer", broker="memory://", set_as_current=False)
    app.conf.update(conf)
    return app


def test_a_producer_with_a_bad_fair_keys_gets_one_warning_naming_it_and_still_boots() -> None:
    app = _app(fair_keys={"jobs": "args:0"})
    messages = _installed(app)
    assert len(messages) == 1, messages
    assert "fair_keys['jobs']='args:0'" in messages[0]
    assert "a worker refuses to start with it" in messages[0]
    assert "every task this app sends raises it" in messages[0]


@pytest.mark.parametrize(
    ("conf", "named"),
    [
        ({"fair_weights": "a=-1"}, "fair_weights['a'] must be a positive number, got '-1'"),
        ({"fair_key_max_backlog": {"*": 0}}, "fair_key_max_backlog"),
        ({"fair_broker_memory_high": 2}, "fair_broker_memory_high"),
        ({"fair_live_weights_ttl": -5}, "fair_live_weights_ttl"),
        ({"fair_kyes": {"jobs": "tenant_id"}}, "did you mean fair_keys?"),
    ],
)
def test_each_bad_or_unknown_setting_is_named(conf: dict[str, object], named: str) -> None:
    messages = _installed(_app(**conf))
    assert len(messages) == 1 and named in messages[0], messages


def test_a_good_configuration_gets_no_warning() -> None:
    app = _app(
        fair_weights={"a": 2}, fair_keys={"jobs": "tenant_id"}, fair_key_max_backlog={"*": 10}
    )
    assert _installed(app) == []
    assert _installed(_app()) == []


def test_settings_read_after_install_are_checked_when_read_django_style() -> None:
    class Settings:
        CELERY_BROKER_URL = "memory://"
        CELERY_FAIR_KEYS = {"jobs": "args:0"}

    app = Celery("django_producer", set_as_current=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        celery_fair.install(app)  # before the settings: nothing to say yet
        assert not caught
        app.config_from_object(Settings, namespace="CELERY")
        app.finalize()
        app.conf.get("broker_url")
    messages = [str(w.message) for w in caught if issubclass(w.category, FairConfigWarning)]
    assert len(messages) == 1, messages
    assert "CELERY_FAIR_KEYS['jobs']='args:0'" in messages[0]


def test_the_warning_can_be_made_an_error_by_a_filter() -> None:
    code = (
        "import celery, celery_fair\n"
        "app = celery.Celery('p', broker='memory://', set_as_current=False)\n"
        "app.conf.fair_weights = 'a=x'\n"
        "celery_fair.install(app)\n"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "FairConfigWarning" in shown.stderr, shown.stderr
    # As the docs say: a filter set in code (Python's -W cannot name a package's
    # warning class, it is read before the package can be imported).
    strict = code.replace(
        "celery_fair.install(app)",
        "import warnings\nwarnings.simplefilter('error', celery_fair.FairConfigWarning)\n"
        "celery_fair.install(app)",
    )
    refused = subprocess.run(
        [sys.executable, "-c", strict],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "fair_weights['a']" in refused.stderr
