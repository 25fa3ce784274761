"""How a bootstep reports a bad setting or a missing capability: one line, exit 1."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click

from ...errors import FairConfigError

__all__ = ("StartError", "one_line_errors")


class StartError(FairConfigError, click.ClickException):
    """A :class:`~celery_fair.errors.FairConfigError` as Celery's command line reports it.

    ``celery worker`` prints a ``click.ClickException`` as one ``Error: ...``
    line and exits with status 1, instead of a traceback.
    """

    def __init__(self, message: str) -> None:
        FairConfigError.__init__(self, message)
        click.ClickException.__init__(self, message)

    def __str__(self) -> str:
        return self.message


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Report a bad setting or a missing capability found at worker start in one line."""
    try:
        yield
    except StartError:
        raise
    except FairConfigError as exc:
        raise StartError(str(exc)) from None
