"""Remote control: ``celery inspect fair_stats`` and ``celery control fair_weights``.

Importing this module registers both commands with Celery's control panel,
in the worker and in the ``celery`` command that sends them.
"""

from __future__ import annotations

from typing import Any

from celery.worker.control import control_command, inspect_command

from .settings import FairConfigError, parse_weights

__all__ = ("fair_stats", "fair_weights")

NOT_INSTALLED = "celery-fair is not installed on this worker (call celery_fair.install(app))"


def _service(state: Any) -> Any:
    return getattr(getattr(state.consumer, "controller", None), "fair", None)


@inspect_command()
def fair_stats(state: Any, **kwargs: Any) -> dict[str, Any]:
    """Weights, deficits, held messages, credits and served cost per queue."""
    service = _service(state)
    if service is None:
        return {"error": NOT_INSTALLED}
    return service.statistics()


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
