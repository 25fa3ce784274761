"""Events per second of the Spark report, per stage, at growing sizes; writer cost per record.

Run: ``.venv/bin/python -m bench.analytics [--sizes 100000,1000000,10000000]``.
Synthetic telemetry (``tests.harness.synthetic``) of each size is
written to a temporary directory (not timed), then the whole pipeline runs
on it ``--reps`` times in one ``local[2]`` session. The anchor measured in
the same run is a bare scan of the same files (``count()`` of every
column), so the ratio pipeline / scan says what the analysis adds to
reading the data; beside it, a bare count per queue and key, the least
that any table with a row per key costs (with a million keys, most of what
the report pays over a few keys). "Past start-up" is the marginal rate:
1 / the slope of the least-squares line through each size's median time
(with two sizes, (n_max - n_min) / (t_max - t_min)), what each further
record costs once Spark's fixed costs are paid. Before the first size, the
pipeline runs once untimed on ``WARM_UP`` records of the same shape: the
first run in a new JVM compiles Spark's code (it took 25-30 s where the
next took 16-22), which is start-up, not a cost per record.
Also measured: the cost of ``TelemetryWriter.record`` (what the worker pays
per task) with its background thread writing.

``--baseline FILE`` puts an earlier run's JSON (for example the code before
a change, run just before in the same conditions) beside this one.
``--keys N`` sets the fairness keys per queue (4 queues; default 50) and
``--key-skew`` the Zipf exponent of their use (default 1.2; 0 is uniform).
``--cluster`` runs the pipeline on a standalone Spark cluster started for
the run (one worker, 1 core, 1 GiB; ``tests.harness.spark_cluster``)
instead of ``--master``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import environment, summary, write

STAGES = ("span", "usage", "tables", "latency")
#: Records of the untimed run before the first size (see the module's docstring).
WARM_UP = 200_000


def _scan(spark: Any, path: str) -> float:
    from pyspark.sql import functions as F

    from celery_fair.analytics.pipeline import read_telemetry

    t0 = time.perf_counter()
    df = read_telemetry(spark, path)
    df.select([F.count(c) for c in df.columns]).collect()
    return time.perf_counter() - t0


def _per_key(spark: Any, path: str) -> float:
    """Seconds for a bare count per queue and key: the least any per-key table costs.

    Written to Spark's ``noop`` sink, which runs the whole aggregation (a
    ``count()`` of the result would let Spark skip it).
    """
    from celery_fair.analytics.pipeline import read_telemetry

    t0 = time.perf_counter()
    keys = read_telemetry(spark, path).groupBy("queue", "fair_key").count()
    keys.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - t0


def spec_for(shape: str, n: int, keys: int | None, skew: float) -> Any:
    """The synthetic telemetry of ``n`` records of a shape (see ``--shape``)."""
    from tests.harness.synthetic import SyntheticSpec, tenant_spec

    if shape == "tenants":
        return replace(tenant_spec(n, keys or 2_000), key_skew=skew)
    return SyntheticSpec(records=n, seed=1, keys_per_queue=keys or 50, key_skew=skew)


def bench_size(spark: Any, spec: Any, reps: int, tmp: Path) -> dict[str, Any]:
    from celery_fair.analytics.pipeline import compute
    from tests.harness.synthetic import write_synthetic

    n = spec.records
    path = tmp / f"n{n}"
    t0 = time.perf_counter()
    write_synthetic(spec, path)
    generated = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in path.iterdir())
    totals, scans, per_key, stages = [], [], [], {s: [] for s in STAGES}
    for rep in range(reps):
        scans.append(_scan(spark, str(path)))
        per_key.append(_per_key(spark, str(path)))
        t0 = time.perf_counter()
        data = compute(spark, str(path))
        totals.append(time.perf_counter() - t0)
        for s in STAGES:
            stages[s].append(data["timings"].get(s, float("nan")))
        print(f"  {n:>11,} rep {rep + 1}/{reps}: {totals[-1]:.1f}s (scan {scans[-1]:.1f}s)")
    shutil.rmtree(path, ignore_errors=True)
    return {
        "records": n,
        "parquet_bytes": size,
        "generate_seconds": generated,
        "total_seconds": summary(totals),
        "scan_seconds": summary(scans),
        "per_key_count_seconds": summary(per_key),
        "events_per_second": n / summary(totals)["median"],
        "pipeline_over_scan": summary(totals)["median"] / summary(scans)["median"],
        "stages": {s: summary(v) for s, v in stages.items()},
    }


def warm_up(spark: Any, spec: Any, tmp: Path) -> None:
    """One untimed run of the pipeline (Spark compiles its code in the first)."""
    from celery_fair.analytics.pipeline import compute
    from tests.harness.synthetic import write_synthetic

    path = tmp / "warm-up"
    write_synthetic(spec, path)
    t0 = time.perf_counter()
    compute(spark, str(path))
    print(f"  warm-up ({spec.records:,} records, untimed): {time.perf_counter() - t0:.1f}s")
    shutil.rmtree(path, ignore_errors=True)


def bench_writer(records: int = 200_000, reps: int = 5) -> dict[str, Any]:
    from celery_fair.telemetry import TaskRecord, TelemetryWriter

    rec = TaskRecord(
        task_id="0" * 36, task_name="work", queue="p0", outcome="success", received=1.0,
        finished=2.0, started=1.5, runtime=0.5, cost=0.5, target_weight=1.0, pid=1,
    )  # fmt: skip
    per_call, drained = [], []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as d:
            w = TelemetryWriter(d, rotate_records=50_000, max_buffer=records)
            t0 = time.perf_counter()
            for _ in range(records):
                w.record(rec)
            per_call.append((time.perf_counter() - t0) / records * 1e9)
            w.close()
            drained.append(records / (time.perf_counter() - t0))
    return {"ns_per_record_call": summary(per_call), "records_per_second_to_disk": summary(drained)}


def past_start_up(sizes: list[dict[str, Any]]) -> float | None:
    """Marginal records per second: 1 / the least-squares slope of median time on records.

    With two sizes, the rate between them; with more, every size counts, so
    one noisy median moves it less than it moves the rate between two.
    """
    if len(sizes) < 2:
        return None
    xs = [float(r["records"]) for r in sizes]
    ys = [r["total_seconds"]["median"] for r in sizes]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return 1.0 / slope if slope > 0 else None


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _baseline(data: dict[str, Any], before: dict[str, Any]) -> list[str]:
    by_size = {r["records"]: r for r in before["sizes"]}
    lines = [
        "",
        f"Before (`{before['command']}` at {before.get('label') or 'the baseline'}, "
        f"{before['environment']['when']}) against this run:",
        "",
        "| records | before s | after s | before events/s | after events/s | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["sizes"]:
        b = by_size.get(r["records"])
        if b is None:
            continue
        t0, t1 = b["total_seconds"]["median"], r["total_seconds"]["median"]
        lines.append(
            f"| {r['records']:,} | {t0:.1f} | {t1:.1f} | {b['events_per_second']:,.0f} | "
            f"{r['events_per_second']:,.0f} | {t0 / t1:.2f}x |"
        )
    lines += [
        "",
        f"Past start-up: before {_rate(past_start_up(before['sizes']))} events/s, "
        f"after {_rate(data['past_start_up'])} events/s.",
    ]
    return lines


def _markdown(data: dict[str, Any]) -> str:
    lines = [
        "# Analytics: Spark report throughput",
        "",
        f"`{data['command']}` on {data['master']} ({data['environment']['cpus']} CPUs, "
        f"spark.driver.memory {data['driver_memory']}), {data['environment']['when']}"
        + (f", code at {data['label']}." if data.get("label") else "."),
        f"Synthetic telemetry, {data.get('queues', 4)} queues x {data.get('keys', 50):,} keys "
        f"(Zipf exponent {data.get('key_skew', 1.2):g})"
        + (
            ", the same tenants in every queue, one of them with 40% of every queue's tasks"
            if data.get("shape") == "tenants"
            else ""
        )
        + "; medians over repetitions, spread = (max-min)/median.",
        "",
        "| records | reps | pipeline s (spread) | events/s | bare scan s | count per key s | "
        "pipeline/scan | " + " | ".join(STAGES) + " |",
        "|" + "---|" * (7 + len(STAGES)),
    ]
    for r in data["sizes"]:
        t = r["total_seconds"]
        stage_cells = " | ".join(f"{r['stages'][s]['median']:.1f}" for s in STAGES)
        lines.append(
            f"| {r['records']:,} | {t['n']} | {t['median']:.1f} ({t['spread']:.0%}) | "
            f"{r['events_per_second']:,.0f} | {r['scan_seconds']['median']:.1f} | "
            f"{r['per_key_count_seconds']['median']:.1f} | "
            f"{r['pipeline_over_scan']:.1f} | {stage_cells} |"
        )
    lines += ["", "Scaling (time ~ size^k between consecutive sizes):", ""]
    for a, b, k in data["scaling"]:
        lines.append(f"- {a:,} -> {b:,} records: k = {k:.2f}")
    lines += [
        "",
        f"Past start-up ({data['sizes'][0]['records']:,} to {data['sizes'][-1]['records']:,} "
        f"records, least-squares slope over the sizes' medians): "
        f"{_rate(data['past_start_up'])} events/s.",
    ]
    if data.get("baseline"):
        lines += _baseline(data, data["baseline"])
    w = data["writer"]
    lines += [
        "",
        f"TelemetryWriter.record: {w['ns_per_record_call']['median']:.0f} ns per call "
        f"(spread {w['ns_per_record_call']['spread']:.0%}); records to Parquet on disk, "
        f"background thread included: {w['records_per_second_to_disk']['median']:,.0f}/s.",
        "",
        "The machine is shared: absolute times are indicative, the stage split and the "
        "scaling exponent are the result.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000,10000000")
    parser.add_argument("--reps", default="3,3,1", help="repetitions per size")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="2g")
    parser.add_argument("--cluster", action="store_true", help="on a 1-core standalone cluster")
    parser.add_argument("--baseline", default=None, help="an earlier run's JSON, shown beside")
    parser.add_argument("--label", default="", help="what code was measured (a commit)")
    parser.add_argument("--name", default="analytics", help="result file name in bench/results")
    parser.add_argument(
        "--shape", choices=("queues", "tenants"), default="queues",
        help="queues: 4 queues of weights 1-4, each with its own keys; tenants: 8 queues "
        "serving the same tenants, one of them with 40%% of every queue's tasks",
    )  # fmt: skip
    parser.add_argument(
        "--keys", type=int, default=None, help="keys per queue (default 50; tenants: 2,000)"
    )
    parser.add_argument("--key-skew", type=float, default=1.2, help="Zipf exponent of key use")
    args = parser.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    reps = [int(r) for r in args.reps.split(",")]
    reps += [reps[-1]] * (len(sizes) - len(reps))

    from contextlib import ExitStack

    from celery_fair.analytics.report import LOOPBACK, session
    from tests.harness.spark_cluster import StandaloneCluster

    writer = bench_writer()
    print(f"writer: {writer['ns_per_record_call']['median']:.0f} ns per record()")
    results = []
    with ExitStack() as stack:
        master, conf = args.master, {}
        if args.cluster:
            cluster = stack.enter_context(StandaloneCluster(cores=1, memory="1g"))
            master, conf = cluster.url, {"spark.executor.memory": "512m"}
            # The driver and its UI bind to loopback too, where the cluster can reach
            # them (a local master gets the same from session()).
            conf["spark.driver.host"] = LOOPBACK
            os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK)
        spark = session(master, args.driver_memory, conf)
        spark.sparkContext.setLogLevel("ERROR")
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="celery-fair-bench-"))
        warm_up(spark, spec_for(args.shape, WARM_UP, args.keys, args.key_skew), Path(tmp))
        for n, r in zip(sizes, reps, strict=True):
            spec = spec_for(args.shape, n, args.keys, args.key_skew)
            results.append(bench_size(spark, spec, r, Path(tmp)))
        spark.stop()
    scaling = [
        (a["records"], b["records"],
         math.log(b["total_seconds"]["median"] / a["total_seconds"]["median"])
         / math.log(b["records"] / a["records"]))
        for a, b in zip(results, results[1:], strict=False)
    ]  # fmt: skip
    command = f"python -m bench.analytics --sizes {args.sizes} --reps {args.reps}"
    command += " --cluster" if args.cluster else ""
    command += f" --shape {args.shape}" if args.shape != "queues" else ""
    command += f" --keys {args.keys}" if args.keys is not None else ""
    command += f" --key-skew {args.key_skew:g}" if args.key_skew != 1.2 else ""
    data = {
        "command": command,
        "label": args.label,
        "master": "standalone cluster, 1 worker, 1 core, 1 GiB" if args.cluster else args.master,
        "driver_memory": args.driver_memory,
        "shape": args.shape,
        "keys": spec_for(args.shape, 1, args.keys, args.key_skew).keys_per_queue,
        "queues": len(spec_for(args.shape, 1, args.keys, args.key_skew).weights),
        "key_skew": args.key_skew,
        "environment": environment(),
        "sizes": results,
        "scaling": scaling,
        "past_start_up": past_start_up(results),
        "writer": writer,
        "baseline": json.loads(Path(args.baseline).read_text()) if args.baseline else None,
    }
    write(args.name, data, _markdown(data))
    print(_markdown(data))


if __name__ == "__main__":
    main()
