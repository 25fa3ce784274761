"""``celery_fair.check(app)``: the settings checked as a worker checks them, and shown."""

from __future__ import annotations

import pytest
from celery import Celery

import celery_fair
from celery_fair.cli import BAD_INPUT, main


def app_with(**conf: object) -> Celery:
    app = Celery("proj", broker="memory://", set_as_current=False)
    app.conf.update(conf)
    return celery_fair.install(app)


def test_check_returns_what_is_in_force_and_warns_of_unknown_names() -> None:
    found = celery_fair.check(app_with(fair_weights={"a": 3}, fair_costs="runtime"))
    assert dict(found.settings.weights) == {"a": 3.0}
    rows = {name: (value, is_set) for name, value, is_set in found.in_force}
    assert rows["fair_weights"] == ({"a": 3}, True)
    assert rows["fair_cost"] == ("count", False)
    assert len(found.warnings) == 1 and "fair_costs" in found.warnings[0]
    assert "fair_cost" in found.warnings[0]  # the closest name


def test_check_refuses_what_a_worker_would_refuse() -> None:
    with pytest.raises(celery_fair.FairConfigError, match="fair_key_concurrency"):
        celery_fair.check(app_with(fair_key_concurrency={"*": 2}))
    with pytest.raises(celery_fair.FairConfigError, match="fair_default_weight"):
        celery_fair.check(app_with(fair_default_weight=-1))


def test_check_accepts_keyed_settings_on_rabbitmq_and_bounds_its_limits() -> None:
    def amqp(**conf: object) -> Celery:
        app = Celery("proj", broker="amqp://guest@localhost//", set_as_current=False)
        app.conf.update(conf)
        return app  # nothing connects: the transport is read from the URL

    keys = {"fair_keys": {"jobs": "tenant_id"}}
    assert dict(celery_fair.check(amqp(**keys, fair_key_weights="a=2")).settings.keys)
    # Per-key limits are limit tokens on RabbitMQ: accepted.
    limited = celery_fair.check(
        amqp(**keys, fair_key_rate_limit={"*": "5/s"}, fair_key_concurrency="*=2")
    ).settings.key_limits
    assert dict(limited.rates) == {"*": 5.0} and dict(limited.concurrency) == {"*": 2}
    # Backlog caps are counters on RabbitMQ: accepted.
    capped = celery_fair.check(amqp(**keys, fair_key_max_backlog={"*": 100}))
    assert dict(capped.settings.key_max_backlog) == {"*": 100}
    two_level = celery_fair.check(amqp(fair_keys={"jobs": ("tenant_id", "user_id")}))
    assert set(two_level.settings.keys) == {"jobs"}  # two-level keys work on RabbitMQ
    # Weighted priority levels are lanes per level on RabbitMQ: accepted.
    weighted = celery_fair.check(amqp(**keys, fair_priority="weighted"))
    assert weighted.settings.priority_weights == {}
    # A concurrency limit is that many token messages per key: bounded, and said so.
    at_most = celery_fair.check(amqp(**keys, fair_key_concurrency={"*": 2, "gold": 1000}))
    assert dict(at_most.settings.key_limits.concurrency) == {"*": 2, "gold": 1000}
    with pytest.raises(
        celery_fair.FairConfigError, match=r"fair_key_concurrency\['gold'\]=1001: .* at most 1,000"
    ):
        celery_fair.check(amqp(**keys, fair_key_concurrency={"*": 2, "gold": 1001}))
    # Redis counts a key's running tasks: no such bound there.
    redis = Celery("proj", broker="redis://localhost/0", set_as_current=False)
    redis.conf.update(keys, fair_key_concurrency={"gold": 5000})
    assert dict(celery_fair.check(redis).settings.key_limits.concurrency) == {"gold": 5000}


def test_the_check_command_prints_the_settings_or_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["check"], app=app_with(fair_weights={"a": 3})) == 0
    out = capsys.readouterr().out
    assert "fair_weights  {'a': 3}" in out and "ok: a worker would start" in out
    assert "fair_cost" not in out  # left at its default: shown with --all
    assert main(["check", "--all"], app=app_with()) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["fair_cost", "'count'", "(default)"] in lines
    assert main(["check"], app=app_with(fair_default_weight="x")) == BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("celery-fair check: ") and "'x'" in err[0], err


def test_errors_name_a_setting_as_a_django_project_spells_it() -> None:
    class Settings:
        CELERY_BROKER_URL = "memory://"
        CELERY_FAIR_CREDIT = "abc"
        CELERY_FAIR_KEY_CONCURRENCY = {"*": 2}

    app = Celery("proj", set_as_current=False)
    app.config_from_object(Settings, namespace="CELERY")
    celery_fair.install(app)
    with pytest.raises(celery_fair.FairConfigError) as found:
        celery_fair.check(app)
    message = str(found.value)
    assert "CELERY_FAIR_CREDIT" in message and "'abc'" in message
    assert "fair_credit" not in message
    # Without a namespace, the names stay as the settings spell them.
    with pytest.raises(celery_fair.FairConfigError, match=r"^fair_credit must"):
        celery_fair.check(app_with(fair_credit="abc"))
