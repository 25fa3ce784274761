"""``celery-fair keys``: a keyed queue's backlog, pauses, or a move back to plain Kombu lists.

On RabbitMQ ``backlog`` and ``unkey`` read and empty the keyed queue's lanes
(:mod:`celery_fair.keys.lanes_admin`), and ``pause`` and ``resume`` write the
pause log (:mod:`celery_fair.keys.pause_log`); ``unschedule`` is Redis only.

``celery-fair keys backlog QUEUE`` shows what waits in the per-key lists,
the paused keys and the largest backlogs with their top users.
``celery-fair keys pause QUEUE KEY...`` and ``resume`` pause and resume keys
on the broker, as ``celery control fair_key_pause`` does without a worker.
``celery-fair keys unkey QUEUE`` moves every waiting message back into the
queue's own Kombu lists, where a worker without celery-fair finds it: the
last step of a return to plain Celery (docs/migrating.md gives the order).
``celery-fair keys unschedule QUEUE`` moves every message of a queue's
schedule (``fair_eta="broker"``), keyed or plain, into the queue now, due
or not: workers then hold them until their eta, as Celery does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..cli_options import (
    UsageError,
    add_broker_options,
    broker_connection,
    load_app,
    positive_int,
)

__all__ = ("register", "run")

#: Seconds between two progress lines of a long move.
PROGRESS_EVERY = 1.0


def register(subparsers: Any) -> None:
    """Add the ``keys`` subcommand to the ``celery-fair`` parser."""
    parser = subparsers.add_parser(
        "keys",
        help="a keyed queue's backlog, or move it back for plain Celery workers",
        description=(
            "backlog: what waits in a keyed queue's per-key lists. pause / resume KEY...: "
            "nothing of a paused key is fetched by any worker until it is resumed. "
            "unkey: move it all back "
            "to the queue's own lists, where any Celery worker consumes it (each batch is "
            "one atomic step: stopping it half way loses and duplicates nothing). "
            "unschedule: move every message of the queue's schedule (fair_eta='broker', "
            "keyed or plain queue) into the queue now, due or not (atomic batches too). "
            "On RabbitMQ: backlog, pause, resume and unkey, of the keyed queue's lanes."
        ),
    )
    parser.add_argument(
        "action",
        choices=("backlog", "pause", "resume", "unkey", "unschedule"),
        help="what to do (see above)",
    )
    parser.add_argument("queue", metavar="QUEUE", help="the keyed queue (unschedule: any queue)")
    parser.add_argument(
        "keys",
        metavar="KEY",
        nargs="*",
        help="the keys (pause, resume; backlog on RabbitMQ: the capped keys' counts)",
    )
    add_broker_options(parser)
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="messages moved per step (unkey, unschedule)",
    )
    parser.add_argument("--top", type=positive_int, default=10, help="next keys shown (backlog)")
    parser.add_argument("--json", action="store_true", help="print JSON (backlog, pause, resume)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``celery-fair keys``."""
    from .. import compat
    from . import store
    from .publish import names_for

    if args.action in ("pause", "resume") and not args.keys:
        raise UsageError("name the keys after the queue")
    with broker_connection(args) as connection:
        channel = connection.default_channel
        if not compat.is_redis_channel(channel):
            driver = connection.transport.driver_type
            if driver == "amqp" and args.action in ("pause", "resume"):
                return _pause_on_rabbitmq(connection, args)
            if driver == "amqp" and args.action in ("backlog", "unkey"):
                return _on_rabbitmq(connection, args)
            also = " (on RabbitMQ: backlog, pause, resume and unkey)" if driver == "amqp" else ""
            print(
                f"celery-fair keys {args.action}: keyed queues live on Redis{also}; "
                f"{connection.as_uri()} is {driver}",
                file=sys.stderr,
            )
            return 2
        names = names_for(channel, args.queue)
        with compat.redis_client(channel) as client:
            if args.action == "backlog":
                return _backlog(client, names, args)
            if args.action in ("pause", "resume"):
                pairs = [(names.base, key) for key in args.keys]
                changed = store.pause(client, names.sep, pairs, args.action == "pause")
                done = "paused" if args.action == "pause" else "resumed"
                if args.json:
                    print(json.dumps({"queue": args.queue, done: changed, "of": len(pairs)}))
                else:
                    print(f"{args.queue}: {done} {changed} of {len(pairs)} key(s)")
                return 0
            if args.action == "unschedule":
                return _unschedule(client, names, args)
            return _unkey(client, names, _suffixes(channel, args.queue), args)


