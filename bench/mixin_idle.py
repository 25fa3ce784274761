"""FairConsumerMixin on each transport: idle CPU, wake-up latency and shares.

Compared in the same run with the anchor, Kombu's own ``ConsumerMixin`` with
one consumer on the same queues and the same total prefetch window; the two
variants alternate within every repetition.

1. Idle: four empty queues; after the consumer is ready, the process CPU time
   (``time.process_time``, all threads; the main thread only sleeps) and the
   voluntary context switches (``getrusage``) over ``--duration`` seconds.
2. Wake-up: while idle, one message is published and the time until the
   handler runs is taken (a few samples; informational, absolute times).
3. Shares: four queues weighted 1:2:3:4, each pre-filled so that all stay
   backlogged, 20,000 messages handled; the share of each queue and the rate.
   ``--shares-reps`` repetitions (the rate moves from run to run on a shared
   machine, so more of them, and the ratio to plain within each repetition).
   On RabbitMQ a third variant acknowledges 16 messages per ``basic.ack``
   (``ack_batch=16``).

Both mixins may hold the same number of unacknowledged messages: plain's
``prefetch_count`` applies to each of its consumer's queues on RabbitMQ
(``basic.qos`` with ``global=False`` is per ``basic.consume``) and to its
channel on the virtual transports, so fair's window is ``WINDOW`` times the
queues on RabbitMQ and ``WINDOW`` elsewhere.

    python -m bench.mixin_idle [--duration 5] [--reps 3] [--shares-reps 9] [--no-rabbitmq]
        [--only rabbitmq] [--pin-broker] [--name NAME]

``--pin-broker`` runs the broker's threads on CPU 0 and this process on CPU 1,
as if the broker had a machine of its own (results in ``mixin_idle_pinned``).

Writes ``bench/results/mixin_idle.json`` and ``bench/results/mixin_idle.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from kombu import Connection, Queue
from kombu.message import Message
from kombu.mixins import ConsumerMixin

from celery_fair.kombu import FairConsumerMixin
from tests.harness.brokers import publish_plain
from tests.harness.harness import process_cpu

from .common import environment, give_broker_a_core, summary, write

WEIGHTS = (1, 2, 3, 4)
WINDOW = 100
#: Messages handled per shares run: at some 10,000 a second on RabbitMQ, 2,000
#: was a fifth of a second, and plain Kombu's rate then spread from 8,600 to
#: 15,600 between repetitions.
HANDLED = 20_000
#: Published per queue for a shares run, as a fraction of those handled: the
#: heaviest queue (weight 4) gives 40%, so every queue stays backlogged.
PUBLISHED_SHARE = 0.6
VARIANTS = ("fair", "plain")
#: Shares runs: on RabbitMQ also the mixin acknowledging ACK_BATCH messages per frame.
ACK_BATCH = 16
BATCHED = "fair ack_batch=16"

Handler = Callable[[str, Any, Message], None]


class Fair(FairConsumerMixin):
    """The mixin under test, with a readiness signal."""

    def __init__(self, url: str, names: list[str], handler: Handler, ack_batch: int = 1) -> None:
        super().__init__(
            Connection(url),
            dict(zip(names, WEIGHTS, strict=True)),
            handler=handler,
            window=fair_window(url),
            ack_batch=ack_batch,
        )
        self.ready = threading.Event()

    def on_consume_ready(self, *args: Any, **kwargs: Any) -> None:
        self.ready.set()


class Plain(ConsumerMixin):  # type: ignore[misc]
    """The anchor: Kombu's ConsumerMixin, one consumer on every queue, ack after handling."""

    def __init__(self, url: str, names: list[str], handler: Handler) -> None:
        self.connection = Connection(url)
        self.names = names
        self.handler = handler
        self.ready = threading.Event()

    def get_consumers(self, consumer_class: Any, channel: Any) -> list[Any]:
        queues = [Queue(name) for name in self.names]
        return [consumer_class(queues=queues, callbacks=[self.on_message], prefetch_count=WINDOW)]

    def on_message(self, body: Any, message: Message) -> None:
        self.handler(message.delivery_info["routing_key"], body, message)
        message.ack()

    def on_consume_ready(self, *args: Any, **kwargs: Any) -> None:
        self.ready.set()


def fair_window(url: str) -> int:
    """As many unacknowledged messages as plain may hold (see the module's docstring)."""
    return WINDOW * len(WEIGHTS) if url.startswith("amqp") else WINDOW


