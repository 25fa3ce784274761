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

__all__ = (
    "BAD_INPUT",
    "BROKER_AWAY",
    "EXIT_STATUSES",
    "SUBCOMMANDS",
    "build_parser",
    "main",
    "reference_page",
)

#: Exit statuses besides 0 and 1 (see the module's docstring).
BAD_INPUT, BROKER_AWAY = 2, 3

#: Each exit status and its meaning: the epilog of ``--help`` and docs/cli.md say these.
EXIT_STATUSES: tuple[tuple[int, str], ...] = (
    (0, "done"),
    (1, "something is left to do (said)"),
    (BAD_INPUT, "bad input"),
    (BROKER_AWAY, "the broker could not be reached"),
)

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
        epilog="Exit status: " + ", ".join(f"{n} {said}" for n, said in EXIT_STATUSES) + ".",
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


#: What docs/cli.md says of the exit statuses besides :data:`EXIT_STATUSES`' words.
_EXIT_DETAILS = {
    1: "the command ran; what is left is said on stderr (`keys unkey`: messages arrived "
    "while it ran; `report`: no records)",
    BAD_INPUT: "an option, an argument, a setting, a path or an app that cannot be loaded: "
    "one line on stderr, no traceback",
    BROKER_AWAY: "a connection error of the broker: one line on stderr",
}


def reference_page(prog: str = "celery fair", width: int = 88) -> str:
    """docs/cli.md: each command's usage, description, options and defaults, from its parser.

    ``scripts/cli_reference.py`` writes it; a unit test fails while the page
    and the parsers differ.  Usage lines are wrapped at ``width`` columns
    whatever the terminal (argparse otherwise follows ``$COLUMNS``).
    """
    parser = build_parser(prog=prog)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = [
        "# Command-line reference",
        "",
        "<!-- Written by scripts/cli_reference.py from the commands' parsers: edit the "
        "commands, then run it (tests/unit/test_cli_reference.py fails while they differ). -->",
        "",
        f"The tools run as `{prog} COMMAND ...` inside `celery` (`celery -A proj fair keys "
        "backlog jobs`: the app, broker and settings of Celery's `-A`/`-b`; then a command's "
        "own `--app`/`--broker` may be left out) and as `celery-fair COMMAND ...`, a program "
        "of its own, where a command that reads the broker needs `--app` or `--broker`. "
        "Every command takes `-h`/`--help`; an option's default, where it has one, is in "
        "its `--help` as here.",
        "",
        "## Exit status",
        "",
        "Every command exits with one of these:",
        "",
        "| status | meaning |",
        "|---|---|",
    ]
    lines += [f"| {n} | {_EXIT_DETAILS.get(n, said)} |" for n, said in EXIT_STATUSES]
    lines += _reference_section(parser, width)
    lines += ["", "Commands:", "", "| command | what it does |", "|---|---|"]
    lines += [
        f"| [`{a.dest}`](#{prog.replace(' ', '-')}-{a.dest}) | {_cell(a.help)} |"
        for a in commands._choices_actions
    ]
    for sub in commands.choices.values():
        lines += _reference_section(sub, width)
    return "\n".join(lines) + "\n"


def _reference_section(parser: argparse.ArgumentParser, width: int) -> list[str]:
    """One command's heading, description, usage and table of options."""
    import functools

    from .cli_options import shown_default

    parser.formatter_class = functools.partial(HelpFormatter, width=width)
    lines = ["", f"## {parser.prog}", ""]
    if parser.description:
        lines += [parser.description, ""]
    lines += ["```text", parser.format_usage().strip(), "```"]
    rows = []
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        invocation = formatter._format_action_invocation(action)
        default = shown_default(action)
        rows.append(
            f"| `{_cell(invocation)}` | {'' if default is None else f'`{_cell(default)}`'} "
            f"| {_cell(_expanded_help(parser, action))} |"
        )
    if rows:
        lines += ["", "| option | default | meaning |", "|---|---|---|", *rows]
    return lines


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help of ``action`` with its ``%(...)s`` filled in, as argparse fills them."""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = parser.prog
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    text = action.help or ""
    return text % params if "%(" in text else text


def _cell(text: str | None) -> str:
    """``text`` in a Markdown table cell: its pipes escaped, on one line."""
    return " ".join((text or "").split()).replace("|", "\\|")


if __name__ == "__main__":
    sys.exit(main())
