"""``celery-fair exporter`` as a subprocess on a free loopback port, and its scrapes parsed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from types import TracebackType

__all__ = ("ExporterProcess", "parse_samples")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_samples(text: str) -> Samples:
    """``{(name, sorted labels): value}`` of a text-format scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class ExporterProcess:
    """The exporter of ``broker_url`` for ``queues``, listening on 127.0.0.1 (any free port)."""

    def __init__(
        self,
        broker_url: str,
        queues: Sequence[str],
        *args: str,
        app: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        where = ["-A", app] if app is not None else ["-b", broker_url]
        self.args = [
            sys.executable, "-m", "celery_fair.cli", "exporter", *where,
            "--queues", ",".join(queues), "--port", "0", *args,
        ]  # fmt: skip
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> ExporterProcess:
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=self.env, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "celery-fair exporter: ... on http://.../metrics"
        if " on http://" not in line:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the exporter did not start: {line}")
        self.url = line.rsplit(" on ", 1)[1].strip()
        return self

    @property
    def address(self) -> str:
        """``host:port`` of its endpoint (a Prometheus target)."""
        return self.url.split("//", 1)[1].split("/", 1)[0]

    def scrape(self, timeout: float = 10.0) -> Samples:
        with urllib.request.urlopen(self.url, timeout=timeout) as response:
            return parse_samples(response.read().decode())

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()

    def wait_until(self, check: object, timeout: float = 30.0) -> Samples:
        """Scrape until ``check(samples)`` is true; the last scrape."""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.scrape()
            if check(samples):  # type: ignore[operator]
                return samples
            if time.monotonic() > deadline:
                raise AssertionError(f"no scrape passed the check in {timeout:g} s: {samples}")
            time.sleep(0.1)
