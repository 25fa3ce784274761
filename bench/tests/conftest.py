"""The tests' real-broker fixtures, for the showcase's tests (the fixtures live in ``tests/``)."""

from tests.conftest import redis_server, redis_url  # noqa: F401 - fixtures, found by name
