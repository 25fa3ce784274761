"""``celery-fair report`` run as a user runs it: the command, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_report(
    telemetry: str | Path, out: Path, *options: str, timeout: float = 300
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run the report without charts on ``telemetry``; its process and ``report.json``.

    Fails the test, with the end of Spark's output, if the command fails.
    """
    cmd = [sys.executable, "-m", "celery_fair.cli", "report", str(telemetry)]
    cmd += ["--out", str(out), "--no-charts", *options]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((out / "report.json").read_text())
