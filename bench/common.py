"""Helpers shared by the benchmarks: medians with spread, result files."""

from __future__ import annotations

import contextlib
import json
import os
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


def pin(pid: int, cpus: set[int]) -> None:
    """Pin every thread of process ``pid`` to ``cpus`` (``sched_setaffinity`` sets one
    thread's mask; threads started later inherit their creator's)."""
    done: set[str] = set()
    # Again until no thread is new: one started meanwhile may have its creator's old mask.
    while fresh := set(os.listdir(f"/proc/{pid}/task")) - done:
        for tid in fresh:
            with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
                os.sched_setaffinity(int(tid), cpus)
        done |= fresh


def give_broker_a_core(server: Any, core: int, others: set[int] | None = None) -> tuple[int, ...]:
    """Pin a started broker ``server`` to ``core`` and this process to ``others`` (default:
    every other CPU it may use).

    Standing in for a broker on a host of its own on a small machine: processes this
    one starts afterwards (workers, publishers) inherit ``others``. Returns
    ``(core,)``, for a burst publisher that stands in for a producer elsewhere too.
    """
    pid = server.pid if hasattr(server, "pid") else server.proc.pid  # RabbitMQ: the node's
    if pid is None:
        raise RuntimeError("the broker's process is not known: cannot pin it")
    cpus = set(os.sched_getaffinity(0))
    rest = cpus - {core} if others is None else others
    if core not in cpus or not rest or core in rest:
        raise SystemExit(f"--broker-core {core}: needs another CPU, {core} among {sorted(cpus)}")
    pin(pid, {core})
    pin(os.getpid(), rest)
    return (core,)


def broker_core_note(core: int | None) -> str:
    """The results' sentence on ``--broker-core`` (empty without it)."""
    if core is None:
        return ""
    return (
        f"The broker's threads and the burst's publisher ran on CPU {core}, the worker "
        "processes, the quiet tenants' publishers and the driver on the other CPUs, standing "
        "in for a broker on a host of its own (the ledger's Redis ran on any CPU)."
    )
