"""Sentinel failovers under load: tasks lost, time to recover, keyed state after each.

A primary and a replica (both AOF, ``appendfsync always``) and one sentinel
(quorum 1, ``down-after-milliseconds`` 1000).  Two ``celery worker -c 2``
processes with Celery's defaults consume through ``sentinel://`` with late
acks and a 10 s visibility timeout, while a producer publishes ``ledger``
tasks (20 ms) through ``sentinel://`` at a steady rate over 20 tenants.  Ten
times: the current primary is SIGKILLed, the sentinel promotes the replica,
the killed server is started again on its data and port (the sentinel makes
it the new primary's replica), and the next failover waits for it to be in
sync.  A worker that exits is started again at once, as a supervisor
(systemd's ``Restart=``, Kubernetes) would, and counted.

Modes, alternating within each repetition:

* ``plain``: plain Celery on a plain queue;
* ``fair``: celery-fair on a keyed queue (``fair_keys``) with a concurrency
  limit of 2 per tenant; the lease TTL is 120 s, so that a slot freed only
  by its lease's expiry shows.

Measured per run: tasks the producer had published (accepted) that never
ran (lost), tasks run twice (late acks: at least once), the time from each
kill to the start of the first task published after it (the producer and a
worker both on the new primary), the most tasks of one tenant at
once (fair), and after each failover and at the end the keyed state checked
(no key with messages out of line, running counts equal to leases, no key
set aside at its limit without the leases to bring it back).

    python -m bench.failover [--reps 1] [--failovers 10] [--rate 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from typing import Any

from tests.harness.harness import WorkerProcess, poll_until
from tests.harness.keys import keyed_app, keyed_consistency, most_at_once
from tests.harness.ledger import Ledger
from tests.harness.redis import RedisSentinel, RedisServer

from .common import environment, summary, write

QUEUE = "jobs"
TENANTS = [f"t{i}" for i in range(20)]
LIMIT = 2
MODES = ("plain", "fair")
MASTER = "fair-master"


class Producer(threading.Thread):
    """Publishes ``rate`` tasks/s through the sentinel; records the accepted ids."""

    def __init__(self, url: str, fair: bool, rate: float) -> None:
        super().__init__(daemon=True)
        options = {"master_name": MASTER}
        self.app = keyed_app(
            url, {QUEUE: "tenant_id"} if fair else {}, broker_transport_options=options
        )
        self.rate = rate
        #: Task id -> when its publish returned (accepted by the broker).
        self.accepted: dict[str, float] = {}
        self.refused = 0
        self.halt = threading.Event()

    def run(self) -> None:
        i, start = 0, time.monotonic()
        while not self.halt.is_set():
            tenant = TENANTS[i % len(TENANTS)]
            task_id = uuid.uuid4().hex
            try:
                self.app.send_task(
                    "ledger", kwargs={"ms": 20, "tenant_id": tenant}, queue=QUEUE, task_id=task_id
                )
                self.accepted[task_id] = time.time()
            except Exception:  # noqa: BLE001 - a publish refused during the failover
                self.refused += 1
            i += 1
            delay = start + i / self.rate - time.monotonic()
            if delay > 0:
                self.halt.wait(delay)

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=60)
        self.app.close()


class Seen:
    """The ledger's entries read so far; :meth:`update` reads only the new ones."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.entries: list[Any] = []
        self.ids: set[str] = set()

    def update(self) -> Seen:
        new = self.ledger.entries(len(self.entries))
        self.entries += new
        self.ids.update(e.id for e in new)
        return self


class Supervisor:
    """Starts again each worker that exits, as systemd's ``Restart=`` or Kubernetes
    would; keeps the exited workers' logs and counts the restarts."""

    def __init__(self, workers: list[WorkerProcess]) -> None:
        self.workers = workers
        self.exited_logs: list[str] = []

    def check(self) -> bool:
        """Restart the workers that exited; always True (for use inside a poll)."""
        for i, worker in enumerate(self.workers):
            if worker.proc is not None and worker.proc.poll() is not None:
                self.exited_logs.append(worker.log())
                self.workers[i] = WorkerProcess(
                    worker.broker_url, worker.queues, fair=worker.fair, env=worker.env
                ).start()
        return True