def _pause_on_rabbitmq(connection: Any, args: argparse.Namespace) -> int:
    """``pause`` and ``resume`` on RabbitMQ: an event in the pause log every worker reads
    (:mod:`celery_fair.keys.pause_log`); a resume also moves the parked tasks back."""
    from kombu.entity import Queue

    from .pause_log import PauseLog, PauseLogUnavailable

    paused = args.action == "pause"
    # The parked lanes are declared as the queue is: the app's declaration.  Without
    # it, the lanes are taken as the broker holds them and none is declared (one
    # without the queue's arguments would be refused): the workers declare them.
    if args.app:
        log = PauseLog(connection.clone, {args.queue: load_app(args.app).amqp.queues[args.queue]})
    else:
        parent = Queue(args.queue, durable=True)  # type: ignore[no-untyped-call]
        found = _with_levels(connection, args.queue)
        log = PauseLog(connection.clone, {args.queue: parent}, as_found=True, prioritised=found)
    try:
        if not log.read(catch_up=True):
            why = log.unsupported or "the pause log could not be read"
            print(f"celery-fair keys {args.action}: {why}", file=sys.stderr)
            return 2
        if not paused:
            # What is parked now, at most: a worker that has not read the resume yet
            # (it reads every 2 s) parks again what it receives, and moves it back later.
            counts = [log.parked(args.queue, key) for key in args.keys]
            log.move_budget = None if None in counts else sum(c or 0 for c in counts)
        changed = log.append(args.queue, args.keys, paused)
        while not paused:  # moved back in steps, until a step finds nothing parked
            before = log.moved
            log.read()
            if log.moved == before:
                break
    except PauseLogUnavailable as exc:
        print(f"celery-fair keys {args.action}: {exc}", file=sys.stderr)
        return 2
    finally:
        log.close()
    done = "paused" if paused else "resumed"
    if args.json:
        print(json.dumps({"queue": args.queue, done: changed, "of": len(args.keys),
                          "moved_back": log.moved}))  # fmt: skip
    else:
        moved = "" if paused else f", {log.moved} parked task(s) moved back"
        print(f"{args.queue}: {done} {changed} of {len(args.keys)} key(s){moved}")
    return 0


def _with_levels(connection: Any, queue: str) -> tuple[str, ...]:
    """``(queue,)`` if keyed ``queue`` has priority levels on the broker (a worker or a
    producer declared its levels' lanes), else ``()``."""
    from .lanes import LEVEL_STEPS, KeyLanes, level_lane
    from .lanes_admin import declared

    lane = level_lane(queue, KeyLanes(frozenset((queue,))).shard_lanes(queue)[0], LEVEL_STEPS[-1])
    messages, _, channel = declared(connection, connection.channel(), lane)
    channel.close()
    return (queue,) if messages is not None else ()


def _on_rabbitmq(connection: Any, args: argparse.Namespace) -> int:
    """``backlog`` and ``unkey`` of a keyed queue's lanes on RabbitMQ."""
    from . import lanes_admin
    from .publish import parse_max_backlog

    if args.action == "backlog":
        keys = None
        if args.keys:
            # Only a capped key is counted, in a counter named by its cap: the
            # producers' setting says which.
            if not args.app:
                raise UsageError(
                    "keys backlog QUEUE KEY... on RabbitMQ: name the app (-A) whose "
                    "fair_key_max_backlog caps the keys"
                )
            caps = parse_max_backlog(load_app(args.app).conf.get("fair_key_max_backlog"))
            keys = lanes_admin.capped(connection, args.queue, args.keys, caps)
        counts = lanes_admin.backlog(connection, args.queue)
        lanes_admin.print_backlog(counts, args.queue, as_json=args.json, keys=keys)
        return 0
    total = 0
    declare = load_app(args.app).amqp.queues[args.queue] if args.app else None
    try:
        for lane, moved in lanes_admin.unkey(
            connection,
            args.queue,
            declare=declare,
            progress=lanes_admin.Progress(PROGRESS_EVERY),
        ):
            total += moved
            print(f"  {lane}: {moved} moved")
    except lanes_admin.QueueMissing as exc:
        print(f"celery-fair keys unkey: {exc}", file=sys.stderr)
        return 2
    print(f"{args.queue}: {total} message(s) moved back from its lanes")
    left = sum(c.messages or 0 for c in lanes_admin.backlog(connection, args.queue)[1:])
    if left:
        # Published to a lane while the move ran: a producer still has fair_keys.
        print(
            f"{args.queue}: {left} message(s) arrived in its lanes meanwhile; stop keyed "
            "publishing (fair_keys in the producers) and run this again",
            file=sys.stderr,
        )
        return 1
    return 0


