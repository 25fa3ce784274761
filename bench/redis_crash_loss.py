"""Loss under a broker crash and a worker crash, on durable Redis.

Redis runs with AOF and ``appendfsync always``; tasks use late acks and a
10 s visibility timeout.  Each run publishes 1,500 ledger tasks, starts a
``celery worker -P prefork -c 2``, kills the broker (SIGKILL) mid-run and
restarts it on the same data and port, then kills the worker (SIGKILL) and
starts another, which finishes the queue and the restored unacked messages.
A ledger on a separate Redis records every task run: an id that never
appears is a lost task; an id that appears twice is an at-least-once
duplicate (counted, allowed).

Kombu's BRPOP removes a message before the client records it as unacked, so
a message in flight when the broker dies can exist only in the dead worker's
memory.  celery-fair's atomic fetch (on by default on Redis) pops and records
in one server-side script.  Modes alternate within each repetition.

``fair-keyed`` runs the same on two keyed queues (``fair_keys``, 50 keys
each): the keyed fetch script and the restore to each key's list.
``fair-keyed-priorities`` publishes every other message at priority 9 (the
last level) and the rest at 0; after the worker kill it restores the unacked
messages itself and counts any found in a level not their priority's.

``fair-scheduled`` and ``fair-keyed-scheduled`` (plain, then keyed queues)
publish every task with an eta (``fair_eta = "broker"``): all wait in their
queue's schedule at the start, due evenly over ``--spread`` seconds, so the
broker and the worker are killed while the fetch moves due messages from the
schedule into the queue.  Each run also records its start, so that a duplicate
is classified: its first run was killed midway, or it finished and a
redelivery (a restore from Kombu's unacked index) ran it again, or, a defect,
two deliveries that were not redeliveries.  After the run the schedules,
queues and unacked index must be empty.

    python -m bench.redis_crash_loss [--runs 10] [--tasks 1500] [--modes plain,fair,fair-keyed]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections import Counter
from typing import Any

import redis as redis_lib

from celery_fair.keys import store
from celery_fair.keys.layout import KeyedNames
from tests.harness.crash import (
    DUPLICATE_CLASSES,
    classify_duplicates,
    leftovers,
    schedule_tasks,
    scheduled_count,
)
from tests.harness.harness import WorkerProcess, fill_queues
from tests.harness.redis import RedisServer

from .common import environment, summary, write
from .keys_scale import messages, template

MODES: dict[str, dict[str, str]] = {
    "plain": {"CELERY_FAIR": "0"},
    "fair": {"CELERY_FAIR": "1"},
    "fair-brpop": {"CELERY_FAIR": "1", "CELERY_FAIR_ATOMIC": "0"},
    # Both queues keyed (fairness keys), 50 keys each.
    "fair-keyed": {"CELERY_FAIR": "1", "CELERY_FAIR_KEYS": "crash-a=tenant_id,crash-b=tenant_id"},
    # The same, every other message at priority 9 (the last level on Redis), the rest at 0.
    "fair-keyed-priorities": {
        "CELERY_FAIR": "1",
        "CELERY_FAIR_KEYS": "crash-a=tenant_id,crash-b=tenant_id",
    },
}
#: Every task sent with an eta, due over the run (``fair_eta = "broker"``).
SCHEDULED = {
    "fair-scheduled": {"CELERY_FAIR": "1"},
    "fair-keyed-scheduled": {
        "CELERY_FAIR": "1",
        "CELERY_FAIR_KEYS": "crash-a=tenant_id,crash-b=tenant_id",
    },
}
MODES.update(SCHEDULED)
#: The priority levels of ``fair-keyed-priorities``: Celery priority -> Kombu's list suffix.
LEVELS = {0: "", 9: "\x06\x169"}
QUEUES = ["crash-a", "crash-b"]
KEYS_PER_QUEUE = 50


def _wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def _fill_keyed(url: str, per_queue: int, priorities: bool = False) -> set[str]:
    """Publish ``per_queue`` ledger tasks to each queue's keys (the keyed publish script).

    ``priorities``: every other message at priority 9, in its level; the rest at 0.
    """
    client = redis_lib.Redis.from_url(url)
    ids: set[str] = set()
    for queue in QUEUES:
        names = KeyedNames(queue)
        model = template(url, "ledger", (1,), queue)
        pipe = client.pipeline(transaction=False)
        for i, (key, tid, text) in enumerate(messages(model, per_queue, KEYS_PER_QUEUE)):
            level = ""
            if priorities:
                priority = 9 if i % 2 else 0
                payload = json.loads(text)
                payload["properties"]["priority"] = priority
                text, level = json.dumps(payload), LEVELS[priority]
            pipe.eval(store.ENQUEUE.text, 0, *store.enqueue_args(names, key, text, level=level))
            ids.add(tid)
        pipe.execute()
    client.close()
    return ids


def _restore_and_check_levels(url: str) -> dict[str, int]:
    """Restore the killed worker's unacked messages, as any consumer does after the
    visibility timeout; then count the messages in each level and those in a level
    that is not their priority's."""
    from tests.harness.keys import keyed_app, restore_unacked

    client = redis_lib.Redis.from_url(url)
    app = keyed_app(url, dict.fromkeys(QUEUES, "tenant_id"), "crash-restore")
    restored = restore_unacked(app, client, visibility=10, timeout=60)
    app.close()
    found = {"restored": restored, "misplaced": 0, "level 0": 0, "level 9": 0}
    for queue in QUEUES:
        names = KeyedNames(queue)
        for priority, suffix in LEVELS.items():
            level = names.level(suffix)
            for k in range(KEYS_PER_QUEUE):
                for raw in client.lrange(level.key_list(f"k{k}"), 0, -1):
                    found[f"level {priority}"] += 1
                    if json.loads(raw)["properties"].get("priority") != priority:
                        found["misplaced"] += 1
        found["misplaced"] += int(client.llen(queue)) + int(client.llen(queue + LEVELS[9]))
    client.close()
    return found


