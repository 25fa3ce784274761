"""The ``celery-fair`` command: one argparse parser, one module per subcommand.

A subcommand lives in its own module exposing ``register(subparsers)``, which
adds its parser and sets ``handler`` (``argparse.Namespace -> int``) with
``set_defaults``. Add the module's dotted path to ``SUBCOMMANDS``; keep heavy
imports (PySpark, Celery apps) inside the handler so that ``celery-fair ring``
does not pay for ``celery-fair report``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ("SUBCOMMANDS", "build_parser", "main")

#: Modules that each define ``register(subparsers) -> None``.
SUBCOMMANDS: tuple[str, ...] = (
    "celery_fair.routing.ring_cli",
    "celery_fair.telemetry.capture",
    "celery_fair.analytics.report",
    "celery_fair.parking.cli",
    "celery_fair.keys.cli",
    "celery_fair.monitoring.exporter",
)


def build_parser(subcommands: Sequence[str] = SUBCOMMANDS) -> argparse.ArgumentParser:
    """Build the top-level parser from the ``register`` function of each subcommand module."""
    parser = argparse.ArgumentParser(
        prog="celery-fair", description="Weighted fair queueing tools for Celery."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in subcommands:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``celery-fair``; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    status: int = args.handler(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
