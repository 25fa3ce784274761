"""``celery_fair.check(app)`` and ``celery fair check``: an app's settings, checked as a
worker checks them at start, and what is in force.

Producers read some settings too (``fair_keys``, backlog caps, admission): a
configuration a worker would refuse is found before anything is deployed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from .cli_options import UsageError, load_app
from .worker.options import OPTIONS
from .worker.settings import FairSettings, unknown_settings

__all__ = ("Checked", "check", "register", "run")


@dataclass(frozen=True)
class Checked:
    """What :func:`check` found: the settings in force, and warnings."""

    settings: FairSettings
    #: Every ``fair_*`` setting: (name, value in force, whether the app sets it).
    in_force: list[tuple[str, Any, bool]]
    #: Settings celery-fair does not know (a misspelling), with the closest name.
    warnings: list[str]


def check(app: Any) -> Checked:
    """Check every ``fair_*`` setting of ``app`` as a worker does at start.

    Raises :class:`~celery_fair.errors.FairConfigError` naming the first
    setting that is wrong, with its value.
    """
    conf = app.conf
    # Here, not at the top: the worker's start-up code is heavy, and every
    # ``celery-fair`` command imports this module to register ``check``.
    from .worker.build import check_keyed_broker

    settings = FairSettings.from_conf(conf)
    check_keyed_broker(app, settings)
    rows = []
    for option in OPTIONS:
        value = conf.get(option.name)
        rows.append((option.name, option.default if value is None else value, value is not None))
    return Checked(settings, rows, unknown_settings(conf))


def register(subparsers: Any) -> None:
    """Add the ``check`` subcommand to the ``celery-fair`` parser."""
    parser = subparsers.add_parser(
        "check",
        help="check an app's fair_* settings as a worker would, and show what is in force",
        description=(
            "Check every fair_* setting of the app as a worker does at start (exit status 2 "
            "with the first error), warn about names celery-fair does not know, and list "
            "each setting's value in force. Connects to nothing."
        ),
    )
    parser.add_argument("--app", "-A", help="the Celery app (module or module:attr)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--all", action="store_true", help="list the settings left at their defaults too"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Handler of ``celery-fair check``."""
    if not args.app:
        raise UsageError("name the app: -A proj (or celery -A proj fair check)")
    found = check(load_app(args.app))
    rows = [(n, v, s) for n, v, s in found.in_force if s or args.all]
    if args.json:
        shown = {"settings": {n: {"value": v, "set": s} for n, v, s in rows}}
        print(json.dumps({**shown, "warnings": found.warnings}, indent=2, default=repr))
        return 0
    for message in found.warnings:
        print(f"warning: {message}", file=sys.stderr)
    if not rows:
        print("no fair_* setting is set: every one is at its default (--all lists them)")
    width = max((len(n) for n, _, _ in rows), default=0)
    for name, value, is_set in rows:
        print(f"{name:<{width}}  {value!r}{'' if is_set else '  (default)'}")
    print("ok: a worker would start with these settings")
    return 0
