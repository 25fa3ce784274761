"""The commands' surface, in process: defaults in --help, misspelt options, capture's
defaults from the app's settings, report's check of its telemetry directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_fair.analytics import report as report_module
from celery_fair.analytics.report import check_directory, short_run_conf
from celery_fair.cli import BAD_INPUT, build_parser, main
from celery_fair.cli_options import UsageError
from celery_fair.monitoring import capture_cli


def helps() -> dict[str, str]:
    parser = build_parser(prog="celery fair")
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = {"": parser.format_help()}
    found.update((name, sub.format_help()) for name, sub in action.choices.items())
    return {name: " ".join(text.split()) for name, text in found.items()}


def test_help_shows_the_defaults_that_say_something() -> None:
    shown = helps()
    assert "--keys KEYS number of keys (default: 100000)" in shown["ring"]
    assert "seed of the random keys (default: 0)" in shown["ring"]  # 0 is a default
    assert "--top TOP largest keys per keyed queue (default: 10)" in shown["exporter"]
    assert "(default: fair-report)" in shown["report"]
    assert "a key's share of all served cost (default: 0.25)" in shown["report"]
    # A help that speaks of its default keeps its own words, once.
    assert "(default: the app's fair_cost, count when unset)" in shown["capture"]
    assert shown["report"].count("(default: auto)") == 1
    for name, text in shown.items():
        for nothing in ("(default: None)", "(default: False)", "(default: [])", "(default: )"):
            assert nothing not in text, (name, nothing)


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == BAD_INPUT
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_misspelt_option_is_answered_with_the_closest_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    said = error_of(["ring", "--queues", "a=1", "--sed", "3"], capsys)
    assert said == "celery-fair ring: error: unrecognized arguments: --sed (did you mean --seed?) 3"
    # Misspelt for a required option: argparse would only say the option is missing.
    said = error_of(["ring", "--queus", "a=1"], capsys)
    assert said.endswith("unrecognized arguments: --queus (did you mean --queues?)"), said
    said = error_of(["exporter", "-b", "redis://x", "--top-keys=3"], capsys)
    assert said.endswith("--top-keys=3 (did you mean --top?)"), said
    # Nothing close: argparse's own words.
    said = error_of(["ring", "--queues", "a=1", "--zzzzzz"], capsys)
    assert said.endswith("unrecognized arguments: --zzzzzz"), said


class Captured:
    """Stands for capture_events: what the command passed, and counts to return."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, app: Any, out: Any, **kwargs: Any) -> dict[str, int]:
        self.calls.append({"app": app, "out": out, **kwargs})
        return {"records": 2, "unfinished": 1, "written": 2, "dropped": 0, "files": 1}


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Captured:
    fake = Captured()
    monkeypatch.setattr(capture_cli, "capture_events", fake)
    # The command stops on SIGINT/SIGTERM: not this test process's handlers.
    monkeypatch.setattr(capture_cli.signal, "signal", lambda *_: None)
    return fake


def test_capture_takes_its_defaults_from_the_apps_settings(
    captured: Captured, capsys: pytest.CaptureFixture[str]
) -> None:
    app = Celery("proj", set_as_current=False)
    app.conf.fair_cost = "runtime"
    app.conf.fair_weights = "a=2,b=1"
    # celery -A proj fair capture: the app is Celery's, --app may be left out.
    assert main(["capture", "--out", "t", "--json"], app=app) == 0
    call = captured.calls[-1]
    assert call["app"] is app and call["cost"] == "runtime"
    assert call["weights"] == {"a": 2.0, "b": 1.0}
    out = capsys.readouterr()
    assert json.loads(out.out) == {
        "records": 2, "unfinished": 1, "written": 2, "dropped": 0, "files": 1,
    }  # fmt: skip
    assert "capturing" not in out.out  # with --json, stdout is the one object
    # The command line wins over the settings.
    assert main(["capture", "--out", "t", "--cost", "count", "--queues", "c=3"], app=app) == 0
    call = captured.calls[-1]
    assert call["cost"] == "count" and call["weights"] == {"c": 3.0}
    assert capsys.readouterr().out.splitlines()[-1] == (
        "records 2, unfinished 1, written 2, dropped 0, files 1"
    )


