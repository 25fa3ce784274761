"""The Redis Lua scripts, as files (loaded by :mod:`celery_fair.keys.scripts`)."""
