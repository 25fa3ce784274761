"""``celery-fair report`` run as a user runs it: the command, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from celery_fair.analytics.report import JAVA_OPTION_VARIABLES

#: The environment of a report run by a test: none of the machine's own Java or
#: Spark options, which would change the JVM the report starts.
CLEAN = (*JAVA_OPTION_VARIABLES, "SPARK_CONF_DIR", "SPARK_HOME")


def clean_environment() -> dict[str, str]:
    """This process's environment without :data:`CLEAN`."""
    return {k: v for k, v in os.environ.items() if k not in CLEAN}


def run_report(
    telemetry: str | Path, out: Path, *options: str, timeout: float = 300
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run the report without charts on ``telemetry``; its process and ``report.json``.

    Fails the test, with the end of Spark's output, if the command fails.
    """
    cmd = [sys.executable, "-m", "celery_fair.cli", "report", str(telemetry)]
    cmd += ["--out", str(out), "--no-charts", *options]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=clean_environment()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((out / "report.json").read_text())