def make(variant: str, url: str, names: list[str], handler: Handler) -> Any:
    if variant == "plain":
        return Plain(url, names, handler)
    return Fair(url, names, handler, ACK_BATCH if variant == BATCHED else 1)


@contextlib.contextmanager
def running(consumer: Any) -> Iterator[threading.Thread]:
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        if not consumer.ready.wait(60):
            raise RuntimeError("consumer did not become ready")
        yield thread
    finally:
        consumer.should_stop = True
        thread.join(60)


def fresh_names() -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"bench-mixin-{tag}-{i}" for i in range(len(WEIGHTS))]


def delete(url: str, names: list[str]) -> None:
    with Connection(url) as conn:
        channel = conn.channel()
        for name in names:
            Queue(name)(channel).delete()


def idle_run(variant: str, url: str, duration: float) -> dict[str, Any]:
    names = fresh_names()
    publish_plain(url, dict.fromkeys(names, 0))
    handled: list[float] = []
    consumer = make(variant, url, names, lambda q, b, m: handled.append(time.monotonic()))
    try:
        with running(consumer), Connection(url) as conn:
            producer = conn.Producer(serializer="json")
            producer.publish({"warm": 1}, routing_key=names[0], declare=[])
            wait_until(lambda: len(handled) == 1)
            time.sleep(0.5)  # let the connection settle
            cpu0, usage0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            time.sleep(duration)
            cpu1, usage1 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
            latencies = []
            for _ in range(3):
                count = len(handled)
                sent = time.monotonic()
                producer.publish({"i": 0}, routing_key=names[0], declare=[])
                wait_until(lambda count=count: len(handled) > count)  # type: ignore[misc]
                latencies.append(handled[-1] - sent)
                time.sleep(0.3)
    finally:
        delete(url, names)
    return {
        "cpu_ms_per_s": 1000 * (cpu1 - cpu0) / duration,
        "voluntary_switches_per_s": (usage1.ru_nvcsw - usage0.ru_nvcsw) / duration,
        "wake_latency_ms": [1000 * x for x in latencies],
    }


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.0005)


def shares_run(
    variant: str,
    url: str,
    handled: int = HANDLED,
    broker_cpu: Callable[[], float | None] = lambda: None,
) -> dict[str, Any]:
    names = fresh_names()
    publish_plain(url, dict.fromkeys(names, int(PUBLISHED_SHARE * handled)))
    before = broker_cpu()
    counts: Counter[str] = Counter()
    stamps: list[float] = []
    cpu: list[float] = []  # the consumer thread's CPU time at the first and last message
    consumer: Any = None

    def handler(queue: str, body: Any, message: Message) -> None:
        counts[queue] += 1
        stamps.append(time.monotonic())
        if counts.total() in (1, handled):
            cpu.append(time.thread_time())
        if counts.total() >= handled:
            consumer.should_stop = True

    consumer = make(variant, url, names, handler)
    try:
        with running(consumer) as thread:
            while thread.is_alive() and counts.total() < handled:
                time.sleep(0.01)
        after = broker_cpu()
    finally:
        delete(url, names)
    # Throughput from the first to the last handled message: no set-up or stop.
    elapsed = stamps[-1] - stamps[0]
    total = sum(WEIGHTS)
    shares = [counts[n] / counts.total() for n in names]
    return {
        "shares": shares,
        "max_deviation_pp": max(
            100 * abs(s - w / total) for s, w in zip(shares, WEIGHTS, strict=True)
        ),
        "messages_per_s": (len(stamps) - 1) / elapsed,
        # The consumer's own cost, apart from the broker's share of the two cores
        # (on this machine the broker runs beside it): steadier than the rate.
        "cpu_us_per_message": (cpu[-1] - cpu[0]) / (len(stamps) - 1) * 1e6,
        # The broker's, from the consumer's start to its stop (None: in memory).
        "broker_cpu_us_per_message": (
            None if before is None or after is None else (after - before) / handled * 1e6
        ),
    }


