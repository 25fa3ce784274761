"""A throw-away Prometheus server (Debian package ``prometheus``) on a free loopback port."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.harness.redis import free_port, stop_process

__all__ = ("PrometheusServer",)


class PrometheusServer:
    """Scrapes ``targets`` (``host:port``) every ``interval`` s and evaluates ``rule_files``."""

    def __init__(
        self, targets: Sequence[str], *, rule_files: Sequence[Path] = (), interval: float = 1.0
    ) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus not found: run `make setup` (Debian package prometheus)")
        self.binary = binary
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="celery-fair-prometheus-"))
        rules = [str(Path(r).resolve()) for r in rule_files]
        config = {
            "global": {
                "scrape_interval": f"{interval:g}s",
                "evaluation_interval": f"{interval:g}s",
            },
            "rule_files": rules,
            "scrape_configs": [
                {"job_name": "celery-fair", "static_configs": [{"targets": list(targets)}]}
            ],
        }
        (self.dir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> PrometheusServer:
        self.proc = subprocess.Popen(
            [
                self.binary, f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL, stderr=(self.dir / "prometheus.log").open("wb"),
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.dir / "prometheus.log").read_text(errors="replace")[-2000:]
                self.__exit__(None, None, None)
                raise RuntimeError(f"prometheus did not start:\n{log}")
            time.sleep(0.1)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to now."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=10) as response:
            reply = json.loads(response.read())
        if reply.get("status") != "success":
            raise AssertionError(f"{expr}: {reply}")
        result: list[dict[str, Any]] = reply["data"]["result"]
        return result

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        proc, self.proc = self.proc, None
        stop_process(proc)  # type: ignore[arg-type]
        shutil.rmtree(self.dir, ignore_errors=True)
