"""Where a quiet tenant's wait goes during scenario K: the broker's part and the worker's.

Run: ``python -m bench.wait_split [--broker rabbitmq] [--flood 8000] [--reps 3]
[--broker-core 1]``.

Scenario K's celery-fair mode (one queue keyed by tenant, one ``celery worker
-P prefork -c 2``, 3 ms tasks, 20 quiet tenants at 5 tasks/s and a burst from
one tenant; :mod:`bench.showcase.flood`), with the worker's telemetry on. Each
quiet task's wait (publish -> start) is split at its receipt by the worker
(Celery's ``process_task``, the telemetry's ``received``):

* **publish -> received**: the broker holding and delivering it, and the
  worker's event loop reading it;
* **received -> started**: the worker's buffer and a free pool process (a
  prefork process runs one task at a time: a quiet task that arrives while
  both run flood tasks waits for one of them).

By phase, from the same run: *unloaded* (before the burst), *publishing*
(while the burst is being published: the broker and the burst's publisher
share the machine's cores with the worker), *after* (the burst published, the
flood draining). Each phase's p99 over the unloaded one is the figure to read:
a ratio within one run.

``--broker-core N`` stands in for a broker on a host of its own: the broker and
the burst's publisher run on CPU ``N``, the worker, the quiet tenants'
publishers and this driver on the others (the ledger's Redis is not pinned).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from bench.common import broker_core_note, environment, give_broker_a_core, summary, write
from bench.showcase.flood import FloodParams, run_flood
from bench.showcase.layout import MODES, TenantLayout
from bench.showcase.runner import server_for
from tests.harness.ledger import percentile
from tests.harness.redis import RedisServer

PHASES = ("unloaded", "publishing", "after")
PARTS = ("publish_received", "received_started", "total")


def split(records: list[dict[str, Any]], flood_key: str) -> dict[str, dict[str, Any]]:
    """Per phase: the quiet tasks' count and each part's p50 and p99, in ms."""
    flood = [r for r in records if r.get("fair_key") == flood_key and r.get("published")]
    first = min(r["published"] for r in flood)
    last = max(r["published"] for r in flood)
    drained = max(r["started"] for r in flood if r.get("started"))
    bounds = {"unloaded": (0.0, first), "publishing": (first, last), "after": (last, drained)}
    out: dict[str, dict[str, Any]] = {}
    for phase, (lo, hi) in bounds.items():
        quiet = [
            r for r in records
            if r.get("fair_key") not in (None, "", flood_key)
            and r.get("published") and r.get("received") and r.get("started")
            and lo <= r["published"] < hi
        ]  # fmt: skip
        parts = {
            "publish_received": [1000 * (r["received"] - r["published"]) for r in quiet],
            "received_started": [1000 * (r["started"] - r["received"]) for r in quiet],
            "total": [1000 * (r["started"] - r["published"]) for r in quiet],
        }
        out[phase] = {"n": len(quiet), "seconds": hi - lo}
        for part, values in parts.items():
            out[phase][part] = {
                "p50": percentile(values, 0.50) if values else None,
                "p99": percentile(values, 0.99) if values else None,
            }
    return out


def _records(directory: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = [pq.read_table(p) for p in sorted(directory.rglob("*.parquet"))]
    return pa.concat_tables(tables, promote_options="default").to_pylist() if tables else []


def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = TenantLayout.build()
    reps: list[dict[str, Any]] = []
    with RedisServer() as ledger, server_for(args.broker) as broker:
        cpus = () if args.broker_core is None else give_broker_a_core(broker, args.broker_core)
        for rep in range(args.reps):
            tag = f"rep {rep + 1}/{args.reps}"

            def progress(text: str, tag: str = tag) -> None:
                print(f"{tag} {text}", flush=True)

            with tempfile.TemporaryDirectory(prefix="celery-fair-waits-") as tel:
                params = FloodParams(flood=args.flood, telemetry_dir=tel, burst_cpus=cpus)
                result = run_flood(
                    broker.url, ledger.url, layout, MODES["fair-keyed"], params, progress
                )
                lost = result.get("lost", 0)
                reps.append({"split": split(_records(Path(tel)), layout.flood), "lost": lost})
    return {
        "env": environment(), "broker": args.broker, "flood": args.flood, "reps": reps,
        "broker_core": args.broker_core,
    }  # fmt: skip


def markdown(data: dict[str, Any], command: str) -> str:
    reps = data["reps"]
    lines = [
        f"# Where a quiet tenant's wait goes in scenario K ({data['broker']})",
        "",
        f"`{command}` ({data['env']['when']}, {data['env']['cpus']} CPUs). celery-fair, one "
        f"queue keyed by tenant, one `celery worker -P prefork -c 2`, 3 ms tasks, 20 quiet "
        f"tenants at 5 tasks/s, a burst of {data['flood']:,}. Quiet tasks' waits split at "
        "their receipt by the worker; medians over the repetitions, [min, max].",
        *filter(None, [broker_core_note(data.get("broker_core"))]),
        "",
        "| phase | quiet tasks | publish -> received p50 / p99 ms | received -> started "
        "p50 / p99 ms | whole wait p50 / p99 ms | p99 over unloaded |",
        "|---|---|---|---|---|---|",
    ]

    def cell(phase: str, part: str, q: str) -> float:
        return float(summary([r["split"][phase][part][q] for r in reps])["median"])

    def ratio_cell(values: list[float]) -> str:
        s = summary(values)
        return f"{s['median']:.2f}x [{s['min']:.2f}, {s['max']:.2f}]"

    for phase in PHASES:
        n = int(summary([r["split"][phase]["n"] for r in reps])["median"])
        parts = [f"{cell(phase, p, 'p50'):.1f} / {cell(phase, p, 'p99'):.1f}" for p in PARTS]
        ratios = [
            r["split"][phase]["total"]["p99"] / r["split"]["unloaded"]["total"]["p99"] for r in reps
        ]
        lines.append(f"| {phase} | {n} | {' | '.join(parts)} | {ratio_cell(ratios)} |")
    seconds = summary([r["split"]["publishing"]["seconds"] for r in reps])["median"]
    lines += [
        "",
        f"The burst took {seconds:.1f} s to publish (median). Lost tasks: "
        f"{sum(r['lost'] for r in reps)}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], default="rabbitmq")
    parser.add_argument("--flood", type=int, default=8_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--name", default=None)
    parser.add_argument(
        "--broker-core", type=int, default=None,
        help="run the broker and the burst's publisher on this CPU, the rest on the others",
    )  # fmt: skip
    args = parser.parse_args(argv)
    name = args.name or f"wait_split_{args.broker}"
    data = run(args)
    command = f"python -m bench.wait_split --broker {args.broker} --flood {args.flood} "
    command += f"--reps {args.reps}" + (f" --name {name}" if args.name else "")
    command += f" --broker-core {args.broker_core}" if args.broker_core is not None else ""
    write(name, data, markdown(data, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
