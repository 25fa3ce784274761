"""Settings are validated at worker start, naming the setting and the value."""

from __future__ import annotations

import argparse

import pytest

import celery_fair
from celery_fair.errors import FairConfigError
from celery_fair.worker.settings import FairSettings, parse_weights


def test_weights_from_mapping_and_string() -> None:
    assert parse_weights({"p0": 4, "p1": "8"}) == {"p0": 4.0, "p1": 8.0}
    assert parse_weights(" p0=4, p1=8 ,") == {"p0": 4.0, "p1": 8.0}


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ({"p0": 0}, "fair_weights['p0'] must be a positive number, got 0"),
        ({"p0": -2}, "got -2"),
        ({"p0": "abc"}, "got 'abc'"),
        ({"p0": True}, "got True"),
        ({"p0": float("nan")}, "got nan"),
        ("p0=4,p1", "bad item 'p1'"),
        ("p0=", "bad item 'p0='"),
        (["p0"], "must be a mapping"),
    ],
)
def test_bad_weights_name_the_setting_and_value(value: object, fragment: str) -> None:
    with pytest.raises(FairConfigError) as info:
        parse_weights(value)
    assert fragment in str(info.value)
    assert "fair_weights" in str(info.value)


def test_cli_option_overrides_the_setting() -> None:
    conf = {"fair_weights": {"a": 1, "b": 2}}
    assert FairSettings.from_conf(conf).weights == {"a": 1, "b": 2}
    assert FairSettings.from_conf(conf, cli_weights="a=5").weights == {"a": 5}
    with pytest.raises(FairConfigError, match=r"--fair-weights\['a'\].*got 'x'"):
        FairSettings.from_conf(conf, cli_weights="a=x")


@pytest.mark.parametrize(
    ("conf", "fragment"),
    [
        (
            {"fair_cost": "time"},
            "fair_cost must be one of 'count', 'runtime', 'dominant'; got 'time'",
        ),
        ({"fair_default_weight": 0}, "fair_default_weight must be a positive number, got 0"),
        ({"fair_runtime_quantum": -1}, "fair_runtime_quantum must be a positive number"),
        ({"fair_credit": 0}, "fair_credit must be a positive integer or None, got 0"),
        ({"fair_credit": 2.5}, "got 2.5"),
    ],
)
def test_other_bad_settings(conf: dict[str, object], fragment: str) -> None:
    with pytest.raises(FairConfigError) as info:
        FairSettings.from_conf(conf)
    assert fragment in str(info.value)


def test_defaults() -> None:
    settings = FairSettings.from_conf({})
    assert settings.weights == {} and settings.cost == "count"
    assert settings.default_weight == 1.0 and settings.credit is None


def test_public_api_is_exported() -> None:
    for name in celery_fair.__all__:
        assert hasattr(celery_fair, name), name
    assert "install" in celery_fair.__all__


def test_install_adds_and_never_replaces_configuration() -> None:
    from celery import Celery

    app = Celery("t", set_as_current=False)
    app.conf.broker_transport_options = {"visibility_timeout": 42}
    app.conf.fair_weights = {"a": 3}
    celery_fair.install(app)
    celery_fair.install(app)  # idempotent
    assert app.conf.broker_transport_options == {"visibility_timeout": 42}
    assert app.conf.fair_weights == {"a": 3}
    names = [getattr(s, "name", "") for s in app.steps["worker"]]
    assert names.count("celery_fair.worker") == 1
    options = [o.name for o in app.user_options["worker"]]
    assert options.count("fair_weights") == 1


@pytest.mark.parametrize(
    ("conf", "fragment"),
    [
        (
            {"fair_codel_target": 0.5, "fair_codel_interval": 0.1},
            "fair_codel_target=0.5: must be below fair_codel_interval=0.1",
        ),
        (
            {"fair_codel_target": 0.1},
            "fair_codel_interval=None: must be set with fair_codel_target=0.1",
        ),
        (
            {"fair_codel_interval": 1},
            "fair_codel_target=None: must be set with fair_codel_interval=1",
        ),
        (
            {"fair_codel_target": -1, "fair_codel_interval": 1},
            "fair_codel_target=-1: must be a positive",
        ),
        ({"fair_codel_target": 0.1, "fair_codel_interval": "x"}, "fair_codel_interval='x'"),
        ({"fair_codel_action": "drop"}, "fair_codel_action='drop': must be one of"),
        ({"fair_codel_max_requeues": -1}, "fair_codel_max_requeues=-1: must be an integer >= 0"),
    ],
)
def test_codel_settings_are_validated(conf: dict[str, object], fragment: str) -> None:
    with pytest.raises(FairConfigError) as info:
        FairSettings.from_conf(conf)
    assert fragment in str(info.value)


