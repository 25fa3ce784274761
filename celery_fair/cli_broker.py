"""What every ``celery-fair`` subcommand that talks to a broker shares: where the broker is."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ("add_broker_options", "broker_connection")


def add_broker_options(parser: argparse.ArgumentParser) -> None:
    """``-A/--app`` (the app's broker and transport options) or ``-b/--broker`` (a URL)."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--app", "-A", help="the Celery app (module or module:attr): its broker")
    where.add_argument("--broker", "-b", help="a broker URL (without the app's transport options)")


def broker_connection(args: argparse.Namespace) -> Any:
    """A Kombu connection to the broker named by :func:`add_broker_options`' options."""
    if args.app:
        from celery.app.utils import find_app

        return find_app(args.app).connection_for_write()
    from kombu.connection import Connection

    return Connection(args.broker)  # type: ignore[no-untyped-call]
