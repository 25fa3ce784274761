"""bench.wait_split: a quiet task's wait split at its receipt, by phase of the flood."""

from __future__ import annotations

from bench.wait_split import split


def _task(key: str, published: float, received: float, started: float) -> dict[str, object]:
    return {"fair_key": key, "published": published, "received": received, "started": started}


def test_quiet_waits_are_split_at_receipt_by_the_floods_phase() -> None:
    records = [
        _task("quiet", 1.0, 1.001, 1.003),  # before the burst
        _task("flood", 10.0, 10.0, 10.5),  # the burst: published 10 s to 12 s
        _task("flood", 12.0, 12.0, 20.0),  # drained at 20 s
        _task("quiet", 11.0, 11.010, 11.030),  # while the burst is published
        _task("quiet", 15.0, 15.002, 15.006),  # after it
        _task("", 11.0, 11.5, 11.9),  # unkeyed: not a tenant's
        _task("quiet", 25.0, 25.0, 25.001),  # after the flood drained: not counted
    ]
    phases = split(records, "flood")
    assert [phases[p]["n"] for p in ("unloaded", "publishing", "after")] == [1, 1, 1]
    publishing = phases["publishing"]
    assert round(publishing["publish_received"]["p99"], 6) == 10.0
    assert round(publishing["received_started"]["p99"], 6) == 20.0
    assert round(publishing["total"]["p50"], 6) == 30.0
    assert publishing["seconds"] == 2.0
    assert round(phases["after"]["total"]["p99"], 6) == 6.0
