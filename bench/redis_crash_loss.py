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


def one_run(mode: str, tasks: int, ledger_url: str) -> dict[str, Any]:
    """One crash run; returns lost and duplicate counts."""
    ledger = redis_lib.Redis.from_url(ledger_url)
    ledger.delete("ledger")

    def ran() -> Counter[str]:
        return Counter(json.loads(e)["id"] for e in ledger.lrange("ledger", 0, -1))

    env = {
        **MODES[mode],
        "CELERY_FAIR_LEDGER": ledger_url,
        "CELERY_FAIR_ACKS_LATE": "1",
        "CELERY_FAIR_VISIBILITY": "10",
    }
    with RedisServer(appendonly=True) as broker:
        per_queue = tasks // len(QUEUES)
        priorities = mode == "fair-keyed-priorities"
        if "CELERY_FAIR_KEYS" in MODES[mode]:
            ids = _fill_keyed(broker.url, per_queue, priorities)
        else:
            fill_queues(broker.url, dict.fromkeys(QUEUES, per_queue), task="ledger", args=(1,))
            client = redis_lib.Redis.from_url(broker.url)
            ids = {json.loads(r)["headers"]["id"] for q in QUEUES for r in client.lrange(q, 0, -1)}
            client.close()
        first = WorkerProcess(broker.url, QUEUES, fair=mode != "plain", env=env).start()
        try:
            _wait(lambda: ledger.llen("ledger") >= tasks // 3, 120, "first third")
            broker.restart(kill=True)
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
                os.killpg(first.proc.pid, signal.SIGKILL)
            first.wait(timeout=30)
        levels = _restore_and_check_levels(broker.url) if priorities else None
        with WorkerProcess(broker.url, QUEUES, fair=mode != "plain", env=env):
            started = time.monotonic()
            # Everything, or 60 s past the visibility timeout: then it is lost.
            with contextlib.suppress(TimeoutError):
                _wait(lambda: ids <= set(ran()), 70, "all ids")
            settle = time.monotonic() - started
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
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=1500)
    parser.add_argument("--modes", default="plain,fair")
    parser.add_argument("--name", default="redis_crash_loss")
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
                result = one_run(mode, args.tasks, ledger_server.url)
                runs[mode].append(result)
                print(
                    f"run {rep + 1}/{args.runs} {mode:>10}: lost {result['lost']}, "
                    + (f"levels {result['levels']}, " if "levels" in result else "")
                    + f"duplicates {result['duplicates']} of {result['tasks']}"
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
            f"--modes {args.modes}`",
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
