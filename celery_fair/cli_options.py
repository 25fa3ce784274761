"""What the ``celery-fair`` subcommands share: where the broker is, and their value types."""

from __future__ import annotations

import argparse
import math
from contextvars import ContextVar
from typing import Any

from .errors import FairConfigError
from .grammar import as_positive, as_positive_int, parse_pairs

__all__ = (
    "APP_GIVEN",
    "HelpFormatter",
    "UsageError",
    "add_broker_options",
    "broker_connection",
    "positive_float",
    "positive_int",
    "queue_weights",
    "shown_default",
)


#: Whether the app comes from ``celery -A proj fair`` (then ``-A``/``-b`` are optional).
APP_GIVEN: ContextVar[bool] = ContextVar("celery_fair_app_given", default=False)


class UsageError(Exception):
    """A command's input is wrong: said in one line, exit status 2."""


def shown_default(action: argparse.Action) -> str | None:
    """The default of ``action`` as ``--help`` and docs/cli.md show it; None: not shown.

    Only a default that says something is shown: not None (no value), not a
    flag's False, not an empty string or list, and not when the help text
    already speaks of its default (``%(default)s`` or words of its own).
    """
    text = action.help
    if text is None or text is argparse.SUPPRESS or "default" in text:
        return None
    default = action.default
    if default is None or default is False or default in ("", [], argparse.SUPPRESS):
        return None
    if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
        return None  # a required positional is never left to its default
    return str(default)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, with each option's default after its help (:func:`shown_default`)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if shown_default(action) is None:
            return action.help
        return f"{action.help} (default: %(default)s)"


def add_broker_options(parser: argparse.ArgumentParser) -> None:
    """``-A/--app`` (the app's broker and transport options) or ``-b/--broker`` (a URL)."""
    where = parser.add_mutually_exclusive_group(required=not APP_GIVEN.get())
    where.add_argument("--app", "-A", help="the Celery app (module or module:attr): its broker")
    where.add_argument("--broker", "-b", help="a broker URL (without the app's transport options)")


def load_app(app: Any) -> Any:
    """The Celery app ``-A`` names (module or module:attr), or ``app`` itself if it is one.

    Raises :class:`UsageError` naming what could not be loaded.
    """
    from celery.app.utils import find_app

    try:
        return find_app(app)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"-A {app!r}: cannot load the Celery app: {exc}") from None


def broker_connection(args: argparse.Namespace) -> Any:
    """A Kombu connection to the broker named by :func:`add_broker_options`' options."""
    if args.broker:
        from kombu.connection import Connection

        return Connection(args.broker)  # type: ignore[no-untyped-call]
    return load_app(args.app).connection_for_write()


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = as_positive_int(text, text=True)
    if value is None:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 1, not {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a positive, finite number."""
    value = as_positive(text, text=True)
    if value is None:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return value


def queue_weights(text: str) -> dict[str, float]:
    """An argparse type: ``t0=10,t1=10,t2`` (a bare name weighs 1), as the settings read it."""
    try:
        pairs = parse_pairs(text, setting="queues", bare="1")
        weights = {name: as_positive(weight, text=True) for name, weight in pairs.items()}
    except FairConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    bad = {name: pairs[name] for name, weight in weights.items() if weight is None}
    if bad:
        name, value = next(iter(bad.items()))
        raise argparse.ArgumentTypeError(
            f"weight of queue {name!r} must be a positive number, not {value!r}"
        )
    found = {name: float(weight) for name, weight in weights.items() if weight is not None}
    if not math.isfinite(sum(found.values())):
        raise argparse.ArgumentTypeError(f"weights too large to add up: {text!r}")
    return found