def test_codel_is_off_unless_both_are_set() -> None:
    assert not FairSettings.from_conf({}).codel
    on = FairSettings.from_conf({"fair_codel_target": 0.1, "fair_codel_interval": 1.0})
    assert on.codel and on.codel_action == "requeue" and on.codel_max_requeues == 3


@pytest.mark.parametrize(
    ("conf", "fragment"),
    [
        ({"fair_metrics_port": 70000}, "fair_metrics_port must be a TCP port number 0-65535"),
        ({"fair_metrics_port": -1}, "got -1"),
        ({"fair_metrics_port": True}, "got True"),
        ({"fair_metrics_port": "http"}, "got 'http'"),
        ({"fair_metrics_port": 9100, "fair_metrics_addr": "localhost"}, "got 'localhost'"),
        ({"fair_metrics_port": 9100, "fair_metrics_addr": 5}, "fair_metrics_addr must be an IP"),
    ],
)
def test_metrics_settings_are_validated(conf: dict[str, object], fragment: str) -> None:
    with pytest.raises(FairConfigError) as info:
        FairSettings.from_conf(conf)
    assert fragment in str(info.value)


def test_metrics_are_off_by_default_and_listen_on_loopback() -> None:
    assert FairSettings.from_conf({}).metrics_port is None
    on = FairSettings.from_conf({"fair_metrics_port": "9100"})
    assert on.metrics_port == 9100 and on.metrics_addr == "127.0.0.1"
    everywhere = FairSettings.from_conf({"fair_metrics_port": 0, "fair_metrics_addr": "::"})
    assert everywhere.metrics_port == 0 and everywhere.metrics_addr == "::"


def test_a_misspelt_setting_is_named_with_the_closest_known_one() -> None:
    from celery import Celery

    from celery_fair.worker.settings import unknown_settings

    class DjangoSettings:
        CELERY_FAIR_WIEGHTS = {"a": 1}
        CELERY_FAIR_COST = "count"

    app = Celery("settings_unit", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    app.conf.fair_costs = "runtime"
    app.conf.fair_weights = {"a": 2}  # known: not named
    assert sorted(unknown_settings(app.conf)) == [
        "celery-fair: unknown setting CELERY_FAIR_WIEGHTS (it is ignored); "
        "did you mean CELERY_FAIR_WEIGHTS?",
        "celery-fair: unknown setting fair_costs (it is ignored); did you mean fair_cost?",
    ]
    app.conf.fair_zzzzzzzz = 1  # close to no known name (fair_eta is close to "fair_zzz")
    unknown = unknown_settings(app.conf)
    assert "celery-fair: unknown setting fair_zzzzzzzz (it is ignored)" in unknown


def test_django_style_settings_reach_the_worker() -> None:
    # app.config_from_object("django.conf:settings", namespace="CELERY")
    from celery import Celery

    class DjangoSettings:
        CELERY_FAIR_WEIGHTS = {"critical": 8, "bulk": 1}
        CELERY_FAIR_COST = "runtime"

    app = Celery("django_unit", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    settings = FairSettings.from_conf(app.conf)
    assert settings.weights == {"critical": 8.0, "bulk": 1.0} and settings.cost == "runtime"


def test_a_name_given_twice_is_an_error_in_every_pairs_list() -> None:
    # One grammar for settings, options, remote control and the command line.
    from celery_fair.cli_options import queue_weights

    with pytest.raises(FairConfigError, match=r"fair_weights: queue 'a' appears twice"):
        parse_weights("a=1,b=2,a=3")
    with pytest.raises(argparse.ArgumentTypeError, match=r"queue 't0' appears twice"):
        queue_weights("t0=1,t0")
    assert queue_weights("t0=10,t1") == {"t0": 10.0, "t1": 1.0}


def test_one_positive_integer_check_for_settings_options_and_the_command_line() -> None:
    from celery_fair.cli_options import positive_int
    from celery_fair.grammar import as_positive_int
    from celery_fair.kombu.mixin_options import _positive_int

    for good in (1, 7):
        assert as_positive_int(good) == good == _positive_int("window", good)
    for bad in (0, -2, True, 4.0, "4", None):
        assert as_positive_int(bad) is None
        with pytest.raises(ValueError, match=r"window=.*integer of at least 1"):
            _positive_int("window", bad)
    assert as_positive_int(" 4", text=True) == 4 == positive_int("4")
    with pytest.raises(FairConfigError, match="fair_credit must be a positive integer"):
        FairSettings.from_conf({"fair_credit": 2.0})
    with pytest.raises(argparse.ArgumentTypeError, match="integer of at least 1, not '0'"):
        positive_int("0")
