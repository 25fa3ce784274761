"""Where a task's routing key comes from: a keyword argument, a position, a header, a property."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

__all__ = (
    "ArgKey",
    "CallableKey",
    "HeaderKey",
    "KeySource",
    "KeySpec",
    "KwargKey",
    "PropertyKey",
    "key_of",
    "parse_key_spec",
)

#: Message properties a key may be read from: the ones RabbitMQ's exchange can hash on,
#: and which a Celery caller can set through ``apply_async(message_id=...)``.
HASHABLE_PROPERTIES = ("message_id", "correlation_id")

KeyFunction = Callable[[str, Sequence[Any], Mapping[str, Any], Mapping[str, Any]], Any]
KeySpec = str | int | KeyFunction


class KeySource(Protocol):
    """Reads a key out of one ``apply_async`` call; ``None`` means the key is missing."""

    def extract(
        self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any]
    ) -> Any: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class KwargKey:
    """The value of keyword argument ``name``."""

    name: str

    def extract(
        self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any]
    ) -> Any:
        return kwargs.get(self.name) if kwargs else None

    def describe(self) -> str:
        return f"keyword argument {self.name!r}"


def key_of(
    source: KeySource,
    name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    options: Mapping[str, Any],
    task: Any = None,
) -> Any:
    """The key of one task call, as its task will see it.

    ``source``'s value; for a keyword argument the caller passed by position
    (``job.delay("acme")`` with ``def job(tenant_id)``), or left to its
    default, the value is found through the signature of ``task`` (the
    registered task object, which the producer's app knows).  ``None`` when
    the key is missing.
    """
    value = source.extract(name, args, kwargs, options)
    if value is not None or task is None or not isinstance(source, KwargKey):
        return value
    if kwargs and source.name in kwargs:
        return None  # passed, as None
    run = getattr(task, "run", None)
    found = _parameter(getattr(run, "__func__", run), source.name, hasattr(run, "__self__"))
    if found is None:
        return None
    index, default = found
    if index is not None and args and len(args) > index:
        return args[index]
    return default


_EMPTY = inspect.Parameter.empty


@lru_cache(maxsize=4096)
def _parameter(function: Any, name: str, bound: bool) -> tuple[int | None, Any] | None:
    """Parameter ``name`` of a task's ``run``: its position (None if keyword-only) and default.

    ``bound``: ``run`` is a method (a class-based or ``bind=True`` task), so
    its first parameter is not passed by the caller.
    """
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    if bound:
        parameters = parameters[1:]
    for index, parameter in enumerate(parameters):
        if parameter.name != name:
            continue
        default = None if parameter.default is _EMPTY else parameter.default
        positional = parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
        return (index if positional else None), default
    return None


@dataclass(frozen=True)
class ArgKey:
    """The positional argument at ``index``."""

    index: int

    def extract(
        self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any]
    ) -> Any:
        return args[self.index] if args and len(args) > self.index else None

    def describe(self) -> str:
        return f"positional argument {self.index}"


@dataclass(frozen=True)
class HeaderKey:
    """Message header ``name``, as passed to ``apply_async(headers={...})``."""

    name: str

    def extract(
        self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any]
    ) -> Any:
        headers = options.get("headers")
        return headers.get(self.name) if isinstance(headers, Mapping) else None

    def describe(self) -> str:
        return f"message header {self.name!r}"


@dataclass(frozen=True)
class PropertyKey:
    """Message property ``name`` (``message_id`` or ``correlation_id``).

    Celery fills ``correlation_id`` with the task id only after routing, so the
    router sees a property only when the caller passes it to ``apply_async``.
    """

    name: str

    def extract(
        self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any]
    ) -> Any:
        return options.get(self.name)

    def describe(self) -> str:
        return f"message property {self.name!r}"


@dataclass(frozen=True)
class CallableKey:
    """Whatever ``function(name, args, kwargs, options)`` returns."""

    function: KeyFunction

    def extract(
        self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any]
    ) -> Any:
        return self.function(name, args or (), kwargs or {}, options)

    def describe(self) -> str:
        label = getattr(self.function, "__qualname__", None) or repr(self.function)
        return f"key function {label}"


def parse_key_spec(spec: KeySpec | KeySource) -> KeySource:
    """Turn the router's ``key=`` argument into a ``KeySource``.

    ``"tenant_id"`` or ``"kwarg:tenant_id"``: a keyword argument; ``0`` or
    ``"arg:0"``: a positional argument; ``"header:x-tenant"``: a message
    header; ``"property:message_id"``: a message property; a callable
    ``f(name, args, kwargs, options)``; or a ready ``KeySource``.
    """
    if isinstance(spec, (KwargKey, ArgKey, HeaderKey, PropertyKey, CallableKey)):
        return spec
    if isinstance(spec, bool):
        raise TypeError(f"key={spec!r}: expected a name, an index or a callable")
    if isinstance(spec, int):
        return _arg(spec, spec)
    if isinstance(spec, str):
        return _parse_text(spec)
    if callable(spec):
        return CallableKey(spec)
    raise TypeError(f"key={spec!r}: expected a name, an index or a callable")


def _arg(index: object, spec: object) -> ArgKey:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"key={spec!r}: a positional index must be an integer >= 0")
    return ArgKey(index)


def _parse_text(spec: str) -> KeySource:
    kind, sep, rest = spec.partition(":")
    if not sep:
        kind, rest = "kwarg", spec
    if not rest:
        raise ValueError(f"key={spec!r}: the name after {kind!r} is empty")
    if kind == "kwarg":
        if not rest.isidentifier():
            raise ValueError(f"key={spec!r}: {rest!r} is not a keyword argument name")
        return KwargKey(rest)
    if kind == "arg":
        if not rest.isdigit():
            raise ValueError(f"key={spec!r}: a positional index must be an integer >= 0")
        return _arg(int(rest), spec)
    if kind == "header":
        return HeaderKey(rest)
    if kind == "property":
        if rest not in HASHABLE_PROPERTIES:
            raise ValueError(
                f"key={spec!r}: property must be one of {', '.join(HASHABLE_PROPERTIES)}"
            )
        return PropertyKey(rest)
    raise ValueError(
        f"key={spec!r}: unknown key source {kind!r} (use kwarg:, arg:, header: or property:)"
    )
