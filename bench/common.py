"""Helpers shared by the benchmarks: medians with spread, result files."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.harness.ledger import spread

RESULTS = Path(__file__).resolve().parent / "results"


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and relative spread ((max - min) / median)."""
    return spread(values)


def environment() -> dict[str, Any]:
    import celery
    import kombu
    import redis

    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "redis": redis.__version__,
        "cpus": __import__("os").cpu_count(),
    }


def write(name: str, data: dict[str, Any], markdown: str) -> None:
    (RESULTS / name).parent.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)
    print(f"wrote {RESULTS / name}.json and .md")
