"""The Redis scripts of celery-fair, read from their ``.lua`` files, and their one loader.

The scripts live in :mod:`celery_fair.lua` as Lua files, each with its KEYS,
ARGV and reply documented at its top.  A script is sent as one text: a header
this module writes (the locals ``SEP`` and ``DFLT``), the shared helpers it
needs (``prelude.lua``, ``unacked.lua``, ``keyed_pop.lua``,
``enqueue_one.lua``, ``promote.lua``), then its own file.  The Lua names the
Redis names and constants of :mod:`celery_fair.keys.layout` ``N.<NAME>``;
each is replaced by its literal value as the text is built.  Names come from
one place, and the Lua stays Lua.

Why literals rather than a table ``N`` in the header: Redis runs a script's
whole text at every call (the compiled chunk is cached, not its results), so
a table of some fifty names would be built again for each fetch and each
publish, about 7 µs of the broker's time per call on Redis 7.0, more than a
BRPOP costs it (``python -m bench.redis_capacity``).

:class:`Script` runs a script by its SHA1 and loads it on the first
``NOSCRIPT`` (a new server, ``SCRIPT FLUSH``, a failover): the one way every
caller runs a script.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

from ..parked import NOT_A_MESSAGE
from ..wire import PUBLISHED_HEADER
from . import layout

__all__ = (
    "CHARGE", "ENQUEUE", "FETCH", "PAUSE", "PROMOTE", "PURGE", "RELEASE", "SCHEDULE", "TAKE",
    "TIDY", "UNKEY", "Script",
)  # fmt: skip

#: What the scripts call ``N.<name>``: every Redis name suffix and constant they use.
NAMES: dict[str, str | int] = {
    "ACTIVE": layout.ACTIVE,
    "LAST": layout.LAST,
    "STATE": layout.STATE,
    "WEIGHTS_CONF": layout.WEIGHTS_CONF,
    "WEIGHTS_LIVE": layout.WEIGHTS_LIVE,
    "KEY_LIST": layout.KEY_LIST,
    "LIMITS_CONF": layout.LIMITS_CONF,
    "LIMITS_LIVE": layout.LIMITS_LIVE,
    "RUNNING": layout.RUNNING,
    "LEASES": layout.LEASES,
    "LEASE_KEY": layout.LEASE_KEY,
    "AT_LIMIT": layout.AT_LIMIT,
    "SLEEP": layout.SLEEP,
    "BUCKET": layout.BUCKET,
    "THROTTLED_SINCE": layout.THROTTLED_SINCE,
    "THROTTLED": layout.THROTTLED,
    "THROTTLED_OWED": layout.THROTTLED_OWED,
    "THROTTLED_TOP": layout.THROTTLED_TOP,
    "THROTTLED_COUNT": layout.THROTTLED_COUNT,
    "THROTTLED_SECONDS": layout.THROTTLED_SECONDS,
    # Earlier releases' names of the same records (tidy.lua moves them).
    "OLD_AT_LIMIT": layout.OLD_AT_LIMIT,
    "OLD_THROTTLED_SINCE": layout.OLD_THROTTLED_SINCE,
    "OLD_THROTTLED": layout.OLD_THROTTLED,
    "OLD_THROTTLED_OWED": layout.OLD_THROTTLED_OWED,
    "OLD_THROTTLED_COUNT": layout.OLD_THROTTLED_COUNT,
    "OLD_THROTTLED_SECONDS": layout.OLD_THROTTLED_SECONDS,
    "SIZES": layout.SIZES,
    "LEVELS": layout.LEVELS,
    "LEVEL_TAGS": layout.LEVEL_TAGS,
    "USERS": layout.USERS,
    "USER_LAST": layout.USER_LAST,
    "USER_VT": layout.USER_VT,
    "PAUSED": layout.PAUSED,
    "PAUSED_SINCE": layout.PAUSED_SINCE,
    "PAUSED_OWED": layout.PAUSED_OWED,
    "BACKLOG": layout.BACKLOG,
    "UNKEYED": layout.UNKEYED,
    "UNKEYED_MARK": layout.UNKEYED_MARK,
    "SCHEDULE": layout.SCHEDULE,
    "SCHEDULED_KEYS": layout.SCHEDULED_KEYS,
    "SCHEDULE_NEXT": layout.SCHEDULE_NEXT,
    "ETA_BATCH": layout.ETA_BATCH,
    "NOT_A_MESSAGE": NOT_A_MESSAGE,
    "PUBLISHED_HEADER": PUBLISHED_HEADER,
}


#: ``N.<NAME>`` in the Lua text (a name of :data:`NAMES`).
_NAME = re.compile(r"\bN\.([A-Z][A-Z_]*)")


def _literal(match: re.Match[str], line: str) -> str:
    name = match.group(1)
    if name in NAMES:
        # JSON's string and number literals are valid Lua literals (ASCII text).
        return json.dumps(NAMES[name])
    if "--" in line[: match.start()]:
        return match.group(0)  # a comment may speak of a family of names (N.OLD_*)
    raise ValueError(f"celery_fair.lua: {name!r} is not a name of NAMES: {line.strip()!r}")


def _with_literals(text: str) -> str:
    """``text`` with every ``N.<NAME>`` outside comments replaced by its value."""
    out = []
    for line in text.splitlines(keepends=True):
        out.append(_NAME.sub(lambda m: _literal(m, line), line))  # noqa: B023 - used at once
    return "".join(out)


def source(*files: str) -> str:
    """The text sent to Redis: the header, then ``files`` of :mod:`celery_fair.lua` in
    order, with the names of :data:`NAMES` as literals."""
    folder = resources.files("celery_fair.lua")
    body = "".join(folder.joinpath(f).read_text() for f in files)
    return "local SEP, DFLT\n" + _with_literals(body)


@dataclass(frozen=True)
class Script:
    """A Lua script run by its SHA1, loaded on the first ``NOSCRIPT``."""

    name: str
    text: str

    @cached_property
    def sha(self) -> str:
        return hashlib.sha1(self.text.encode()).hexdigest()

    def __call__(self, client: Any, *args: Any) -> Any:
        """Run on ``client`` (no KEYS: every script names its keys from its ARGV)."""
        try:
            return client.evalsha(self.sha, 0, *args)
        except NoScriptError:
            return client.eval(self.text, 0, *args)

    def add_to(self, pipe: Any, *args: Any) -> Any:
        """Queue a run on someone else's pipeline (Kombu's restore ``MULTI``): by its text,
        as a missing script could not be loaded from there."""
        return pipe.eval(self.text, 0, *args)

    def pipelined(
        self, client: Any, args: tuple[Any, ...], also: Callable[[Any], Any] | None = None
    ) -> list[Any]:
        """Run in one round trip with whatever ``also(pipe)`` adds; load it if it is missing.

        Without the script the other commands have run once already; they are
        sent again with it, so they must bear running twice.
        """
        for attempt in (1, 2):
            pipe = client.pipeline(transaction=False)
            pipe.evalsha(self.sha, 0, *args)
            if also is not None:
                also(pipe)
            try:
                return list(pipe.execute())
            except NoScriptError:
                if attempt == 2:
                    raise
                client.script_load(self.text)
        raise AssertionError("unreachable")


ENQUEUE = Script("enqueue", source("prelude.lua", "enqueue_one.lua", "enqueue.lua"))
CHARGE = Script("charge", source("prelude.lua", "charge.lua"))
RELEASE = Script("release", source("prelude.lua", "release.lua"))
PURGE = Script("purge", source("prelude.lua", "purge.lua"))
UNKEY = Script("unkey", source("prelude.lua", "unkey.lua"))
PAUSE = Script("pause", source("prelude.lua", "pause.lua"))
TIDY = Script("tidy", source("prelude.lua", "tidy.lua"))
FETCH = Script(
    "fetch",
    source(
        "prelude.lua",
        "unacked.lua",
        "keyed_pop.lua",
        "enqueue_one.lua",
        "promote.lua",
        "fetch.lua",
    ),
)
SCHEDULE = Script("schedule", source("prelude.lua", "schedule.lua"))
PROMOTE = Script(
    "promote", source("prelude.lua", "enqueue_one.lua", "promote.lua", "promote_now.lua")
)
TAKE = Script("take", source("unacked.lua", "take.lua"))
