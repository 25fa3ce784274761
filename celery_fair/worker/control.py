"""Remote control: ``celery inspect fair_stats`` and ``celery control fair_weights``.

Importing this module registers both commands with Celery's control panel,
in the worker and in the ``celery`` command that sends them.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from celery.worker.control import control_command, inspect_command

from ..errors import FairConfigError
from ..grammar import boolean, parse_pairs
from ..keys.limits import CONCURRENCY, RATE, KeyLimits, limit_field, parse_concurrency, parse_rates
from .options import BY_NAME
from .settings import parse_weights

__all__ = (
    "fair_key_limits",
    "fair_key_pause",
    "fair_key_resume",
    "fair_key_weights",
    "fair_stats",
    "fair_weights",
)

NOT_INSTALLED = "celery-fair is not installed on this worker (call celery_fair.install(app))"


def _service(state: Any) -> Any:
    return getattr(getattr(state.consumer, "controller", None), "fair", None)


@inspect_command()
def fair_stats(state: Any, **kwargs: Any) -> dict[str, Any]:
    """Weights, deficits, held messages, credits and served cost per queue."""
    service = _service(state)
    if service is None:
        return {"error": NOT_INSTALLED}
    stats = service.statistics()
    # Seconds left of each live weight that lapses (kept ones are not listed).
    stats["live_weights_expire_in"] = service.live_weights.expires_in()
    # Read from the broker: what waits in each consumed queue's schedule (fair_eta).
    try:
        stats["scheduled"] = service.keys.scheduled()
    except Exception as exc:  # a broker error must not fail the whole reply
        stats["scheduled"] = {"error": repr(exc)}
    if stats.get("keys") is not None:
        # Read from the broker: what waits in each keyed queue, and who is next.
        try:
            stats["keys"]["backlog"] = {
                queue: asdict(backlog) for queue, backlog in service.keys.backlogs().items()
            }
        except Exception as exc:  # a broker error must not fail the whole reply
            stats["keys"]["backlog"] = {"error": repr(exc)}
        try:
            stats["keys"]["limits_state"] = {
                queue: asdict(state) for queue, state in service.keys.limits_state().items()
            }
        except Exception as exc:
            stats["keys"]["limits_state"] = {"error": repr(exc)}
        try:
            stats["keys"]["controls"] = {
                queue: asdict(controls) for queue, controls in service.keys.controls().items()
            }
        except Exception as exc:
            stats["keys"]["controls"] = {"error": repr(exc)}
        stats["keys"]["max_backlog"] = dict(service.settings.key_max_backlog)
    elif service.keys.pause_log is not None:
        # Keyed queues on RabbitMQ: the paused keys, from the pause log.
        stats["keys"] = {
            "controls": {queue: asdict(c) for queue, c in service.keys.controls().items()}
        }
        if service.backlog is not None:
            # The producers' caps, as this worker met them (fair_key_max_backlog).
            stats["keys"]["backlog_counters"] = service.backlog.counter.stats()
    return stats


@control_command(
    variadic="weights",
    signature="QUEUE=WEIGHT|QUEUE=default [QUEUE=WEIGHT ...] [ttl=SECONDS|keep] | clear",
)
def fair_weights(state: Any, weights: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Change queue weights at run time, for a while; invalid input changes nothing.

    They lapse after ``fair_live_weights_ttl`` seconds (``ttl=SECONDS`` for
    this command; ``keep``, or ``ttl=0``: until cleared), and the worker goes
    back to its settings.  On Redis they are also stored on the broker, so a
    worker that starts later uses them (over its settings) until they lapse;
    ``QUEUE=default`` goes back to the configured weight, and ``clear`` (or
    ``default``) alone clears every live weight.
    """
    service = _service(state)
    if service is None:
        return {"error": NOT_INSTALLED}
    words = list(weights) if isinstance(weights, (list, tuple)) else str(weights or "").split()
    if [str(w) for w in words] in (["default"], ["clear"]):
        service.live_weights.clear()
        return {"ok": f"live weights cleared; weights now {service.scheduler.weights}"}
    try:
        ttl, words = _live_ttl(words)
        reset, rest = _split_defaults(words, "fair_weights", "QUEUE=WEIGHT")
        parsed = parse_weights(rest, setting="fair_weights")
        if not parsed and not reset:
            raise FairConfigError(f"fair_weights: no QUEUE=WEIGHT given, got {weights!r}")
    except FairConfigError as exc:
        return {"error": str(exc)}
    service.live_weights.set(parsed, reset=reset, ttl=ttl)
    if ttl is None:
        ttl = service.settings.live_weights_ttl
    said = f"weights now {service.scheduler.weights}"
    if parsed:
        said += (
            "; live weights kept until cleared ('fair_weights clear')"
            if ttl == 0
            else f"; they lapse in {ttl:g} s (keep: until cleared)"
        )
    reply = {"ok": said}
    elsewhere = sorted(q for q in parsed if q not in service.scheduler.queues)
    if elsewhere:
        reply["warning"] = (
            f"this worker does not consume {', '.join(elsewhere)}: stored on the broker "
            "(Redis) for workers that do, and for those that start later; "
            "'fair_weights QUEUE=default' removes it"
        )
    return reply


