"""Remote control: ``celery inspect fair_stats`` and ``celery control fair_weights``.

Importing this module registers both commands with Celery's control panel,
in the worker and in the ``celery`` command that sends them.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from celery.worker.control import control_command, inspect_command

from .settings import FairConfigError, parse_weights

__all__ = ("fair_key_weights", "fair_stats", "fair_weights")

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
    if stats.get("keys") is not None:
        # Read from the broker: what waits in each keyed queue, and who is next.
        try:
            stats["keys"]["backlog"] = {
                queue: asdict(backlog) for queue, backlog in service.key_backlogs().items()
            }
        except Exception as exc:  # a broker error must not fail the whole reply
            stats["keys"]["backlog"] = {"error": repr(exc)}
    return stats


@control_command(variadic="weights", signature="QUEUE=WEIGHT [QUEUE=WEIGHT ...]")
def fair_weights(state: Any, weights: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Change queue weights at run time; invalid input changes nothing."""
    service = _service(state)
    if service is None:
        return {"error": NOT_INSTALLED}
    if isinstance(weights, (list, tuple)):
        weights = ",".join(str(w) for w in weights)
    try:
        parsed = parse_weights(weights, setting="fair_weights")
        if not parsed:
            raise FairConfigError(f"fair_weights: no QUEUE=WEIGHT given, got {weights!r}")
    except FairConfigError as exc:
        return {"error": str(exc)}
    service.set_weights(parsed)
    return {"ok": f"weights now {service.scheduler.weights}"}


@control_command(variadic="weights", signature="KEY=WEIGHT|KEY=default [KEY=WEIGHT ...]")
def fair_key_weights(state: Any, weights: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Change key weights of the keyed queues, on the broker: every worker uses them at once.

    ``KEY=default`` removes a live weight (the configured one applies again).
    Invalid input changes nothing.
    """
    service = _service(state)
    if service is None:
        return {"error": NOT_INSTALLED}
    if isinstance(weights, (list, tuple)):
        weights = ",".join(str(w) for w in weights)
    text = str(weights or "")
    reset = {
        name.strip(): None
        for name, _, value in (p.partition("=") for p in text.split(","))
        if value.strip() == "default" and name.strip()
    }
    rest = ",".join(p for p in text.split(",") if p.partition("=")[2].strip() != "default")
    try:
        parsed: dict[str, float | None] = dict(parse_weights(rest, setting="fair_key_weights"))
        parsed.update(reset)
        if not parsed:
            raise FairConfigError(f"fair_key_weights: no KEY=WEIGHT given, got {weights!r}")
        service.set_key_weights(parsed)
    except FairConfigError as exc:
        return {"error": str(exc)}
    return {"ok": f"key weights set {parsed}"}
