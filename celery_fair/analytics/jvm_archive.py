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
written again; after two such failures none is written any more.  Before
each use the archive's size is checked against the size it was moved into
place with.  The name carries a digest of the Java and Spark installations,
the class path's settings, the options and the launcher's arguments that
change the JVM, since an archive serves only the JVM and class path that
wrote it; the :data:`KEEP` archives used last are kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .._process import alive

__all__ = ("ENV", "Archive", "archive_for", "cache_dir", "spark_conf_dir", "spark_home")

#: The directory of the archives; ``off`` (or empty) writes and uses none.
ENV = "CELERY_FAIR_JVM_ARCHIVE"
#: Seconds a ``.part`` whose writer is not known must be left unchanged before it is tried.
SETTLED = 30.0
#: Seconds after which a pid file no longer names a writer: a short report and
#: its JVM's dump last minutes at most, and past that the pid may be another
#: process's (reused, or of another container sharing the directory).
WRITER_MAX_AGE = 1800.0
#: The largest pid Linux gives (``pid_max`` at most 2^22).
MAX_PID = 2**22
#: Seconds a JVM started to try an archive may take.
TRIAL_TIMEOUT = 60.0
#: Archives of one digest that failed their trial before none is written any more.
MAX_FAILURES = 2
#: Archives kept in the directory (about 180 MB each): the most recently used,
#: one per Java, Spark and set of options in use; older ones are removed when
#: a new one is moved into place.
KEEP = 3
#: Every set-up's archive in the directory (a digest is 16 hex digits).
_ARCHIVES = "spark-" + "[0-9a-f]" * 16 + ".jsa"
#: Quiet: the JVM names every class it cannot archive as it exits, after the
#: report has printed its summary.
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
#: Spark's launcher builds the class path from these too (``bin/spark-class``).
CLASS_PATH_VARIABLES = (
    "SPARK_CONF_DIR",
    "SPARK_DIST_CLASSPATH",
    "HADOOP_CONF_DIR",
    "YARN_CONF_DIR",
)


def cache_dir(env: Mapping[str, str] = os.environ) -> Path | None:
    """Where the archives are kept: ``$CELERY_FAIR_JVM_ARCHIVE``, else the user's cache
    directory (``$XDG_CACHE_HOME`` or ``~/.cache``) ``/celery-fair/jvm``; None: off."""
    if ENV in env:
        value = env[ENV].strip()
        return None if value in ("", "off") else Path(value)
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "celery-fair", "jvm")


def spark_home() -> Path:
    """The Spark whose launcher starts a local driver: ``$SPARK_HOME``, else the
    installed PySpark's directory (a pip install carries ``bin/``, ``jars/``, ``conf/``)."""
    if os.environ.get("SPARK_HOME"):
        return Path(os.environ["SPARK_HOME"])
    import pyspark

    return Path(pyspark.__file__).parent


def spark_conf_dir(home: Path | None = None) -> Path:
    """Where Spark's launcher reads ``spark-defaults.conf`` and ``spark-env.sh``:
    ``$SPARK_CONF_DIR``, else ``conf`` in ``home`` (default :func:`spark_home`)."""
    if os.environ.get("SPARK_CONF_DIR"):
        return Path(os.environ["SPARK_CONF_DIR"])
    return (home or spark_home()) / "conf"


