"""A flood that fills Redis to its maxmemory: does the worker survive and drain it?

Per round, one real Redis with ``maxmemory`` (40 MB by default) and
``noeviction``, one ``celery worker -c 2`` with Celery's defaults (early acks,
``-E``), and a producer that floods the queue ``flood`` with 4 KB tasks of
10 ms, and keeps trying for ``--full-for`` seconds after the first refusal
(a tenant that retries), while a second producer publishes a task for a quiet
tenant every 20 ms (to the queue ``quiet``; with a keyed queue, as one of four
other keys of ``flood``).  Then it waits for the worker to run what was
accepted (or to exit), and tries one more publish.  The variants run in
turns: plain Celery, celery-fair with weights, celery-fair with the flood
queue keyed by tenant, and both of those with admission
(``fair_broker_memory_high = 0.8``: the flood is refused from 80% of
``maxmemory``, before the broker fills).  The ledger of runs lives on a
second Redis.  ``CELERY_FAIR_TEST_SERVER=valkey`` runs it on Valkey.

    python -m bench.broker_full [--reps 2] [--maxmemory 40mb] [--full-for 8] [--name N]

Results: ``bench/results/broker_full.{json,md}``.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from tests.harness.harness import WorkerProcess
from tests.harness.redis import RedisServer, server_kind

from .common import environment, write

APP = "tests.integration.production_app"
VARIANTS = ("plain", "fair", "keyed", "admit", "admit-keyed")
PAD = "x" * 4000
#: ``fair_broker_memory_high`` of the admission variants.
HIGH = 0.8
#: The quiet tenants' producer publishes one task every QUIET_EVERY seconds.
QUIET_EVERY = 0.02
#: A round gives up waiting for the worker after this long.
DRAIN_LIMIT = 240.0


def one_round(variant: str, maxmemory: str, full_for: float) -> dict[str, Any]:
    from tests.integration.production_app import make_app

    with RedisServer() as broker, RedisServer() as ledger_server:
        client = broker.client()
        client.config_set("maxmemory", maxmemory)
        client.config_set("maxmemory-policy", "noeviction")
        env = {
            "CELERY_FAIR_BROKER": broker.url,
            "CELERY_FAIR": "0" if variant == "plain" else "1",
            "PRODUCTION_LEDGER": ledger_server.url,
            "PRODUCTION_WEIGHTS": "flood=1,quiet=1",
            "PRODUCTION_ACKS_LATE": "0",  # Celery's default early acks
        }
        keyed = variant.endswith("keyed")
        if keyed:
            env["PRODUCTION_KEYS"] = "flood=tenant_id"
        if variant.startswith("admit"):
            env["PRODUCTION_MEMORY_HIGH"] = str(HIGH)
        producer = make_app(env, name=f"full-{variant}")
        record = producer.tasks["prod.record"]
        quiet_app = make_app(env, name=f"quiet-{variant}")
        quiet: dict[str, int] = {"accepted": 0, "refused": 0}
        flooding = threading.Event()
        worker = WorkerProcess(
            broker.url, ["flood", "quiet"], concurrency=2, app=APP, env=env,
            fair=variant != "plain", extra_args=["-E"],
        )  # fmt: skip
        ledger = ledger_server.client()
        with worker:
            deadline = time.monotonic() + 60
            while " ready." not in worker.log() and time.monotonic() < deadline:
                time.sleep(0.1)
            accepted = refused = 0
            flooding.set()
            trickle = threading.Thread(
                target=_quiet, args=(quiet_app, keyed, flooding, quiet), daemon=True
            )
            trickle.start()
            stop = time.monotonic() + 120
            while time.monotonic() < stop:
                kwargs: dict[str, Any] = {"ms": 10}
                if keyed:
                    kwargs["tenant_id"] = "noisy"
                try:
                    record.apply_async(
                        (accepted,), kwargs, queue="flood", headers={"pad": PAD}, retry=False
                    )
                    accepted += 1
                except Exception:  # refused: the broker is full
                    if not refused:
                        stop = min(stop, time.monotonic() + full_for)
                    refused += 1
            flood_end = time.monotonic()
            flooding.clear()
            trickle.join()
            deadline = flood_end + DRAIN_LIMIT
            expected = accepted + quiet["accepted"]
            while time.monotonic() < deadline:
                if ledger.llen("ledger") >= expected or worker.proc.poll() is not None:  # type: ignore[union-attr]
                    break
                time.sleep(0.5)
            alive = worker.proc is not None and worker.proc.poll() is None
            ran = int(ledger.llen("ledger"))
            drained = time.monotonic() - flood_end
            try:
                record.apply_async((-1,), {"ms": 0}, queue="quiet", retry=False)
                recovered = True
            except Exception:
                recovered = False
            memory = client.info("memory")
            used, peak = int(memory["used_memory"]), int(memory["used_memory_peak"])
            limit = int(client.config_get("maxmemory")["maxmemory"])
            log = worker.log()
        producer.close()
        quiet_app.close()
    return {
        "variant": variant,
        "accepted": accepted,
        "refused": refused,
        "ran": ran,
        "expected": accepted + quiet["accepted"],
        "worker_alive": alive,
        "publishing_recovered": recovered,
        "drain_seconds": round(drained, 1),
        "broker_used_after": used,
        "broker_peak_of_max": round(peak / limit, 3),
        "quiet_accepted": quiet["accepted"],
        "quiet_refused": quiet["refused"],
        "critical": next((x[:160] for x in log.splitlines() if "CRITICAL" in x), None),
        "full_logged": "celery-fair: the broker is full" in log,
    }


def _quiet(app: Any, keyed: bool, flooding: threading.Event, counts: dict[str, int]) -> None:
    """Publish a quiet tenant's task every QUIET_EVERY seconds while the flood lasts."""
    record = app.tasks["prod.record"]
    n = 0
    while flooding.is_set():
        kwargs: dict[str, Any] = {"ms": 10}
        queue = "quiet"
        if keyed:
            kwargs["tenant_id"], queue = f"q{n % 4}", "flood"
        try:
            record.apply_async((1_000_000 + n,), kwargs, queue=queue, retry=False)
            counts["accepted"] += 1
        except Exception:  # refused: by the broker, or by admission
            counts["refused"] += 1
        n += 1
        time.sleep(QUIET_EVERY)  # a steady trickle


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--maxmemory", default="40mb")
    parser.add_argument("--full-for", type=float, default=8.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--name", default="broker_full", help="results file name")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    rounds = []
    for rep in range(args.reps):
        for variant in variants:
            result = one_round(variant, args.maxmemory, args.full_for)
            result["rep"] = rep
            print(result, flush=True)
            rounds.append(result)
    lines = [
        "# A flood that fills Redis to its maxmemory",
        "",
        f"`python -m bench.broker_full --reps {args.reps} --maxmemory {args.maxmemory} "
        f"--full-for {args.full_for:g}`; one worker `-c 2`, Celery's defaults (early acks, "
        "`-E`), 4 KB tasks of 10 ms; the producer keeps trying for "
        f"{args.full_for:g} s after the first refusal. Variants in turns. "
        f"Server: {server_kind()}.",
        "",
        "| rep | variant | flood accepted | flood refused | quiet accepted | quiet refused | ran | "
        "broker peak | worker | publishing after | drain s | logged |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for r in rounds:
        worker = "up" if r["worker_alive"] else f"exited ({r['critical'] or 'no CRITICAL'})"
        lines.append(
            f"| {r['rep']} | {r['variant']} | {r['accepted']:,} | {r['refused']:,} | "
            f"{r['quiet_accepted']:,} | {r['quiet_refused']:,} | "
            f"{r['ran']:,} of {r['expected']:,} | "
            f"{r['broker_peak_of_max']:.0%} | {worker} | "
            f"{'ok' if r['publishing_recovered'] else 'refused'} | "
            f"{r['drain_seconds']} | {'yes' if r['full_logged'] else 'no'} |"
        )
    env = environment()
    lines += ["", f"{env['when']}, Celery {env['celery']}, Kombu {env['kombu']}, "
              f"redis-py {env['redis']}, {env['cpus']} CPUs."]  # fmt: skip
    write(args.name, {"environment": env, "rounds": rounds}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
