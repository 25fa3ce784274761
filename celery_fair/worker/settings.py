"""The ``fair_*`` settings: parsed and validated once, when the worker starts.

Each setting's default and its own check are in the table of
:mod:`celery_fair.worker.options`; here they are read together, and the
settings that depend on one another are checked as a group.  Every error
names the setting (or the command-line option) and the value.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import FairConfigError
from ..grammar import as_int, positive
from ..keys.limits import KeyLimits
from ..scheduling.admission import AdmissionLimits, parse_admission
from ..scheduling.codel import CoDelAction
from ..scheduling.cost import CostMode
from ..scheduling.resources import parse_capacity
from ..scheduling.shedding import CoDelOptions, check_codel
from .options import BY_NAME, DEFAULTS, as_written, parse_weights, unknown_settings

__all__ = (
    "DEFAULTS",
    "FairSettings",
    "parse_weights",
    "read_setting",
    "unknown_settings",
)


def _value(conf: Mapping[str, Any], name: str) -> Any:
    """The setting's value in ``conf``, or its default when absent or None."""
    value = conf.get(name)
    return DEFAULTS[name] if value is None else value


def read_setting(conf: Mapping[str, Any], name: str) -> Any:
    """The setting ``name`` of ``conf`` (its default when absent), checked by its row of the table.

    The one reader of a single setting: the worker reads each through it, and
    so do the commands that take their defaults from the app (``capture``).
    """
    read = BY_NAME[name].read
    assert read is not None, name
    return read(_value(conf, name))


def _priority(conf: Mapping[str, Any]) -> dict[int, float] | None:
    """``fair_priority`` and ``fair_priority_weights``, checked.

    None: strict priority (the first non-empty level is served); else the
    weights by Celery priority (empty: each level half the one before it).
    """
    mode = read_setting(conf, "fair_priority")
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


def _key_limits(conf: Mapping[str, Any]) -> KeyLimits:
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
        concurrency=parse_concurrency(_value(conf, "fair_key_concurrency")),
        rates=parse_rates(_value(conf, "fair_key_rate_limit")),
        lease_ttl=positive(setting)(ttl),
    )


