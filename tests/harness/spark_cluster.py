"""A throw-away standalone Spark cluster on loopback, for tests and benchmarks.

One Master and one Worker started from the installed PySpark's
``bin/spark-class`` (the same jars the driver uses, so versions match),
bound to 127.0.0.1 on free ports, with their logs, work and scratch
directories in a temporary directory. Readiness is polled on the master's
JSON status page with a deadline; :meth:`StandaloneCluster.stop` stops the
two JVMs by PID (``spark-class`` execs ``java``, so the PID is the JVM's).

Not for production clusters: it exists so that ``celery-fair report
--master spark://...`` and ``spark-submit`` can be exercised for real on
one machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ("StandaloneCluster", "java_missing", "spark_home")


def spark_home() -> Path:
    """The installed PySpark's directory, which holds ``bin/`` and ``jars/``."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def java_missing() -> str | None:
    """Why no JVM can be started here, or ``None`` when one can."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return None
    if shutil.which("java"):
        return None
    return "no Java runtime (java on PATH or JAVA_HOME): Spark's master and worker are JVMs"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class StandaloneCluster:
    """A Spark standalone master and one worker of ``cores`` cores and ``memory``.

    Use as a context manager; ``url`` is the ``spark://`` master URL and
    :meth:`env` the environment a driver on this machine should run with.
    """

    def __init__(self, *, cores: int = 1, memory: str = "1g", start_timeout: float = 120.0) -> None:
        self.cores = cores
        self.memory = memory
        self.start_timeout = start_timeout
        self.port = _free_port()
        self.ui_port = _free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="celery-fair-spark-"))
        self.master: subprocess.Popen[bytes] | None = None
        self.worker: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """The environment for the cluster's JVMs and for drivers that talk to it."""
        conf = self.dir / "conf"  # empty: no site-wide spark-defaults.conf applies
        conf.mkdir(exist_ok=True)
        env = dict(os.environ)
        env.update(
            SPARK_HOME=str(spark_home()),
            SPARK_CONF_DIR=str(conf),
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_LOCAL_DIRS=str(self.dir / "local"),
            SPARK_LOG_DIR=str(self.dir / "logs"),
            # Spark 4 starts a REST submission server on the fixed port 6066:
            # a second cluster (or anything else there) would clash.
            SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
        )
        return env

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.dir / f"{name}.log").open("wb")
        try:
            return subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), *args],
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
            )
        finally:
            log.close()  # the child holds its own descriptor

    def status(self) -> dict[str, Any]:
        """The master's JSON status page (workers, running and completed apps)."""
        url = f"http://127.0.0.1:{self.ui_port}/json/"
        with urllib.request.urlopen(url, timeout=5) as response:
            data: dict[str, Any] = json.load(response)
        return data

    def log(self, name: str) -> str:
        """The tail of the ``master`` or ``worker`` log, for error messages."""
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def start(self) -> StandaloneCluster:
        """Start the master, then the worker; return once the worker is registered."""
        (self.dir / "local").mkdir(exist_ok=True)
        self.master = self._spawn(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--webui-port", str(self.ui_port),
        )  # fmt: skip
        self.worker = self._spawn(
            "worker",
            "org.apache.spark.deploy.worker.Worker",
            self.url,
            "--host", "127.0.0.1",
            "--port", str(_free_port()),
            "--webui-port", str(_free_port()),
            "--cores", str(self.cores),
            "--memory", self.memory,
            "--work-dir", str(self.dir / "work"),
        )  # fmt: skip
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            for name, proc in (("master", self.master), ("worker", self.worker)):
                if proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"spark {name} exited:\n{self.log(name)}")
            try:
                if self.status().get("aliveworkers", 0) >= 1:
                    return self
            except (OSError, urllib.error.URLError, ValueError):
                pass  # the master's web UI is not up yet
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(
            f"no worker registered within {self.start_timeout:.0f}s:\n"
            f"{self.log('master')}\n{self.log('worker')}"
        )

    def stop(self) -> None:
        """Stop the worker, then the master (SIGTERM, SIGKILL after 20 s), by PID."""
        for proc in (self.worker, self.master):
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
