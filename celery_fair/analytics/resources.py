"""The report's resources section: shaped from the pipeline's rows, and its summary lines.

Pure (no Spark): the pipeline's ``resource_usage`` rows (per window and
resource, see :func:`~celery_fair.analytics.transforms.resource_usage`) and
``resource_shares`` rows (per queue and key, see
:func:`~celery_fair.analytics.transforms.resource_shares`) become the
``resources`` object of ``report.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ("ranked_tenants", "resources_section", "summary_lines")

#: Tenants the terminal summary names (``report.json`` has them all).
SHOWN = 5


def resources_section(data: Mapping[str, Any]) -> dict[str, Any]:
    """``report.json``'s ``resources``: ``{}`` when no record carried a capacity.

    - ``capacity_seconds``, ``held_seconds``: per resource over the report,
      summed over workers and windows; ``held_share`` the one over the other;
      ``peak`` the largest share of a window.
    - ``queues``: per queue, and ``keys``: per queue and key (the keys with
      the largest dominant share first): ``dominant_share`` (the largest share
      of the capacity-seconds of one resource, a queue's own resource left
      out), ``dominant_resource``, and per resource ``held_seconds`` and
      ``shares``.
    - ``usage``: per window and resource, ``held_seconds``,
      ``capacity_seconds`` and ``held_share``.
    """
    usage = list(data.get("resource_usage") or [])
    rows = list(data.get("resource_shares") or [])
    if not usage and not rows:
        return {}
    capacity: dict[str, float] = {}
    held: dict[str, float] = {}
    peak: dict[str, float] = {}
    for u in usage:
        name = u["resource"]
        capacity[name] = capacity.get(name, 0.0) + (u["capacity_seconds"] or 0.0)
        held[name] = held.get(name, 0.0) + (u["held_seconds"] or 0.0)
        if u["held_share"] is not None:
            peak[name] = max(peak.get(name, 0.0), u["held_share"])
    queues: dict[str, dict[str, Any]] = {}
    keys: dict[str, dict[str, dict[str, Any]]] = {}
    ranked = sorted(rows, key=lambda r: (-(r["dominant_share"] or 0.0), str(r["fair_key"])))
    for row in ranked:
        fields = {
            "dominant_share": row["dominant_share"],
            "dominant_resource": row["dominant_resource"],
            "held_seconds": dict(sorted((row["held_seconds"] or {}).items())),
            "shares": dict(sorted((row["shares"] or {}).items())),
        }
        if row["fair_key"] is None:
            queues[row["queue"]] = fields
        else:
            keys.setdefault(row["queue"], {})[row["fair_key"]] = fields
    names = sorted(capacity.keys() | held.keys())
    return {
        "capacity_seconds": {n: capacity.get(n, 0.0) for n in names},
        "held_seconds": {n: held.get(n, 0.0) for n in names},
        "held_share": {
            n: held.get(n, 0.0) / capacity[n] if capacity.get(n) else None for n in names
        },
        "peak": {n: peak.get(n) for n in names},
        "queues": dict(sorted(queues.items())),
        "keys": {q: keys[q] for q in sorted(keys)},
        "usage": usage,
    }


def _ratio(numerator: float, denominator: float | None) -> float | None:
    return numerator / denominator if denominator else None


def ranked_tenants(section: Mapping[str, Any]) -> list[tuple[str, str | None, dict[str, Any]]]:
    """(queue, key or None, fields) of every tenant, the largest dominant share first."""
    tenants: list[tuple[str, str | None, dict[str, Any]]] = [
        (q, None, f) for q, f in section.get("queues", {}).items()
    ]
    tenants += [(q, k, f) for q, per in section.get("keys", {}).items() for k, f in per.items()]
    return sorted(tenants, key=lambda t: (-(t[2]["dominant_share"] or 0.0), t[0], t[1] or ""))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _dominant(fields: Mapping[str, Any]) -> str:
    return f"{_pct(fields['dominant_share'])} {fields['dominant_resource'] or '-'}"


def summary_lines(section: Mapping[str, Any]) -> list[str]:
    """The terminal summary's lines: resources held over the report, dominant shares."""
    if not section:
        return []
    held = ", ".join(
        f"{n} {_pct(share)} (peak {_pct(section['peak'].get(n))})"
        for n, share in section["held_share"].items()
    )
    queues = ", ".join(f"{q} {_dominant(f)}" for q, f in section["queues"].items())
    keyed = [t for t in ranked_tenants(section) if t[1] is not None]
    lines = [f"resources held of the workers' capacity: {held or '-'}"]
    lines.append(f"  dominant share per queue: {queues or '-'}")
    if keyed:
        shown = ", ".join(f"{k} ({q}) {_dominant(f)}" for q, k, f in keyed[:SHOWN])
        more = f" ... and {len(keyed) - SHOWN} more" if len(keyed) > SHOWN else ""
        lines.append(f"  dominant share per key: {shown}{more}")
    return lines