def _current(servers: dict[int, RedisServer], sentinel: RedisSentinel) -> RedisServer | None:
    port = sentinel.master_port()
    return servers.get(port) if port is not None else None


def _in_sync(server: RedisServer) -> bool:
    try:
        info = server.client().info("replication")
    except Exception:  # noqa: BLE001 - still loading after its restart
        return False
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


def one_run(mode: str, failovers: int, rate: float, ledger_url: str) -> dict[str, Any]:
    fair = mode == "fair"
    ledger = Ledger(ledger_url)
    ledger.reset()
    seen = Seen(ledger)
    with (
        RedisServer(appendonly=True) as first,
        RedisServer(appendonly=True, replica_of=first.port) as second,
    ):
        servers = {first.port: first, second.port: second}
        assert poll_until(lambda: _in_sync(second), 30), "the replica did not sync"
        with RedisSentinel(first, master_name=MASTER, down_after_ms=1000) as sentinel:
            # The sentinel must know the replica before the first failover.
            assert poll_until(
                lambda: bool(sentinel.client().sentinel_slaves(MASTER)),
                30,
            ), "the sentinel found no replica"
            env = {
                "CELERY_FAIR_LEDGER": ledger_url,
                "CELERY_FAIR_MASTER_NAME": MASTER,
                "CELERY_FAIR_ACKS_LATE": "1",
                "CELERY_FAIR_VISIBILITY": "10",
            }
            if fair:
                env |= {
                    "CELERY_FAIR_KEYS": f"{QUEUE}=tenant_id",
                    "CELERY_FAIR_KEY_CONCURRENCY": f"*={LIMIT}",
                    "CELERY_FAIR_KEY_LEASE_TTL": "120",
                }
            supervisor = Supervisor(
                [WorkerProcess(sentinel.url, [QUEUE], fair=fair, env=env).start() for _ in range(2)]
            )
            workers = supervisor.workers
            producer = Producer(sentinel.url, fair, rate)
            recoveries: list[float | None] = []
            checks: list[list[str]] = []
            producer.start()
            try:
                assert ledger.wait_for(20, timeout=60, alive=workers), workers[0].log()[-3000:]
                for _ in range(failovers):
                    time.sleep(3)  # load between failovers (the scenario, not a wait)
                    primary = _current(servers, sentinel)
                    assert primary is not None, "the sentinel names no known primary"
                    killed_at = time.time()
                    primary.stop(kill=True)
                    promoted = poll_until(
                        lambda p=primary: _current(servers, sentinel) not in (None, p), 30
                    )
                    supervisor.check()

                    # Recovered: a task published after the kill has run (the
                    # producer and a worker both reach the new primary).  Tasks a
                    # worker had prefetched before the kill do not count.
                    def first_new(t: float = killed_at) -> float | None:
                        # A copy: the producer's thread adds to it (dict.copy holds the GIL).
                        late = {i for i, at in producer.accepted.copy().items() if at > t}
                        starts = [e.started for e in seen.update().entries if e.id in late]
                        return min(starts) if starts else None

                    recovered = poll_until(
                        lambda: supervisor.check() and first_new() is not None,
                        60,
                    )
                    first = first_new() if recovered else None
                    recoveries.append(first - killed_at if first is not None else None)
                    primary.start()  # on its data: the sentinel makes it a replica
                    poll_until(lambda p=primary: _in_sync(p), 60)
                    if promoted:
                        now = _current(servers, sentinel)
                        if fair and now is not None:
                            checks.append(keyed_consistency(now.client(), QUEUE)["problems"])
            except BaseException:
                for w in workers:  # a failed run leaves no worker behind
                    w.stop(timeout=10)
                raise
            finally:
                producer.stop()
            accepted = set(producer.accepted)
            poll_until(
                lambda: supervisor.check() and accepted <= seen.update().ids,
                90,
            )
            final: dict[str, Any] = {}
            current = _current(servers, sentinel)
            if fair and current is not None:
                client = current.client()
                poll_until(lambda: not keyed_consistency(client, QUEUE)["leases"], 10)
                final = keyed_consistency(client, QUEUE)
            alive = sum(1 for w in workers if w.proc is not None and w.proc.poll() is None)
            exited_logs = supervisor.exited_logs
            logs = [w.log() for w in workers] + exited_logs
            # Why each worker exited: its log's last line (the exception), no paths.
            exits = sorted({log.strip().splitlines()[-1] for log in exited_logs if log.strip()})
            for w in workers:
                w.stop()
    entries = ledger.entries()
    ran = Counter(e.id for e in entries)
    done = [r for r in recoveries if r is not None]
    return {
        "accepted": len(accepted),
        "refused": producer.refused,
        "lost": len(accepted - set(ran)),
        "duplicates": sum(n - 1 for i, n in ran.items() if i in accepted and n > 1),
        "recovery_s": recoveries,
        "recovery_median_s": statistics.median(done) if done else None,
        "recovery_max_s": max(done) if done else None,
        "not_recovered": len(recoveries) - len(done),
        "most_at_once": max(most_at_once(entries).values(), default=0),
        "problems_after_failovers": sum(len(p) for p in checks),
        "problems_sample": [p for c in checks for p in c][:5],
        "final": final,
        "workers_alive": alive,
        "worker_restarts": len(exited_logs),
        "lost_state_warnings": sum(log.count("lost its state") for log in logs),
        "tracebacks": sum(log.count("Traceback") for log in logs),
        "exit_reasons": exits,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--failovers", type=int, default=10)
    parser.add_argument("--rate", type=float, default=60.0, help="tasks published per second")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--name", default="failover")
    args = parser.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    for mode in modes:
        if mode not in MODES:
            parser.error(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with RedisServer() as ledger_server:
        for rep in range(args.reps):
            for mode in modes if rep % 2 == 0 else modes[::-1]:
                result = one_run(mode, args.failovers, args.rate, ledger_server.url)
                runs[mode].append(result)
                print(f"rep {rep + 1} {mode}: {json.dumps(result)}", flush=True)
    lines = [
        "# Sentinel failovers under load: loss, recovery, keyed state",
        "",
        f"`python -m bench.failover --reps {args.reps} --failovers {args.failovers} "
        f"--rate {args.rate:g} --modes {args.modes}`",
        "",
        f"{args.failovers} failovers per run (SIGKILL of the primary, the replica promoted by "
        "one sentinel, down-after 1000 ms); two `celery worker -c 2` with Celery's defaults "
        f"through `sentinel://`, late acks, visibility timeout 10 s; {args.rate:g} tasks/s "
        f"published through `sentinel://` over {len(TENANTS)} tenants. fair: a keyed queue, "
        f"concurrency limit {LIMIT} per tenant, lease TTL 120 s.",
        "",
        "| mode | run | accepted | refused at publish | lost | duplicates "
        "| recovery median / max (s) | not recovered | most of a tenant at once "
        "| keyed-state problems after failovers | leases held at the end "
        "| workers that exited (started again) | 'lost its state' warnings |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        for i, r in enumerate(runs[mode], 1):
            rec = (
                f"{r['recovery_median_s']:.1f} / {r['recovery_max_s']:.1f}"
                if r["recovery_median_s"] is not None
                else "-"
            )
            final = r["final"]
            lines.append(
                f"| {mode} | {i} | {r['accepted']} | {r['refused']} | {r['lost']} "
                f"| {r['duplicates']} | {rec} | {r['not_recovered']} | {r['most_at_once']} "
                f"| {r['problems_after_failovers'] if mode == 'fair' else '-'} "
                f"| {final.get('leases', '-') if final else '-'} | {r['worker_restarts']} "
                f"| {r['lost_state_warnings']} |"
            )
    lines.append("")
    data = {
        "environment": environment(),
        "args": vars(args),
        "runs": runs,
        "lost": {m: summary([float(r["lost"]) for r in runs[m]]) for m in modes if runs[m]},
    }
    markdown = "\n".join(lines)
    write(args.name, data, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
