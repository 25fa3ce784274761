"""Stable hashes of ring keys and queue names, shared by both of the ring's mappings.

Every hash is BLAKE2b, or SplitMix64 over it, never Python's salted
``hash()``, so every process on every machine maps a key the same way.

This module is pure: no Celery, Kombu, I/O or clock.
"""

from __future__ import annotations

import uuid
from hashlib import blake2b

__all__ = (
    "GOLDEN",
    "MASK64",
    "MIX1",
    "MIX2",
    "TWO_POW_MINUS_53",
    "RingKey",
    "canonical_key",
    "key_hash",
    "queue_seed",
)

#: The key types a ring accepts. Each has one canonical text form (see ``canonical_key``).
RingKey = str | bytes | int | uuid.UUID

MASK64 = (1 << 64) - 1
# BLAKE2b personalisation keeps the key hash and the queue seeds in separate domains.
_KEY_PERSON = b"celery-fair-key"
_QUEUE_PERSON = b"celery-fair-q"
# 2**-53: turns the top 53 bits of a 64-bit word into a double in (0, 1).
TWO_POW_MINUS_53 = 1.0 / (1 << 53)
# SplitMix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number
# generators", OOPSLA 2014): the stream increment and the finaliser's multipliers.
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


def canonical_key(key: RingKey) -> str:
    """Return the text form under which ``key`` is hashed.

    ``42``, ``"42"`` and ``b"42"`` are the same key; a UUID is its hyphenated
    lower-case form. That text is also what the router stamps into the message
    header, so hashing the header again gives the same queue. ``bool`` and
    other types are refused: their text forms are either surprising or not
    stable across processes.
    """
    if isinstance(key, str):
        return key
    if isinstance(key, bool):
        raise TypeError(f"a ring key must be str, bytes, int or UUID, not bool ({key!r})")
    if isinstance(key, int):
        return str(key)
    if isinstance(key, bytes):
        try:
            return key.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"a bytes ring key must be valid UTF-8: {key!r}") from None
    if isinstance(key, uuid.UUID):
        return str(key)
    raise TypeError(
        f"a ring key must be str, bytes, int or UUID, not {type(key).__name__} ({key!r})"
    )


def key_hash(key: RingKey) -> int:
    """Return the stable 64-bit hash of ``key`` (BLAKE2b of its canonical UTF-8 text)."""
    data = canonical_key(key).encode("utf-8", "surrogatepass")
    return int.from_bytes(blake2b(data, digest_size=8, person=_KEY_PERSON).digest(), "little")


def queue_seed(name: str) -> int:
    """The stable 64-bit seed of queue ``name`` (BLAKE2b in a domain apart from keys)."""
    data = name.encode("utf-8", "surrogatepass")
    return int.from_bytes(blake2b(data, digest_size=8, person=_QUEUE_PERSON).digest(), "little")