def test_capture_without_settings_charges_a_count(captured: Captured) -> None:
    app = Celery("plain", set_as_current=False)
    assert main(["capture", "--out", "t"], app=app) == 0
    assert captured.calls[-1]["cost"] == "count" and captured.calls[-1]["weights"] == {}


def test_capture_bad_input_is_one_line(
    captured: Captured, capsys: pytest.CaptureFixture[str]
) -> None:
    app = Celery("proj", set_as_current=False)
    app.conf.fair_cost = "bogus"
    assert main(["capture", "--out", "t"], app=app) == BAD_INPUT
    assert capsys.readouterr().err == (
        "celery-fair capture: fair_cost must be one of 'count', 'runtime', 'dominant'; "
        "got 'bogus'\n"
    )
    assert main(["capture", "--out", "t", "-A", "nosuchmod_cli_test"]) == BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot load the Celery app" in err
    assert error_of(["capture", "-A", "x", "--out", "t", "--duration", "0"], capsys).endswith(
        "argument --duration: must be a positive number, not '0'"
    )
    assert captured.calls == []  # nothing was captured on bad input


def test_report_refuses_a_missing_or_empty_local_directory(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such telemetry directory"):
        check_directory(str(tmp_path / "nothing"))
    with pytest.raises(UsageError, match="no such telemetry directory"):
        check_directory(f"file://{tmp_path / 'nothing'}")
    empty = tmp_path / "empty"
    (empty / "_temporary").mkdir(parents=True)
    (empty / "_temporary" / "part-0.parquet").write_bytes(b"")
    (empty / "_SUCCESS").write_bytes(b"")
    (empty / ".part-0.parquet.crc").write_bytes(b"")
    with pytest.raises(UsageError, match="no telemetry files"):
        check_directory(str(empty))  # what Spark skips does not count
    (empty / "host-1" / "day=1").mkdir(parents=True)
    (empty / "host-1" / "day=1" / "fair-1.parquet").write_bytes(b"")
    check_directory(str(empty))  # a file below: left to Spark
    check_directory(f"file://{empty}")
    check_directory("s3a://bucket/telemetry")  # another file system: left to Spark


def test_report_says_a_missing_directory_before_spark_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_fair.analytics import report

    def no_spark(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Spark started")

    monkeypatch.setattr(report, "session", no_spark)
    assert main(["report", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"celery-fair report: {tmp_path / 'nothing'}: no such telemetry directory\n"
    )


SHORT_RUN = {"spark.driver.extraJavaOptions": report_module.SHORT_RUN_JAVA_OPTIONS}


@pytest.fixture
def no_java_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No variable of the JVM's, no spark-defaults.conf, not under spark-submit."""
    for name in (*report_module.JAVA_OPTION_VARIABLES, "SPARK_HOME", "PYSPARK_GATEWAY_PORT"):
        monkeypatch.delenv(name, raising=False)
    conf_dir = tmp_path / "spark-conf"
    conf_dir.mkdir()
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))
    return conf_dir


def test_a_short_runs_jvm_for_small_local_telemetry_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_java_settings: Path
) -> None:
    telemetry = tmp_path / "telemetry"
    (telemetry / "host-1").mkdir(parents=True)
    (telemetry / "host-1" / "fair-1.parquet").write_bytes(b"x" * 600)
    (telemetry / "_temporary").mkdir()
    (telemetry / "_temporary" / "part-0.parquet").write_bytes(b"x" * 600)  # Spark skips it
    monkeypatch.setattr(report_module, "SHORT_RUN_BYTES", 1000)
    assert short_run_conf(str(telemetry), None, {}) == SHORT_RUN
    assert short_run_conf(f"file://{telemetry}", "local[2]", {}) == SHORT_RUN
    assert short_run_conf(str(telemetry / "host-1" / "fair-1.parquet"), None, {}) == SHORT_RUN
    (telemetry / "host-1" / "fair-2.parquet").write_bytes(b"x" * 600)  # 1,200 bytes now
    assert short_run_conf(str(telemetry), None, {}) == {}
    assert short_run_conf(str(telemetry / "host-1" / "fair-1.parquet"), None, {}) == SHORT_RUN
    # Spark's JVM is not this process's, or its size is unknown here.
    one = str(telemetry / "host-1" / "fair-1.parquet")
    assert short_run_conf(one, "spark://head:7077", {}) == {}
    assert short_run_conf("s3a://bucket/telemetry", None, {}) == {}
    assert short_run_conf(str(tmp_path / "nothing"), None, {}) == {}
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "40000")  # under spark-submit
    assert short_run_conf(one, None, {}) == {}


