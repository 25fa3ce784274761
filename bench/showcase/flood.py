"""Scenarios A, D, K and KS: one tenant floods while quiet tenants trickle.

One run, for one mode (:data:`~bench.showcase.layout.MODES`):

1. start ``workers`` real ``celery worker -P prefork`` processes on the
   mode's queues and wait until they log ``ready``;
2. **unloaded phase**: every quiet tenant publishes a steady trickle of
   ``ledger(task_ms)`` tasks for ``settle + baseline`` seconds (the first
   ``settle`` seconds are not counted);
3. **flood phase**: the flooding tenant publishes ``flood`` tasks in one
   burst from a second thread while the trickle goes on, until the ledger
   shows every flood task started; with ``slow_ms`` the last worker's tasks
   take that much longer from the flood's start on (scenario D);
4. the trickle stops, the run waits until every published task is in the
   ledger, and the workers are stopped.

With ``due_after`` (scenario KS) the burst's tasks are all published with
one eta, ``due_after`` seconds after the flood's start (a few seconds after
the burst is published): the *flood phase* then begins when they come due.

Waits are publish -> start from the ledger, per quiet tenant and phase; the
flood's throughput is its task count over the time from its first publish
(or its due time) to its last finish. The ledger also proves that no task was lost or run
twice and that every task ran from its tenant's queue.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tests.harness.brokers import broker_for
from tests.harness.harness import WorkerProcess
from tests.harness.ledger import Entry, Ledger, percentile

from .layout import (
    AUTO_ISOLATED_QUEUE,
    ISOLATED_QUEUE,
    SHARED_QUEUE,
    Mode,
    TenantLayout,
    TenantProducer,
)

__all__ = ("FloodParams", "analyse_flood", "run_flood")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class FloodParams:
    """The size of one flood run."""

    flood: int = 20_000
    rate: float = 5.0  # tasks per second per quiet tenant
    task_ms: float = 3.0  # every task sleeps this long (a pool slot, not a core)
    # Counted seconds of the unloaded phase: 100 tasks per quiet tenant at the
    # default rate, the fewest from which a p99 is more than the sample's
    # largest value (each tenant's 2x threshold is twice its unloaded p99).
    baseline: float = 20.0
    settle: float = 1.0  # uncounted seconds after the workers are ready
    workers: int = 1
    concurrency: int = 2
    slow_ms: float = 0.0  # scenario D: extra ms per task on the last worker, from the flood on
    startup: float = 8.0  # with slow_ms: seconds allowed for the workers to start
    timeout: float = 240.0  # the flood must drain within this many seconds
    # The burst is published by a separate process at this nice level,
    # standing in for a producer on another machine: on a small machine a
    # full-speed publisher takes a core from the worker and the broker.
    burst_nice: int = 19
    # ... and pinned to these CPUs (``--broker-core``: the broker's own core).
    burst_cpus: tuple[int, ...] = ()
    telemetry_dir: str | None = None  # fair modes: the workers' fair_telemetry_dir
    # Scenario KS: every flood task is published with eta = the flood's start +
    # this many seconds (0: no eta). The burst should be published by then: the
    # record's flood.due_margin says by how much it was (negative: it was not).
    due_after: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The parameters as a plain record (for result files)."""
        return asdict(self)


def _ready(workers: list[WorkerProcess], timeout: float) -> None:
    """Poll the worker logs until each says ``ready``; raise with the log otherwise."""
    deadline = time.monotonic() + timeout
    pending = list(workers)
    while pending:
        for w in list(pending):
            if w.proc is None or w.proc.poll() is not None:
                raise RuntimeError(f"worker exited at start:\n{w.log()[-3000:]}")
            if " ready." in w.log():
                pending.remove(w)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"worker not ready in {timeout}s:\n{pending[0].log()[-3000:]}")
        time.sleep(0.05)


def _worker_env(ledger_url: str, mode: Mode, params: FloodParams) -> dict[str, str]:
    env = {"CELERY_FAIR_LEDGER": ledger_url, **mode.env}
    if mode.fair and params.telemetry_dir:
        env["CELERY_FAIR_TELEMETRY_DIR"] = params.telemetry_dir
    return env


