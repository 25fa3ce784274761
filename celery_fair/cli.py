"""``celery-fair`` and ``celery fair``: one argparse parser, one module per subcommand.

A subcommand lives in its own module exposing ``register(subparsers)``, which
adds its parser and sets ``handler`` (``argparse.Namespace -> int``) with
``set_defaults``. Add the module's dotted path to ``SUBCOMMANDS``; keep heavy
imports (PySpark, Celery apps) inside the handler so that ``celery-fair ring``
does not pay for ``celery-fair report``.

Exit status: 0 done; 1 the command ran and says what is left to do; 2 bad
input (an option, an argument, an app that cannot be loaded); 3 the broker
could not be reached.  Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ._version import __version__
from .cli_options import APP_GIVEN, HelpFormatter, UsageError
from .errors import FairConfigError

__all__ = ("BAD_INPUT", "BROKER_AWAY", "SUBCOMMANDS", "build_parser", "main")

#: Exit statuses besides 0 and 1 (see the module's docstring).
BAD_INPUT, BROKER_AWAY = 2, 3

#: Modules that each define ``register(subparsers) -> None``.
SUBCOMMANDS: tuple[str, ...] = (
    "celery_fair.routing.ring_cli",
    "celery_fair.monitoring.capture_cli",
    "celery_fair.analytics.report",
    "celery_fair.parking.cli",
    "celery_fair.keys.cli",
    "celery_fair.monitoring.exporter",
    "celery_fair.checking",
)


class _Parser(argparse.ArgumentParser):
    """Refuses an abbreviated option (``--queue`` for ``--queues``) rather than guessing,
    names the option meant for a misspelt one, and shows the defaults in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """argparse's ``parse_args``; an unknown option is answered with the closest known one.

        The subcommand's parser says it (its usage, its options): the unknown
        arguments of a subcommand reach the top parser only, which does not
        know that subcommand's options.
        """
        found, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = self._chosen(found)
            chosen.error(chosen.unrecognized(extras))
        return found

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """argparse's ``parse_known_args``, keeping the arguments for :meth:`error`."""
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        """argparse's error; a missing option is reported as the misspelt one given for it.

        argparse checks the required options before it reports the unknown
        ones, so ``--queus`` (for the required ``--queues``) would be answered
        "--queues is required" without a word on the typo.
        """
        if "required" in message:
            unknown = [
                given
                for given in getattr(self, "_given", ())
                if given.startswith("--")
                and given.split("=", 1)[0] not in self._option_string_actions
            ]
            if unknown:
                message = self.unrecognized(unknown)
        super().error(message)

    def _chosen(self, namespace: argparse.Namespace) -> _Parser:
        """The (sub)parser that parsed the last subcommand named in ``namespace``."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(namespace, action.dest or "", None) or "")
                if isinstance(sub, _Parser):
                    return sub._chosen(namespace)
        return self

    def unrecognized(self, extras: Sequence[str]) -> str:
        """argparse's message for ``extras``, each misspelt option followed by the closest one."""
        import difflib

        known = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        said = []
        for extra in extras:
            name = extra.split("=", 1)[0]
            close = difflib.get_close_matches(name, known, n=1) if name.startswith("--") else []
            said.append(f"{extra} (did you mean {close[0]}?)" if close else extra)
        return "unrecognized arguments: " + " ".join(said)


def build_parser(
    subcommands: Sequence[str] = SUBCOMMANDS, prog: str = "celery-fair"
) -> argparse.ArgumentParser:
    """Build the top-level parser from the ``register`` function of each subcommand module."""
    parser = _Parser(
        prog=prog,
        description="Weighted fair queueing tools for Celery.",
        epilog="Exit status: 0 done, 1 something is left to do (said), 2 bad input, "
        "3 the broker could not be reached.",
    )
    parser.add_argument("--version", action="version", version=f"celery-fair {__version__}")
    subparsers = parser.add_subparsers(
        dest="command",
        metavar="COMMAND",
        required=True,
        parser_class=_Parser,
    )
    for module_name in subcommands:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None, app: Any = None, prog: str = "celery-fair") -> int:
    """Run ``celery-fair``; returns the process exit status.

    ``app``: the Celery app of ``celery -A proj fair`` (then ``-A`` and ``-b``
    are optional: the subcommands use its broker and settings).
    """
    token = APP_GIVEN.set(app is not None)
    try:
        parser = build_parser(prog=prog)
        args = parser.parse_args(argv)
    finally:
        APP_GIVEN.reset(token)
    if app is not None and hasattr(args, "app") and not (args.app or getattr(args, "broker", None)):
        args.app = app
    try:
        status: int = args.handler(args)
    except (UsageError, FairConfigError) as exc:
        print(f"{prog} {args.command}: {exc}", file=sys.stderr)
        return BAD_INPUT
    except ImportError as exc:  # -A naming no module, or an extra not installed
        print(f"{prog} {args.command}: {exc}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if not _broker_away(exc):
            raise
        print(f"{prog} {args.command}: cannot reach the broker: {exc}", file=sys.stderr)
        return BROKER_AWAY
    return status


def _broker_away(exc: BaseException) -> bool:
    """A connection error of Kombu, redis-py or py-amqp, or of the socket under them.

    Not any ``OSError``: a missing input file (``report``) is not the broker.
    """
    import socket

    from kombu.exceptions import OperationalError

    builtin = (OperationalError, ConnectionError, TimeoutError, socket.gaierror)
    # redis-py's and py-amqp's connection errors do not derive from the builtin ones.
    return isinstance(exc, builtin) or type(exc).__name__ in (
        "ConnectionError",
        "TimeoutError",
        "AMQPConnectionError",
    )


if __name__ == "__main__":
    sys.exit(main())