@pytest.mark.parametrize("setting", report_module.JAVA_OPTION_SETTINGS)
def test_a_short_runs_jvm_leaves_the_users_java_options_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_java_settings: Path, setting: str
) -> None:
    """A second garbage collector on the command line would stop the JVM from starting."""
    telemetry = tmp_path / "fair-1.parquet"
    telemetry.write_bytes(b"x")
    assert short_run_conf(str(telemetry), None, {}) == SHORT_RUN
    assert short_run_conf(str(telemetry), None, {setting: "-XX:+UseG1GC"}) == {}
    assert short_run_conf(str(telemetry), None, {setting: ""}) == {}  # an explicit nothing
    (no_java_settings / "spark-defaults.conf").write_text(f"  {setting}  -XX:+UseG1GC\n")
    assert short_run_conf(str(telemetry), None, {}) == {}
    (no_java_settings / "spark-defaults.conf").write_text("spark.driver.memory 2g\n")
    assert short_run_conf(str(telemetry), None, {}) == SHORT_RUN
    (no_java_settings / "java-opts").write_text("-XX:+UseG1GC\n")  # read by Spark's launcher
    assert short_run_conf(str(telemetry), None, {}) == {}
    (no_java_settings / "java-opts").unlink()
    for name in report_module.JAVA_OPTION_VARIABLES:
        monkeypatch.setenv(name, "-Xmx1g")
        assert short_run_conf(str(telemetry), None, {}) == {}, name
        monkeypatch.delenv(name)
    monkeypatch.delenv("SPARK_CONF_DIR")
    monkeypatch.setenv("SPARK_HOME", str(no_java_settings.parent))
    (no_java_settings.parent / "conf").mkdir()
    assert short_run_conf(str(telemetry), None, {}) == SHORT_RUN
    (no_java_settings.parent / "conf" / "spark-defaults.conf").write_text(f"{setting} -Xss4m\n")
    assert short_run_conf(str(telemetry), None, {}) == {}


def test_a_short_runs_size_counts_what_spark_reads_through_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_java_settings: Path
) -> None:
    """Spark follows links to directories: their files count (each directory once, so a
    loop of links ends)."""
    monkeypatch.setattr(report_module, "SHORT_RUN_BYTES", 1000)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "fair-1.parquet").write_bytes(b"x" * 600)
    telemetry = tmp_path / "telemetry"
    telemetry.mkdir()
    (telemetry / "host-1").symlink_to(elsewhere)
    (elsewhere / "back").symlink_to(telemetry)  # a loop: walked once
    assert short_run_conf(str(telemetry), None, {}) == SHORT_RUN
    check_directory(str(telemetry))  # the linked file is one to read
    other = tmp_path / "other"
    other.mkdir()
    (other / "fair-2.parquet").write_bytes(b"x" * 600)
    (telemetry / "host-2").symlink_to(other)  # 1,200 bytes behind two links
    assert short_run_conf(str(telemetry), None, {}) == {}
    (telemetry / "host-2").unlink()
    (telemetry / "gone.parquet").symlink_to(tmp_path / "nothing")  # a size not known
    assert short_run_conf(str(telemetry), None, {}) == {}
    loop = tmp_path / "loop"
    loop.mkdir()
    (loop / "self").symlink_to(loop)
    with pytest.raises(UsageError, match="no telemetry files"):
        check_directory(str(loop))  # ends: no file behind the loop
