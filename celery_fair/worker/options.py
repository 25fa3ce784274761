"""Every ``fair_*`` setting in one table: name, default, how it is read, and its line in the docs.

As Celery's own settings (``celery/app/defaults.py``, a table of ``Option``),
one row per setting is the one place of its default; the check of its value,
the warning about an unknown ``fair_*`` name, and the reference tables of
docs/configuration.md all come from :data:`OPTIONS` (a test fails when the
page and the table differ; ``python scripts/settings_reference.py`` writes
the page's tables anew).

Every value is read by the grammar's readers (:func:`~celery_fair.grammar.positive`,
:func:`~celery_fair.grammar.integer`, ...): one coercion rule, a string read
as the setting's type as an environment variable or a config file gives it.
Settings that are checked together (the CoDel pair, the metrics port and
address, the key limits and their lease, the priority mode and its weights,
the broker-memory fractions) have no ``read`` of their own: the worker's
:class:`~celery_fair.worker.settings.FairSettings` checks them as a group.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import FairConfigError
from ..grammar import as_positive, boolean, integer, one_of, parse_weights, positive
from ..scheduling.admission import DEFAULT_HARD
from ..scheduling.cost import COST_MODES

__all__ = (
    "BY_NAME",
    "DEFAULTS",
    "OPTIONS",
    "PRIORITY_MODES",
    "Option",
    "as_written",
    "parse_weights",
    "reference_page",
    "reference_rows",
    "unknown_settings",
)

#: ``fair_priority``: how a keyed queue's priority levels share the worker.
PRIORITY_MODES = ("strict", "weighted")


@dataclass(frozen=True)
class Option:
    """One ``fair_*`` setting."""

    name: str
    #: The value when the setting is absent (or None).
    default: Any
    #: The heading of docs/configuration.md under which it is listed.
    section: str
    #: What it accepts, and what it means: the page's two last columns.
    accepts: str
    meaning: str
    #: Raw value (the default when absent) -> checked value; None: checked with others.
    read: Callable[[Any], Any] | None = None
    #: The default turns the feature off (the page says so).
    off: bool = False

    def shown_default(self) -> str:
        """The default as the reference page shows it."""
        value = self.default
        shown = f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"
        return f"{shown} (off)" if self.off else shown

    def row(self) -> str:
        """The setting's row in the reference table of docs/configuration.md."""
        return f"| `{self.name}` | {self.shown_default()} | {self.accepts} | {self.meaning} |"


def _key_weights(value: Any) -> dict[str, float]:
    return parse_weights(value, setting="fair_key_weights", what="KEY=WEIGHT")


def _window(setting: str, value: Any) -> int:
    window: int = integer(setting, at_least=1)(value)
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


def _live_weights_ttl(value: Any) -> float:
    """``fair_live_weights_ttl``: seconds >= 0, finite (0: live weights never lapse)."""
    if not isinstance(value, bool) and as_positive(value, text=True) is None:
        try:
            if float(value) == 0:
                return 0.0
        except (TypeError, ValueError):
            pass
    number = as_positive(value, text=True)
    if number is None:
        raise FairConfigError(
            f"fair_live_weights_ttl must be a number of seconds >= 0 (0: never expire), "
            f"got {value!r}"
        )
    return number