def run_flood(
    broker_url: str,
    ledger_url: str,
    layout: TenantLayout,
    mode: Mode,
    params: FloodParams,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run one flood scenario for ``mode`` and return :func:`analyse_flood`'s record."""
    queues = layout.queues(mode)
    broker = broker_for(broker_url)
    broker.purge([*layout.shards, SHARED_QUEUE, ISOLATED_QUEUE, AUTO_ISOLATED_QUEUE])
    ledger = Ledger(ledger_url)
    ledger.reset()
    producer = TenantProducer(broker_url, layout, mode)
    producer.declare(queues)
    env = _worker_env(ledger_url, mode, params)
    launched = time.time()
    flood_at: float | None = None
    workers = []
    for i in range(params.workers):
        wenv = dict(env)
        if params.slow_ms and i == params.workers - 1:
            # The slowdown is switched on by the wall clock: the flood is
            # published at exactly this time, whatever the start-up took.
            flood_at = launched + params.startup + params.settle + params.baseline
            wenv.update(
                CELERY_FAIR_SLOW_MS=str(params.slow_ms), CELERY_FAIR_SLOW_FROM=str(flood_at)
            )
        workers.append(
            WorkerProcess(
                broker_url, queues, concurrency=params.concurrency, fair=mode.fair, env=wenv
            )
        )
    published: dict[str, tuple[str, float]] = {}  # id -> (tenant, local publish time)
    flood_ids = [str(uuid.uuid4()) for _ in range(params.flood)]
    marks: dict[str, float] = {}
    try:
        for w in workers:
            w.start()
        _ready(workers, timeout=params.startup + 30)
        ready = time.time()
        if flood_at is None:
            flood_at = ready + params.settle + params.baseline
        elif flood_at - ready < params.settle + 1.0:
            raise TimeoutError("workers took too long to start for the planned slowdown")
        marks["counted_from"] = min(ready + params.settle, flood_at - 1.0)
        marks["flood_at"] = flood_at
        due = flood_at + params.due_after if params.due_after else None
        if due is not None:
            marks["flood_due"] = due
        total_rate = params.rate * len(layout.quiet)
        flooder: Any = None  # the burst's process
        fork = multiprocessing.get_context("fork")
        published_to: Any = fork.Value("d", 0.0)
        k = 0
        t0 = time.time()
        next_report = 0.0
        drained_at: float | None = None
        deadline = (due or flood_at) + params.timeout
        with producer.app.producer_pool.acquire(block=True) as prod:
            while drained_at is None:
                now = time.time()
                # The trickle: publish every send that is due (catching up after a stall).
                while t0 + k / total_rate <= now:
                    tenant = layout.quiet[k % len(layout.quiet)]
                    published[producer.send(tenant, params.task_ms, producer=prod)] = (tenant, now)
                    k += 1
                if flooder is None and now >= flood_at:
                    marks["flood_published_from"] = time.time()
                    flooder = fork.Process(
                        target=_burst,
                        args=(broker_url, layout, mode, params, flood_ids, published_to, due),
                        name="celery-fair-showcase-burst",
                        daemon=True,
                    )
                    flooder.start()
                if now >= next_report:
                    next_report = now + 0.25
                    counts = ledger.per_tenant()
                    done = counts.get(layout.flood, 0)
                    quiet_done = sum(v for t, v in counts.items() if t != layout.flood)
                    if progress is not None:
                        phase = "unloaded" if flooder is None else "flood"
                        if due is not None and flooder is not None and now < due:
                            phase = "not due"
                        progress(
                            f"{phase:8} flood {done:6}/{params.flood} started, "
                            f"quiet {quiet_done:5}/{len(published):5}"
                        )
                    for w in workers:
                        if w.proc is None or w.proc.poll() is not None:
                            raise RuntimeError(f"worker exited early:\n{w.log()[-3000:]}")
                    if flooder is not None and done >= params.flood:
                        drained_at = now
                        break
                    if now > deadline:
                        raise TimeoutError(
                            f"the flood did not drain in {params.timeout}s "
                            f"({done}/{params.flood}):\n{workers[0].log()[-2000:]}"
                        )
                time.sleep(max(0.0, min(t0 + k / total_rate, next_report) - time.time()))
        if flooder is not None:
            flooder.join(timeout=60)
            if flooder.exitcode != 0:
                raise RuntimeError(f"the burst's publisher exited with {flooder.exitcode}")
            marks["flood_published_to"] = float(published_to.value)
        marks["drained_at"] = drained_at
        for tid in flood_ids:
            published[tid] = (layout.flood, due or marks["flood_published_from"])
        complete = ledger.wait_for(len(published), timeout=120, alive=workers)
        marks["complete"] = float(complete)
    finally:
        for w in workers:
            w.stop()
        producer.close()
    entries = ledger.entries()
    broker.purge([*layout.shards, SHARED_QUEUE, ISOLATED_QUEUE, AUTO_ISOLATED_QUEUE])
    return analyse_flood(entries, published, layout, mode, marks, params)


def _burst(
    broker_url: str,
    layout: TenantLayout,
    mode: Mode,
    params: FloodParams,
    ids: list[str],
    published_to: Any,
    due: float | None = None,
) -> None:
    """The burst's process: publish one flood task per id (eta ``due``), then note the time."""
    if params.burst_nice:
        os.nice(params.burst_nice)
    if params.burst_cpus:
        os.sched_setaffinity(0, set(params.burst_cpus))
    producer = TenantProducer(broker_url, layout, mode)
    try:
        producer.burst(layout.flood, params.task_ms, ids, eta=due)
    finally:
        producer.close()
    published_to.value = time.time()


def _waits(entries: list[Entry]) -> list[float]:
    return [e.wait for e in entries if e.wait is not None]


def _p(values: list[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 0.50),
        "p99": percentile(values, 0.99),
        "n": float(len(values)),
    }


def analyse_flood(
    entries: list[Entry],
    published: Mapping[str, tuple[str, float]],
    layout: TenantLayout,
    mode: Mode,
    marks: Mapping[str, float | None],
    params: FloodParams,
) -> dict[str, Any]:
    """Turn the ledger of one run into waits per tenant and phase, throughput and checks.

    A quiet task belongs to the *unloaded* phase if it was published between
    ``counted_from`` and the flood's start, to the *flood* phase if it was
    published after the flood's start and before the flood's last task
    started. ``within_2x`` counts quiet tenants whose flood-phase p99 stays
    within twice the unloaded p99 of all quiet tenants of the same run (a
    tenant's own unloaded phase holds too few tasks for a p99).

    With ``marks["flood_due"]`` (scenario KS: the flood's tasks all have that
    eta) the flood phase begins at the due time instead, the flood's rates are
    counted from it, and quiet tasks published between the flood's start and
    its due time (while it is published and waits) are ``quiet_others_before_due``.

    Two measurements separate what the worker does from what the test rig
    costs (both were measured on a 2-core machine on RabbitMQ):

    * ``flood.worker_throughput`` counts the tasks of *every* tenant that
      finished between the flood's first publish and its last finish.  The
      flood's own rate alone favours a deployment that runs the flood first:
      one shared queue postpones the quiet tenants' ~100 tasks/s until after
      the flood, and so "gains" exactly that much flood rate over a worker
      that keeps serving them.
    * quiet waits on other shards are split into tasks published while the
      burst was still being published (``quiet_others_publishing``) and after
      it (``quiet_others_after``): publishing 20,000 tasks takes one core of
      the driver plus about half a core of the broker for a few seconds, and
      on a small machine that starves the worker for stretches of 100 ms or
      more, whatever the scheduling.
    """
    first: dict[str, Entry] = {}
    runs = Counter(e.id for e in entries)
    for e in entries:
        if e.id not in first or e.started < first[e.id].started:
            first[e.id] = e
    lost = [tid for tid in published if tid not in first]
    misrouted = sum(
        1
        for e in first.values()
        if e.tenant and e.queue not in layout.allowed_queues(mode, e.tenant)
    )
    flood_runs = [
        first[t] for t, (ten, _) in published.items() if ten == layout.flood and t in first
    ]
    flood_start = float(marks["flood_at"] or 0.0)
    counted_from = float(marks["counted_from"] or 0.0)
    flood_published = float(marks.get("flood_published_from") or flood_start)
    due = marks.get("flood_due")
    loaded_from = float(due) if due is not None else flood_start
    last_flood_start = max((e.started for e in flood_runs), default=math.nan)
    last_flood_finish = max((e.finished for e in flood_runs), default=math.nan)
    unloaded: dict[str, list[Entry]] = {t: [] for t in layout.quiet}
    loaded: dict[str, list[Entry]] = {t: [] for t in layout.quiet}
    not_due: dict[str, list[Entry]] = {t: [] for t in layout.quiet}
    for e in first.values():
        if e.tenant not in unloaded or e.published is None:
            continue
        if counted_from <= e.published < flood_start:
            unloaded[e.tenant].append(e)
        elif loaded_from <= e.published < last_flood_start:
            loaded[e.tenant].append(e)
        elif flood_start <= e.published < loaded_from:
            not_due[e.tenant].append(e)
    all_unloaded = [w for t in layout.quiet for w in _waits(unloaded[t])]
    base = _p(all_unloaded)
    neighbours = set(layout.neighbours)
    tenants: dict[str, Any] = {}
    for t in layout.quiet:
        lw = _waits(loaded[t])
        tenants[t] = {
            "shard": layout.expected_queue(mode, t),
            "neighbour": t in neighbours,
            "unloaded": _p(_waits(unloaded[t])),
            "flood": _p(lw),
            "within_2x": bool(lw) and percentile(lw, 0.99) <= 2 * base["p99"],
        }
    others = [t for t in layout.quiet if t not in neighbours]
    other_waits = [w for t in others for w in _waits(loaded[t])]
    neighbour_waits = [w for t in neighbours for w in _waits(loaded[t])]
    drain_from = loaded_from if due is not None else flood_published
    drain = last_flood_finish - drain_from
    published_to = float(marks.get("flood_published_to") or flood_published)
    publishing: list[float] = []
    after: dict[str, list[float]] = {t: [] for t in others}
    for t in others:
        for e in loaded[t]:
            if e.published is None or e.wait is None:
                continue
            (publishing if e.published < published_to else after[t]).append(e.wait)
    in_window = [e for e in first.values() if drain_from <= e.finished <= last_flood_finish]
    quiet_served = sum(1 for e in in_window if e.tenant != layout.flood)
    requeued = sum(1 for e in first.values() if e.requeues > 0)
    return {
        "mode": mode.name,
        "published": len(published),
        "ran": len(first),
        "lost": len(lost),
        "duplicates": sum(n - 1 for n in runs.values() if n > 1),
        "misrouted": misrouted,
        "complete": bool(marks.get("complete")),
        "requeued_fraction": requeued / max(1, len(first)),
        "flood": {
            "tasks": len(flood_runs),
            "drain_seconds": drain,
            "throughput": len(flood_runs) / drain if drain > 0 else math.nan,
            "worker_throughput": len(in_window) / drain if drain > 0 else math.nan,
            "quiet_served": quiet_served / drain if drain > 0 else math.nan,
            "publish_seconds": published_to - flood_published,
            # KS: seconds from the burst's last publish to its due time; flood
            # tasks that started before it (must be none); its first start after it.
            "due_margin": loaded_from - published_to if due is not None else math.nan,
            "early": sum(1 for e in flood_runs if e.started < loaded_from)
            if due is not None
            else 0,
            "first_start_after_due": min((e.started for e in flood_runs), default=math.nan)
            - loaded_from
            if due is not None
            else math.nan,
        },
        "unloaded": base,
        "quiet_others": _p(other_waits),
        "neighbours": _p(neighbour_waits),
        "quiet_others_publishing": _p(publishing),
        "quiet_others_after": _p([w for t in others for w in after[t]]),
        "quiet_others_before_due": _p([w for t in others for w in _waits(not_due[t])]),
        "within_2x_others_after": sum(
            1 for t in others if after[t] and percentile(after[t], 0.99) <= 2 * base["p99"]
        ),
        "worst_other_p99": max(
            (tenants[t]["flood"]["p99"] for t in others if tenants[t]["flood"]["n"]),
            default=math.nan,
        ),
        "within_2x": sum(1 for t in layout.quiet if tenants[t]["within_2x"]),
        "within_2x_others": sum(1 for t in others if tenants[t]["within_2x"]),
        "others": len(others),
        "tenants": tenants,
        "params": params.to_dict(),
    }
