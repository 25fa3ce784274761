"""The noisy-neighbour showcase (issue #8): plain Celery against celery-fair, four scenarios.

A flood, B heavy tasks, C tiers, D slow worker; real ``celery worker -P prefork
-c 2`` processes on a real Redis or RabbitMQ; the modes alternate within each
repetition. Results: ``bench/results/noisy_neighbour_<broker>.{json,md,png}``.
The scenario logic lives in :mod:`bench.showcase`.

    python -m bench.noisy_neighbour [--broker redis|rabbitmq] [--scenarios A,B,C,D]
                                    [--reps 3] [--quick] [--flood 20000]
                                    [--broker-core 1]

``--broker-core N`` stands in for a broker on a host of its own: the broker and
the flood's burst publisher run on CPU ``N``, the workers, the quiet tenants'
publishers and the driver on the others (the ledger's Redis is not pinned).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from bench.showcase.runner import LABELS, Live, ShowcaseConfig, run_showcase, server_for
from bench.showcase.summary import markdown, summarise, write_chart
from tests.harness.redis import RedisServer

from .common import RESULTS, broker_core_note, environment, give_broker_a_core, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], default="redis")
    parser.add_argument("--scenarios", default="A,B,C,D", help="comma-separated, e.g. A,D")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the demo's short versions")
    parser.add_argument(
        "--flood", type=int, default=None, help="scenario A's (and K's, KS's) burst size"
    )
    parser.add_argument(
        "--due-after",
        type=float,
        default=None,
        help="scenario KS: the flood's eta, seconds after its burst starts",
    )
    parser.add_argument(
        "--modes", default=None, help="only these modes, e.g. fair,fair-isolated (default: all)"
    )
    parser.add_argument("--name", default=None, help="result file name")
    parser.add_argument(
        "--broker-core", type=int, default=None,
        help="run the broker and the burst's publisher on this CPU, the rest on the others",
    )  # fmt: skip
    parser.add_argument(
        "--resummarise", action="store_true", help="rebuild .md and .png from the stored .json"
    )
    args = parser.parse_args(argv)
    scenarios = tuple(s.strip().upper() for s in args.scenarios.split(",") if s.strip())
    if "KS" in scenarios and args.broker != "redis":
        parser.error("--scenarios KS: scheduled work on the broker needs the Redis broker")
    modes = tuple(m.strip() for m in args.modes.split(",")) if args.modes else None
    config = (ShowcaseConfig.quick if args.quick else ShowcaseConfig)(
        scenarios=scenarios, reps=args.reps, modes=modes
    )
    if args.flood is not None:
        config = replace(
            config,
            flood=replace(config.flood, flood=args.flood),
            scheduled=replace(config.scheduled, flood=args.flood),
        )
    if args.due_after is not None:
        config = replace(config, scheduled=replace(config.scheduled, due_after=args.due_after))
    name = args.name or f"noisy_neighbour_{args.broker}" + ("_quick" if args.quick else "")
    if args.resummarise:
        # Rebuild the tables and the chart from the runs stored in the JSON file.
        stored = json.loads((RESULTS / f"{name}.json").read_text())
        publish(name, stored["broker"], stored["config"], stored["runs"], stored["env"])
        return 0
    live = Live()
    with RedisServer() as ledger_server, server_for(args.broker) as broker:
        live.line(f"{args.broker} on 127.0.0.1, ledger on its own redis-server; {name}")
        if args.broker_core is not None:
            cpus = give_broker_a_core(broker, args.broker_core)
            config = replace(
                config, **{
                    part: replace(getattr(config, part), burst_cpus=cpus)
                    for part in ("flood", "slow", "scheduled")
                },
            )  # fmt: skip
        runs = run_showcase(config, broker.url, ledger_server.url, live)
    stored_config = {
        **config.to_dict(),
        "modes_arg": args.modes,
        "flood_arg": args.flood,
        "due_after_arg": args.due_after,
        "broker_core_arg": args.broker_core,
    }
    publish(name, args.broker, stored_config, runs, environment(), quick=args.quick)
    return 0


def publish(
    name: str,
    broker: str,
    config: dict[str, Any],
    runs: dict[str, Any],
    env: dict[str, Any],
    *,
    quick: bool | None = None,
) -> None:
    """Summarise the runs and write ``<name>.json``, ``.md`` and ``.png`` in bench/results."""
    if quick is None:
        quick = bool(config.get("quick"))
    config = {**config, "quick": quick}
    summary = summarise(runs)
    results: dict[str, Any] = {
        "env": env,
        "broker": broker,
        "config": config,
        "summary": summary,
        "runs": runs,
    }
    reps = config["reps"]
    chart = None
    if "A" in summary:
        chart = f"{name}.png"
        write_chart(
            summary, LABELS, RESULTS / chart,
            title=f"Scenario A on {broker}: quiet tenants' wait during a "
                  f"{config['A']['flood']:,}-task flood (medians of {reps} runs)",
        )  # fmt: skip
    flags = f"--broker {broker} --scenarios {','.join(config['scenarios'])} --reps {reps}"
    flags += " --quick" if quick else ""
    flags += f" --modes {config['modes_arg']}" if config.get("modes_arg") else ""
    flags += f" --flood {config['flood_arg']}" if config.get("flood_arg") is not None else ""
    flags += f" --due-after {config['due_after_arg']:g}" if config.get("due_after_arg") else ""
    core = config.get("broker_core_arg")
    flags += f" --broker-core {core}" if core is not None else ""
    note = broker_core_note(core)
    default_name = f"noisy_neighbour_{broker}" + ("_quick" if quick else "")
    flags += f" --name {name}" if name != default_name else ""
    loads = [r["load"] for modes in runs.values() for rs in modes.values() for r in rs]
    text = "\n".join(
        [
            f"# Noisy neighbour ({broker})",
            "",
            f"Reproduce: `python -m bench.noisy_neighbour {flags}` ({env['when']}, "
            f"celery {env['celery']}, kombu {env['kombu']}, "
            f"{env['cpus']} CPUs shared with other work: 1-minute load average "
            f"{min(loads):.1f} to {max(loads):.1f} during the runs). Medians over "
            f"{reps} repetitions, [min, max]; the modes alternate within each repetition."
            + (f" {note}" if note else ""),
            "",
            _setup(config),
            "",
            markdown(summary, LABELS, chart=chart),
        ]
    )
    write(name, results, text)
    print(text)


def _setup(config: dict[str, Any]) -> str:
    f, d, b, c = config["A"], config["D"], config["B"], config["C"]
    ran = set(config["scenarios"])
    parts = [
        f"Setup: {config['quiet_tenants']} quiet tenants at {f['rate']:g} tasks/s each and one "
        f"flooding tenant, routed by `tenant_id` with `ConsistentHashRouter` onto "
        f"{len(config['shards'])} shard queues ({config['flood_tenant']} -> "
        f"{config['flood_shard']}, shared with "
        f"{', '.join(config['flood_shard_neighbours']) or 'no quiet tenant'}). Tasks sleep "
        f"{f['task_ms']:g} ms."
    ]
    if "A" in ran:
        parts.append(
            f"A: one worker `-P prefork -c {f['concurrency']}`, {f['baseline']:g} s unloaded, "
            f"then a burst of {f['flood']:,} tasks."
        )
    if "K" in ran:
        parts.append(
            f"K: one worker `-P prefork -c {f['concurrency']}`, {f['baseline']:g} s unloaded "
            f"(about {f['baseline'] * f['rate']:.0f} tasks per quiet tenant), then a burst of "
            f"{f['flood']:,} tasks; every tenant publishes to one queue keyed by `tenant_id` "
            "(`fair_keys`), against plain Celery with the same one queue (a FIFO) and with "
            "A's shard queues."
        )
    if "KS" in ran:
        s = config["KS"]
        parts.append(
            f"KS (fair when due): as K ({s['baseline']:g} s unloaded, one worker "
            f"`-P prefork -c {s['concurrency']}` with Celery's defaults), but the flood's "
            f"{s['flood']:,} tasks are all published with one eta, {s['due_after']:g} s after "
            "the burst starts (a few seconds after it is published), while the quiet tenants "
            "go on sending tasks without one. Plain Celery (one queue) and celery-fair's keyed "
            "queue with Celery's `fair_eta` default (`worker`) deliver the flood at once and the "
            "worker holds it until due; with `fair_eta` `broker` on the producer it waits in the "
            "queue's schedule and joins the flood tenant's key when due. *During the flood* "
            "counts quiet tasks published from the due time until the flood's last task "
            "started; throughput is counted from the due time."
        )
    if "I" in ran:
        parts.append(
            'I: as A, with `ConsistentHashRouter(..., isolate="fair.isolated")`: the router '
            "moves the noisy tenant to an isolation queue the workers consume at weight 0.25."
        )
    if "D" in ran:
        parts.append(
            f"D: two workers `-c {d['concurrency']}`, a {d['flood']:,}-task burst, from which "
            f"one worker's tasks take {d['task_ms'] + d['slow_ms']:g} ms."
        )
    if "B" in ran:
        parts.append(
            f"B: tasks busy the CPU {b['heavy_us'] / 1000:g} ms (heavy tenant) and "
            f"{b['light_us'] / 1000:g} ms ({b['light']} light tenants), {b['target']:,} tasks "
            "measured."
        )
    if "C" in ran:
        parts.append(
            f"C: {c['premium']} premium and {c['standard']} standard shards weighted "
            f"{c['weight']}:1, {c['task_ms']:g} ms tasks, {c['target']:,} tasks measured."
        )
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
