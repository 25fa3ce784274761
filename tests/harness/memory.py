"""Resident memory of a worker's main process while it drains a deep backlog.

Shared by the bounded-memory test and ``bench/memory.py``: the queues are
filled (by the caller), one ``celery worker`` drains them while its main
process's RSS is sampled from ``/proc``; the first sample is taken once the
worker has consumed ``warmup`` tasks (start-up done, pool forked, buffers and
caches warm), the last when ``drain`` tasks are consumed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .brokers import broker_for
from .harness import QUICK_STOP, WorkerProcess

__all__ = ("MemoryRun", "drain_and_sample", "rss_bytes")


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux ``/proc``), in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


@dataclass(frozen=True)
class MemoryRun:
    """RSS of the main process: after start-up, the peak while draining, the end."""

    fair: bool
    queued: int
    drained: int
    #: Tasks consumed between the first and the last sample.
    measured: int
    start_rss: int
    peak_rss: int
    end_rss: int
    seconds: float
    #: ``(tasks consumed, RSS)`` about once a second from the first sample on.
    timeline: tuple[tuple[int, int], ...] = ()

    @property
    def growth(self) -> int:
        """Peak while draining minus the RSS after start-up (bytes)."""
        return self.peak_rss - self.start_rss

    @property
    def rate(self) -> float:
        return self.measured / self.seconds if self.seconds > 0 else 0.0


def drain_and_sample(
    broker_url: str,
    queues: Sequence[str],
    *,
    drain: int,
    warmup: int = 1000,
    fair: bool = True,
    env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    concurrency: int = 2,
    timeout: float = 600.0,
) -> MemoryRun:
    """Run one worker on the (already filled) ``queues`` until ``drain`` tasks are gone."""
    broker = broker_for(broker_url)
    initial = sum(broker.lengths(queues).values())
    if drain > initial:
        raise ValueError(f"drain={drain} but only {initial} tasks are queued")
    worker = WorkerProcess(
        broker_url,
        list(queues),
        concurrency=concurrency,
        fair=fair,
        env=env or {},
        extra_args=extra_args,
    )
    deadline = time.monotonic() + timeout
    start_rss = peak = at_start = 0
    started = last = 0.0
    timeline: list[tuple[int, int]] = []
    with worker:
        assert worker.proc is not None
        pid = worker.proc.pid
        while True:
            if worker.proc.poll() is not None:
                raise RuntimeError(f"worker exited early:\n{worker.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker did not drain {drain} tasks in {timeout} s")
            consumed = initial - sum(broker.lengths(queues).values())
            rss = rss_bytes(pid)
            if not start_rss:
                if consumed >= warmup:
                    start_rss = peak = rss
                    started, at_start = time.monotonic(), consumed
            else:
                peak = max(peak, rss)
                now = time.monotonic()
                if now - last >= 1.0:
                    timeline.append((consumed, rss))
                    last = now
                if consumed >= drain:
                    seconds = time.monotonic() - started
                    worker.stop(QUICK_STOP)  # measured: a warm stop's 30 s wait buys nothing
                    return MemoryRun(
                        fair=fair,
                        queued=initial,
                        drained=consumed,
                        measured=consumed - at_start,
                        start_rss=start_rss,
                        peak_rss=peak,
                        end_rss=rss,
                        seconds=seconds,
                        timeline=(*timeline, (consumed, rss)),
                    )
            time.sleep(0.1)
