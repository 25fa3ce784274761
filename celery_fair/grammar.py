"""The grammar of celery-fair's values: positive numbers and ``NAME=VALUE`` lists, in one place.

Settings (``fair_weights = "p0=4,p1=8"``), worker options (``--fair-weights``),
remote-control arguments (``control fair_weights p0=8``), command-line
options (``celery-fair ring --queues t0=10,t1``) and the pure core's own
checks all read values through these functions, so that each kind of value
has one meaning everywhere.  Pure: no I/O, nothing above it imported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

from .errors import FairConfigError

__all__ = (
    "as_int",
    "as_positive",
    "as_positive_int",
    "boolean",
    "integer",
    "one_of",
    "parse_pairs",
    "parse_weights",
    "positive",
)

#: Strings read as a boolean, as Celery reads its own (``celery.utils.serialization.strtobool``).
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def as_positive(value: object, *, text: bool = False) -> float | None:
    """``value`` as a positive, finite float; None if it is not one.

    ``True`` is not a number here (it is an ``int`` to Python, and a weight
    of ``True`` is a mistake).  With ``text``, a string such as ``"4"`` (from
    an environment variable or a command line) is read as a number too.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and text:
        try:
            value = float(value)
        except ValueError:
            return None
    if not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if number > 0 and math.isfinite(number) else None


def as_positive_int(value: object, *, text: bool = False) -> int | None:
    """``value`` as an integer of at least 1; None if it is not one.

    As :func:`as_positive`: ``True`` is not a number, and with ``text`` a
    string such as ``"4"`` is read too.  A float is not an integer here,
    even ``4.0`` (a window or a count of 4.5 is a mistake, not a rounding).
    """
    number = as_int(value, text=text)
    return number if number is not None and number >= 1 else None


def as_int(value: object, *, text: bool = False) -> int | None:
    """``value`` as an integer, of any sign; None if it is not one.

    ``True`` is not a number, a float is not an integer (even ``4.0``), and
    with ``text`` a string such as ``"-4"`` is read too.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and text:
        try:
            return int(value.strip())
        except ValueError:
            return None
    return value if isinstance(value, int) else None


def parse_pairs(
    value: Any, *, setting: str, what: str = "QUEUE=WEIGHT", bare: str | None = None
) -> dict[str, Any]:
    """A mapping, or ``"a=1,b=2"``, as a dict of non-empty names to raw values.

    The one parser of ``NAME=VALUE`` lists; callers check the values.  A
    name given twice is an error (which one was meant?).  ``bare``: the
    value of a name given alone (``"t0,t1=2"``); without it, a bare name is
    an error.  Errors name ``setting`` and the value.
    """
    if value is None:
        return {}
    name_of = what.split("=", 1)[0].lower()
    if isinstance(value, str):
        pairs: dict[str, Any] = {}
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, item = part.partition("=")
            name, item = name.strip(), item.strip()
            if not sep and bare is not None:
                item = bare
            elif not sep or not name or not item:
                raise FairConfigError(
                    f"{setting}: expected {what}[,{what}...], got {value!r} (bad item {part!r})"
                )
            if not name:
                raise FairConfigError(f"{setting}: empty {name_of} name in {value!r}")
            if name in pairs:
                raise FairConfigError(f"{setting}: {name_of} {name!r} appears twice in {value!r}")
            pairs[name] = item
        return pairs
    if not isinstance(value, Mapping):
        raise FairConfigError(
            f"{setting} must be a mapping of {name_of} name to "
            f"{what.split('=', 1)[1].lower()}, got {value!r}"
        )
    for name in value:
        if not isinstance(name, str) or not name:
            raise FairConfigError(
                f"{setting}: {name_of} names must be non-empty strings, got {name!r}"
            )
    return dict(value)


# The readers of settings: one coercion rule for every value.  A string is read
# as the setting's type (``"4"``, ``"0.5"``, ``"true"``), as an environment
# variable or a config file gives it; anything else is refused with the
# setting's name and the value.


def positive(setting: str, key: str | None = None) -> Callable[[Any], float]:
    """A positive, finite number (``"0.5"`` too)."""

    def read(value: Any) -> float:
        number = as_positive(value, text=True)
        if number is None:
            where = f"{setting}[{key!r}]" if key is not None else setting
            raise FairConfigError(f"{where} must be a positive number, got {value!r}")
        return number

    return read


def integer(setting: str, *, at_least: int, none: bool = False) -> Callable[[Any], Any]:
    """An integer of at least ``at_least`` (``"4"`` too; ``4.5``, ``4.0`` and ``True`` are
    mistakes, not roundings); with ``none``, None too."""

    def read(value: Any) -> int | None:
        if value is None and none:
            return None
        number = as_int(value, text=True)
        if number is None or number < at_least:
            expected = "a positive integer" if at_least == 1 else f"an integer >= {at_least}"
            raise FairConfigError(
                f"{setting} must be {expected}{' or None' if none else ''}, got {value!r}"
            )
        return number

    return read


def boolean(setting: str) -> Callable[[Any], bool]:
    """True or False; as text, ``"true"``/``"false"``, ``"yes"``/``"no"``, ``"on"``/``"off"``
    or ``"1"``/``"0"``."""

    def read(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise FairConfigError(f"{setting} must be True or False, got {value!r}")

    return read


def one_of(setting: str, choices: Collection[str]) -> Callable[[Any], Any]:
    """One of ``choices``, exactly."""

    def read(value: Any) -> Any:
        if value not in choices:
            raise FairConfigError(
                f"{setting} must be one of {', '.join(map(repr, choices))}; got {value!r}"
            )
        return value

    return read


def parse_weights(
    value: Any, *, setting: str = "fair_weights", what: str = "QUEUE=WEIGHT"
) -> dict[str, float]:
    """Parse weights from a mapping or from ``"p0=4,p1=8"``.

    >>> parse_weights("p0=4, p1=8")
    {'p0': 4.0, 'p1': 8.0}
    """
    return {
        name: positive(setting, name)(weight)
        for name, weight in parse_pairs(value, setting=setting, what=what).items()
    }