def _live_ttl(words: list[Any]) -> tuple[float | None, list[str]]:
    """``["a=2", "ttl=60"]`` -> (60.0, ``["a=2"]``); ``keep`` (``keep=true``) -> 0.0.

    None: no ``ttl``/``keep`` given (the worker's ``fair_live_weights_ttl``).
    ``ttl`` and ``keep`` are words of the command, not queue names.
    """
    ttl: float | None = None
    rest: list[str] = []
    for word in words:
        for token in str(word).split(","):
            token = token.strip()
            name, _, value = token.partition("=")
            name = name.strip().lower()
            if token.lower() == "keep" or name == "keep":
                keep = True if token.lower() == "keep" else boolean("fair_weights keep")(value)
                if keep:
                    ttl = 0.0
                elif ttl == 0.0:
                    ttl = None
            elif name == "ttl":
                read = BY_NAME["fair_live_weights_ttl"].read
                assert read is not None
                try:
                    ttl = read(value.strip())
                except FairConfigError:
                    raise FairConfigError(
                        f"fair_weights: ttl must be a number of seconds >= 0 (0: keep until "
                        f"cleared), got {value!r}"
                    ) from None
            elif token:
                rest.append(token)
    return ttl, rest


def _split_defaults(value: Any, setting: str, what: str) -> tuple[list[str], dict[str, Any]]:
    """``"a=2,b=default"`` (or its words) -> (``["b"]``, ``{"a": "2"}``)."""
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    pairs = parse_pairs(str(value or ""), setting=setting, what=what)
    reset = [name for name, item in pairs.items() if item == "default"]
    return reset, {name: item for name, item in pairs.items() if item != "default"}