@contextlib.contextmanager
def broker(kind: str, pin: bool = False) -> Iterator[tuple[str, Callable[[], float | None]]]:
    """The broker's URL, and a function giving its process's CPU seconds (None: no process)."""
    if kind == "memory":
        yield "memory://", lambda: None
        return
    if kind == "redis":
        from tests.harness.redis import RedisServer

        with RedisServer() as server:
            proc = server.proc
            if pin:
                give_broker_a_core(server, 0, {1})
            yield server.url, lambda: None if proc is None else process_cpu(proc.pid)
        return
    from tests.harness.rabbitmq import RabbitMQServer

    with RabbitMQServer() as rabbit:
        if pin:
            give_broker_a_core(rabbit, 0, {1})
        yield rabbit.url, lambda: None if rabbit.pid is None else process_cpu(rabbit.pid)


def share_variants(kind: str) -> tuple[str, ...]:
    return (*VARIANTS, BATCHED) if kind == "rabbitmq" else VARIANTS


def measure(
    kind: str,
    duration: float,
    reps: int,
    handled: int = HANDLED,
    pin: bool = False,
    shares_reps: int = 9,
) -> dict[str, Any]:
    idle: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    variants = share_variants(kind)
    shares: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with broker(kind, pin) as (url, broker_cpu):
        for rep in range(reps):
            order = VARIANTS if rep % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                idle[variant].append(idle_run(variant, url, duration))
                print(kind, variant, "idle", idle[variant][-1], flush=True)
        for rep in range(shares_reps):
            # Each variant first, middle and last in turn.
            turn = rep % len(variants)
            for variant in variants[turn:] + variants[:turn]:
                shares[variant].append(shares_run(variant, url, handled, broker_cpu))
                print(kind, variant, "shares", shares[variant][-1], flush=True)
    result: dict[str, Any] = {"runs": {"idle": idle, "shares": shares}}
    for variant in variants:
        idled = idle.get(variant, [])
        rates = [r["messages_per_s"] for r in shares[variant]]
        plain = [r["messages_per_s"] for r in shares["plain"]]
        result[variant] = {
            "cpu_ms_per_s": _summary_or_none([r["cpu_ms_per_s"] for r in idled]),
            "voluntary_switches_per_s": _summary_or_none(
                [r["voluntary_switches_per_s"] for r in idled]
            ),
            "wake_latency_ms": _summary_or_none([x for r in idled for x in r["wake_latency_ms"]]),
            # Against plain in the same repetition, run next to it.
            "rate_to_plain": summary([a / b for a, b in zip(rates, plain, strict=True)]),
            "shares": [
                summary([r["shares"][i] for r in shares[variant]]) for i in range(len(WEIGHTS))
            ],
            "max_deviation_pp": summary([r["max_deviation_pp"] for r in shares[variant]]),
            "messages_per_s": summary(rates),
            "cpu_us_per_message": summary([r["cpu_us_per_message"] for r in shares[variant]]),
            "broker_cpu_us_per_message": _summary_or_none(
                [r["broker_cpu_us_per_message"] for r in shares[variant]]
            ),
        }
    return result


def _summary_or_none(values: list[float | None]) -> dict[str, float] | None:
    known = [v for v in values if v is not None]
    return summary(known) if known else None


def _cell(s: dict[str, float] | None, fmt: str = "{:.2f}") -> str:
    if s is None:
        return "-"
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}, {fmt.format(s['max'])}]"


