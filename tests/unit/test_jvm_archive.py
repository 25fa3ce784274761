"""The report JVM's class archive: when it is written, tried, moved into place and used."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from celery_fair.analytics import jvm_archive
from celery_fair.analytics.jvm_archive import (
    ENV,
    KEEP,
    MAX_FAILURES,
    SETTLED,
    WRITER_MAX_AGE,
    Archive,
    archive_for,
    cache_dir,
)

OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseParallelGC"


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _archive(tmp_path: Path, tried: list[Path], works: bool = True,
             clock: Clock | None = None) -> Archive:  # fmt: skip
    spark_home = tmp_path / "spark"
    (spark_home / "jars").mkdir(parents=True, exist_ok=True)

    def trial(part: Path) -> bool:
        tried.append(part)
        return works

    return Archive(tmp_path / "cache", OPTIONS, spark_home, trial=trial,
                   clock=clock or time.time)  # fmt: skip


def _written(tmp_path: Path, tried: list[Path], content: bytes, writer_pid: int,
             works: bool = True) -> Archive:  # fmt: skip
    """A first run's archive: its options asked for a part, its JVM (``writer_pid``)
    wrote ``content`` there."""
    archive = _archive(tmp_path, tried, works)
    assert archive.java_options().startswith("-XX:ArchiveClassesAtExit=")
    assert archive.part is not None
    archive.part.write_bytes(content)
    archive.writer_started(writer_pid)
    return archive


def test_the_first_run_writes_a_part_of_its_own_and_names_its_jvm(tmp_path: Path) -> None:
    tried: list[Path] = []
    archive = _archive(tmp_path, tried)
    options = archive.java_options()
    assert archive.part is not None and archive.part.parent == tmp_path / "cache"
    assert archive.part.name == f"{archive.ready.stem}.{os.getpid()}.part"
    assert options.startswith(f"-XX:ArchiveClassesAtExit={archive.part} ")
    assert "-Xlog:cds=off" in options and not tried
    archive.writer_started(1234)
    assert Path(f"{archive.part}.pid").read_text() == "1234"


def test_a_part_is_left_alone_while_its_jvm_runs_then_tried_and_moved_into_place(
    tmp_path: Path,
) -> None:
    tried: list[Path] = []
    writer = _written(tmp_path, tried, b"archive", os.getpid())  # a live process: writing
    assert writer.part is not None
    assert _archive(tmp_path, tried).java_options() == "" and not tried
    Path(f"{writer.part}.pid").write_text(str(_dead_pid()))
    reader = _archive(tmp_path, tried)
    assert reader.java_options() == f"-XX:SharedArchiveFile={reader.ready} {jvm_archive.QUIET}"
    assert tried == [writer.part] and reader.ready.read_bytes() == b"archive"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        reader.ready.name,
        f"{reader.ready.name}.size",
    ]
    # Then used as it is, not tried again.
    assert _archive(tmp_path, tried).java_options().startswith("-XX:SharedArchiveFile=")
    assert len(tried) == 1


def test_a_part_no_jvm_can_use_is_removed_and_written_again(tmp_path: Path) -> None:
    tried: list[Path] = []
    writer = _written(tmp_path, tried, b"truncated", _dead_pid())
    again = _archive(tmp_path, tried, works=False)
    assert again.java_options().startswith("-XX:ArchiveClassesAtExit=")
    assert tried == [writer.part] and not again.ready.exists() and again.part is not None
    # This process writes the next one (its pid until its JVM's is known).
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        f"{again.part.name}.pid",
        f"{again.ready.stem}.failed",
    ]


def test_after_two_archives_fail_none_is_written_any_more(tmp_path: Path) -> None:
    tried: list[Path] = []
    for _ in range(MAX_FAILURES):
        _written(tmp_path, tried, b"truncated", _dead_pid(), works=False)
    assert _archive(tmp_path, tried, works=False).java_options() == ""
    assert len(tried) == MAX_FAILURES


def test_an_archive_in_place_whose_size_changed_is_removed_and_written_again(
    tmp_path: Path,
) -> None:
    tried: list[Path] = []
    writer = _written(tmp_path, tried, b"a whole archive", _dead_pid())
    assert _archive(tmp_path, tried).java_options().startswith("-XX:SharedArchiveFile=")
    os.chmod(writer.ready, 0o644)
    writer.ready.write_bytes(b"a whole")  # cut short after it was moved into place
    assert _archive(tmp_path, tried).java_options().startswith("-XX:ArchiveClassesAtExit=")
    assert not writer.ready.exists()


def test_a_live_writers_pid_file_is_kept_and_dead_writers_parts_go_once_one_is_in_place(
    tmp_path: Path,
) -> None:
    tried: list[Path] = []
    cache = tmp_path / "cache"
    running = _archive(tmp_path, tried)
    running.java_options()
    running.writer_started(os.getpid())  # its JVM runs and has written nothing yet
    assert running.part is not None
    stem = running.ready.stem
    for n in (1, 2):  # two finished writers
        (cache / f"{stem}.{n}.part").write_bytes(b"archive")
        (cache / f"{stem}.{n}.part.pid").write_text(str(_dead_pid()))
    assert _archive(tmp_path, tried).java_options().startswith("-XX:SharedArchiveFile=")
    assert tried == [cache / f"{stem}.1.part"]  # the first moved into place, the other removed
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [running.ready.name, f"{running.ready.name}.size", f"{running.part.name}.pid"]
    )


def test_while_a_writers_jvm_runs_no_second_archive_is_written(tmp_path: Path) -> None:
    tried: list[Path] = []
    running = _archive(tmp_path, tried)
    assert running.java_options().startswith("-XX:ArchiveClassesAtExit=")
    running.writer_started(os.getpid())  # its JVM runs and has written nothing yet
    assert running.part is not None
    assert _archive(tmp_path, tried).java_options() == ""
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"{running.part.name}.pid"]


def test_no_archive_in_a_directory_whose_path_has_a_blank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "with blank"))
    assert archive_for("-XX:+UseParallelGC") is None
    monkeypatch.setenv(ENV, str(tmp_path / "plain"))
    archive = archive_for("-XX:+UseParallelGC")
    assert archive is not None and archive.directory == tmp_path / "plain"


def test_a_part_of_an_unknown_writer_is_tried_once_left_unchanged_long_enough(
    tmp_path: Path,
) -> None:
    tried: list[Path] = []
    writer = _archive(tmp_path, tried)
    writer.java_options()
    assert writer.part is not None
    writer.writer_started(None)  # the JVM's pid was not reachable
    writer.part.write_bytes(b"archive")
    written = writer.part.stat().st_mtime
    young = _archive(tmp_path, tried, clock=Clock(written + SETTLED - 1))
    assert young.java_options() == "" and not tried
    old = _archive(tmp_path, tried, clock=Clock(written + SETTLED + 1))
    assert old.java_options().startswith("-XX:SharedArchiveFile=") and tried == [writer.part]


def test_a_pid_file_whose_jvm_wrote_nothing_is_removed(tmp_path: Path) -> None:
    tried: list[Path] = []
    first = _archive(tmp_path, tried)
    first.java_options()
    assert first.part is not None
    # Another report's JVM died before it wrote anything, and so did this one's.
    stale = first.part.with_name(f"{first.ready.stem}.1.part.pid")
    stale.write_text(str(_dead_pid()))
    first.writer_started(_dead_pid())
    next_run = _archive(tmp_path, tried)
    assert next_run.java_options().startswith("-XX:ArchiveClassesAtExit=")
    assert next_run.part is not None
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"{next_run.part.name}.pid"]
    assert Path(f"{next_run.part}.pid").read_text() == str(os.getpid())  # its own
    assert not tried


@pytest.mark.parametrize("pid", ["0", "-1", str(2**40), "", "not a pid"])
def test_a_pid_file_naming_no_process_is_no_writer(tmp_path: Path, pid: str) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    first = _archive(tmp_path, [])
    (cache / f"{first.ready.stem}.1.part.pid").write_text(pid)
    assert first.java_options().startswith("-XX:ArchiveClassesAtExit=")
    assert not (cache / f"{first.ready.stem}.1.part.pid").exists()


def test_a_pid_file_older_than_any_report_names_no_writer(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    first = _archive(tmp_path, [])
    pid_file = cache / f"{first.ready.stem}.1.part.pid"
    pid_file.write_text(str(os.getpid()))  # a live process: another's, its pid reused
    written = pid_file.stat().st_mtime
    assert _archive(tmp_path, [], clock=Clock(written + WRITER_MAX_AGE - 1)).java_options() == ""
    later = _archive(tmp_path, [], clock=Clock(written + WRITER_MAX_AGE + 1))
    assert later.java_options().startswith("-XX:ArchiveClassesAtExit=")
    assert not pid_file.exists()


def test_the_archive_is_named_by_the_options_and_the_installation(tmp_path: Path) -> None:
    spark_home = tmp_path / "spark"
    (spark_home / "jars").mkdir(parents=True)
    name = Archive(tmp_path, OPTIONS, spark_home).ready.name
    assert Archive(tmp_path, OPTIONS, spark_home).ready.name == name
    assert Archive(tmp_path, OPTIONS + " -Xmx1g", spark_home).ready.name != name
    memory = Archive(tmp_path, OPTIONS, spark_home, launcher=("--driver-memory", "40g"))
    assert memory.ready.name != name
    (spark_home / "jars" / "spark-core.jar").write_bytes(b"jar")
    assert Archive(tmp_path, OPTIONS, spark_home).ready.name != name


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({ENV: "off"}, None),
        ({ENV: ""}, None),
        ({ENV: "/srv/cache"}, Path("/srv/cache")),
        ({"XDG_CACHE_HOME": "/xdg"}, Path("/xdg/celery-fair/jvm")),
        ({"HOME": "/home/u"}, Path("/home/u/.cache/celery-fair/jvm")),
    ],
)
def test_where_the_archives_are_kept(
    env: dict[str, str], expected: Path | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", env.get("HOME", "/home/u"))
    assert cache_dir(env) == expected


def test_a_directory_that_cannot_be_written_means_no_archive(tmp_path: Path) -> None:
    (tmp_path / "cache").write_text("a file where the directory would be")
    archive = _archive(tmp_path, [])
    assert archive.java_options() == ""
    archive.writer_started(1234)  # nothing to note, nothing raised


def test_a_new_archive_in_place_removes_the_least_recently_used_beyond_the_kept(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    # Archives of other set-ups, each with its size; the higher i, the more recently used.
    others = [cache / f"spark-{i:016x}.jsa" for i in range(KEEP)]
    mine = cache / "spark-mine.jsa"  # not an archive's name: left alone
    mine.write_bytes(b"the user's")
    for i, other in enumerate(others):
        other.write_bytes(b"x" * (i + 1))
        Path(f"{other}.size").write_text(str(i + 1))
        os.utime(other, (1_000 + i, 1_000 + i))
    tried: list[Path] = []
    archive = _written(tmp_path, tried, b"archive", _dead_pid())
    assert archive.java_options().startswith("-XX:SharedArchiveFile=")
    # KEEP kept in all: the new one and the KEEP - 1 used last.
    kept = sorted(p.name for p in cache.glob("spark-*.jsa"))
    assert kept == sorted([archive.ready.name, mine.name, *(o.name for o in others[1:])])
    assert not Path(f"{others[0]}.size").exists()


def test_using_an_archive_marks_it_used(tmp_path: Path) -> None:
    archive = _written(tmp_path, [], b"archive", _dead_pid())
    assert archive.java_options().startswith("-XX:SharedArchiveFile=")
    os.utime(archive.ready, (1_000, 1_000))
    assert archive.java_options().startswith("-XX:SharedArchiveFile=")
    assert archive.ready.stat().st_mtime > 1_000


def test_the_users_driver_settings_name_the_archive_and_reach_its_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_fair.analytics import report

    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    setting = report.JAVA_OPTION_SETTINGS[0]

    def archive(conf: dict[str, str], memory: str | None = None) -> Archive:
        found = report._with_archive({setting: OPTIONS}, memory, conf)
        assert found is not None
        return found

    plain = archive({})
    # Settings that act inside the running JVM do not change the JVM.
    inside = {"spark.sql.shuffle.partitions": "4", "spark.driver.maxResultSize": "2g"}
    assert archive(inside).ready == plain.ready
    by_conf = archive({"spark.driver.memory": "2g", "spark.sql.shuffle.partitions": "4"})
    assert by_conf.launcher == ("--conf", "spark.driver.memory=2g")
    assert by_conf.ready != plain.ready
    by_option = archive({}, "2g")
    assert by_option.launcher == ("--driver-memory", "2g")
    assert by_option.ready not in (plain.ready, by_conf.ready)
