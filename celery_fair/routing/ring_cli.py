"""``celery-fair ring``: print a ring's key distribution and what a change would move."""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from typing import Any

from celery_fair.cli_options import APP_GIVEN, positive_float, positive_int, queue_weights
from celery_fair.routing.ring import ALGORITHMS, HashRing, ideal_moved_fraction

__all__ = ("register", "ring_of_app", "ring_report", "run")


def register(subparsers: Any) -> None:
    """Add the ``ring`` subcommand to the ``celery-fair`` parser."""
    parser = subparsers.add_parser(
        "ring",
        help="show how keys spread over weighted queues, and how many a change moves",
        description=(
            "Hash --keys random keys onto --queues and print each queue's share against its "
            "weight share. With --add, --remove, --set or --to (another queue set), and with "
            "--to-algorithm (another mapping), also print the fraction of keys that moved "
            "against the least fraction any mapping must move. --key shows where given keys go."
        ),
    )
    where = parser.add_mutually_exclusive_group(required=not APP_GIVEN.get())
    where.add_argument(
        "--queues",
        type=queue_weights,
        help="queue=weight pairs, comma separated (t0=10,t1=10,t2=20); a bare name weighs 1",
    )
    where.add_argument(
        "--app",
        "-A",
        help="a Celery app (module or module:attr): the ring of its ConsistentHashRouter "
        "in task_routes (queues, weights and algorithm)",
    )
    parser.add_argument("--keys", type=positive_int, default=100_000, help="number of keys")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random keys")
    change = parser.add_mutually_exclusive_group()
    change.add_argument("--add", type=_one_pair, metavar="QUEUE=WEIGHT", help="add a queue")
    change.add_argument("--remove", metavar="QUEUE", help="remove a queue")
    change.add_argument("--set", type=_one_pair, metavar="QUEUE=WEIGHT", help="change a weight")
    change.add_argument(
        "--to",
        type=queue_weights,
        metavar="QUEUES",
        help="compare with another queue set (same form as --queues)",
    )
    parser.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        default="rendezvous",
        help="mapping: rendezvous (default), table, or auto (rendezvous up to 12 queues)",
    )
    parser.add_argument(
        "--to-algorithm",
        choices=ALGORITHMS,
        default=None,
        help="map the compared ring with this algorithm (preview a migration)",
    )
    parser.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="KEY",
        help="show the queue of this key (repeatable), before and after a change",
    )
    parser.add_argument(
        "--table-weight",
        type=positive_float,
        default=None,
        metavar="W",
        help="lay the table out for total weight W (keeps the layout across the change)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.set_defaults(handler=run)


def _one_pair(text: str) -> tuple[str, float]:
    pairs = queue_weights(text)
    if len(pairs) != 1 or "=" not in text:
        raise argparse.ArgumentTypeError(f"expected one QUEUE=WEIGHT, not {text!r}")
    return next(iter(pairs.items()))


def _changed_ring(ring: HashRing, args: argparse.Namespace) -> tuple[HashRing | None, str]:
    changed: HashRing | None = None
    change = ""
    if args.add is not None:
        name, weight = args.add
        changed, change = ring.with_queue(name, weight), f"add {name}={weight:g}"
    elif args.remove is not None:
        changed, change = ring.without_queue(args.remove), f"remove {args.remove}"
    elif args.set is not None:
        name, weight = args.set
        changed, change = ring.with_weight(name, weight), f"set {name}={weight:g}"
    elif args.to is not None:
        pairs = ",".join(f"{name}={weight:g}" for name, weight in sorted(args.to.items()))
        changed = HashRing(args.to, algorithm=args.algorithm, table_weight=args.table_weight)
        change = f"queues {pairs}"
    if args.to_algorithm is not None and args.to_algorithm != args.algorithm:
        weights = ring.weights if changed is None else changed.weights
        changed = HashRing(weights, algorithm=args.to_algorithm, table_weight=args.table_weight)
        switch = f"algorithm {args.algorithm} -> {args.to_algorithm}"
        change = f"{change}, {switch}" if change else switch
    return changed, change


def _distribution(ring: HashRing, assigned: list[str]) -> list[dict[str, Any]]:
    counts = Counter(assigned)
    total = len(assigned)
    rows = []
    for name, ideal in sorted(ring.shares().items()):
        share = counts[name] / total
        rows.append(
            {
                "queue": name,
                "weight": ring.weights[name],
                "ideal_share": ideal,
                "keys": counts[name],
                "share": share,
                "relative_deviation": (share - ideal) / ideal,
            }
        )
    return rows


def ring_report(
    ring: HashRing,
    keys: list[str],
    changed: HashRing | None = None,
    change: str = "",
    shown: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Compute the distribution of ``keys`` on ``ring`` and, if given, the moves to ``changed``.

    ``shown`` are keys whose queue is reported one by one (before and after).
    When the two rings use different mappings, ``unrelated_fraction`` is what two
    independent mappings would move, ``1 - sum(share * share')``: the scale of a
    switch of algorithm, which keeps nothing of the old mapping.
    """
    before = [ring.lookup(k) for k in keys]
    report: dict[str, Any] = {
        "keys": len(keys),
        "algorithm": ring.algorithm,
        "before": _distribution(ring, before),
    }
    if shown:
        report["lookups"] = [
            {"key": k, "before": ring.lookup(k)}
            | ({} if changed is None else {"after": changed.lookup(k)})
            for k in shown
        ]
    if changed is None:
        return report
    after = [changed.lookup(k) for k in keys]
    moves = Counter((a, b) for a, b in zip(before, after, strict=True) if a != b)
    moved = sum(moves.values())
    ideal = ideal_moved_fraction(ring, changed)
    touched = set(ring.weights.items()) ^ set(changed.weights.items())
    changed_names = {name for name, _ in touched}
    only_changed: bool | None = all(a in changed_names or b in changed_names for a, b in moves)
    if changed.algorithm != ring.algorithm:
        # Another mapping: any queue may gain or lose keys, so the question does not apply.
        only_changed = None
        old, new = ring.shares(), changed.shares()
        report["unrelated_fraction"] = 1.0 - sum(old[q] * new.get(q, 0.0) for q in old)
    report.update(
        change=change,
        algorithm_after=changed.algorithm,
        layout_changed=ring.layout != changed.layout,
        after=_distribution(changed, after),
        moved_keys=moved,
        moved_fraction=moved / len(keys),
        ideal_fraction=ideal,
        moves={f"{a}->{b}": n for (a, b), n in sorted(moves.items())},
        only_changed_queue_involved=only_changed,
    )
    return report


def _format_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"  {'queue':<16} {'weight':>8} {'ideal':>8} {'keys':>9} {'share':>8} {'dev':>8}"]
    for r in rows:
        lines.append(
            f"  {r['queue']:<16} {r['weight']:>8g} {r['ideal_share']:>8.2%} {r['keys']:>9d} "
            f"{r['share']:>8.2%} {r['relative_deviation']:>+8.2%}"
        )
    return lines


_DESCRIPTIONS = {"rendezvous": "weighted rendezvous hashing", "table": "weighted probe table"}


def format_report(report: dict[str, Any], seed: int) -> str:
    """Render ``ring_report`` output as the text the command prints."""
    lines = [
        f"{report['keys']} random keys (seed {seed}), {_DESCRIPTIONS[report['algorithm']]}",
        "",
    ]
    lines += _format_table(report["before"])
    if "change" in report:
        ideal = report["ideal_fraction"]
        ratio = f"ratio {report['moved_fraction'] / ideal:.3f}" if ideal else "ratio n/a"
        after = f"after {report['change']}:"
        if report["algorithm_after"] != report["algorithm"]:
            after = f"after {report['change']} ({_DESCRIPTIONS[report['algorithm_after']]}):"
        lines += ["", after] + _format_table(report["after"])
        lines += [
            "",
            f"moved: {report['moved_keys']} keys = {report['moved_fraction']:.2%} "
            f"(ideal {ideal:.2%}, {ratio})",
            "moves: " + (", ".join(f"{k} {v}" for k, v in report["moves"].items()) or "none"),
        ]
        if report["only_changed_queue_involved"] is None:
            lines.append(
                "the mapping changed: two unrelated mappings would move "
                f"{report['unrelated_fraction']:.2%}"
            )
        else:
            lines.append(
                "only the changed queue gained or lost keys: "
                + ("yes" if report["only_changed_queue_involved"] else "NO")
            )
        if report["layout_changed"] and report["algorithm_after"] == report["algorithm"] == "table":
            lines.append(
                "note: the change crosses a table band, so every slot was redrawn; "
                "--table-weight keeps one layout"
            )
    for row in report.get("lookups", ()):
        where = row["before"] if "after" not in row else f"{row['before']} -> {row['after']}"
        lines.append(f"key {row['key']!r}: {where}")
    return "\n".join(lines)


def ring_of_app(name: str) -> HashRing:
    """The ring of the first ``ConsistentHashRouter`` in app ``name``'s ``task_routes``."""
    from celery.app.utils import find_app

    from celery_fair.routing.router import ConsistentHashRouter

    routes = find_app(name).conf.task_routes or ()
    if isinstance(routes, (dict, str)) or not hasattr(routes, "__iter__"):
        routes = (routes,)
    for route in routes:
        if isinstance(route, ConsistentHashRouter):
            return route.ring
    raise SystemExit(
        f"celery-fair ring: app {name!r} has no ConsistentHashRouter in task_routes "
        f"(got {routes!r}); give the queues with --queues"
    )


def run(args: argparse.Namespace) -> int:
    """Handler of ``celery-fair ring``."""
    try:
        if args.app and not args.queues:
            ring = ring_of_app(args.app)
            args.algorithm = ring.algorithm
        else:
            ring = HashRing(args.queues, algorithm=args.algorithm, table_weight=args.table_weight)
        changed, change = _changed_ring(ring, args)
    except (KeyError, ValueError) as exc:
        message = exc.args[0] if exc.args else str(exc)
        raise SystemExit(f"celery-fair ring: {message}") from None
    rng = random.Random(args.seed)
    keys = [f"{rng.getrandbits(64):016x}" for _ in range(args.keys)]
    report = ring_report(ring, keys, changed, change, tuple(args.key))
    print(json.dumps(report, indent=2) if args.json else format_report(report, args.seed))
    return 0
