"""What celery-fair writes on messages: every header name, in one place.

Producers, workers, the parking place and telemetry read and write these;
they are part of the wire format between processes (and releases), so they
never change their spelling.  The records some of them carry, and the fetch
script's replies, are read and written by :mod:`.served` and :mod:`.replies`.
"""

from __future__ import annotations

__all__ = (
    "ADMIT_HEADER",
    "AT_HEADER",
    "CAPACITY_STAMP",
    "DEMAND_STAMP",
    "DISPATCHED_STAMP",
    "FROM_HEADER",
    "KEYED_HEADER",
    "KEY_HEADER",
    "MAX_BACKLOG_HEADER",
    "PUBLISHED_HEADER",
    "QUEUE_STAMP",
    "REASON_HEADER",
    "RECEIVED_STAMP",
    "REQUEUE_HEADER",
    "RESOURCES_HEADER",
    "RETURNS_HEADER",
    "SERVED_HEADER",
    "DUE_HEADER",
    "USER_HEADER",
    "WEIGHT_STAMP",
)

# -- the producer --------------------------------------------------------------

#: Its wall time when a producer with ``celery_fair.install`` sent the task
#: (``before_task_publish``): telemetry's publish -> start wait, the exporter's ages.
PUBLISHED_HEADER = "fair_published"
#: A task's fairness key: stamped by ``ConsistentHashRouter`` and by a producer
#: with ``fair_keys``; telemetry records it.
KEY_HEADER = "fair_key"
#: The keyed queue a message was published for (by an app with ``fair_keys``):
#: Kombu's Redis ``_put`` stores it in its key's list only for that queue.
KEYED_HEADER = "fair_keyed"
#: Two-level keys: the task's user within its key (``fair_keys`` with a pair
#: of sources); present, even empty, only on messages of such a queue.
USER_HEADER = "fair_user"
#: The key's backlog cap in force for this message (``fair_key_max_backlog``
#: of the producer): Kombu's Redis ``_put`` passes it to the push script,
#: which refuses the message when the key has this many waiting.
MAX_BACKLOG_HEADER = "fair_max_backlog"
#: Admission before the broker fills (``fair_broker_memory_high``), for a keyed
#: message: ``[ceiling, used, maxmemory]``, the backlog from which its key is
#: refused and the broker's memory it was judged on.  Kombu's Redis ``_put``
#: takes it off the message and passes the ceiling to the push script, which
#: compares it with the key's own backlog; it is never stored.
ADMIT_HEADER = "fair_admit"
#: A task whose ``eta`` (or countdown) is in the future, sent by an app with
#: ``fair_eta = "broker"``: when it is due, in epoch seconds.  Kombu's Redis
#: ``_put`` puts such a message in its queue's schedule instead of its queue
#: when that time is still ahead.
DUE_HEADER = "fair_due"
#: What one run of the task holds (``fair_resources``, given per call or as a
#: task attribute), checked by the producer: ``{"cpu": 1, "mem": 4}``.  The
#: worker starts it when that fits its ``fair_capacity``.
RESOURCES_HEADER = "fair_resources"

# -- the worker ----------------------------------------------------------------

#: Stamped by the worker on a message it fetched from a keyed queue:
#: ``[key, charge, weight, throttled, level, user, paused]``: the key served, the cost charged to
#: it at fetch time (run-time mode corrects it when the task finishes), the
#: key's weight when it was served, the seconds the key had spent throttled
#: (set aside by its limits) since its previous task was served (0 without limits), and the
#: suffix of the priority level it was served from (``""``: the first level;
#: absent from workers before priority levels), the user served within a
#: two-level key (``""`` for a one-level key) and the seconds the key had been
#: paused since its previous task was served (both absent before two-level keys).
#: Telemetry records weight, throttled, user and paused as ``key_weight``,
#: ``key_throttled``, ``key_user`` and ``key_paused``.  Written and read only as
#: :class:`celery_fair.wire.served.Served`.
SERVED_HEADER = "fair_served"
#: Request stamps of the main process, for telemetry: wall times of receipt and
#: dispatch to the pool, the queue, the queue's weight in force.
RECEIVED_STAMP = "fair_received"
DISPATCHED_STAMP = "fair_dispatched"
QUEUE_STAMP = "fair_queue"
WEIGHT_STAMP = "fair_weight"
#: With resources on (a worker's ``fair_capacity`` ...), for telemetry: what the
#: task holds as the worker read it (its declaration, ``slots`` and its queue's
#: own resource included) and the worker's whole capacity at hand-over, each a
#: dict of resource -> amount.  Telemetry records them as ``resources`` and
#: ``capacity``.
DEMAND_STAMP = "fair_demand"
CAPACITY_STAMP = "fair_capacity"
#: How many times CoDel sent this message back.
REQUEUE_HEADER = "fair_codel_requeues"

# -- bad input (the parking place) ----------------------------------------------

#: Why the message was parked (a header on RabbitMQ, a field on Redis).
REASON_HEADER = "fair_parked_reason"
#: When it was parked (epoch seconds).
AT_HEADER = "fair_parked_at"
#: The queue it was taken from (where ``--replay`` puts it back).
FROM_HEADER = "fair_parked_from"
#: How often workers that did not know its task sent it back.
RETURNS_HEADER = "fair_unknown_returns"