def markdown(data: dict[str, Any]) -> str:
    env, args = data["environment"], data["arguments"]
    lines = [
        "# FairConsumerMixin: idle CPU, wake-up and shares per transport",
        "",
        f"`python -m bench.mixin_idle --duration {args['duration']} --reps {args['reps']} "
        f"--shares-reps {args['shares_reps']} --handled {args['handled']}"
        + (f" --only {args['only']}" if args.get("only") else "")
        + (" --pin-broker" if args.get("pin_broker") else "")
        + (f" --name {args['name']}" if args.get("name") else "")
        + "`, "
        + (
            "the broker's threads on CPU 0 and the consumers on CPU 1, "
            if args.get("pin_broker")
            else ""
        )  # fmt: skip
        + f"Python {env['python']}, Kombu {env['kombu']}, {env['cpus']} CPUs, {env['when']}.",
        "`fair` is FairConsumerMixin; `plain` is Kombu's ConsumerMixin on the same queues,",
        f"one consumer with `prefetch_count={WINDOW}`, alternated with it in each repetition.",
        "Both may hold as many unacknowledged messages: plain's prefetch count applies to",
        "each queue it consumes on RabbitMQ (`basic.qos` with `global=False`) and to its",
        "channel on the virtual transports, so fair's window, split by weight, is",
        f"{WINDOW * len(WEIGHTS)} on RabbitMQ and {WINDOW} elsewhere.",
        f"`{BATCHED}` (RabbitMQ only) acknowledges {ACK_BATCH} messages per `basic.ack`.",
        "Medians of the repetitions, with [min, max].",
        "",
        f"## Idle: four empty queues, {args['duration']} s per repetition",
        "",
        "CPU is the process CPU time (all threads) per second of idling: 1 ms/s is 0.1% "
        "of one core.",
        "",
        "| transport | variant | CPU ms/s | voluntary switches/s | wake-up latency ms |",
        "|---|---|---:|---:|---:|",
    ]
    for kind, result in data["transports"].items():
        for variant in VARIANTS:
            r = result[variant]
            lines.append(
                f"| {kind} | {variant} | {_cell(r['cpu_ms_per_s'], '{:.3f}')} "
                f"| {_cell(r['voluntary_switches_per_s'], '{:.1f}')} "
                f"| {_cell(r['wake_latency_ms'], '{:.1f}')} |"
            )
    total = sum(WEIGHTS)
    target = " / ".join(f"{100 * w / total:.0f}" for w in WEIGHTS)
    lines += [
        "",
        f"## Shares: weights 1:2:3:4 (target {target} %), all backlogged, "
        f"{args['handled']:,} handled, {args['shares_reps']} repetitions",
        "",
        "Rate to plain: each repetition's rate over plain's in the same repetition.",
        "",
        "| transport | variant | shares % | max deviation (pp) | messages/s | rate to plain "
        "| consumer CPU µs/message | broker CPU µs/message |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for kind, result in data["transports"].items():
        for variant in share_variants(kind):
            r = result[variant]
            measured = " / ".join(f"{100 * s['median']:.1f}" for s in r["shares"])
            lines.append(
                f"| {kind} | {variant} | {measured} | {_cell(r['max_deviation_pp'])} "
                f"| {_cell(r['messages_per_s'], '{:.0f}')} "
                f"| {_cell(r['rate_to_plain'])} "
                f"| {_cell(r['cpu_us_per_message'], '{:.1f}')} "
                f"| {_cell(r.get('broker_cpu_us_per_message'), '{:.1f}')} |"
            )
    lines += [
        "",
        "Wake-up latency is from just before a publish (on an open connection) to the handler",
        "starting; messages/s runs from the first to the last handled message, and the",
        "consumer's CPU per message is its thread's CPU time over the same span (the",
        "broker shares the machine's cores, so the rate moves with the broker's load); the",
        "broker's is its process's CPU time from the consumer's start to its stop. Kombu's",
        "in-memory transport has no sockets: its `drain_events` polls once per",
        "`polling_interval` (1 s), hence its latency; Redis (BRPOP) and AMQP (pushed",
        "deliveries) wake the blocked consumer at once.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="idle seconds per run")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--handled", type=int, default=HANDLED, help="messages handled per shares run"
    )
    parser.add_argument("--shares-reps", type=int, default=9, help="repetitions of the shares runs")
    parser.add_argument("--no-rabbitmq", action="store_true", help="skip RabbitMQ")
    parser.add_argument("--only", choices=("memory", "redis", "rabbitmq"), help="one transport")
    parser.add_argument(
        "--pin-broker", action="store_true", help="the broker on CPU 0, the consumers on CPU 1"
    )
    parser.add_argument(
        "--name",
        help="result file name in bench/results (mixin_idle, with --pin-broker mixin_idle_pinned)",
    )
    args = parser.parse_args(argv)
    kinds = ["memory", "redis"] + ([] if args.no_rabbitmq else ["rabbitmq"])
    if args.only:
        kinds = [args.only]
    data: dict[str, Any] = {
        "environment": environment(),
        "arguments": {
            "duration": args.duration, "reps": args.reps, "handled": args.handled,
            "shares_reps": args.shares_reps,
            "pin_broker": args.pin_broker, "only": args.only, "name": args.name,
        },
        "transports": {
            kind: measure(
                kind, args.duration, args.reps, args.handled, args.pin_broker, args.shares_reps
            )
            for kind in kinds
        },
    }  # fmt: skip
    name = args.name or ("mixin_idle_pinned" if args.pin_broker else "mixin_idle")
    write(name, data, markdown(data))


if __name__ == "__main__":
    main()
