"""``celery fair``: the ``celery-fair`` tools as a ``celery`` subcommand.

Registered through Celery's ``celery.commands`` entry point (as Flower is), so
``celery -A proj fair keys backlog jobs`` loads the app as every ``celery``
command does (``-A``, ``-b``, ``--config``, ``--workdir``) and the subcommands
read its broker and transport options; ``celery-fair ... -A proj`` stays the
same tools as a program of their own.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from .cli import main

__all__ = ("fair",)


@click.command(
    name="fair",
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": [],  # --help goes to the subcommands' parser
    },
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def fair(ctx: click.Context, args: tuple[str, ...]) -> None:
    """celery-fair's tools: keys, parked, ring, capture, report, exporter (see --help)."""
    # Celery's own -A or -b: without either its context holds Celery's default
    # app, which names no broker of the user's and no routes.
    given = ctx.parent is not None and any(ctx.parent.params.get(o) for o in ("app", "broker"))
    app: Any = getattr(ctx.obj, "app", None) if given else None
    sys.exit(main(list(args), app=app, prog="celery fair"))