def one_run(
    mode: str,
    tasks: int,
    ledger_url: str,
    *,
    spread: float = 20.0,
    broker_crash: bool = True,
) -> dict[str, Any]:
    """One crash run; returns lost and duplicate counts."""
    ledger = redis_lib.Redis.from_url(ledger_url)
    ledger.delete("ledger", "ledger:started", "ledger:recorded")
    scheduled = mode in SCHEDULED
    events: dict[str, float] = {}

    def ran() -> Counter[str]:
        return Counter(json.loads(e)["id"] for e in ledger.lrange("ledger", 0, -1))

    env = {
        **MODES[mode],
        "CELERY_FAIR_LEDGER": ledger_url,
        "CELERY_FAIR_ACKS_LATE": "1",
        "CELERY_FAIR_VISIBILITY": "10",
        **({"CELERY_FAIR_LEDGER_STARTS": "1"} if scheduled else {}),
    }
    with RedisServer(appendonly=True) as broker:
        per_queue = tasks // len(QUEUES)
        priorities = mode == "fair-keyed-priorities"
        client = redis_lib.Redis.from_url(broker.url)
        if scheduled:
            # The first due a few seconds on, once the worker is up: every task
            # waits in a schedule at the start and comes due during the run.
            start = time.time()
            keyed = "CELERY_FAIR_KEYS" in MODES[mode]
            ids = schedule_tasks(broker.url, QUEUES, per_queue, keyed, start + 3.0, spread)
            events["published_s"] = time.time() - start
            events["scheduled_at_start"] = scheduled_count(client, QUEUES)
        elif "CELERY_FAIR_KEYS" in MODES[mode]:
            ids = _fill_keyed(broker.url, per_queue, priorities)
        else:
            fill_queues(broker.url, dict.fromkeys(QUEUES, per_queue), task="ledger", args=(1,))
            ids = {json.loads(r)["headers"]["id"] for q in QUEUES for r in client.lrange(q, 0, -1)}
        first = WorkerProcess(broker.url, QUEUES, fair=mode != "plain", env=env).start()
        try:
            _wait(lambda: ledger.llen("ledger") >= tasks // 3, 120, "first third")
            if scheduled:
                events["scheduled_at_broker_kill"] = scheduled_count(client, QUEUES)
                events["broker_kill"] = time.time()
            if broker_crash:
                broker.restart(kill=True)
            events["broker_back"] = time.time()
            mark = ledger.llen("ledger")
            # The worker should rejoin and go on; if it exits or stalls instead,
            # the run goes on to the worker kill all the same (and says so).
            with contextlib.suppress(TimeoutError):
                _wait(
                    lambda: (
                        ledger.llen("ledger") >= mark + tasks // 4
                        or (first.proc is not None and first.proc.poll() is not None)
                    ),
                    60,
                    "after restart",
                )
            exited = first.proc is not None and first.proc.poll() is not None
            resumed = ledger.llen("ledger") >= mark + tasks // 4
        finally:
            if first.proc is not None and first.proc.poll() is None:
                if scheduled:
                    with contextlib.suppress(redis_lib.RedisError):
                        events["scheduled_at_worker_kill"] = scheduled_count(client, QUEUES)
                    events["worker_kill"] = time.time()
                os.killpg(first.proc.pid, signal.SIGKILL)
            first.wait(timeout=30)
        levels = _restore_and_check_levels(broker.url) if priorities else None
        with WorkerProcess(broker.url, QUEUES, fair=mode != "plain", env=env):
            started = time.monotonic()
            # Everything, or 60 s past the visibility timeout: then it is lost.
            with contextlib.suppress(TimeoutError):
                _wait(lambda: ids <= set(ran()), 70, "all ids")
            settle = time.monotonic() - started
            if scheduled:
                # Then until nothing is left: a message of the killed worker that
                # ran is restored past the visibility timeout and runs again.
                with contextlib.suppress(TimeoutError):
                    _wait(lambda: not any(leftovers(client, QUEUES).values()), 30, "nothing left")
        left = leftovers(client, QUEUES) if scheduled else None
        client.close()
    counts = ran()
    lost = len(ids - set(counts))
    duplicates = sum(n - 1 for i, n in counts.items() if i in ids and n > 1)
    return {
        "lost": lost,
        "duplicates": duplicates,
        "tasks": len(ids),
        "settle_s": settle,
        "resumed_after_restart": resumed,
        "worker_exited_at_restart": exited,
        **({"levels": levels} if levels is not None else {}),
        **(_scheduled_report(ids, ledger, events, left) if left is not None else {}),
    }


def _scheduled_report(
    ids: set[str], ledger: Any, events: dict[str, float], left: dict[str, int]
) -> dict[str, Any]:
    starts = [json.loads(e) for e in ledger.lrange("ledger:started", 0, -1)]
    ends = [json.loads(e) for e in ledger.lrange("ledger", 0, -1)]
    classes, details = classify_duplicates(ids, starts, ends)
    kills = [events[k] for k in ("broker_kill", "worker_kill") if k in events]
    for each in details:
        # How far from a kill the first run finished: its ack, sent just after,
        # fails while the broker is down or the worker dead.
        done = each["runs"][0]["finished"]
        near = [abs(k - done) for k in kills if done is not None]
        each["first_finished_from_kill_s"] = min(near) if near else None
    return {
        "events": events,
        "left_after": left,
        "duplicate_classes": dict(classes),
        "unfinished_runs": len(starts) - len(ends),
        "duplicated": details,
    }


def _scheduled_table(
    modes: list[str], runs: dict[str, list[dict[str, Any]]], data: dict[str, Any]
) -> list[str]:
    """The scheduled modes' lines: scheduled at each kill, extra runs by class, leftovers."""
    chosen = [m for m in modes if m in SCHEDULED]
    if not chosen:
        return []
    lines = [
        "",
        'Scheduled modes: every task sent with an eta (`fair_eta = "broker"`), all in '
        "their queue's schedule at the start and due evenly over the run.",
        "",
        "| mode | runs | in the schedule at the broker kill (min, max) "
        "| at the worker kill (min, max) "
        + "".join(f"| extra runs: {c} (total) " for c in DUPLICATE_CLASSES)
        + "| first run finished, redelivered: its finish from the nearest kill (max) "
        + "| runs leaving anything scheduled, queued or unacked |",
        "|---|---|---|---|" + "---|" * len(DUPLICATE_CLASSES) + "---|---|",
    ]
    for mode in chosen:
        each = runs[mode]
        at_broker = [r["events"].get("scheduled_at_broker_kill", 0) for r in each]
        at_worker = [r["events"].get("scheduled_at_worker_kill", 0) for r in each]
        totals = {c: sum(r["duplicate_classes"][c] for r in each) for c in DUPLICATE_CLASSES}
        leftover = sum(1 for r in each if any(r["left_after"].values()))
        gaps = [
            d["first_finished_from_kill_s"]
            for r in each
            for d in r["duplicated"]
            if d["class"] == "first run finished, redelivered"
        ]
        gap = "-" if not gaps else "unfinished" if None in gaps else f"{max(gaps) * 1000:.0f} ms"
        data["modes"][mode].update(duplicate_classes=totals, runs_with_leftovers=leftover)
        lines.append(
            f"| {mode} | {len(each)} | {min(at_broker)}, {max(at_broker)} "
            f"| {min(at_worker)}, {max(at_worker)} | "
            + "".join(f"{totals[c]} | " for c in DUPLICATE_CLASSES)
            + f"{gap} | {leftover} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=1500)
    parser.add_argument("--modes", default="plain,fair")
    parser.add_argument("--name", default="redis_crash_loss")
    parser.add_argument(
        "--spread",
        type=float,
        default=20.0,
        help="scheduled modes: seconds over which tasks come due",
    )
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode not in MODES:
            parser.error(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with RedisServer() as ledger_server:
        for rep in range(args.runs):
            order = modes if rep % 2 == 0 else modes[::-1]
            for mode in order:
                result = one_run(mode, args.tasks, ledger_server.url, spread=args.spread)
                runs[mode].append(result)
                print(
                    f"run {rep + 1}/{args.runs} {mode:>10}: lost {result['lost']}, "
                    + (f"levels {result['levels']}, " if "levels" in result else "")
                    + f"duplicates {result['duplicates']} of {result['tasks']}"
                    + (
                        f", classes {result['duplicate_classes']}, left {result['left_after']}, "
                        f"scheduled at the kills {result['events'].get('scheduled_at_broker_kill')}"
                        f"/{result['events'].get('scheduled_at_worker_kill')}"
                        if "duplicate_classes" in result
                        else ""
                    )
                    + ("" if result["resumed_after_restart"] else ", stalled after the restart")
                    + (", worker exited" if result["worker_exited_at_restart"] else ""),
                    flush=True,
                )
    table = [
        "| mode | runs | runs with a loss | tasks lost (total) | duplicates (median, max) "
        "| runs where the worker did not resume after the broker restart |",
        "|---|---|---|---|---|---|",
    ]
    data: dict[str, Any] = {"environment": environment(), "args": vars(args), "modes": {}}
    for mode in modes:
        lost = [r["lost"] for r in runs[mode]]
        dups = [r["duplicates"] for r in runs[mode]]
        data["modes"][mode] = {
            "runs": runs[mode],
            "runs_with_loss": sum(1 for n in lost if n),
            "lost_total": sum(lost),
            "duplicates": summary([float(d) for d in dups]),
        }
        table.append(
            f"| {mode} | {len(lost)} | {sum(1 for n in lost if n)} | {sum(lost)} | "
            f"{summary([float(d) for d in dups])['median']:.0f}, {max(dups)} | "
            f"{sum(1 for r in runs[mode] if not r['resumed_after_restart'])} |"
        )
    table += _scheduled_table(modes, runs, data)
    levels = [r["levels"] for m in modes for r in runs[m] if "levels" in r]
    if levels:
        restored = sum(x["restored"] for x in levels)
        misplaced = sum(x["misplaced"] for x in levels)
        table += [
            "",
            f"fair-keyed-priorities: {restored} unacked messages restored by hand after the "
            f"worker kill over {len(levels)} runs; {misplaced} found in a level other than "
            "their priority's (of "
            f"{sum(x['level 0'] + x['level 9'] for x in levels)} waiting at those moments).",
        ]
    markdown = "\n".join(
        [
            "# Broker crash, then worker crash: tasks lost (Redis, AOF always, late acks)",
            "",
            f"`python -m bench.redis_crash_loss --runs {args.runs} --tasks {args.tasks} "
            f"--modes {args.modes}"
            + (f" --spread {args.spread:g}" if any(m in SCHEDULED for m in modes) else "")
            + (f" --name {args.name}" if args.name != "redis_crash_loss" else "")
            + "`",
            "",
            f"{args.tasks} tasks per run; the broker is SIGKILLed after a third ran and "
            "restarted on the same data; the worker is SIGKILLed a quarter later and "
            "another started; visibility timeout 10 s.  A lost task is an id that "
            "never reached the ledger (a separate Redis).",
            "",
            *table,
            "",
        ]
    )
    write(args.name, data, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
