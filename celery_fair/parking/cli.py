"""``celery-fair parked QUEUE``: list, replay or purge the messages parked from a queue."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..cli_options import add_broker_options, broker_connection, positive_int
from ..parked import ParkedMessage, parking_queue

__all__ = ("format_age", "register", "run")


def register(subparsers: Any) -> None:
    """Add the ``parked`` subcommand to the ``celery-fair`` parser."""
    parser = subparsers.add_parser(
        "parked",
        help="list, replay or purge the messages parked from a queue",
        description=(
            "Messages a fair worker could not run (undecodable body, content type not "
            "accepted, not a task, a task no worker knew) are kept next to their queue, in "
            "QUEUE.fair-malformed. List them (the default), put them back on QUEUE once the "
            "cause is fixed (--replay), or drop them on purpose (--purge)."
        ),
    )
    parser.add_argument("queue", metavar="QUEUE", help="the queue the messages came from")
    add_broker_options(parser)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--replay", action="store_true", help="put them back on QUEUE")
    action.add_argument("--purge", action="store_true", help="drop them (they are gone)")
    parser.add_argument(
        "--limit", type=positive_int, default=None, help="at most this many (oldest first)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per message")
    parser.set_defaults(handler=run)


def format_age(seconds: float | None) -> str:
    """``42s``, ``7m``, ``3h``, ``2d`` (``?`` when unknown)."""
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def run(args: argparse.Namespace) -> int:
    """Handler of ``celery-fair parked``."""
    from .store import parking_for

    with broker_connection(args) as connection:
        parking = parking_for(connection.default_channel)
        name = parking_queue(args.queue)
        if args.replay:
            count = parking.replay(args.queue, args.limit)
            print(f"{count} message(s) put back from {name} on {args.queue}")
            return 0
        if args.purge:
            count = parking.purge(args.queue)
            print(f"{count} message(s) dropped from {name}")
            return 0
        parked = parking.list(args.queue, args.limit)
    _print(parked, name, as_json=args.json)
    return 0


def _print(parked: list[ParkedMessage], name: str, *, as_json: bool) -> None:
    now = time.time()
    out = sys.stdout
    if as_json:
        for message in parked:
            row = {
                "queue": message.queue,
                "reason": message.reason,
                "parked_at": message.parked_at,
                "age": message.age(now),
                "task": message.task,
                "id": message.task_id,
            }
            out.write(json.dumps(row) + "\n")
        return
    print(f"{len(parked)} message(s) parked in {name} (oldest first)", file=out)
    for message in parked:
        print(
            f"{format_age(message.age(now)):>5}  {message.task or '-'}  "
            f"{message.task_id or '-'}  {message.reason}",
            file=out,
        )
