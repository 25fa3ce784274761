"""``celery-fair capture``: record Celery's task events as telemetry, from the command line.

The receiver and the records are :mod:`celery_fair.telemetry.capture`; this
module is the command: its options, and their defaults read from the app's
settings as a worker reads them (``fair_cost``, ``fair_weights``, through
:func:`celery_fair.worker.settings.read_setting`), so a capture charges and
weighs as the deployment's workers do unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

from ..cli_options import APP_GIVEN, load_app, positive_float, queue_weights
from ..scheduling.cost import MEASURED_COST_MODES
from ..telemetry.capture import capture_events
from ..worker.settings import read_setting

__all__ = ("register", "run")


def register(subparsers: Any) -> None:
    """Add the ``capture`` subcommand to the ``celery-fair`` parser."""
    parser = subparsers.add_parser(
        "capture",
        help="record Celery's task events (workers run with -E) as telemetry",
        description=(
            "Receive task events from the broker of --app and write one telemetry record "
            "per finished task to --out, in the schema the worker's telemetry uses. "
            "Stops after --duration seconds, or on Ctrl-C / SIGTERM."
        ),
    )
    # celery -A proj fair capture: Celery's app is the one (see cli.main).
    parser.add_argument(
        "--app",
        "-A",
        required=not APP_GIVEN.get(),
        help="the Celery app (module or module:attr): its broker and settings",
    )
    parser.add_argument("--out", required=True, help="directory of the Parquet files")
    parser.add_argument(
        "--duration",
        type=positive_float,
        default=None,
        help="seconds to capture (default: until stopped)",
    )
    parser.add_argument(
        "--queues",
        type=queue_weights,
        default=None,
        help="queue=weight pairs recorded as the targets (default: the app's fair_weights)",
    )
    parser.add_argument(
        "--cost",
        choices=MEASURED_COST_MODES,
        default=None,
        help="cost charged per task (default: the app's fair_cost, count when unset)",
    )
    parser.add_argument(
        "--enable-events", action="store_true", help="ask running workers to send task events"
    )
    parser.add_argument("--json", action="store_true", help="print the final counts as JSON")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``celery-fair capture``."""
    app = load_app(args.app)
    # Read before any connection: a bad setting is bad input, whatever the broker.
    cost = args.cost or read_setting(app.conf, "fair_cost")
    if cost not in MEASURED_COST_MODES:
        # Events carry no task's resources: a dominant-cost app is captured as counts.
        cost = "count"
    weights = args.queues if args.queues is not None else read_setting(app.conf, "fair_weights")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.enable_events:
        app.control.enable_events()

    def ready() -> None:
        # With --json, stdout holds the one JSON object only.
        print(
            f"capturing task events into {args.out}",
            file=sys.stderr if args.json else sys.stdout,
            flush=True,
        )

    counts = capture_events(
        app,
        args.out,
        duration=args.duration,
        weights=weights,
        cost=cost,
        stop=stop,
        on_ready=ready,
    )
    if args.json:
        print(json.dumps(counts), flush=True)
    else:
        print(", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
    return 0
