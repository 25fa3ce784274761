"""Backlog caps on RabbitMQ, the worker's part: which arrivals free a place, and where."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

from kombu.entity import Queue

from celery_fair.keys.lanes import KeyLanes, key_digest
from celery_fair.keys.pause_events import parked_lane
from celery_fair.wire import KEY_HEADER, MAX_BACKLOG_HEADER
from celery_fair.worker.attachment import Attachment
from celery_fair.worker.backlog import BacklogReleases
from celery_fair.worker.queue_map import QueueMap


class _Counter:
    def __init__(self) -> None:
        self.released: list[tuple[str, str, int]] = []

    def release(self, queue: str, key: str, cap: int) -> bool:
        self.released.append((queue, key, cap))
        return True

    def close(self) -> None:
        self.closed = True


def _releases(*, background: bool = False) -> tuple[BacklogReleases, _Counter]:
    lanes = KeyLanes(frozenset({"jobs"}))
    queue_map = QueueMap(Attachment())
    queue_map.use_lanes(lanes)
    queue_map.map([Queue(name) for name in ("jobs", *lanes.lanes("jobs"), "plain")])
    counter = _Counter()
    # background=False: at once, in the caller.
    return BacklogReleases(counter, queue_map, background=background), counter  # type: ignore[arg-type]


def _request(task_id: str, lane: str, **headers: Any) -> Any:
    """A worker ``Request`` as Celery hands it to ``task_received``."""
    return SimpleNamespace(
        id=task_id, delivery_info={"routing_key": lane}, _request_dict=dict(headers)
    )


def _context(task_id: str, lane: str, **headers: Any) -> Any:
    """A task's context as Celery sends it with ``task_revoked``."""
    return SimpleNamespace(id=task_id, delivery_info={"routing_key": lane}, **headers)


CAPPED = {KEY_HEADER: "a", MAX_BACKLOG_HEADER: 20}


def test_a_capped_task_frees_its_place_in_its_keys_counter_as_it_arrives() -> None:
    releases, counter = _releases()
    releases.on_received(request=_request("t1", "jobs.fair.s3", **CAPPED))
    releases.on_received(request=_request("t2", "jobs.fair.n1", **CAPPED))
    assert counter.released == [("jobs", "a", 20), ("jobs", "a", 20)]


def test_uncapped_and_unkeyed_tasks_free_nothing() -> None:
    releases, counter = _releases()
    releases.on_received(request=_request("t1", "jobs.fair.s3", **{KEY_HEADER: "a"}))
    releases.on_received(request=_request("t2", "plain", **CAPPED))  # not a keyed queue
    releases.on_received(request=_request("t3", "jobs", **{MAX_BACKLOG_HEADER: True}))
    releases.on_received(request=_request("t4", "jobs", **{MAX_BACKLOG_HEADER: 0}))
    assert counter.released == []
    # A plain producer's task in the queue itself is the unkeyed key's.
    releases.on_received(request=_request("t5", "jobs", **{MAX_BACKLOG_HEADER: 5}))
    assert counter.released == [("jobs", "", 5)]


def test_a_revoke_frees_a_place_only_for_a_task_this_worker_had_not_received() -> None:
    releases, counter = _releases()
    # Revoked (or expired) as it arrives: Celery sends task_revoked, not task_received.
    releases.on_revoked(request=_context("early", "jobs.fair.s0", **CAPPED))
    assert counter.released == [("jobs", "a", 20)]
    # Received, then revoked while it waits or runs: its place went at receipt.
    releases.on_received(request=_request("late", "jobs.fair.s0", **CAPPED))
    releases.on_revoked(request=_context("late", "jobs.fair.s0", **CAPPED))
    assert counter.released == [("jobs", "a", 20)] * 2
    # A retry is a new message with the same id: it was counted again, and frees again.
    releases.on_received(request=_request("late", "jobs.fair.s0", **CAPPED))
    assert counter.released == [("jobs", "a", 20)] * 3


def test_a_counter_is_named_by_its_queue_cap_and_key_digest() -> None:
    assert KeyLanes.backlog_counter("jobs", "tenant-1", 100) == (
        f"jobs.fair.b100.{hashlib.blake2b(b'tenant-1', digest_size=8).hexdigest()}"
    )
    assert KeyLanes.backlog_counter("jobs", "t", 5) != KeyLanes.backlog_counter("jobs", "t", 6)
    # The parked lanes keep their names (a pause log written before is still read).
    assert parked_lane("jobs", "tenant-1") == f"jobs.fair.p.{key_digest('tenant-1')}"


def test_places_are_freed_off_the_event_loop_in_order_and_drained_at_shutdown() -> None:
    releases, counter = _releases(background=True)  # as the worker runs it
    for i in range(50):
        releases.on_received(
            request=_request(
                f"t{i}", "jobs.fair.s1", **{KEY_HEADER: f"k{i}", MAX_BACKLOG_HEADER: 3}
            )
        )
    releases.disconnect()  # waits for the thread to free what was received
    assert counter.released == [("jobs", f"k{i}", 3) for i in range(50)]
    assert counter.closed


def test_a_redelivered_task_frees_no_second_place() -> None:
    """A task the broker delivers again (its first worker died holding it) freed its
    place at its first delivery: received or revoked again, it frees none."""
    releases, counter = _releases()
    again = _request("t1", "jobs.fair.s3", **CAPPED)
    again.delivery_info["redelivered"] = True
    releases.on_received(request=again)
    revoked = _context("t2", "jobs.fair.s3", **CAPPED)
    revoked.delivery_info["redelivered"] = True
    releases.on_revoked(request=revoked)
    assert counter.released == []
    first = _request("t3", "jobs.fair.s3", **CAPPED)
    first.delivery_info["redelivered"] = False
    releases.on_received(request=first)
    assert counter.released == [("jobs", "a", 20)]