def _java() -> Path | None:
    """The ``java`` Spark's launcher runs: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    if os.environ.get("JAVA_HOME"):
        return Path(os.environ["JAVA_HOME"], "bin", "java")
    found = shutil.which("java")
    return Path(found) if found else None


def _fingerprint(home: Path, options: str, launcher: Sequence[str]) -> str:
    """What an archive depends on: the JVM (its binary, modules and build), Spark's jars,
    the class path's settings, the options and the launcher's arguments."""
    parts = [options, " ".join(launcher), str(home.resolve())]
    parts += [f"{name}={os.environ.get(name, '')}" for name in CLASS_PATH_VARIABLES]
    files: list[Path] = []
    java = _java()
    if java is not None:
        jdk = Path(os.path.realpath(java)).parent.parent
        files += [
            java,
            jdk / "release",
            jdk / "lib" / "modules",
            jdk / "lib" / "server" / "libjvm.so",
        ]
    # The launcher reads these too: settings of the driver's JVM and class path.
    conf_dir = spark_conf_dir(home)
    files += [conf_dir / "spark-defaults.conf", conf_dir / "spark-env.sh"]
    files += sorted((home / "jars").glob("*.jar"))
    for path in files:
        real = os.path.realpath(path)
        with contextlib.suppress(OSError):
            stat = os.stat(real)
            parts.append(f"{real}:{stat.st_size}:{int(stat.st_mtime)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


class Archive:
    """The archive of one JVM set-up in ``directory``: to use, to write, or neither now.

    ``options``: the JVM's options besides the archive's; ``launcher``: arguments
    of ``spark-submit`` that change the JVM (``--driver-memory``, ``--conf`` of the
    driver's memory, class path and libraries), which the trial passes too.
    ``clock`` (wall-clock seconds) and ``trial`` are injected by the tests.
    """

    def __init__(
        self,
        directory: Path,
        options: str,
        home: Path,
        *,
        launcher: Sequence[str] = (),
        clock: Callable[[], float] = time.time,
        trial: Callable[[Path], bool] | None = None,
    ) -> None:
        self.directory = directory
        self.home = home
        self.options = options
        self.launcher = tuple(launcher)
        digest = _fingerprint(home, options, self.launcher)
        self.ready = directory / f"spark-{digest}.jsa"
        self._size = directory / f"spark-{digest}.jsa.size"
        self._failed = directory / f"spark-{digest}.failed"
        self._parts = f"spark-{digest}.*.part"
        self._clock = clock
        self._trial = trial or self._start_with
        #: The file this run's JVM writes, when it writes one.
        self.part: Path | None = None

    def java_options(self) -> str:
        """The options that use the archive, or write one; ``""`` while one is being
        written, after :data:`MAX_FAILURES` failed ones, or when the directory cannot be
        written (the report then runs without an archive)."""
        try:
            return self._java_options()
        except OSError:
            return ""

    def _java_options(self) -> str:
        writing = False
        for pid_file in self.directory.glob(f"{self._parts}.pid"):
            part, writer = Path(str(pid_file)[: -len(".pid")]), self._writer(pid_file)
            if writer is not None:
                # A report or its JVM runs, and the JVM writes its part as it exits:
                # a second writer now would only make a second report pay for one.
                writing = True
            elif not part.exists():
                pid_file.unlink(missing_ok=True)  # its JVM ended and wrote nothing
        for part in sorted(self.directory.glob(self._parts)):
            writing |= not self._settle(part)
        if self._usable():
            with contextlib.suppress(OSError):
                os.utime(self.ready)  # its last use: the archives least used go first
            return f"-XX:SharedArchiveFile={self.ready} {QUIET}"
        if writing or self._failures() >= MAX_FAILURES:
            return ""
        self.directory.mkdir(parents=True, exist_ok=True)
        part = self.directory / f"{self.ready.stem}.{os.getpid()}.part"
        # This process until its JVM's pid is known (writer_started): a report
        # started meanwhile sees that one is being written.
        _write_pid(Path(f"{part}.pid"), os.getpid())
        self.part = part
        return f"-XX:ArchiveClassesAtExit={part} {QUIET}"

    def writer_started(self, jvm_pid: int | None) -> None:
        """Note the pid of the JVM writing :attr:`part` (None: not known; the part is then
        only tried once it has been left unchanged for :data:`SETTLED` seconds)."""
        if self.part is None:
            return
        pid_file = Path(f"{self.part}.pid")
        with contextlib.suppress(OSError):
            if jvm_pid is None:
                pid_file.unlink(missing_ok=True)
            else:
                _write_pid(pid_file, jvm_pid)

    def _writer(self, pid_file: Path) -> int | None:
        """The pid ``pid_file`` names while that process may still be writing (None: the
        file is unreadable, older than :data:`WRITER_MAX_AGE`, or the process ended)."""
        pid = _pid(pid_file)
        try:
            young = self._clock() - pid_file.stat().st_mtime < WRITER_MAX_AGE
        except FileNotFoundError:
            return None
        return pid if pid is not None and young and alive(pid) else None

    def _usable(self) -> bool:
        """Whether the archive in place has the size it was moved into place with (a
        truncated one would crash the JVM); one that has not is removed."""
        try:
            size = self.ready.stat().st_size
        except FileNotFoundError:
            return False
        try:
            expected = int(self._size.read_text())
        except (OSError, ValueError):
            expected = None
        if size == expected:
            return True
        self.ready.unlink(missing_ok=True)
        self._size.unlink(missing_ok=True)
        return False

    def _settle(self, part: Path) -> bool:
        """Deal with ``part`` once its writer is done: move it into place if it is complete
        and none is, else remove it.  True when it was dealt with."""
        pid_file = Path(f"{part}.pid")
        if _pid(pid_file) is not None:
            if self._writer(pid_file) is not None:
                return False
        else:
            try:
                if self._clock() - part.stat().st_mtime < SETTLED:
                    return False
            except FileNotFoundError:
                return True
        if not self._usable():
            if self._trial(part):
                self._size.write_text(str(part.stat().st_size))
                os.utime(part)  # in use from now: not the first to go (_prune)
                os.replace(part, self.ready)
                self._failed.unlink(missing_ok=True)
                self._prune()
            else:
                self._failed.write_text(str(self._failures() + 1))
        part.unlink(missing_ok=True)
        pid_file.unlink(missing_ok=True)
        return True

    def _prune(self) -> None:
        """Remove the archives of other set-ups beyond the :data:`KEEP` - 1 used last.

        A JVM running from a removed archive keeps it mapped until it exits.
        """
        others = [p for p in self.directory.glob(_ARCHIVES) if p != self.ready]
        others.sort(key=_last_use, reverse=True)
        for old in others[KEEP - 1 :]:
            # Tidying up must not cost this report the archive it just moved in.
            with contextlib.suppress(OSError):
                old.unlink(missing_ok=True)
                Path(f"{old}.size").unlink(missing_ok=True)

    def _failures(self) -> int:
        try:
            return int(self._failed.read_text())
        except (OSError, ValueError):
            return 0

    def _start_with(self, part: Path) -> bool:
        """Whether a JVM started by Spark's launcher maps ``part`` (``-Xshare:on``) and
        finds every region's checksum right (``VerifySharedSpaces`` reads them all)."""
        crash = self.directory / f"hs_err_trial_{os.getpid()}.log"
        options = f"{self.options} -Xshare:on -XX:+VerifySharedSpaces"
        options += f" -XX:SharedArchiveFile={part} {QUIET} -XX:ErrorFile={crash}"
        submit = self.home / "bin" / "spark-submit"
        try:
            done = subprocess.run(
                [str(submit), *self.launcher, "--driver-java-options", options, "--version"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=TRIAL_TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
        finally:
            crash.unlink(missing_ok=True)
        return done.returncode == 0


def _last_use(archive: Path) -> float:
    try:
        return archive.stat().st_mtime
    except FileNotFoundError:  # removed by another report meanwhile
        return 0.0


def _pid(pid_file: Path) -> int | None:
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return None
    return pid if 0 < pid <= MAX_PID else None  # 0 or -1 would name a process group


def _write_pid(pid_file: Path, pid: int) -> None:
    """Write ``pid_file`` whole or not at all: a reader never finds it empty."""
    temporary = pid_file.with_name(f".{pid_file.name}.{os.getpid()}")
    temporary.write_text(str(pid))
    os.replace(temporary, pid_file)


def archive_for(options: str, launcher: Sequence[str] = ()) -> Archive | None:
    """The archive of a short report's JVM started with ``options`` (None: not kept).

    Kept with PySpark 4 or later (which needs Java 17): the options are
    unknown to a Java before 13, which would not start with them.  Not kept in
    a directory whose path has a blank or a quote: Spark's launcher splits
    the JVM's options on blanks.
    """
    directory = cache_dir()
    if directory is None or any(c.isspace() or c in "\"'\\" for c in str(directory)):
        return None
    try:
        import pyspark

        if int(pyspark.__version__.split(".")[0]) < 4:
            return None
        return Archive(directory, options, spark_home(), launcher=launcher)
    except (OSError, ValueError):
        return None
