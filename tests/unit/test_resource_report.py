"""The report's resources section, shaped from the pipeline's rows (no Spark)."""

from __future__ import annotations

import pytest

from celery_fair.analytics.resources import ranked_tenants, resources_section, summary_lines


def _usage(window: float, resource: str, held: float, capacity: float) -> dict[str, object]:
    share = held / capacity if capacity else None
    return {"window": window, "resource": resource, "held_seconds": held,
            "capacity_seconds": capacity, "held_share": share}  # fmt: skip


def _tenant(queue: str, key: str | None, shares: dict[str, float]) -> dict[str, object]:
    shared = {r: s for r, s in shares.items() if not r.startswith("queue:")}
    top = max(shared, key=shared.__getitem__)
    held = {r: s * 100 for r, s in shares.items()}
    return {"queue": queue, "fair_key": key, "held_seconds": held, "shares": shares,
            "dominant_share": shared[top], "dominant_resource": top}  # fmt: skip


def test_no_rows_no_section_and_no_lines() -> None:
    assert resources_section({}) == {}
    assert resources_section({"resource_usage": [], "resource_shares": []}) == {}
    assert summary_lines({}) == []


def test_totals_peaks_queues_and_keys_ranked_by_dominant_share() -> None:
    data = {
        "resource_usage": [
            _usage(0.0, "cpu", 45.0, 90.0), _usage(10.0, "cpu", 90.0, 90.0),
            _usage(0.0, "mem", 36.0, 180.0), _usage(10.0, "mem", 0.0, 0.0),
        ],
        "resource_shares": [
            _tenant("jobs", "B", {"cpu": 2 / 3, "mem": 1 / 9}),
            _tenant("jobs", None, {"cpu": 1.0, "mem": 7 / 9, "queue:jobs": 1.0}),
            _tenant("jobs", "A", {"cpu": 1 / 3, "mem": 0.7}),
            _tenant("video", None, {"cpu": 0.1, "mem": 0.05}),
        ],
    }  # fmt: skip
    section = resources_section(data)
    assert section["capacity_seconds"] == {"cpu": 180.0, "mem": 180.0}
    assert section["held_share"] == pytest.approx({"cpu": 0.75, "mem": 0.2})
    assert section["peak"] == {"cpu": 1.0, "mem": 0.2}
    # A queue's own resource never dominates, though its share is 1.
    assert section["queues"]["jobs"]["dominant_resource"] == "cpu"
    assert list(section["keys"]["jobs"]) == ["A", "B"]  # 0.7 before 2/3
    assert [(q, k) for q, k, _ in ranked_tenants(section)] == [
        ("jobs", None), ("jobs", "A"), ("jobs", "B"), ("video", None)
    ]  # fmt: skip
    lines = summary_lines(section)
    assert lines[0] == (
        "resources held of the workers' capacity: cpu 75.0% (peak 100.0%), mem 20.0% (peak 20.0%)"
    )
    assert lines[1] == "  dominant share per queue: jobs 100.0% cpu, video 10.0% cpu"
    assert lines[2] == "  dominant share per key: A (jobs) 70.0% mem, B (jobs) 66.7% cpu"
