"""Celery's own task events folded into telemetry records (``celery-fair capture``).

For deployments that do not run the celery-fair bootstep yet: workers started
with ``-E`` (or after ``celery control enable_events``) publish task events,
and this receiver joins the events of each task into one :class:`TaskRecord`
when the task ends. What the events carry maps onto the schema:

=================  ==========================================================
task-sent          published (its timestamp), queue, routing key, task name
                   (only if the producer sets ``task_send_sent_event``)
task-received      received, worker hostname and pid
task-started       started
task-succeeded     finished, runtime, outcome ``success``
task-failed        finished, outcome ``failure``
task-retried       finished, outcome ``retry``
task-revoked       finished, outcome ``revoked``
=================  ==========================================================

Events carry no dispatch time, no fairness key and no charged cost: those
stay null (the report then uses start for dispatch, and the run time or a
count for cost). ``task-rejected`` is not an outcome of the schema and is
ignored.

The command itself (its options, and their defaults from the app's
settings) is :mod:`celery_fair.monitoring.capture_cli`: the settings'
reader is the worker's, a layer above this one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..scheduling.cost import COST_MODES

if TYPE_CHECKING:
    from celery_fair.telemetry.schema import TaskRecord

__all__ = ("EventCapture", "capture_events")

_TERMINAL = {
    "task-succeeded": "success",
    "task-failed": "failure",
    "task-retried": "retry",
    "task-revoked": "revoked",
}


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


class EventCapture:
    """Join task events by task id and emit a record when the task ends.

    ``pending`` holds tasks seen but not ended, at most ``max_pending`` (the
    oldest is forgotten first), so a lost terminal event cannot grow memory.
    """

    def __init__(
        self,
        sink: Callable[[TaskRecord], None],
        *,
        weights: Mapping[str, float] | None = None,
        cost: str = "runtime",
        max_pending: int = 100_000,
    ) -> None:
        if cost not in COST_MODES:
            raise ValueError(f"cost={cost!r}: must be one of {', '.join(COST_MODES)}")
        self.sink = sink
        self.weights = dict(weights or {})
        self.cost = cost
        self.max_pending = max_pending
        self.pending: dict[str, dict[str, Any]] = {}
        self.emitted = 0
        self.forgotten = 0

    def on_event(self, event: Mapping[str, Any]) -> None:
        """Handle one event (Celery's receiver calls it for every event)."""
        kind, uuid = event.get("type", ""), event.get("uuid")
        if not uuid or not kind.startswith("task-"):
            return
        state = self.pending.get(uuid)
        if state is None:
            if len(self.pending) >= self.max_pending:
                del self.pending[next(iter(self.pending))]
                self.forgotten += 1
            state = self.pending[uuid] = {}
        ts = _float(event.get("timestamp"))
        if kind == "task-sent":
            state.update(
                published=ts,
                name=event.get("name"),
                queue=event.get("queue") or event.get("routing_key"),
                routing_key=event.get("routing_key"),
            )
        elif kind == "task-received":
            state.update(received=ts, name=event.get("name") or state.get("name"))
            state.update(hostname=event.get("hostname"), pid=event.get("pid"))
        elif kind == "task-started":
            state.update(started=ts, hostname=event.get("hostname"), pid=event.get("pid"))
        elif kind in _TERMINAL:
            del self.pending[uuid]
            state.update(finished=ts, runtime=_float(event.get("runtime")))
            self.sink(self._record(uuid, _TERMINAL[kind], state))
            self.emitted += 1

    def _record(self, uuid: str, outcome: str, s: Mapping[str, Any]) -> TaskRecord:
        from celery_fair.telemetry.schema import TaskRecord  # pyarrow: the telemetry extra

        queue = s.get("queue")
        runtime = s.get("runtime") if outcome == "success" else None
        ran = outcome in ("success", "failure", "retry")
        cost = (1.0 if self.cost == "count" else runtime) if ran else 0.0
        return TaskRecord(
            task_id=uuid,
            task_name=s.get("name") or "",
            queue=queue,
            outcome=outcome,
            received=s.get("received"),
            finished=s.get("finished"),
            routing_key=s.get("routing_key"),
            published=s.get("published"),
            started=s.get("started"),
            runtime=runtime,
            cost=cost,
            target_weight=self.weights.get(queue) if queue else None,
            hostname=s.get("hostname"),
            pid=int(s["pid"]) if s.get("pid") is not None else None,
            source="events",
        )


def capture_events(
    app: Any,
    out: str | Path,
    *,
    duration: float | None = None,
    weights: Mapping[str, float] | None = None,
    cost: str = "runtime",
    stop: threading.Event | None = None,
    on_ready: Callable[[], None] | None = None,
) -> dict[str, int]:
    """Capture ``app``'s task events into telemetry files under ``out``.

    Runs until ``duration`` seconds pass or ``stop`` is set; then writes what
    is buffered and returns counters.
    """
    from celery_fair.telemetry.writer import TelemetryWriter

    stopper = stop if stop is not None else threading.Event()
    writer = TelemetryWriter(out, rotate_seconds=10.0)
    capture = EventCapture(writer.record, weights=weights, cost=cost)

    class Receiver(app.events.Receiver):  # type: ignore[misc]
        def on_consume_ready(self, *args: Any, **kwargs: Any) -> None:
            super().on_consume_ready(*args, **kwargs)
            if on_ready is not None:
                on_ready()

        def on_iteration(self) -> None:
            if stopper.is_set():
                self.should_stop = True

    timer = threading.Timer(duration, stopper.set) if duration else None
    try:
        with app.connection_for_read() as conn:
            receiver = Receiver(conn, handlers={"*": capture.on_event}, app=app)
            if timer is not None:
                timer.start()
            receiver.capture(limit=None, timeout=None, wakeup=True)
    except KeyboardInterrupt:
        pass
    finally:
        if timer is not None:
            timer.cancel()
        writer.close()
    stats = writer.statistics()
    return {
        "records": capture.emitted,
        "unfinished": len(capture.pending),
        "written": stats.written,
        "dropped": stats.dropped,
        "files": stats.files,
    }
