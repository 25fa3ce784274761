"""The report JVM's class archive with a real JVM: written by one report, used by the next.

A short report's JVM writes the classes it loaded to a ``.part`` as it exits;
the next report tries it with a JVM of its own and moves it into place, and
its JVM starts from it. A part no JVM can use (here, a truncated copy) is
removed, never used: a JVM that mapped it would crash.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_fair._process import alive
from celery_fair.analytics.jvm_archive import ENV
from celery_fair.analytics.report import SHORT_RUN_JAVA_OPTIONS
from tests.harness.harness import poll_until
from tests.harness.synthetic import tenant_spec, write_synthetic
from tests.report_command import run_report


def test_a_report_writes_the_archive_the_next_one_starts_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    telemetry = tmp_path / "telemetry"
    write_synthetic(tenant_spec(5_000), telemetry)
    cache = tmp_path / "jvm"
    monkeypatch.setenv(ENV, str(cache))
    _, first = run_report(telemetry, tmp_path / "first", "--master", "local[2]")
    ran = first["meta"]["driver_java_options"]
    assert ran.startswith(f"{SHORT_RUN_JAVA_OPTIONS} -XX:ArchiveClassesAtExit={cache}/"), ran
    [pid_file] = cache.glob("*.part.pid")
    part = Path(str(pid_file)[: -len(".pid")])
    jvm = int(pid_file.read_text())
    # The JVM writes the archive as it exits, after the report's process.
    assert poll_until(lambda: not alive(jvm), timeout=120), "the report's JVM did not exit"
    assert part.stat().st_size > 10 * 2**20
    # A truncated copy, named to be tried first.
    broken = part.with_name(part.name.split(".")[0] + ".1.part")
    with part.open("rb") as src:
        broken.write_bytes(src.read(part.stat().st_size // 2))
    Path(f"{broken}.pid").write_text(pid_file.read_text())

    _, second = run_report(telemetry, tmp_path / "second", "--master", "local[2]")
    ready = part.with_name(part.name.split(".")[0] + ".jsa")
    ran = second["meta"]["driver_java_options"]
    assert ran.startswith(f"{SHORT_RUN_JAVA_OPTIONS} -XX:SharedArchiveFile={ready} "), ran
    # The broken part failed its trial and went; the JVM that crashed on it left no
    # crash report behind, here or in the working directory.
    assert sorted(p.name for p in cache.iterdir()) == [ready.name, f"{ready.name}.size"]
    assert not list(Path.cwd().glob("hs_err_pid*.log"))
    # The same report from the archive's JVM.
    for table in ("queues", "keys", "noisy_tenants"):
        assert second[table] == first[table], table
