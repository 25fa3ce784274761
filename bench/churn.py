"""The churn soak (#49, "Nothing stranded"): :func:`tests.harness.churn.run_churn`, long,
celery-fair and plain Celery in turns on each broker, and its result file.

What a run does and how every task is accounted for: :mod:`tests.harness.churn`.

    python -m bench.soak --churn [--tasks 100000] [--reps 1] [--only redis|rabbitmq]
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.harness.churn import (
    KEYED,
    MS,
    OVER_MS,
    SLOW_MS,
    TASK_TIME_LIMIT,
    VISIBILITY,
    WORKER_TIME_LIMIT,
    run_churn,
)

BROKERS = ("redis", "rabbitmq")
#: The table's columns: (header, how a record gives it).
COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], Any]], ...] = (
    ("tasks", lambda r: r["tasks"]),
    ("runs", lambda r: r["runs"]),
    ("lost", lambda r: r["lost"]),
    ("duplicates (explained)", lambda r: _duplicates(r)),
    ("unexplained outcomes", lambda r: r["unexplained"]),
    ("child replacements", lambda r: r["child_replacements"]),
    ("kills (tasks killed)", lambda r: f"{r['kills']} ({r['killed_tasks']})"),
    ("time limits", lambda r: r["time_limits"]),
    ("revokes (revoked; running)", lambda r: _revokes(r)),
    ("hi:lo", lambda r: _fmt(r["shares"]["ratio"])),
    ("stalls", lambda r: r["stalls"]),
    ("resources: settled; most at once", lambda r: _resources(r)),
    ("left on broker", lambda r: _left(r)),
    ("wall s", lambda r: f"{r['wall_seconds']:.0f}"),
)


def _duplicates(r: dict[str, Any]) -> str:
    d = r["duplicates"]
    return f"{sum(d.values())} ({d.get('after a kill', 0)})"


def _revokes(r: dict[str, Any]) -> str:
    return f"{r['revokes']} ({r['revoked']}; {r['outcomes'].get('revoked while running', 0)})"


def _resources(r: dict[str, Any]) -> str:
    """With ``--resources``: whether every worker's books came back to nothing held,
    and per worker the most CPU and ``lo`` runs held at once (finished runs)."""
    res = r.get("resources")
    if not res:
        return "n/a"
    most = "; ".join(
        f"{w.split('-')[0]} cpu {m['cpu']:g}, lo {m.get('lo', 0):g}"
        for w, m in sorted(res["at_once"].items())
    )
    settled = {True: "yes", False: "NO", None: "n/a"}[res["settled"]]
    return f"{settled}; {most}"


def _left(r: dict[str, Any]) -> str:
    left = r["left_running"]
    return f"{left['waiting']} + {left['unacked']} unacked"


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def render(records: Sequence[dict[str, Any]], summary: dict[str, Any], command: str,
           env: dict[str, Any]) -> str:  # fmt: skip
    """The result file's Markdown: one row per run, then medians over repetitions."""
    first = records[0]["params"] if records else {}
    lines = [
        "# Churn soak: nothing stranded (#49)",
        "",
        f"Reproduce: `{command}` ({env['when']}; commit {env.get('commit', '?')}"
        f"{' with changes to celery_fair not committed' if env.get('package_modified') else ''}; "
        f"Celery {env['celery']}, Kombu "
        f"{env['kombu']}, {env['cpus']} CPUs).  Two workers of "
        "`tests.integration.production_app` with Celery's defaults plus `-E -O fair`, "
        f"`--time-limit={WORKER_TIME_LIMIT:g}`: one with "
        f"`--max-tasks-per-child={first.get('max_tasks_per_child')}` (2 processes), one "
        "with `--autoscale=3,1` (`AUTOSCALE_KEEPALIVE=2`: it shrinks in the pauses "
        "between waves); late acks, prefetch multiplier 1, a Redis result backend, "
        f"Redis `visibility_timeout` {VISIBILITY}.  Queues hi:lo weighted 4:1 and "
        f"`{KEYED}` keyed by tenant ({first.get('tenants')} tenants; on RabbitMQ in its "
        "lanes).  Tasks of "
        f"{MS} ms in {first.get('waves')} waves; {first.get('slow_share', 0):.1%} sleep "
        f"{SLOW_MS} ms (revoked with terminate while they run), "
        f"{first.get('over_share', 0):.1%} sleep {OVER_MS} ms past a hard time limit "
        f"(half the worker's, half `time_limit={TASK_TIME_LIMIT:g}`), "
        f"{first.get('countdown_share', 0):.0%} have a countdown.  A random pool process "
        f"SIGKILLed every {first.get('kill_every', 0):g} s; every "
        f"{first.get('revoke_every', 0):g} s up to two running slow tasks and one task "
        "not started yet revoked with `terminate=True`.",
        "",
        "A task either ran once and succeeded or its result says why not: a hard time "
        "limit (`TimeLimitExceeded`), a pool process killed under it (`WorkerLostError`: "
        "with late acks Celery marks it failed and acknowledges it, "
        "`task_reject_on_worker_lost` being off; or, killed as its run started, before "
        "the main process knew the job was on that process, its hard time limit: "
        "counted with the kills, plain Celery as well), a revoke.  **lost**: no run and no "
        "such result when nothing moved for the quiet period; *unexplained outcomes*: "
        "a result the churn does not account for.  hi:lo: starts while both queues "
        "were backlogged (countdown tasks left out), every wave together.  *left on "
        "broker*: messages waiting + unacknowledged once every task was accounted for, "
        "the workers still running.  stalls: `celery-fair: stall` lines in the logs.",
        "",
        "| broker | variant | " + " | ".join(h for h, _ in COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for r in records:
        cells = " | ".join(str(get(r)) for _, get in COLUMNS)
        lines.append(f"| {r['broker']} | {r['variant']} | {cells} |")
    if any(s["wall_seconds"]["n"] > 1 for s in summary.values()):
        lines += ["", "Over the repetitions: median [min, max].", "",
                  "| broker | variant | lost | hi:lo | child replacements | wall s |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for key, s in summary.items():
            broker, variant = key.split("/")
            lines.append(
                f"| {broker} | {variant} | " + " | ".join(
                    f"{s[m]['median']:.3g} [{s[m]['min']:.3g}, {s[m]['max']:.3g}]"
                    for m in ("lost", "ratio", "child_replacements", "wall_seconds")
                ) + " |"
            )  # fmt: skip
    for r in records:
        if r.get("reaccounted"):
            lines += ["", f"{r['broker']} {r['variant']}: {r['reaccounted']}"]
    odd = [r for r in records if r["unexplained"] or r["lost"] or r["stalls"]]
    for r in odd:
        lines += ["", f"{r['broker']} {r['variant']}: lost {r['lost']} "
                  f"(where: {r['lost_where']}), unexplained {r['unexplained']}: "
                  f"{json.dumps(r['unexplained_examples'][:3])[:1500]}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _revision() -> dict[str, Any]:
    """The commit measured, and whether the package had changes not committed yet."""
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "package_modified": bool(git("status", "--porcelain", "celery_fair"))}  # fmt: skip


def main(tasks: int, reps: int, only: str | None, name: str, command: str,
         resources: bool = False, priorities: bool = False) -> int:  # fmt: skip
    """``python -m bench.soak --churn``: celery-fair and plain Celery in turns, per broker.

    ``resources``: the workers have a capacity and a per-queue limit, the tasks
    declare what they hold (``tests.harness.churn.CAPACITY``).  ``priorities``: the
    tasks have priorities in weighted levels (``tests.harness.churn.PRIORITIES``)."""
    from .common import environment, summary, write

    records: list[dict[str, Any]] = []
    for broker in BROKERS if only is None else (only,):
        for rep in range(reps):
            for fair in (True, False):
                print(f"== {broker} {'celery-fair' if fair else 'plain'} rep {rep + 1}/{reps}",
                      flush=True)  # fmt: skip
                record = run_churn(broker, tasks, fair, resources=resources,
                                   priorities=priorities,
                                   progress=lambda m: print(m, flush=True))  # fmt: skip
                records.append(record)
                print(render([record], {}, command, environment()), flush=True)
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(f"{r['broker']}/{r['variant']}", []).append(r)
    stats = {
        key: {
            "lost": summary([r["lost"] for r in rs]),
            "ratio": summary([r["shares"]["ratio"] or float("nan") for r in rs]),
            "child_replacements": summary([r["child_replacements"] for r in rs]),
            "wall_seconds": summary([r["wall_seconds"] for r in rs]),
        }
        for key, rs in groups.items()
    }
    env = {**environment(), **_revision()}
    # The workers' log files are this machine's temporary files: not in the results.
    runs = [{k: v for k, v in r.items() if k != "log_files"} for r in records]
    data = {"env": env, "command": command, "tasks": tasks, "reps": reps,
            "runs": runs, "summary": stats}  # fmt: skip
    write(name, data, render(records, stats, command, env))
    bad = [r for r in records if r["variant"] == "celery-fair" and (
        r["lost"] or r["stalls"] or (r.get("resources") and r["resources"]["settled"] is False)
    )]  # fmt: skip
    return 1 if bad else 0
