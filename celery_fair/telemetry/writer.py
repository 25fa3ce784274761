"""Buffered, rotating Parquet files of :class:`TaskRecord`, written off the hot path.

The worker calls :meth:`TelemetryWriter.record` once per task. It appends to a
bounded in-memory buffer under a lock held for a few instructions, and never
does I/O: a background thread turns the buffer into a Parquet file when it
holds ``rotate_records`` records or when ``rotate_seconds`` have passed since
the last file. Telemetry must never stop a worker: a write that fails (a full
disk, a directory that went away) keeps the records buffered, logs one
rate-limited warning and retries later; while writes keep failing, the
buffer drops its *oldest* records and counts them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from celery_fair.telemetry.schema import TaskRecord, as_row, rows_to_table

__all__ = ("TelemetryWriter", "WriterStatistics", "write_parquet")

logger = logging.getLogger(__name__)

#: ``(table, path)``: writes a whole file at ``path``; raises ``OSError`` on failure.
WriteTable = Callable[[pa.Table, str], None]


def write_parquet(table: pa.Table, path: str) -> None:
    """The default :data:`WriteTable`: one Parquet file, zstd-compressed."""
    pq.write_table(table, path, compression="zstd")


@dataclass(frozen=True)
class WriterStatistics:
    """Counters of a :class:`TelemetryWriter` (a snapshot)."""

    recorded: int
    written: int
    dropped: int
    buffered: int
    files: int
    errors: int
    last_error: str | None


class TelemetryWriter:
    """Write task records to rotating Parquet files in ``directory``.

    Files are named ``fair-<hostname>-<pid>-<start>-<sequence>.parquet`` and
    appear atomically: each is written to a hidden temporary name in the same
    directory (Spark and pyarrow skip names starting with ``.``) and renamed.

    ``clock`` (``time.time`` by default) decides rotation by age, retry
    back-off and warning rate limits; pass a fake clock and
    ``background=False`` to drive the writer by hand with :meth:`poll`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_buffer: int = 100_000,
        rotate_records: int = 50_000,
        rotate_seconds: float = 60.0,
        retry_seconds: float = 5.0,
        warn_seconds: float = 60.0,
        clock: Callable[[], float] = time.time,
        background: bool = True,
        write_table: WriteTable = write_parquet,
        hostname: str | None = None,
        pid: int | None = None,
    ) -> None:
        if max_buffer < 1:
            raise ValueError(f"max_buffer={max_buffer!r}: must be at least 1")
        if rotate_records < 1:
            raise ValueError(f"rotate_records={rotate_records!r}: must be at least 1")
        if not rotate_seconds > 0:
            raise ValueError(f"rotate_seconds={rotate_seconds!r}: must be positive")
        self.directory = Path(directory)
        self.max_buffer = max_buffer
        self.rotate_records = rotate_records
        self.rotate_seconds = rotate_seconds
        self.retry_seconds = retry_seconds
        self.warn_seconds = warn_seconds
        self._clock = clock
        self._write_table = write_table
        host = (hostname or socket.gethostname()).replace(os.sep, "_")
        self._prefix = f"fair-{host}-{pid if pid is not None else os.getpid()}-{int(clock())}"
        self._sequence = itertools.count()

        self._buffer: deque[tuple[Any, ...]] = deque()  # as_row tuples: GC-untracked
        self._lock = threading.Lock()  # guards _buffer and the counters record() touches
        self._write_lock = threading.Lock()  # one file written at a time
        self._wake = threading.Event()
        self._closed = False
        self._recorded = self._dropped = 0
        self._written = self._files = self._errors = 0
        self._last_error: str | None = None
        self._last_flush = clock()
        self._retry_at = float("-inf")
        self._warned_at = float("-inf")
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._run, name="celery-fair-telemetry", daemon=True
            )
            self._thread.start()

    # -- the hot path -----------------------------------------------------

    def record(self, rec: TaskRecord) -> None:
        """Buffer one record: O(1), no I/O, never blocks on a write."""
        self.record_row(as_row(rec))

    def record_row(self, row: tuple[Any, ...]) -> None:
        """Buffer one record given as a tuple in :data:`~celery_fair.telemetry.schema.FIELDS` order.

        The pool's hot path builds the tuple directly: a frozen record object
        costs more to make (about 2 us) than everything else it does.
        """
        with self._lock:
            if self._closed:
                self._dropped += 1
                return
            if len(self._buffer) >= self.max_buffer:
                self._buffer.popleft()
                self._dropped += 1
            self._buffer.append(row)
            self._recorded += 1
            full = len(self._buffer) >= self.rotate_records
        if full:
            self._wake.set()

    # -- writing ----------------------------------------------------------

    def poll(self) -> int:
        """Write a file if a rotation threshold is reached; return records written."""
        now = self._clock()
        if now < self._retry_at:
            return 0
        with self._lock:
            n = len(self._buffer)
        if n >= self.rotate_records or (n and now - self._last_flush >= self.rotate_seconds):
            return self.flush()
        return 0

    def flush(self) -> int:
        """Write everything buffered now (in files of at most ``rotate_records``).

        Returns the number of records written; on a write error the records
        stay buffered (oldest dropped if new ones overflow) and it returns.
        """
        written = 0
        with self._write_lock:
            while True:
                with self._lock:
                    take = min(len(self._buffer), self.rotate_records)
                    batch = [self._buffer.popleft() for _ in range(take)]
                if not batch:
                    break
                if not self._write_file(batch):
                    self._requeue(batch)
                    break
                written += len(batch)
            self._last_flush = self._clock()
        return written

    def _write_file(self, batch: list[tuple[Any, ...]]) -> bool:
        name = f"{self._prefix}-{next(self._sequence):06d}.parquet"
        final = self.directory / name
        tmp = self.directory / f".{name}.tmp"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._write_table(rows_to_table(batch), str(tmp))
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._on_error(exc)
            return False
        with self._lock:
            self._written += len(batch)
            self._files += 1
        return True

    def _requeue(self, batch: list[tuple[Any, ...]]) -> None:
        # The batch is older than anything recorded since: it goes back in
        # front, and whatever no longer fits is dropped from the old end.
        with self._lock:
            self._buffer.extendleft(reversed(batch))
            while len(self._buffer) > self.max_buffer:
                self._buffer.popleft()
                self._dropped += 1

    def _on_error(self, exc: OSError) -> None:
        now = self._clock()
        self._retry_at = now + self.retry_seconds
        with self._lock:
            self._errors += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            errors, dropped = self._errors, self._dropped
        if now - self._warned_at >= self.warn_seconds:
            self._warned_at = now
            logger.warning(
                "celery-fair telemetry: cannot write to %s (%s); records stay buffered "
                "(%d errors, %d records dropped so far), retrying in %gs",
                self.directory,
                exc,
                errors,
                dropped,
                self.retry_seconds,
            )

    # -- background thread and shutdown -----------------------------------

    def _run(self) -> None:
        tick = min(1.0, self.rotate_seconds / 4, max(self.retry_seconds, 0.05))
        while not self._closed:
            self._wake.wait(tick)
            self._wake.clear()
            try:
                self.poll()
            except Exception:  # never let the thread die: telemetry is best effort
                logger.exception("celery-fair telemetry: unexpected error while writing")

    def close(self, timeout: float = 10.0) -> None:
        """Stop the background thread and write what is buffered (one attempt)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._retry_at = float("-inf")
        self.flush()
        left = self.statistics().buffered
        if left:
            logger.warning("celery-fair telemetry: %d records lost at shutdown", left)

    def statistics(self) -> WriterStatistics:
        """Return the counters as a frozen record."""
        with self._lock:
            return WriterStatistics(
                recorded=self._recorded,
                written=self._written,
                dropped=self._dropped,
                buffered=len(self._buffer),
                files=self._files,
                errors=self._errors,
                last_error=self._last_error,
            )

    def __enter__(self) -> TelemetryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