def _backlog(client: Any, names: Any, args: argparse.Namespace) -> int:
    from . import store

    found = store.backlog(client, names, top=args.top)
    controls = store.controls(client, names, top=args.top)
    if args.json:
        record = {
            "queue": args.queue,
            "messages": found.messages,
            "keys": found.keys,
            "next_keys": [{"key": k, "messages": n} for k, n in found.next_keys],
            "paused": controls.paused,
            "scheduled": store.scheduled(client, names),
            "scheduled_keys": dict(store.scheduled_keys(client, names, args.top)),
            "top_users": {k: dict(users) for k, users in controls.top_users.items()},
        }
        print(json.dumps(record, indent=2))
        return 0
    print(f"{args.queue}: {found.messages} message(s) in {found.keys} key(s)")
    scheduled = store.scheduled(client, names)
    if scheduled:
        print(f"scheduled (fair_eta='broker'): {scheduled} message(s) not moved in yet")
        for key, waiting in store.scheduled_keys(client, names, args.top):
            print(f"  scheduled {key}: {waiting}")
    for key, waiting in found.next_keys:
        print(f"  {key or '(unkeyed)'}: {waiting}")
    if controls.paused:
        shown = ", ".join(f"{k or '(unkeyed)'} ({s:.0f} s)" for k, s in controls.paused.items())
        print(f"paused: {shown}")
    for key, users in controls.top_users.items():
        print(f"  {key} top users: " + ", ".join(f"{u or '(none)'}: {n}" for u, n in users))
    return 0


def _suffixes(channel: Any, queue: str) -> tuple[str, list[str]]:
    """Where Kombu puts a message of ``queue`` without a priority and with 0..9."""
    from .. import compat

    def suffix(payload: Any) -> str:
        return compat.queue_key(channel, "", compat.message_priority(channel, payload))

    return suffix({}), [suffix({"properties": {"priority": p}}) for p in range(10)]


def _unkey(
    client: Any, names: Any, suffixes: tuple[str, list[str]], args: argparse.Namespace
) -> int:
    from . import store

    total, left, shown = 0, None, time.monotonic()
    batch = args.batch or store.UNKEY_BATCH
    for moved, left in store.unkey(client, names, suffixes, batch):
        total += moved
        if time.monotonic() - shown >= PROGRESS_EVERY:
            shown = time.monotonic()
            print(f"moved {total} message(s), {left} left", flush=True)
    print(f"{args.queue}: {total} message(s) moved back to its own lists")
    remaining = store.backlog(client, names).messages
    if remaining:
        # Published with a key while the move ran: a producer still has fair_keys.
        print(
            f"{args.queue}: {remaining} message(s) arrived in the per-key lists meanwhile; "
            "stop keyed publishing (fair_keys in the producers) and run this again",
            file=sys.stderr,
        )
        return 1
    return 0


def _unschedule(client: Any, names: Any, args: argparse.Namespace) -> int:
    from . import store

    total, shown = 0, time.monotonic()
    for moved, left in store.unschedule(client, names, args.batch or store.UNKEY_BATCH):
        total += moved
        if time.monotonic() - shown >= PROGRESS_EVERY:
            shown = time.monotonic()
            print(f"moved {total} message(s), {left} left", flush=True)
    print(f"{args.queue}: {total} scheduled message(s) moved into the queue")
    remaining = store.scheduled(client, names)
    if remaining:
        # Scheduled while the move ran: a producer still has fair_eta="broker".
        print(
            f"{args.queue}: {remaining} message(s) were scheduled meanwhile; stop scheduling "
            "on the broker (fair_eta in the producers) and run this again",
            file=sys.stderr,
        )
        return 1
    return 0