@control_command(variadic="weights", signature="KEY=WEIGHT|KEY=default [KEY=WEIGHT ...]")
def fair_key_weights(state: Any, weights: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Change key weights of the keyed queues: every worker uses them at once.

    On Redis they are stored on the broker (workers started later use them too);
    on RabbitMQ they are events of the control log, which every worker reads.
    ``KEY=default`` removes a live weight (the configured one applies again).
    Invalid input changes nothing.
    """
    service = _service(state)
    if service is None:
        return {"error": NOT_INSTALLED}
    try:
        reset, rest = _split_defaults(weights, "fair_key_weights", "KEY=WEIGHT")
        parsed: dict[str, float | None] = dict(
            parse_weights(rest, setting="fair_key_weights", what="KEY=WEIGHT")
        )
        parsed.update(dict.fromkeys(reset))
        if not parsed:
            raise FairConfigError(f"fair_key_weights: no KEY=WEIGHT given, got {weights!r}")
        where = service.set_key_weights(parsed)
    except FairConfigError as exc:
        return {"error": str(exc)}
    return {"ok": f"key weights set {parsed} {where}"}


_LIMIT_KINDS = {"concurrency": CONCURRENCY, "rate": RATE}


@control_command(
    variadic="limits", signature="concurrency|rate KEY=LIMIT|KEY=default [KEY=LIMIT ...]"
)
def fair_key_limits(state: Any, limits: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Change per-key limits of the keyed queues, on the broker (every worker, at once;
    on RabbitMQ through the control log).

    ``concurrency gold=8 *=2`` or ``rate free=5/s``; ``KEY=default`` removes
    a live limit (the configured one applies again).  Invalid input changes
    nothing.
    """
    service = _service(state)
    if service is None:
        return {"error": NOT_INSTALLED}
    words = list(limits) if isinstance(limits, (list, tuple)) else str(limits or "").split()
    kind = _LIMIT_KINDS.get(words[0]) if words else None
    if kind is None:
        return {"error": f"fair_key_limits: start with 'concurrency' or 'rate', got {limits!r}"}
    setting = f"fair_key_limits {words[0]}"
    try:
        reset, rest = _split_defaults(words[1:], setting, "KEY=LIMIT")
        if kind == CONCURRENCY:
            parsed = KeyLimits(concurrency=parse_concurrency(rest, setting=setting))
            shown = {k: str(v) for k, v in parsed.concurrency.items()}
        else:
            parsed = KeyLimits(rates=parse_rates(rest, setting=setting))
            shown = {k: f"{v:g}/s" for k, v in parsed.rates.items()}
        fields: dict[str, str | None] = {limit_field(kind, k): None for k in reset}
        fields.update(parsed.as_fields())
        if not fields:
            raise FairConfigError(f"fair_key_limits: no KEY=LIMIT given, got {limits!r}")
        service.set_key_limits(fields)
    except FairConfigError as exc:
        return {"error": str(exc)}
    said = [f"{words[0]} limits set: " + ", ".join(f"{k}={v}" for k, v in shown.items())]
    if reset:
        said.append("back to the configured limit: " + ", ".join(reset))
    return {"ok": "; ".join(said if shown else said[1:])}


def _pause_arguments(setting: str, value: Any) -> tuple[list[str], str | None]:
    """``KEY [KEY ...] [queue=QUEUE]`` (or ``--queue QUEUE`` after ``--``) -> keys, queue."""
    words = list(value) if isinstance(value, (list, tuple)) else str(value or "").split()
    keys: list[str] = []
    queue: str | None = None
    i = 0
    while i < len(words):
        word = str(words[i])
        if word in ("--queue", "-Q"):
            if i + 1 >= len(words):
                raise FairConfigError(f"{setting}: {word} needs a queue name")
            queue, i = str(words[i + 1]), i + 2
            continue
        for prefix in ("queue=", "--queue="):
            if word.startswith(prefix):
                queue = word[len(prefix) :]
                break
        else:
            keys.append(word)
        i += 1
    if not keys:
        raise FairConfigError(f"{setting}: no key given, got {value!r}")
    if queue == "":
        raise FairConfigError(f"{setting}: empty queue name in {value!r}")
    return keys, queue


def _pause(state: Any, value: Any, paused: bool) -> dict[str, Any]:
    setting = "fair_key_pause" if paused else "fair_key_resume"
    service = _service(state)
    if service is None:
        return {"error": NOT_INSTALLED}
    try:
        keys, queue = _pause_arguments(setting, value)
        changed = service.pause_keys(keys, queue, paused)
    except FairConfigError as exc:
        return {"error": str(exc)}
    done = "paused" if paused else "resumed"
    where = ", ".join(f"{q} ({n} changed)" for q, n in changed.items())
    return {"ok": f"{done} {', '.join(keys)} in {where}"}


@control_command(variadic="keys", signature="KEY [KEY ...] [queue=QUEUE]")
def fair_key_pause(state: Any, keys: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Pause keys of the keyed queues (all, or ``queue=QUEUE``), on the broker.

    A paused key's messages stay where they are and nothing of it is fetched
    by any worker, present or started later, until ``fair_key_resume``; its
    running tasks finish.
    """
    return _pause(state, keys, True)


@control_command(variadic="keys", signature="KEY [KEY ...] [queue=QUEUE]")
def fair_key_resume(state: Any, keys: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Resume paused keys: they go back in line where they were."""
    return _pause(state, keys, False)
