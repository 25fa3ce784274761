"""Which RabbitMQ queues the exporter leaves out when it lists a vhost's queues."""

from __future__ import annotations

import pytest

from celery_fair.monitoring.exporter import celery_internal


@pytest.mark.parametrize(
    "queue",
    [
        "worker1@host.celery.pidbox",
        "0c4b2f1e-4b8a-3e1f-9d1c-2d6f0a1b2c3d.reply.celery.pidbox",
        "celeryev.5f1e0c2a-1b2c-4d5e-8f90-a1b2c3d4e5f6",
        "amq.gen-JzTY20BRgKO-HjmUJj0wLg",
        "jobs.fair-malformed",
        "",
    ],
)
def test_celerys_own_queues_are_left_out(queue: str) -> None:
    assert celery_internal(queue)


@pytest.mark.parametrize("queue", ["celery", "jobs", "pidbox_jobs", "celeryevents", "amq"])
def test_work_queues_are_kept(queue: str) -> None:
    assert not celery_internal(queue)
