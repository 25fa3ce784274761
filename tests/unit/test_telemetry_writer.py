"""TelemetryWriter: atomic rotating files, bounded memory, failures that only warn."""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from celery_fair.telemetry import SCHEMA, TaskRecord, TelemetryWriter, records_to_table
from celery_fair.telemetry.schema import FIELDS, SCHEMA_VERSION
from celery_fair.telemetry.writer import write_parquet
from tests.harness.clock import FakeClock


class FlakyDisk:
    """A write function that fails with ENOSPC while ``full`` is set."""

    def __init__(self) -> None:
        self.full = True
        self.attempts = 0

    def __call__(self, table: pa.Table, path: str) -> None:
        self.attempts += 1
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        write_parquet(table, path)


def rec(i: int) -> TaskRecord:
    return TaskRecord(
        task_id=f"t{i}", task_name="work", queue="q", outcome="success",
        received=float(i), finished=float(i) + 1, runtime=0.5, pid=7,
    )  # fmt: skip


def read_ids(directory: Path) -> list[str]:
    files = sorted(directory.glob("*.parquet"))
    return [r for f in files for r in pq.read_table(f).column("task_id").to_pylist()]


def manual(directory: Path, **kw: object) -> TelemetryWriter:
    return TelemetryWriter(directory, background=False, hostname="h", pid=1, **kw)  # type: ignore[arg-type]


def test_schema_and_record_list_the_same_fields() -> None:
    assert tuple(SCHEMA.names) == FIELDS
    table = records_to_table([rec(1)])
    assert table.schema.equals(SCHEMA)
    assert table.to_pylist()[0] == dataclasses.asdict(rec(1))


def test_rotates_by_count_and_age_with_atomic_names(tmp_path: Path) -> None:
    clock = FakeClock(1000.0)
    w = manual(tmp_path, rotate_records=3, rotate_seconds=10, clock=clock)
    for i in range(7):
        w.record(rec(i))
    assert w.poll() == 7  # two full files, then the remainder
    w.record(rec(7))
    assert w.poll() == 0  # one record, young: stays buffered
    clock.now += 11
    assert w.poll() == 1
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"fair-h-1-1000-{i:06d}.parquet" for i in range(4)]
    assert read_ids(tmp_path) == [f"t{i}" for i in range(8)]
    stats = w.statistics()
    assert (stats.recorded, stats.written, stats.files, stats.dropped) == (8, 8, 4, 0)


def test_close_flushes_and_later_records_are_dropped(tmp_path: Path) -> None:
    w = TelemetryWriter(tmp_path, rotate_records=1000, rotate_seconds=3600)
    for i in range(5):
        w.record(rec(i))
    w.close()
    assert read_ids(tmp_path) == [f"t{i}" for i in range(5)]
    w.record(rec(5))
    assert w.statistics().dropped == 1


def test_background_thread_writes_when_a_file_is_full(tmp_path: Path) -> None:
    done = threading.Event()

    def write(table: pa.Table, path: str) -> None:
        write_parquet(table, path)
        done.set()

    with TelemetryWriter(tmp_path, rotate_records=10, write_table=write) as w:
        for i in range(10):
            w.record(rec(i))
        assert done.wait(10)
    assert sorted(read_ids(tmp_path)) == sorted(f"t{i}" for i in range(10))


def test_broken_directory_warns_once_and_keeps_recording(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    clock = FakeClock(1000.0)
    w = manual(not_a_dir / "telemetry", rotate_records=2, max_buffer=4, clock=clock)
    with caplog.at_level(logging.WARNING):
        for i in range(10):
            w.record(rec(i))
            clock.now += 1  # retries after retry_seconds, warns once per warn_seconds
            w.poll()
    stats = w.statistics()
    assert stats.errors >= 2
    assert stats.buffered == 4 and stats.dropped == 6 and stats.written == 0
    assert "NotADirectoryError" in (stats.last_error or "")
    warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1


def test_full_disk_keeps_newest_records_and_recovers(tmp_path: Path) -> None:
    disk = FlakyDisk()
    clock = FakeClock(1000.0)
    w = manual(tmp_path, rotate_records=3, max_buffer=5, clock=clock, write_table=disk)
    for i in range(4):
        w.record(rec(i))
    assert w.flush() == 0
    for i in range(4, 8):
        w.record(rec(i))  # the buffer holds 5: the oldest three go
    assert w.statistics().dropped == 3
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind
    disk.full = False
    clock.now += 60
    assert w.flush() == 5
    assert read_ids(tmp_path) == [f"t{i}" for i in range(3, 8)]
    assert w.statistics().errors == 1


def test_failed_write_does_not_block_record(tmp_path: Path) -> None:
    # While the writer is stuck in a write, record() still returns at once.
    entered, release = threading.Event(), threading.Event()

    def stuck(table: pa.Table, path: str) -> None:
        entered.set()
        release.wait(10)
        raise OSError(errno.EIO, "I/O error")

    w = manual(tmp_path, rotate_records=1, max_buffer=3, write_table=stuck)
    w.record(rec(0))
    flusher = threading.Thread(target=w.flush)
    flusher.start()
    assert entered.wait(10)
    for i in range(1, 6):
        w.record(rec(i))
    release.set()
    flusher.join(10)
    stats = w.statistics()
    assert stats.recorded == 6 and stats.buffered == 3 and stats.dropped == 3


def test_concurrent_records_are_each_written_once(tmp_path: Path) -> None:
    w = TelemetryWriter(tmp_path, rotate_records=500, max_buffer=100_000, rotate_seconds=0.05)
    threads = [
        threading.Thread(target=lambda t=t: [w.record(rec(t * 10_000 + i)) for i in range(5000)])
        for t in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    ids = read_ids(tmp_path)
    assert len(ids) == len(set(ids)) == 20_000
    stats = w.statistics()
    assert (stats.recorded, stats.written, stats.dropped, stats.buffered) == (20_000, 20_000, 0, 0)


def test_bad_options_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_buffer"):
        TelemetryWriter(tmp_path, max_buffer=0, background=False)
    with pytest.raises(ValueError, match="rotate_seconds"):
        TelemetryWriter(tmp_path, rotate_seconds=0, background=False)


def test_resources_and_capacity_are_maps_written_and_read_back(tmp_path: Path) -> None:
    # Schema 6: what a task held and its worker's capacity, resource -> amount.
    assert SCHEMA_VERSION == 6
    assert SCHEMA.metadata[b"celery_fair.schema_version"] == b"6"
    for name in ("resources", "capacity"):
        assert SCHEMA.field(name).type == pa.map_(pa.string(), pa.float64())
    held = dataclasses.replace(
        rec(1), resources={"cpu": 1.0, "mem": 4.0, "slots": 1.0}, capacity=(("cpu", 9.0),)
    )
    writer = manual(tmp_path)
    writer.record(held)
    writer.record(rec(2))  # resources off: null
    writer.close()
    (path,) = tmp_path.glob("*.parquet")
    table = pq.read_table(path)
    assert table.schema.equals(SCHEMA)
    assert table.column("resources").to_pylist() == [
        [("cpu", 1.0), ("mem", 4.0), ("slots", 1.0)],
        None,
    ]
    assert table.column("capacity").to_pylist() == [[("cpu", 9.0)], None]
