"""Every access to a private part of Celery, Kombu or redis-py, in one place.

celery-fair acts where Celery and Kombu keep no public hook: the Redis
channel's fetch (``_brpop_start``/``_brpop_read``/``_queue_cycle``), the
prefork semaphore's waiters, a request's header dict.  Users run Celery 5.3
to 5.7, Kombu 5.3 to 5.7 and redis-py 4.6 to 8, and those private parts move
between releases (``Channel.brpop_timeout`` appeared in Kombu 5.6,
``Consumer.qos_global`` in Celery 5.7).

So the adapters never touch a private name themselves: they call the
functions here.  Each function belongs to a :class:`Capability`, and every
capability is *probed* when the worker starts (:func:`probe_worker`,
:func:`probe_consumer`, :func:`probe_redis_channel`): a missing one either
takes the documented fallback, logged once on one line, or stops the worker
with a :class:`CompatibilityError` naming the versions.  Nothing here may
fail later, at the first poll.

The functions live in one module per dependency surface (:mod:`.probes`,
:mod:`.kombu_redis`, :mod:`.redis_py`, :mod:`.worker`, :mod:`.consumer`,
:mod:`.amqp`); callers import them from here.
"""

from __future__ import annotations

from ..errors import CompatibilityError
from .amqp import (
    drain_events_without_wait,
)
from .consumer import (
    BAD_INPUT_HANDLERS,
    backport_immediate_acks,
    consumer_qos_global,
    move_qos_window,
    probe_bad_input_handlers,
    probe_consumer_qos,
    set_bad_input_handlers,
    wrap_drain_events,
)
from .kombu_redis import (
    active_queue_count,
    begin_poll,
    bound_queues,
    brpop_timeout,
    can_push_front,
    deliver,
    end_poll,
    fetch_read,
    hold_fetch_while,
    is_polling_channel,
    is_redis_channel,
    key_prefix,
    key_separator,
    message_priority,
    poll_in_flight,
    priority_steps,
    probe_redis_channel,
    probe_redis_publishing,
    probe_virtual_qos,
    queue_cycle,
    queue_key,
    raw_payload,
    redis_channel_class,
    redis_client,
    remove_from_unacked,
    replace_fetch,
    replace_fetch_read,
    reply_waiting,
    set_queue_cycle,
    unacked_keys,
    unrecorded_append,
    wrap_fetch_start,
    wrap_parse_response,
    wrap_redis_publishing,
    wrap_task_sender,
    wrap_virtual_qos,
)
from .probes import (
    CAPABILITIES,
    KOMBU_BRPOP_TIMEOUT,
    Capability,
    Probe,
    versions,
)
from .redis_py import (
    plain_connection,
    socket_of,
)
from .worker import (
    can_follow_hard_timeouts,
    delivery_tag,
    dispatch_of,
    dispatches_directly,
    green_spawns,
    install_waiters,
    on_hard_timeout,
    on_pool_done,
    probe_worker,
    request_headers,
    runs_inline,
    set_dispatch,
)

__all__ = (
    "active_queue_count",
    "backport_immediate_acks",
    "BAD_INPUT_HANDLERS",
    "begin_poll",
    "bound_queues",
    "brpop_timeout",
    "can_follow_hard_timeouts",
    "can_push_front",
    "CAPABILITIES",
    "Capability",
    "CompatibilityError",
    "consumer_qos_global",
    "deliver",
    "delivery_tag",
    "dispatch_of",
    "dispatches_directly",
    "drain_events_without_wait",
    "end_poll",
    "fetch_read",
    "green_spawns",
    "hold_fetch_while",
    "install_waiters",
    "is_polling_channel",
    "is_redis_channel",
    "key_prefix",
    "key_separator",
    "KOMBU_BRPOP_TIMEOUT",
    "message_priority",
    "move_qos_window",
    "on_hard_timeout",
    "on_pool_done",
    "plain_connection",
    "poll_in_flight",
    "priority_steps",
    "Probe",
    "probe_bad_input_handlers",
    "probe_consumer_qos",
    "probe_redis_channel",
    "probe_redis_publishing",
    "probe_virtual_qos",
    "probe_worker",
    "queue_cycle",
    "queue_key",
    "raw_payload",
    "redis_channel_class",
    "redis_client",
    "remove_from_unacked",
    "replace_fetch",
    "replace_fetch_read",
    "reply_waiting",
    "request_headers",
    "runs_inline",
    "set_bad_input_handlers",
    "set_dispatch",
    "set_queue_cycle",
    "socket_of",
    "unacked_keys",
    "unrecorded_append",
    "versions",
    "wrap_drain_events",
    "wrap_fetch_start",
    "wrap_parse_response",
    "wrap_redis_publishing",
    "wrap_task_sender",
    "wrap_virtual_qos",
)
