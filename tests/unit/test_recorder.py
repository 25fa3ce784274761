"""The pool-side telemetry recorder, driven by hand (no worker, no broker)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from celery_fair.telemetry.schema import FIELDS, TaskRecord, as_row, records_to_table
from celery_fair.wire import (
    CAPACITY_STAMP,
    DEMAND_STAMP,
    DISPATCHED_STAMP,
    QUEUE_STAMP,
    RECEIVED_STAMP,
    WEIGHT_STAMP,
)
from celery_fair.worker.recorder import PoolRecorder, as_amounts, outcome_of
from tests.harness.clock import FakeClock


class FakeWriter:
    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.records: list[Any] = []
        self.closed = False

    def record(self, rec: Any) -> None:
        self.records.append(rec)

    def record_row(self, row: tuple[Any, ...]) -> None:
        # The recorder builds rows in FIELDS order by hand: hold it to the schema.
        assert len(row) == len(FIELDS)
        rec = TaskRecord(*row)
        assert as_row(rec) == row
        self.records.append(rec)

    def close(self) -> None:
        self.closed = True


class Context:
    """The attributes of ``task.request`` the recorder reads (a Celery Context)."""

    def __init__(self, **headers: Any) -> None:
        self.id = "t-1"
        self.delivery_info = {"routing_key": "rk"}
        self.__dict__.update(headers)


class FakeTask:
    name = "proj.work"

    def __init__(self, request: Context) -> None:
        self.request = request


def _recorder(*, runtime_cost: bool = False) -> tuple[PoolRecorder, FakeClock, FakeClock]:
    wall, perf = FakeClock(1000.0), FakeClock(5.0)
    writers: list[FakeWriter] = []

    def make(pid: int) -> FakeWriter:
        writers.append(FakeWriter(pid))
        return writers[-1]

    recorder = PoolRecorder(make, hostname="w1@h", runtime_cost=runtime_cost, wall=wall, perf=perf)
    return recorder, wall, perf


def _stamped(**extra: Any) -> Context:
    headers = {
        RECEIVED_STAMP: 990.0,
        DISPATCHED_STAMP: 995.0,
        QUEUE_STAMP: "q1",
        WEIGHT_STAMP: 3,
        "fair_published": 980.5,
        "fair_key": 42,
    }
    headers.update(extra)
    return Context(**headers)


def test_a_run_gives_one_record_with_the_stamped_and_measured_times() -> None:
    recorder, wall, perf = _recorder()
    writer = recorder.open()
    task = FakeTask(_stamped())
    recorder.on_prerun(task=task, task_id="t-1")
    wall.now, perf.now = 1000.25, 5.2
    recorder.on_postrun(task=task, task_id="t-1", state="SUCCESS")
    (rec,) = writer.records
    assert (rec.task_id, rec.task_name, rec.queue, rec.outcome) == (
        "t-1",
        "proj.work",
        "q1",
        "success",
    )
    assert (rec.published, rec.received, rec.dispatched) == (980.5, 990.0, 995.0)
    assert (rec.started, rec.finished) == (1000.0, 1000.25)
    assert rec.runtime == pytest.approx(0.2)
    assert rec.cost == 1.0 and rec.target_weight == 3.0
    assert (rec.fair_key, rec.routing_key) == ("42", "rk")
    assert (rec.hostname, rec.pid) == ("w1@h", os.getpid())


def test_runtime_cost_records_the_run_time_as_cost() -> None:
    recorder, _, perf = _recorder(runtime_cost=True)
    writer = recorder.open()
    task = FakeTask(_stamped())
    recorder.on_prerun(task=task)
    perf.now += 0.5
    recorder.on_postrun(task=task, task_id="t-1", state="FAILURE")
    (rec,) = writer.records
    assert rec.outcome == "failure" and rec.cost == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("state", "outcome"),
    [("SUCCESS", "success"), ("FAILURE", "failure"), ("RETRY", "retry"),
     ("IGNORED", "success"), ("REJECTED", "failure")],
)  # fmt: skip
def test_celery_states_map_to_outcomes(state: str, outcome: str) -> None:
    assert outcome_of(state) == outcome


def test_no_record_without_a_final_state_or_a_dispatch_stamp_or_a_writer() -> None:
    recorder, _, _ = _recorder()
    task = FakeTask(_stamped())
    recorder.on_postrun(task=task, task_id="t-1", state="SUCCESS")  # not opened yet
    writer = recorder.open()
    recorder.on_postrun(task=task, task_id="t-1", state=None)  # body interrupted
    eager = FakeTask(Context())  # run inside a task, never dispatched by the worker
    recorder.on_prerun(task=eager)
    recorder.on_postrun(task=eager, task_id="t-2", state="SUCCESS")
    assert writer.records == []


def test_close_flushes_only_a_writer_this_process_opened() -> None:
    recorder, _, _ = _recorder()
    inherited = FakeWriter()
    recorder.open(inherited)
    # As in a pool process forked after the main process opened its writer.
    recorder.pid = -1
    assert recorder.close() is None and not inherited.closed
    own = recorder.open()
    assert own is not inherited and own.pid == os.getpid()
    assert recorder.close() is own and own.closed and recorder.writer is None


def test_what_the_task_held_and_the_workers_capacity_are_recorded() -> None:
    recorder, _, _ = _recorder()
    writer = recorder.open()
    demand = {"cpu": 1.0, "mem": 4, "slots": 1.0}
    capacity = {"cpu": 9.0, "mem": 18.0, "slots": 4.0}
    task = FakeTask(_stamped(**{DEMAND_STAMP: demand, CAPACITY_STAMP: capacity}))
    recorder.on_prerun(task=task)
    recorder.on_postrun(task=task, task_id="t-1", state="SUCCESS")
    plain = FakeTask(_stamped())  # resources off: no stamps
    recorder.on_prerun(task=plain)
    recorder.on_postrun(task=plain, task_id="t-2", state="SUCCESS")
    held, off = writer.records
    assert dict(held.resources) == {"cpu": 1.0, "mem": 4.0, "slots": 1.0}
    assert dict(held.capacity) == capacity
    assert off.resources is None and off.capacity is None
    table = records_to_table(writer.records)
    assert table.column("resources").to_pylist()[0] == [("cpu", 1.0), ("mem", 4.0), ("slots", 1.0)]
    assert table.column("capacity").to_pylist()[1] is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("cpu=1", None), ([("cpu", 1)], None), ({}, ()),
     ({"cpu": 2, "gpu": "x", "on": True}, (("cpu", 2.0),))],
)  # fmt: skip
def test_a_stamp_of_amounts_is_read_as_pairs_of_numbers(value: Any, expected: Any) -> None:
    assert as_amounts(value) == expected
