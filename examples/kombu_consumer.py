"""A plain Kombu program that consumes four queues by weight with FairConsumerMixin.

    python examples/kombu_consumer.py                      # starts its own redis-server
    python examples/kombu_consumer.py --broker redis://127.0.0.1:6379/0
    python examples/kombu_consumer.py --broker amqp://guest:guest@127.0.0.1//
    python examples/kombu_consumer.py --broker memory://

It publishes a backlog to queues weighted 1:2:3:4, consumes part of it (so
that every queue stays backlogged), prints each queue's share next to its
weight's share, and deletes its queues.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

from kombu import Connection, Queue
from kombu.message import Message

from celery_fair.kombu import FairConsumerMixin


class Worker(FairConsumerMixin):
    """Handles a message by counting it; stops after ``stop_after`` messages."""

    def __init__(self, connection: Connection, weights: dict[str, int], stop_after: int) -> None:
        super().__init__(connection, weights, cost="count", on_error="reject")
        self.stop_after = stop_after
        self.counts: Counter[str] = Counter()

    def handle(self, queue: str, body: Any, message: Message) -> None:
        # The work goes here; the mixin acks the message when this returns.
        self.counts[queue] += 1
        if self.counts.total() >= self.stop_after:
            self.should_stop = True


@contextlib.contextmanager
def broker(url: str | None) -> Iterator[str]:
    """``url``, or a private ``redis-server`` on a free loopback port for the example's run."""
    if url is not None:
        yield url
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        server = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", directory],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(
                            "could not start redis-server (is it installed?)"
                        ) from None
                    time.sleep(0.05)
            print(f"started redis-server on port {port}")
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            server.terminate()
            server.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="FairConsumerMixin example")
    parser.add_argument("--broker", help="broker URL (default: start a local redis-server)")
    parser.add_argument("--backlog", type=int, default=1000, help="messages per queue")
    parser.add_argument("--consume", type=int, default=2000, help="messages to handle")
    args = parser.parse_args(argv)
    if not 0 < args.consume <= 4 * args.backlog:
        parser.error(f"--consume {args.consume}: must be between 1 and 4 x --backlog")

    tag = uuid.uuid4().hex[:6]
    weights = {f"example-{tag}-w{w}": w for w in (1, 2, 3, 4)}
    with broker(args.broker) as url:
        with Connection(url) as conn:
            channel = conn.channel()
            producer = conn.Producer(serializer="json")
            for name in weights:
                Queue(name)(channel).declare()
                for i in range(args.backlog):
                    producer.publish({"n": i}, routing_key=name, declare=[])
        print(f"published {args.backlog} messages to each of {len(weights)} queues")

        worker = Worker(Connection(url), weights, stop_after=args.consume)
        thread = threading.Thread(target=worker.run)
        thread.start()
        thread.join()

        total_weight = sum(weights.values())
        handled = worker.counts.total()
        print(f"\nhandled {handled} messages\n")
        print(f"{'queue':24} {'weight':>6} {'target':>7} {'share':>7} {'handled':>8}")
        for name, weight in weights.items():
            print(
                f"{name:24} {weight:6} {weight / total_weight:7.1%} "
                f"{worker.counts[name] / handled:7.1%} {worker.counts[name]:8}"
            )
        with Connection(url) as conn:
            channel = conn.channel()
            for name in weights:
                queue = Queue(name)(channel)
                queue.purge()  # Kombu's Redis queue_delete leaves the list itself behind
                queue.delete()


if __name__ == "__main__":
    main()
