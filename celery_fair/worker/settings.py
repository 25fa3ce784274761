"""The ``fair_*`` settings: parsed and validated once, when the worker starts.

Every error names the setting (or the command-line option) and the value.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import FairConfigError
from ..grammar import as_positive, as_positive_int, parse_pairs
from ..keys.limits import KeyLimits
from ..scheduling.admission import AdmissionLimits, parse_admission
from ..scheduling.codel import CoDelAction
from ..scheduling.cost import COST_MODES, CostMode
from ..scheduling.shedding import CoDelOptions, check_codel

__all__ = (
    "DEFAULTS",
    "FairSettings",
    "parse_weights",
    "unknown_settings",
)

#: Every setting celery-fair reads, with its default.
DEFAULTS: dict[str, Any] = {
    "fair_weights": {},
    "fair_default_weight": 1.0,
    "fair_cost": "count",
    "fair_runtime_quantum": 0.001,
    "fair_credit": None,
    "fair_prefetch": None,
    "fair_prefetch_max": None,
    "fair_telemetry_dir": None,
    "fair_codel_target": None,
    "fair_codel_interval": None,
    "fair_codel_action": "requeue",
    "fair_codel_max_requeues": 3,
    "fair_atomic_fetch": True,
    "fair_metrics_port": None,
    "fair_metrics_addr": "127.0.0.1",
    "fair_keys": {},
    "fair_key_weights": {},
    "fair_default_key_weight": 1.0,
    "fair_key_concurrency": {},
    "fair_key_rate_limit": {},
    "fair_key_lease_ttl": None,
    "fair_key_max_backlog": {},
    "fair_priority": "strict",
    "fair_priority_weights": {},
    "fair_unknown_task_delay": 10.0,
    "fair_unknown_task_max_returns": 30,
    "fair_stall_after": 10.0,
    "fair_broker_memory_high": None,
    "fair_broker_memory_hard": None,
}


def unknown_settings(conf: Mapping[str, Any]) -> list[str]:
    """One message per ``fair_*`` setting celery-fair does not know, with the closest name.

    A misspelt setting (``fair_costs``, ``CELERY_FAIR_WIEGHTS``) would be
    ignored without a word.  Django-style names (``CELERY_`` namespace,
    upper case) are checked too, and the suggestion keeps their style.
    """
    import difflib

    messages = []
    for name in list(conf.keys()):
        if not isinstance(name, str):
            continue
        lowered = name.lower()
        namespace = ""
        if lowered.startswith("celery_fair_"):
            namespace, lowered = name[: len("celery_")], lowered[len("celery_") :]
        if not lowered.startswith("fair_") or lowered in DEFAULTS:
            continue
        close = difflib.get_close_matches(lowered, DEFAULTS, n=1, cutoff=0.6)
        hint = ""
        if close:
            suggestion = close[0]
            if name.isupper():
                suggestion = suggestion.upper()
            hint = f"; did you mean {namespace}{suggestion}?"
        messages.append(f"celery-fair: unknown setting {name} (it is ignored){hint}")
    return messages


def _keys(conf: Mapping[str, Any]) -> dict[str, Any]:
    """``fair_keys``, checked."""
    from ..keys.publish import parse_fair_keys

    return dict(parse_fair_keys(conf.get("fair_keys")))


#: ``fair_priority``: how a keyed queue's priority levels share the worker.
PRIORITY_MODES = ("strict", "weighted")


def _priority(conf: Mapping[str, Any]) -> dict[int, float] | None:
    """``fair_priority`` and ``fair_priority_weights``, checked.

    None: strict priority (the first non-empty level is served); else the
    weights by Celery priority (empty: each level half the one before it).
    """
    mode = conf.get("fair_priority")
    mode = DEFAULTS["fair_priority"] if mode is None else mode
    if mode not in PRIORITY_MODES:
        raise FairConfigError(
            f"fair_priority must be one of {', '.join(map(repr, PRIORITY_MODES))}, got {mode!r}"
        )
    raw = conf.get("fair_priority_weights")
    if mode == "strict":
        if raw:
            raise FairConfigError(
                f"fair_priority_weights={raw!r} needs fair_priority='weighted' "
                "(with 'strict', the default, levels are served in order and have no weight)"
            )
        return None
    weights: dict[int, float] = {}
    setting = "fair_priority_weights"
    if isinstance(raw, Mapping):  # priorities are numbers: {0: 8, 9: 1}
        raw = {str(k) if type(k) is int else k: v for k, v in raw.items()}
    for name, weight in parse_weights(raw or {}, setting=setting, what="PRIORITY=WEIGHT").items():
        priority = int(name) if str(name).strip().isdigit() else None
        if priority is None or priority > 255:
            raise FairConfigError(
                f"{setting}: a priority must be an integer from 0 to 255 (Celery's "
                f"priority argument), got {name!r}"
            )
        weights[priority] = weight
    return weights


def _key_limits(conf: Mapping[str, Any], get: Any) -> KeyLimits:
    """``fair_key_concurrency``, ``fair_key_rate_limit`` and the lease TTL, checked.

    The lease TTL defaults to the Redis ``visibility_timeout`` (Kombu's default
    3600 s): a task of a crashed worker comes back when its slot does.
    """
    from ..keys.limits import KeyLimits, parse_concurrency, parse_rates

    ttl = conf.get("fair_key_lease_ttl")
    if ttl is None:
        options = conf.get("broker_transport_options") or {}
        ttl = options.get("visibility_timeout", 3600) if isinstance(options, Mapping) else 3600
        setting = "broker_transport_options['visibility_timeout']"
    else:
        setting = "fair_key_lease_ttl"
    return KeyLimits(
        concurrency=parse_concurrency(get("fair_key_concurrency")),
        rates=parse_rates(get("fair_key_rate_limit")),
        lease_ttl=_positive(setting, None, ttl),
    )


def _positive(setting: str, key: str | None, value: Any) -> float:
    where = f"{setting}[{key!r}]" if key is not None else setting
    number = as_positive(value, text=True)
    if number is None:
        raise FairConfigError(f"{where} must be a positive number, got {value!r}")
    return number


def parse_weights(
    value: Any, *, setting: str = "fair_weights", what: str = "QUEUE=WEIGHT"
) -> dict[str, float]:
    """Parse weights from a mapping or from ``"p0=4,p1=8"``.

    >>> parse_weights("p0=4, p1=8")
    {'p0': 4.0, 'p1': 8.0}
    """
    return {
        name: _positive(setting, name, weight)
        for name, weight in parse_pairs(value, setting=setting, what=what).items()
    }


def _window(setting: str, value: Any) -> int:
    window = as_positive_int(value)
    if window is None:
        raise FairConfigError(f"{setting} must be a positive integer, got {value!r}")
    return window


def _prefetch(value: Any) -> int | dict[str, int] | str | None:
    """``fair_prefetch``: None, ``"auto"``, one window for every queue, or per queue."""
    if value is None:
        return None
    if value == "auto":
        return "auto"
    if isinstance(value, Mapping):
        return {str(q): _window(f"fair_prefetch[{q!r}]", w) for q, w in value.items()}
    return _window("fair_prefetch", value)


def _codel(conf: Mapping[str, Any]) -> dict[str, Any]:
    """The ``fair_codel_*`` settings, checked by the one CoDel validator."""
    action = conf.get("fair_codel_action") or "requeue"
    max_requeues = conf.get("fair_codel_max_requeues")
    if max_requeues is None:
        max_requeues = 3
    times = [conf.get("fair_codel_target"), conf.get("fair_codel_interval")]
    for i, value in enumerate(times):
        if isinstance(value, str):  # from the command line or the environment
            with contextlib.suppress(ValueError):
                times[i] = float(value)
    try:
        options = check_codel(times[0], times[1], action, max_requeues, name="fair_{}".format)
    except ValueError as exc:
        raise FairConfigError(str(exc)) from None
    if options is None:
        return {"codel_action": action, "codel_max_requeues": max_requeues}
    return {
        "codel_target": options.target,
        "codel_interval": options.interval,
        "codel_action": options.action,
        "codel_max_requeues": options.max_requeues,
    }


def _metrics(conf: Mapping[str, Any]) -> dict[str, Any]:
    """``fair_metrics_port`` (None: off; 0: any free port) and ``fair_metrics_addr``."""
    port, addr = conf.get("fair_metrics_port"), conf.get("fair_metrics_addr")
    if addr is None:
        addr = DEFAULTS["fair_metrics_addr"]
    if port is not None:
        if isinstance(port, str) and port.strip().isdigit():
            port = int(port)  # from an environment variable or a config file
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise FairConfigError(
                f"fair_metrics_port must be a TCP port number 0-65535 (0: any free port) "
                f"or None, got {port!r}"
            )
    try:
        if not isinstance(addr, str):
            raise ValueError(addr)
        ipaddress.ip_address(addr)
    except ValueError:
        raise FairConfigError(
            f"fair_metrics_addr must be an IP address to listen on (e.g. '127.0.0.1'), got {addr!r}"
        ) from None
    return {"metrics_port": port, "metrics_addr": str(addr)}


@dataclass(frozen=True)
class FairSettings:
    """The validated configuration of one worker."""

    weights: Mapping[str, float] = field(default_factory=dict)
    default_weight: float = 1.0
    cost: CostMode = "count"
    runtime_quantum: float = 0.001
    credit: int | None = None
    prefetch: int | Mapping[str, int] | str | None = None
    prefetch_max: int | None = None
    telemetry_dir: str | None = None
    codel_target: float | None = None
    codel_interval: float | None = None
    codel_action: CoDelAction = "requeue"
    codel_max_requeues: int = 3
    atomic_fetch: bool = True
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    #: Keyed queues: queue -> where a message's key is (:mod:`celery_fair.keys`).
    keys: Mapping[str, Any] = field(default_factory=dict)
    key_weights: Mapping[str, float] = field(default_factory=dict)
    default_key_weight: float = 1.0
    #: Per-key concurrency and rate limits of the keyed queues.
    key_limits: KeyLimits = field(default_factory=KeyLimits)
    #: Backlog caps per key (``"*"``: every other key), applied by producers.
    key_max_backlog: Mapping[str, int] = field(default_factory=dict)
    #: Keyed queues' priority levels: None, served strictly in order
    #: (``fair_priority="strict"``); else weights by Celery priority ("weighted").
    priority_weights: Mapping[int, float] | None = None
    #: An unknown task waits this long (s) before it is sent back to its queue.
    unknown_task_delay: float = 10.0
    #: ... and is parked after this many returns (0: parked at once).
    unknown_task_max_returns: int = 30
    #: A task waiting this long (s) while a pool process is free is a stall.
    stall_after: float = 10.0
    #: Producers: admission before the broker fills (``fair_broker_memory_*``); None: off.
    admission: AdmissionLimits | None = None

    @property
    def codel(self) -> bool:
        """Whether CoDel is on (both ``fair_codel_target`` and ``_interval`` set)."""
        return self.codel_target is not None

    @property
    def codel_options(self) -> CoDelOptions | None:
        """The checked CoDel options, or None when CoDel is off."""
        if self.codel_target is None or self.codel_interval is None:
            return None
        return CoDelOptions(
            self.codel_target,
            self.codel_interval,
            self.codel_action,
            self.codel_max_requeues,
        )

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any], *, cli_weights: str | None = None) -> FairSettings:
        """Read and check the ``fair_*`` settings of a Celery config.

        ``cli_weights`` (the worker's ``--fair-weights``) replaces
        ``fair_weights`` when given.
        """

        def get(name: str) -> Any:
            value = conf.get(name)
            return DEFAULTS[name] if value is None else value

        if cli_weights is not None:
            weights = parse_weights(cli_weights, setting="--fair-weights")
        else:
            weights = parse_weights(get("fair_weights"))
        cost = get("fair_cost")
        if cost not in COST_MODES:
            raise FairConfigError(f"fair_cost must be one of {', '.join(COST_MODES)}; got {cost!r}")
        credit = conf.get("fair_credit")
        if credit is not None and as_positive_int(credit) is None:
            raise FairConfigError(f"fair_credit must be a positive integer or None, got {credit!r}")
        telemetry_dir = conf.get("fair_telemetry_dir")
        if telemetry_dir is not None and (
            not isinstance(telemetry_dir, (str, os.PathLike)) or not str(telemetry_dir)
        ):
            raise FairConfigError(
                f"fair_telemetry_dir must be a directory path, got {telemetry_dir!r}"
            )
        codel = _codel(conf)
        prefetch = _prefetch(conf.get("fair_prefetch"))
        if prefetch is not None and conf.get("worker_disable_prefetch"):
            # Celery >= 5.6 (Redis): the worker fetches only for a free slot,
            # so there is no window left to size.
            raise FairConfigError(
                f"fair_prefetch={prefetch!r} cannot work with worker_disable_prefetch=True "
                "(the worker then fetches one task per free pool slot and has no prefetch "
                "window); unset one of them"
            )
        atomic = get("fair_atomic_fetch")
        if not isinstance(atomic, bool):
            raise FairConfigError(f"fair_atomic_fetch must be True or False, got {atomic!r}")
        keys = _keys(conf)
        if keys and not atomic:
            raise FairConfigError(
                f"fair_keys={dict(conf.get('fair_keys') or {})!r} needs fair_atomic_fetch=True "
                "(keyed queues are served by the atomic fetch script)"
            )
        limits = _key_limits(conf, get)
        if limits and not keys:
            raise FairConfigError(
                "fair_key_concurrency / fair_key_rate_limit apply to keyed queues: set fair_keys "
                f"too (got concurrency {dict(limits.concurrency)!r}, rates "
                f"{dict(limits.rates)!r})"
            )
        from ..keys.publish import parse_max_backlog

        caps = parse_max_backlog(get("fair_key_max_backlog"))
        if caps and not keys:
            raise FairConfigError(
                f"fair_key_max_backlog={caps!r} applies to keyed queues on Redis: set "
                "fair_keys too (on RabbitMQ, keyed queues and their caps are refused)"
            )
        max_returns = get("fair_unknown_task_max_returns")
        if isinstance(max_returns, str) and max_returns.strip().isdigit():
            max_returns = int(max_returns)  # from an environment variable or a config file
        if isinstance(max_returns, bool) or not isinstance(max_returns, int) or max_returns < 0:
            raise FairConfigError(
                f"fair_unknown_task_max_returns must be an integer >= 0, got {max_returns!r}"
            )
        return cls(
            unknown_task_delay=_positive(
                "fair_unknown_task_delay", None, get("fair_unknown_task_delay")
            ),
            unknown_task_max_returns=max_returns,
            stall_after=_positive("fair_stall_after", None, get("fair_stall_after")),
            admission=parse_admission(
                conf.get("fair_broker_memory_high"), conf.get("fair_broker_memory_hard")
            ),
            keys=keys,
            key_limits=limits,
            key_max_backlog=caps,
            priority_weights=_priority(conf),
            key_weights=parse_weights(
                get("fair_key_weights"), setting="fair_key_weights", what="KEY=WEIGHT"
            ),
            default_key_weight=_positive(
                "fair_default_key_weight", None, get("fair_default_key_weight")
            ),
            atomic_fetch=atomic,
            **codel,
            **_metrics(conf),
            telemetry_dir=None if telemetry_dir is None else os.fspath(telemetry_dir),
            prefetch=prefetch,
            prefetch_max=(
                None
                if conf.get("fair_prefetch_max") is None
                else _window("fair_prefetch_max", conf.get("fair_prefetch_max"))
            ),
            weights=weights,
            default_weight=_positive("fair_default_weight", None, get("fair_default_weight")),
            cost=cost,
            runtime_quantum=_positive("fair_runtime_quantum", None, get("fair_runtime_quantum")),
            credit=credit,
        )