def _codel(conf: Mapping[str, Any]) -> dict[str, Any]:
    """The ``fair_codel_*`` settings, checked by the one CoDel validator."""
    action = _value(conf, "fair_codel_action")
    max_requeues = _value(conf, "fair_codel_max_requeues")
    if isinstance(max_requeues, str):  # the one coercion rule: strings are read
        number = as_int(max_requeues, text=True)
        max_requeues = max_requeues if number is None else number
    times = [conf.get("fair_codel_target"), conf.get("fair_codel_interval")]
    for i, value in enumerate(times):
        if isinstance(value, str):
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
    port, addr = conf.get("fair_metrics_port"), _value(conf, "fair_metrics_addr")
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
    default_weight: float = DEFAULTS["fair_default_weight"]
    #: Seconds a weight set live (``control fair_weights``) lasts; 0: until cleared.
    live_weights_ttl: float = DEFAULTS["fair_live_weights_ttl"]
    cost: CostMode = DEFAULTS["fair_cost"]
    runtime_quantum: float = DEFAULTS["fair_runtime_quantum"]
    credit: int | None = None
    prefetch: int | Mapping[str, int] | str | None = None
    prefetch_max: int | None = None
    telemetry_dir: str | None = None
    codel_target: float | None = None
    codel_interval: float | None = None
    codel_action: CoDelAction = DEFAULTS["fair_codel_action"]
    codel_max_requeues: int = DEFAULTS["fair_codel_max_requeues"]
    atomic_fetch: bool = DEFAULTS["fair_atomic_fetch"]
    #: Where a task with a future eta waits: "worker" (Celery's) or "broker" (Redis).
    eta: str = DEFAULTS["fair_eta"]
    metrics_port: int | None = None
    metrics_addr: str = DEFAULTS["fair_metrics_addr"]
    #: Keyed queues: queue -> where a message's key is (:mod:`celery_fair.keys`).
    keys: Mapping[str, Any] = field(default_factory=dict)
    key_weights: Mapping[str, float] = field(default_factory=dict)
    default_key_weight: float = DEFAULTS["fair_default_key_weight"]
    #: Per-key concurrency and rate limits of the keyed queues.
    key_limits: KeyLimits = field(default_factory=KeyLimits)
    #: Backlog caps per key (``"*"``: every other key), applied by producers.
    key_max_backlog: Mapping[str, int] = field(default_factory=dict)
    #: Keyed queues' priority levels: None, served strictly in order
    #: (``fair_priority="strict"``); else weights by Celery priority ("weighted").
    priority_weights: Mapping[int, float] | None = None
    #: An unknown task waits this long (s) before it is sent back to its queue.
    unknown_task_delay: float = DEFAULTS["fair_unknown_task_delay"]
    #: ... and is parked after this many returns (0: parked at once).
    unknown_task_max_returns: int = DEFAULTS["fair_unknown_task_max_returns"]
    #: A task waiting this long (s) while a pool process is free is a stall.
    stall_after: float = DEFAULTS["fair_stall_after"]
    #: Producers: admission before the broker fills (``fair_broker_memory_*``); None: off.
    admission: AdmissionLimits | None = None
    #: What one worker can hold (``fair_capacity``); ``slots`` added at start.
    capacity: Mapping[str, float] = field(default_factory=dict)
    #: At most this many tasks of a queue at once on one worker.
    queue_concurrency: Mapping[str, int] = field(default_factory=dict)

    @property
    def resources(self) -> bool:
        """Whether tasks start by what they hold (a capacity, queue limits or DRF cost)."""
        return bool(self.capacity or self.queue_concurrency) or self.cost == "dominant"

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
    def from_conf(
        cls,
        conf: Mapping[str, Any],
        *,
        cli_weights: str | None = None,
        cli_capacity: str | None = None,
    ) -> FairSettings:
        """Read and check the ``fair_*`` settings of a Celery config.

        ``cli_weights`` (the worker's ``--fair-weights``) replaces
        ``fair_weights`` when given.  An error names each setting as the
        configuration spells it (``CELERY_FAIR_CREDIT`` with Django's namespace).
        """
        try:
            return cls._from_conf(conf, cli_weights, cli_capacity)
        except FairConfigError as exc:
            message = as_written(str(exc), conf)
            if message == str(exc):
                raise
            raise type(exc)(message) from None

    @classmethod
    def _from_conf(
        cls, conf: Mapping[str, Any], cli_weights: str | None, cli_capacity: str | None
    ) -> FairSettings:

        read = {name: read_setting(conf, name) for name, option in BY_NAME.items() if option.read}
        if cli_weights is not None:
            read["fair_weights"] = parse_weights(cli_weights, setting="--fair-weights")
        if cli_capacity is not None:
            read["fair_capacity"] = parse_capacity(
                cli_capacity, slots=None, setting="--fair-capacity"
            )
        prefetch = read["fair_prefetch"]
        if prefetch is not None and conf.get("worker_disable_prefetch"):
            # Celery >= 5.6 (Redis): the worker fetches only for a free slot,
            # so there is no window left to size.
            raise FairConfigError(
                f"fair_prefetch={prefetch!r} cannot work with worker_disable_prefetch=True "
                "(the worker then fetches one task per free pool slot and has no prefetch "
                "window); unset one of them"
            )
        keys, atomic = read["fair_keys"], read["fair_atomic_fetch"]
        if keys and not atomic:
            raise FairConfigError(
                f"fair_keys={dict(conf.get('fair_keys') or {})!r} needs fair_atomic_fetch=True "
                "(keyed queues are served by the atomic fetch script)"
            )
        if read["fair_eta"] == "broker" and not atomic:
            raise FairConfigError(
                "fair_eta='broker' needs fair_atomic_fetch=True (scheduled messages come "
                "due in the atomic fetch script)"
            )
        limits = _key_limits(conf)
        if limits and not keys:
            raise FairConfigError(
                "fair_key_concurrency / fair_key_rate_limit apply to keyed queues: set fair_keys "
                f"too (got concurrency {dict(limits.concurrency)!r}, rates "
                f"{dict(limits.rates)!r})"
            )
        caps = read["fair_key_max_backlog"]
        if caps and not keys:
            raise FairConfigError(
                f"fair_key_max_backlog={caps!r} applies to keyed queues: set fair_keys too"
            )
        return cls(
            weights=read["fair_weights"],
            default_weight=read["fair_default_weight"],
            live_weights_ttl=read["fair_live_weights_ttl"],
            cost=read["fair_cost"],
            runtime_quantum=read["fair_runtime_quantum"],
            credit=read["fair_credit"],
            prefetch=prefetch,
            prefetch_max=read["fair_prefetch_max"],
            telemetry_dir=read["fair_telemetry_dir"],
            **_codel(conf),
            atomic_fetch=atomic,
            eta=read["fair_eta"],
            **_metrics(conf),
            keys=dict(keys),
            key_weights=read["fair_key_weights"],
            default_key_weight=read["fair_default_key_weight"],
            key_limits=limits,
            key_max_backlog=caps,
            priority_weights=_priority(conf),
            unknown_task_delay=read["fair_unknown_task_delay"],
            unknown_task_max_returns=read["fair_unknown_task_max_returns"],
            stall_after=read["fair_stall_after"],
            admission=parse_admission(
                conf.get("fair_broker_memory_high"), conf.get("fair_broker_memory_hard")
            ),
            capacity=read["fair_capacity"],
            queue_concurrency=read["fair_queue_concurrency"],
        )
