"""What a ledger of runs says about resources: time-averaged running tasks, peaks held.

Shared by the integration tests of resources and ``bench.resources``.  A run's
recorded interval (start to finish, inside the task) lies within the time
the worker holds its resources, so a peak computed here can only be lower
than what the worker held: a peak over the capacity is the worker's fault.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from .ledger import Entry

__all__ = (
    "backlogged_window", "declared", "over_capacity", "peaks", "ran_once", "running", "shares",
)  # fmt: skip


def backlogged_window(entries: Sequence[Entry], tenants: Iterable[str]) -> tuple[float, float]:
    """From the first start to the first tenant's last start: every tenant backlogged."""
    start = min(e.started for e in entries)
    end = min(max(e.started for e in entries if e.tenant == t) for t in tenants)
    return start, end


def running(entries: Iterable[Entry], tenant: str, start: float, end: float) -> float:
    """Time-averaged tasks of ``tenant`` running over [start, end]."""
    runs = [e for e in entries if e.tenant == tenant]
    busy = sum(max(0.0, min(e.finished, end) - max(e.started, start)) for e in runs)
    return busy / (end - start)


def _sweep(entries: Iterable[Entry]) -> list[tuple[float, int, Entry]]:
    listed = list(entries)
    return sorted(
        [(e.started, 1, e) for e in listed] + [(e.finished, -1, e) for e in listed],
        key=lambda p: (p[0], p[1]),  # at a tie a finish comes first
    )


def peaks(entries: Iterable[Entry]) -> dict[str, float]:
    """The most of each resource the recorded runs held at one instant."""
    held: dict[str, float] = {}
    peak: dict[str, float] = {}
    for _, step, entry in _sweep(entries):
        for name, amount in (entry.resources or {}).items():
            held[name] = held.get(name, 0.0) + step * amount
            peak[name] = max(peak.get(name, 0.0), held[name])
    return peak


def over_capacity(entries: Iterable[Entry], capacity: Mapping[str, float]) -> int:
    """How many starts found the runs holding more than ``capacity`` of some resource."""
    held: dict[str, float] = {}
    over = 0
    for _, step, entry in _sweep(entries):
        for name, amount in (entry.resources or {}).items():
            held[name] = held.get(name, 0.0) + step * amount
        if step > 0 and any(held.get(n, 0.0) > c + 1e-9 for n, c in capacity.items()):
            over += 1
    return over


def shares(
    entries: Sequence[Entry],
    demands: Mapping[str, Mapping[str, float]],
    capacity: Mapping[str, float],
    start: float,
    end: float,
) -> dict[str, float]:
    """Each tenant's dominant share of ``capacity``, time-averaged over [start, end]."""
    return {
        tenant: max(
            running(entries, tenant, start, end) * demand.get(name, 0.0) / amount
            for name, amount in capacity.items()
        )
        for tenant, demand in demands.items()
    }


def declared(entries: Iterable[Entry], shapes: Mapping[str, Mapping[str, float]]) -> list[Entry]:
    """The entries, each holding its tenant's shape where the run recorded none.

    A worker records what the message declared (the ``fair_resources``
    header, an attribute of the request for plain Celery too); a run that
    recorded nothing is given what its tenant's tasks were published with,
    so that plain Celery's peaks are counted like celery-fair's.
    """
    return [
        e if e.resources or e.tenant not in shapes
        else dataclasses.replace(e, resources=dict(shapes[e.tenant]))
        for e in entries
    ]  # fmt: skip


def ran_once(entries: Iterable[Entry], published: int) -> dict[str, int]:
    """How many of ``published`` tasks never ran, and how many runs were repeats."""
    runs = Counter(e.id for e in entries)
    return {
        "ran": len(runs),
        "missing": max(0, published - len(runs)),
        "repeats": sum(n - 1 for n in runs.values()),
    }