def _directory(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise FairConfigError(f"fair_telemetry_dir must be a directory path, got {value!r}")
    return os.fspath(value)


def _eta_mode(value: Any) -> str:
    from ..keys.eta import parse_eta_mode

    return parse_eta_mode(value)


def _capacity(value: Any) -> dict[str, float]:
    from ..scheduling.resources import parse_capacity

    return parse_capacity(value, slots=None)


def _queue_concurrency(value: Any) -> dict[str, int]:
    from ..scheduling.resources import parse_queue_concurrency

    return parse_queue_concurrency(value)


def _fair_keys(value: Any) -> Any:
    from ..keys.publish import parse_fair_keys

    return parse_fair_keys(value)


def _max_backlog(value: Any) -> dict[str, int]:
    from ..keys.publish import parse_max_backlog

    return parse_max_backlog(value)


#: Every setting celery-fair reads, in the order of the reference page.
OPTIONS: tuple[Option, ...] = (
    Option(
        "fair_weights",
        {},
        "Weights and cost",
        accepts='mapping (or `"q=w,q=w"`) of non-empty names to finite numbers > 0',
        meaning="weight (quantum) per queue",
        read=parse_weights,
    ),
    Option(
        "fair_default_weight",
        1.0,
        "Weights and cost",
        accepts="finite number > 0",
        meaning="weight of a consumed queue missing from `fair_weights`",
        read=positive("fair_default_weight"),
    ),
    Option(
        "fair_cost",
        "count",
        "Weights and cost",
        accepts='`"count"`, `"runtime"` or `"dominant"`',
        meaning=(
            "a message costs 1, its measured run time, or its dominant share of the "
            "worker's `fair_capacity` in pool slots (both post-charged, DRR++; "
            "[resources](resources.md))"
        ),
        read=one_of("fair_cost", COST_MODES),
    ),
    Option(
        "fair_runtime_quantum",
        0.001,
        "Weights and cost",
        accepts="finite number > 0",
        meaning="runtime mode: seconds of run time per DRR visit of the heaviest queue",
        read=positive("fair_runtime_quantum"),
    ),
    Option(
        "fair_credit",
        None,
        "Weights and cost",
        accepts="`None` or integer >= 1",
        meaning=(
            "Redis: held messages before a queue is polled last; `None`: `window - "
            "concurrency`, or twice the queue's expected share of the window if larger"
        ),
        read=integer("fair_credit", at_least=1, none=True),
    ),
    Option(
        "fair_live_weights_ttl",
        3600.0,
        "Weights and cost",
        accepts="number >= 0 (`0`: never)",
        meaning=(
            "seconds a weight set with `control fair_weights` lasts before the worker goes "
            "back to `fair_weights` (logged once); `control fair_weights ... ttl=S` or "
            "`keep` overrides it for one command"
        ),
        read=_live_weights_ttl,
    ),
    Option(
        "fair_prefetch",
        None,
        "Prefetch",
        accepts='`None`, `"auto"`, an integer >= 1, or a mapping queue -> integer >= 1',
        meaning=(
            "RabbitMQ: per-queue windows (`None`: proportional to the weights, the lightest "
            "queue `max(2, ceil(window / queues))`, none above `max(4 * window, 64)`, so that"
            " a window of one task, a prefetch multiplier of 1 with one process, keeps the "
            'weights). `"auto"`: the worker\'s window sized from measured round trip and task '
            "time (Redis: in place; RabbitMQ: split by weight, applied by re-consuming)"
        ),
        read=_prefetch,
    ),
    Option(
        "fair_prefetch_max",
        None,
        "Prefetch",
        accepts="`None` or integer >= 1",
        meaning=(
            "upper bound of the adaptive window (default: Celery's "
            "`worker_prefetch_multiplier * concurrency`)"
        ),
        read=integer("fair_prefetch_max", at_least=1, none=True),
    ),
    Option(
        "fair_codel_target",
        None,
        "CoDel",
        accepts="number > 0, less than the interval; set with `fair_codel_interval`",
        meaning="how long (s) a prefetched task may wait for a pool slot",
        off=True,
    ),
    Option(
        "fair_codel_interval",
        None,
        "CoDel",
        accepts="number > 0; set with `fair_codel_target`",
        meaning="about the worst normal task duration (s)",
        off=True,
    ),
    Option(
        "fair_codel_action",
        "requeue",
        "CoDel",
        accepts='`"requeue"` or `"reject"`',
        meaning=(
            "send a stale task back, or reject it to the queue's dead-letter exchange "
            "(RabbitMQ only: refused at start on other brokers, which would drop it)"
        ),
    ),
    Option(
        "fair_codel_max_requeues",
        3,
        "CoDel",
        accepts="integer >= 0",
        meaning="after this many returns (header `fair_codel_requeues`) a task runs where it is",
    ),
    Option(
        "fair_unknown_task_delay",
        10.0,
        "Bad input",
        accepts="number > 0",
        meaning=(
            "a task name this worker does not know waits this long (s) here, then goes back "
            "to the back of its queue for a worker that knows it"
        ),
        read=positive("fair_unknown_task_delay"),
    ),
    Option(
        "fair_unknown_task_max_returns",
        30,
        "Bad input",
        accepts="integer >= 0",
        meaning=(
            "after this many returns (header `fair_unknown_returns`) the message is parked "
            "(`0`: parked at once)"
        ),
        read=integer("fair_unknown_task_max_returns", at_least=0),
    ),
    Option(
        "fair_capacity",
        {},
        "Resources",
        accepts=(
            'mapping (or `"cpu=9,mem=18"`) of resource names to finite numbers > 0; '
            "`slots` defaults to the pool's processes; `--fair-capacity`"
        ),
        meaning=(
            "what one worker can hold at once: a task starts only when its `fair_resources` "
            "fit what is free ([resources](resources.md))"
        ),
        read=_capacity,
    ),
    Option(
        "fair_queue_concurrency",
        {},
        "Resources",
        accepts='mapping (or `"video=3"`) of queue names to integers >= 1',
        meaning=(
            "at most this many of a queue's tasks at once on one worker; the rest of the "
            "worker serves the other queues"
        ),
        read=_queue_concurrency,
    ),
    Option(
        "fair_stall_after",
        10.0,
        "Stalls",
        accepts="number > 0",
        meaning=(
            "a task that waits in the worker this long (s) while a pool process is free is a "
            "stall: logged once, counted, and the worker's count of free slots repaired"
        ),
        read=positive("fair_stall_after"),
    ),
    Option(
        "fair_atomic_fetch",
        True,
        "Fetch (Redis)",
        accepts="`True` or `False`",
        meaning=(
            "fetch with a server-side script that pops the message and writes its "
            "unacknowledged record in one atomic step (`False`: Kombu's `BRPOP`, then the "
            "record from the client)"
        ),
        read=boolean("fair_atomic_fetch"),
    ),
    Option(
        "fair_eta",
        "worker",
        "Fetch (Redis)",
        accepts=(
            '`"worker"` or `"broker"`; `"broker"` needs the Redis broker and '
            "`fair_atomic_fetch=True`; set it on producers too"
        ),
        meaning=(
            "where a task with a future `eta`/`countdown` (a retry's too) waits: in a worker, "
            "as Celery does, or in its queue's schedule on the broker until due, then in "
            "line, fairly and once ([scheduled tasks](scheduled.md))"
        ),
        read=_eta_mode,
    ),
    Option(
        "fair_keys",
        {},
        "Fairness keys",
        accepts=(
            "mapping of queue name -> key source (`ConsistentHashRouter`'s `key=`: "
            '`"tenant_id"`, `"arg:0"`, `"header:x-tenant"`, `"property:message_id"`, a '
            "callable), or a pair of sources for [two-level "
            "keys](fairness-keys.md#two-level-keys-fair-between-tenants-then-between-the-users-of-each)"
            ' (`("tenant_id", "user_id")`); Redis or RabbitMQ ([keys on '
            "RabbitMQ](fairness-keys.md#keys-on-rabbitmq)); on Redis not with "
            "`fair_atomic_fetch=False`"
        ),
        meaning=(
            "these queues are keyed: each key's messages wait apart and keys are served in "
            "weighted fair order ([fairness keys](fairness-keys.md)). Set it on producers "
            "too: they publish to the key's list (Redis) or lane (RabbitMQ)"
        ),
        read=_fair_keys,
    ),
    Option(
        "fair_key_weights",
        {},
        "Fairness keys",
        accepts='mapping (or `"k=w,k=w"`) of keys to finite numbers > 0',
        meaning=(
            "weight per key, in every keyed queue; on Redis written to the broker at worker "
            "start, and `control fair_key_weights KEY=W` overrides it live (`KEY=default` "
            "removes the override); on RabbitMQ each worker applies its own, and the "
            "command sets them in every worker, through the control log"
        ),
        read=_key_weights,
    ),
    Option(
        "fair_default_key_weight",
        1.0,
        "Fairness keys",
        accepts="finite number > 0",
        meaning="weight of keys without one (and of messages without a key)",
        read=positive("fair_default_key_weight"),
    ),
    Option(
        "fair_key_concurrency",
        {},
        "Fairness keys",
        accepts=(
            'mapping (or `"k=n,k=n"`) of keys (`"*"`: every other key) to integers >= 1 '
            "(at most 1,000 on RabbitMQ); needs `fair_keys`; Redis or RabbitMQ"
        ),
        meaning=(
            "tasks of one key fetched and not finished, across every worker ([per-key "
            "limits](fairness-keys.md#per-key-limits); on RabbitMQ as token messages, "
            "[limits on RabbitMQ](fairness-keys.md#limits-on-rabbitmq))"
        ),
    ),
    Option(
        "fair_key_rate_limit",
        {},
        "Fairness keys",
        accepts=(
            'mapping of keys (`"*"`) to Celery rates (`"10/s"`, `"100/m"`, `"1000/h"`) or '
            "numbers per second; needs `fair_keys`; Redis or RabbitMQ"
        ),
        meaning=(
            "tasks of one key fetched per second: on Redis a token bucket on the broker's "
            "clock, on RabbitMQ a sliding window of tokens (no burst above one second's)"
        ),
    ),
    Option(
        "fair_key_max_backlog",
        {},
        "Fairness keys",
        accepts=(
            'mapping (or `"k=n,k=n"`) of keys (`"*"`: every other key) to integers >= 1; '
            "needs `fair_keys`"
        ),
        meaning=(
            "producers: a key with this many messages waiting refuses a publish with "
            "`celery_fair.KeyBacklogFull` "
            "([caps](fairness-keys.md#a-cap-on-each-keys-backlog))"
        ),
        read=_max_backlog,
    ),
    Option(
        "fair_key_max_backlog_durable",
        False,
        "Fairness keys",
        accepts="`True` or `False`; RabbitMQ only (Redis keeps its counts with its data)",
        meaning=(
            "producers on RabbitMQ: a persistent task's place is counted by a persistent "
            "marker, so the counts outlive a broker restart as the tasks do; a capped "
            "publish then waits for the broker's disk, about half as fast "
            "([caps on RabbitMQ](fairness-keys.md#backlog-caps-on-rabbitmq))"
        ),
        read=boolean("fair_key_max_backlog_durable"),
    ),
    Option(
        "fair_broker_memory_high",
        None,
        "Fairness keys",
        accepts="fraction of `maxmemory`, above 0 and below `fair_broker_memory_hard`; Redis only",
        meaning=(
            "producers: from this share of the broker's `maxmemory` on, a publish to one of "
            "the largest backlogs (a key's, in a keyed queue; a queue's otherwise) raises "
            "`celery_fair.BrokerMemoryHigh` "
            "([admission](operations.md#admission-refuse-the-flood-before-the-broker-fills))"
        ),
        off=True,
    ),
    Option(
        "fair_broker_memory_hard",
        DEFAULT_HARD,
        "Fairness keys",
        accepts=(
            "fraction of `maxmemory`, above `fair_broker_memory_high` and at most 1; needs "
            "`fair_broker_memory_high`"
        ),
        meaning="producers: from this share on every publish is refused, before Redis refuses it",
    ),
    Option(
        "fair_key_lease_ttl",
        None,
        "Fairness keys",
        accepts="number > 0 (`None`: the Redis `visibility_timeout`, Kombu's default 3600)",
        meaning=(
            "seconds a fetched task holds its key's slot at most: when a crashed worker's "
            "slots come back"
        ),
    ),
    Option(
        "fair_priority",
        "strict",
        "Fairness keys",
        accepts='`"strict"` or `"weighted"`',
        meaning=(
            "how a keyed queue's priority levels share the worker: the first level with work "
            "first, or by weight ([priorities](priorities.md))"
        ),
        read=one_of("fair_priority", PRIORITY_MODES),
    ),
    Option(
        "fair_priority_weights",
        {},
        "Fairness keys",
        accepts=(
            'mapping of Celery priority (0-255) -> number > 0, or `"0=8,9=1"`; only with '
            '`fair_priority="weighted"`'
        ),
        meaning=(
            "each level's weight (the weight of its step, or of the first priority given in "
            "it; others 1); empty: each level half the one more urgent (on Redis the lower "
            "step, on RabbitMQ the higher)"
        ),
    ),
    Option(
        "fair_telemetry_dir",
        None,
        "Telemetry",
        accepts="a directory path",
        meaning=(
            "the worker writes one record per task to rotating Parquet files there (needs the"
            " `telemetry` extra: `pip install celery-fair[telemetry]`)"
        ),
        read=_directory,
        off=True,
    ),
    Option(
        "fair_metrics_port",
        None,
        "Prometheus metrics",
        accepts=(
            "`None` or a TCP port 0-65535 (a string of digits is accepted; `0`: any free "
            "port, logged at start)"
        ),
        meaning=(
            "the worker's main process serves Prometheus metrics on "
            "`http://ADDR:PORT/metrics` (needs the `prometheus` extra: `pip install "
            "celery-fair[prometheus]`)"
        ),
        off=True,
    ),
    Option(
        "fair_metrics_addr",
        "127.0.0.1",
        "Prometheus metrics",
        accepts='an IP address (`"0.0.0.0"` or `"::"` for every interface)',
        meaning="where the endpoint listens; loopback unless you say otherwise",
    ),
)

#: Each setting's default, by name.
DEFAULTS: dict[str, Any] = {option.name: option.default for option in OPTIONS}

#: Each setting's row, by name.
BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}


