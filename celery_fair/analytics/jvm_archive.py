"""A class archive of the report's driver JVM, so that a short report starts sooner.

A local report of a few megabytes spends about a third of its run starting
Spark's JVM and loading, verifying and linking the classes of its first
queries.  The JDK can write the classes a run loaded to an archive when the
JVM exits and map them at the next start (dynamic class-data sharing,
JEP 350: ``-XX:ArchiveClassesAtExit``, ``-XX:SharedArchiveFile``).  So the
first short report writes one, and the later ones start from it.

The archive is only ever used complete: a JVM that maps a truncated one
crashes.  The writing JVM dumps it as it exits, which is after this process
has exited (the gateway's JVM ends when its standard input closes), so it
writes to a file of its own (``.part``, with the JVM's pid beside it).  A
later report moves it into place only once that JVM is gone and a JVM has
started with it and read all of it (``-Xshare:on -XX:+VerifySharedSpaces``,
which refuse an archive the JVM cannot use); otherwise it is removed and
written again.  The name carries a digest of the Java and Spark
installations and of the options, since an archive serves only the JVM and
class path that wrote it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ("ENV", "Archive", "archive_for", "cache_dir")

#: The directory of the archives; ``off`` (or empty) writes and uses none.
ENV = "CELERY_FAIR_JVM_ARCHIVE"
#: Seconds a ``.part`` whose writer is not known must be left unchanged before it is tried.
SETTLED = 30.0
#: Seconds a JVM started to try an archive may take.
TRIAL_TIMEOUT = 60.0
#: Quiet: the JVM names every class it cannot archive as it exits, after the
#: report has printed its summary.
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def cache_dir(env: Mapping[str, str] = os.environ) -> Path | None:
    """Where the archives are kept: ``$CELERY_FAIR_JVM_ARCHIVE``, else the user's cache
    directory (``$XDG_CACHE_HOME`` or ``~/.cache``) ``/celery-fair/jvm``; None: off."""
    if ENV in env:
        value = env[ENV].strip()
        return None if value in ("", "off") else Path(value)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "celery-fair", "jvm")


def _spark_home() -> Path:
    """The Spark whose launcher starts the driver (a pip install: the package)."""
    if os.environ.get("SPARK_HOME"):
        return Path(os.environ["SPARK_HOME"])
    import pyspark

    return Path(pyspark.__file__).parent


def _fingerprint(spark_home: Path, options: str) -> str:
    """What an archive depends on: the JVM's binary, Spark's jars, the options."""
    parts = [options, str(spark_home.resolve())]
    java = Path(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else None
    found = str(java) if java is not None else shutil.which("java")
    for path in [found, *sorted(str(p) for p in (spark_home / "jars").glob("*.jar"))]:
        if path is None:
            continue
        real = os.path.realpath(path)
        try:
            stat = os.stat(real)
        except OSError:
            continue
        parts.append(f"{real}:{stat.st_size}:{int(stat.st_mtime)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid
        return True
    return True


class Archive:
    """The archive of one JVM set-up in ``directory``: to use, to write, or neither now."""

    def __init__(
        self,
        directory: Path,
        options: str,
        spark_home: Path,
        *,
        clock: Callable[[], float] = time.time,
        trial: Callable[[Path], bool] | None = None,
    ) -> None:
        self.directory = directory
        self.spark_home = spark_home
        self.options = options
        digest = _fingerprint(spark_home, options)
        self.ready = directory / f"spark-{digest}.jsa"
        self._parts = f"spark-{digest}.*.part"
        self._clock = clock
        self._trial = trial or self._start_with
        #: The file this run's JVM writes, when it writes one.
        self.part: Path | None = None

    def java_options(self) -> str:
        """The options that use the archive, or write one; ``""`` while one is being written,
        or when the directory cannot be written (the report runs without an archive)."""
        try:
            return self._java_options()
        except OSError:
            return ""

    def _java_options(self) -> str:
        if self.ready.exists():
            return f"-XX:SharedArchiveFile={self.ready} {QUIET}"
        for pid_file in self.directory.glob(f"{self._parts}.pid"):
            if not Path(str(pid_file)[: -len(".pid")]).exists():
                pid_file.unlink(missing_ok=True)  # its JVM wrote nothing
        writing = False
        for part in sorted(self.directory.glob(self._parts)):
            writing |= not self._settle(part)
            if self.ready.exists():
                return f"-XX:SharedArchiveFile={self.ready} {QUIET}"
        if writing:
            return ""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.part = self.directory / f"{self.ready.stem}.{os.getpid()}.part"
        return f"-XX:ArchiveClassesAtExit={self.part} {QUIET}"

    def writer_started(self, jvm_pid: int | None) -> None:
        """Note the pid of the JVM writing :attr:`part` (None: not known; the part is then
        only tried once it has been left unchanged for :data:`SETTLED` seconds)."""
        if jvm_pid is not None and self.part is not None:
            # Not written: the part is tried once left unchanged long enough.
            with contextlib.suppress(OSError):
                Path(f"{self.part}.pid").write_text(str(jvm_pid))

    def _settle(self, part: Path) -> bool:
        """Move ``part`` into place if it is complete; True when it is settled either way."""
        pid_file = Path(f"{part}.pid")
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            pid = None
        try:
            age = self._clock() - part.stat().st_mtime
        except OSError:
            return True
        if _alive(pid) if pid is not None else age < SETTLED:
            return False
        if not self.ready.exists() and self._trial(part):
            os.replace(part, self.ready)
        else:
            part.unlink(missing_ok=True)
        pid_file.unlink(missing_ok=True)
        return True

    def _start_with(self, part: Path) -> bool:
        """Whether a JVM started by Spark's launcher maps ``part`` (``-Xshare:on``) and
        finds every region's checksum right (``VerifySharedSpaces`` reads them all)."""
        submit = self.spark_home / "bin" / "spark-submit"
        options = f"{self.options} -Xshare:on -XX:+VerifySharedSpaces"
        options += f" -XX:SharedArchiveFile={part} {QUIET}"
        options += f" -XX:ErrorFile={self.directory}/hs_err_%p.log"
        try:
            done = subprocess.run(
                [str(submit), "--driver-java-options", options, "--version"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=TRIAL_TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0


def archive_for(options: str) -> Archive | None:
    """The archive of a short report's JVM started with ``options`` (None: not kept).

    Kept with PySpark 4 or later (which needs Java 17): the options are
    unknown to a Java before 13, which would not start with them.
    """
    directory = cache_dir()
    if directory is None:
        return None
    try:
        import pyspark

        if int(pyspark.__version__.split(".")[0]) < 4:
            return None
        return Archive(directory, options, _spark_home())
    except (OSError, ValueError):
        return None
