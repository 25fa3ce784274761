"""The keyed scripts called directly on a real Redis, without Kombu or a worker:
one queue's names, a Kombu payload, and one run of ENQUEUE or FETCH."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from celery_fair.keys import scripts, store
from celery_fair.keys.layout import KeyedNames
from celery_fair.keys.store import enqueue_args
from celery_fair.wire.replies import KeyedMessage, decode_fetch

Q = "jobs"
SEP = "\x06\x16"
NAMES = KeyedNames(Q, SEP)


def message(key: str = "", n: int = 0) -> str:
    """A Kombu Redis payload with a delivery tag, as the fetch needs."""
    return json.dumps(
        {
            "body": "",
            "headers": {"fair_key": key, "n": n},
            "properties": {
                "delivery_tag": str(uuid.uuid4()),
                "delivery_info": {"exchange": Q, "routing_key": Q},
            },
        }
    )


#: Kombu's Redis priority steps by default, as list suffixes: the levels after the first.
LEVELS = [f"{SEP}3", f"{SEP}6", f"{SEP}9"]


def enqueue(client: Any, key: str, payload: str, front: bool = False, level: str = "") -> Any:
    return scripts.ENQUEUE(client, *enqueue_args(NAMES, key, payload, front=front, level=level))


def fetch(
    client: Any,
    word: str = "1",
    *queues: str,
    level_weights: dict[str, float] | None = None,
    charges: tuple[str, ...] = (),
    releases: tuple[str, ...] = (),
    batch: int = 1,
) -> Any:
    """One run of the fetch script over ``queues`` (default: the keyed queue with ``word``).

    ``level_weights`` (level suffix -> weight) makes the levels weighted; without,
    strict.  ``charges``: flat (base, level, key, user, delta) run-time corrections;
    ``releases``: flat (base, delivery tag) key slots freed first; ``batch``: the
    most messages to take from the first queue.
    """
    keys = list(queues) or [Q]
    words = ["-"] * len(queues) if queues else [word]
    pairs = [x for s, w in (level_weights or {}).items() for x in (s, repr(w))]
    return client.eval(
        scripts.FETCH.text,
        2 * len(keys) + 2,
        *keys, *[k + ".fair-malformed" for k in keys], "unacked", "unacked_index",
        *store.fetch_args(
            words, sep=SEP, now=time.time(), suffixes=LEVELS, level_words=pairs,
            charges=charges, releases=releases, batch=batch,
        ),
    )  # fmt: skip


def fetched(client: Any, word: str = "1", **options: Any) -> KeyedMessage:
    """One run of the fetch script that must serve a keyed message: its reply, decoded."""
    reply = decode_fetch(fetch(client, word, **options))
    assert isinstance(reply, KeyedMessage), reply
    return reply


def served(
    client: Any, n: int, word: str = "1", level_weights: dict[str, float] | None = None
) -> list[str]:
    return [key for key, _ in served_levels(client, n, word, level_weights)]


def served_levels(
    client: Any, n: int, word: str = "1", level_weights: dict[str, float] | None = None
) -> list[tuple[str, str]]:
    """The (key, level suffix) of the next ``n`` messages served."""
    out = []
    for _ in range(n):
        reply = fetched(client, word, level_weights=level_weights)
        out.append((reply.fair_key, reply.level))
    return out