def reference_rows(section: str) -> list[str]:
    """The rows of the reference table of ``section`` in docs/configuration.md."""
    return [option.row() for option in OPTIONS if option.section == section]


def reference_page(text: str) -> str:
    """docs/configuration.md (``text``) with each section's settings table made from the table.

    A section's rows are the ones of the first table after its heading;
    every other line is kept.  Raises ValueError for a section the page
    lacks.
    """
    lines = text.split("\n")
    for section in dict.fromkeys(option.section for option in OPTIONS):
        try:
            at = lines.index(f"## {section}")
        except ValueError:
            raise ValueError(f"docs/configuration.md has no section '## {section}'") from None
        while not lines[at].startswith("| setting |"):
            at += 1
        start = end = at + 2  # past the header and its |---| line
        while end < len(lines) and lines[end].startswith("| `"):
            end += 1
        lines[start:end] = reference_rows(section)
    return "\n".join(lines)


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


def as_written(message: str, conf: Mapping[str, Any]) -> str:
    """``message`` with each setting's name as the app's configuration spells it.

    A Django project configured with ``namespace="CELERY"`` writes
    ``CELERY_FAIR_CREDIT``; Celery reads it as ``fair_credit``, and an error
    naming ``fair_credit`` would send its reader looking for a name that is in
    no file of theirs.
    """
    import re

    written: dict[str, str] = {}
    for key in list(conf.keys()):
        if not isinstance(key, str):
            continue
        lowered = key.lower()
        bare = lowered[len("celery_") :] if lowered.startswith("celery_fair_") else lowered
        if bare in DEFAULTS and key != bare:
            written[bare] = key
    if not written:
        return message
    return re.sub(r"\bfair_[a-z_]+\b", lambda m: written.get(m.group(0), m.group(0)), message)
