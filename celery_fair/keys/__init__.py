"""Fairness keys: weighted fair shares between the keys (tenants) of one queue.

A keyed queue (``app.conf.fair_keys = {"jobs": "tenant_id"}``) keeps each
key's messages in a list of their own on the Redis broker and serves the
keys in start-time fair queuing order (weighted, by count or by measured run
time) from the worker's atomic fetch script.  ``docs/fairness-keys.md``
describes the guarantees and costs.

* :mod:`.layout`: the Redis names of a keyed queue and the message headers;
* :mod:`.lua`: the server-side scripts (publish, fetch, charge, purge);
* :mod:`.store`: the Python side of those scripts;
* :mod:`.publish`: the producer's hooks (``celery_fair.install`` adds them);
* :mod:`.serving`: the worker's per-channel state (run-time charges, counts).
"""
