"""The report against a hand-written aggregation of the same rows: their ratio, in one run.

Run: ``.venv/bin/python -m bench.report_ratio [--sizes 50000,4000000] [--reps 4]``.

Tenant-shaped synthetic telemetry (``bench.analytics.spec_for("tenants", ...)``:
8 queues, 2,000 keys, one tenant with 40% of every queue's tasks) of each size
is written once (not timed). Then, in rounds, each of these runs once per
size, as a program of its own from start to exit (a fresh JVM every time,
timed from outside):

* the report: ``python -m celery_fair.cli report DIR --out OUT --master local[2]``,
  the code path of ``celery fair report`` with all its outputs (``report.json``,
  the PNG charts, ``report.html``);
* the aggregation: ``python -m bench.report_ratio --aggregate DIR --out OUT``, a
  hand-written PySpark job on the same master and Spark settings: per queue and
  key, the count, the sum of run time and wait p50/p99 (``percentile_approx``),
  written as JSON. The least a per-key table of the same rows costs.

The order of the runs rotates from round to round (A B, then B A), so a drift
of the machine's speed falls on both alike. Two figures, each the report's
over the aggregation's:

* **whole run** on the smallest size (Spark's start-up included): the
  ratio of the medians, and each round's ratio;
* **per row past start-up**: the marginal cost, the least-squares slope of
  time on records (with two sizes, the time between them over the rows
  between them; ``bench.analytics.past_start_up``), from the medians and
  from each round's own times.

``--revisions REV ...`` runs the report of each revision (a temporary ``git
worktree``, removed at the end) in the same rotation, beside the
aggregation, which is always this tree's: a before and an after in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.analytics import past_start_up, spec_for
from bench.common import environment, summary, write
from celery_fair._process import alive
from celery_fair.analytics.jvm_archive import ENV as ARCHIVE_ENV
from celery_fair.testing import poll_until

ROOT = Path(__file__).resolve().parent.parent
#: The column naming the aggregation (the report's columns are named by their code).
AGGREGATION = "aggregation"
#: What the whole-run figure is taken at unless ``--sizes`` says otherwise.
SIZES = "50000,4000000"


def aggregate(spark: Any, path: str) -> list[dict[str, Any]]:
    """Per queue and key: tasks, summed run time, wait p50/p99 (publish, else receive, -> start).

    Written as one would by hand: read, group, collect. The wait is the
    report's (``transforms.normalize``), so both compute the same quantity.
    """
    from pyspark.sql import functions as F

    tasks = spark.read.parquet(path)
    wait = F.col("started") - F.coalesce("published", "received")
    rows = (
        tasks.groupBy("queue", "fair_key")
        .agg(
            F.count(F.lit(1)).alias("tasks"),
            F.sum("runtime").alias("run_time"),
            F.percentile_approx(wait, [0.5, 0.99]).alias("wait"),
        )
        .collect()
    )
    return [
        {
            "queue": r["queue"],
            "fair_key": r["fair_key"],
            "tasks": r["tasks"],
            "run_time": r["run_time"],
            "wait_p50": r["wait"][0] if r["wait"] else None,
            "wait_p99": r["wait"][1] if r["wait"] else None,
        }
        for r in rows
    ]


def aggregate_main(directory: str, out: str, master: str) -> int:
    """The aggregation as a program: start Spark, aggregate, write ``aggregation.json``."""
    from pyspark.sql import SparkSession

    # The settings a local report's session makes (report.session), spelt out here
    # so that a change of the report's does not move the yardstick.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    spark = (
        SparkSession.builder.appName("hand-written-aggregation")
        .master(master)
        .config("spark.sql.shuffle.partitions", "8")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    try:
        rows = aggregate(spark, directory)
    finally:
        spark.stop()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "aggregation.json").write_text(json.dumps(rows) + "\n")
    return 0


def report_command(directory: str, out: str, master: str) -> list[str]:
    """``celery-fair report`` as the command line runs it (``celery fair report`` too)."""
    return [
        sys.executable, "-m", "celery_fair.cli", "report", directory,
        "--out", out, "--master", master,
    ]  # fmt: skip


def aggregation_command(directory: str, out: str, master: str) -> list[str]:
    """This module's ``--aggregate``."""
    return [
        sys.executable, "-m", "bench.report_ratio", "--aggregate", directory,
        "--out", out, "--master", master,
    ]  # fmt: skip


def warm_up(code: dict[str, Path], telemetry: Path, tmp: Path, master: str) -> dict[str, float]:
    """Run each revision's report twice, untimed in the figures: the first run writes the
    JVM's class archive (where the revision has one), the second moves it into place.
    Returns the first runs' seconds, a first report's cost on a machine."""
    archives = Path(os.environ[ARCHIVE_ENV])
    first: dict[str, float] = {}
    for column, tree in code.items():
        for turn in range(2):
            out = tmp / "out"
            seconds = timed(report_command(str(telemetry), str(out), master), tree)
            shutil.rmtree(out, ignore_errors=True)
            first.setdefault(column, seconds)
            print(f"warm-up {turn + 1}/2 {column:>12}: {seconds:.1f}s", flush=True)
            for pid_file in archives.glob("*.part.pid"):  # its JVM writes as it exits
                writer = int(pid_file.read_text())
                poll_until(lambda w=writer: not alive(w), timeout=300, every=0.5)
    return first


def timed(cmd: Sequence[str], tree: Path) -> float:
    """Seconds from start to exit of ``cmd`` run with ``tree`` first on the Python path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    done = subprocess.run(list(cmd), cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return seconds


def marginal(sizes: Sequence[int], seconds: Sequence[float]) -> float | None:
    """Seconds per further row: the least-squares slope of ``seconds`` on ``sizes``."""
    rate = past_start_up(
        [
            {"records": n, "total_seconds": {"median": t}}
            for n, t in zip(sizes, seconds, strict=True)
        ]
    )
    return None if rate is None else 1.0 / rate


def figures(sizes: list[int], runs: dict[str, list[dict[int, float]]]) -> dict[str, Any]:
    """Medians per size, whole-run and marginal figures, each column's over the aggregation's.

    ``runs[column]`` holds one ``{size: seconds}`` per round, rounds in the
    same order for every column (the per-round ratios pair them).
    """
    small = min(sizes)
    base = runs[AGGREGATION]
    out: dict[str, Any] = {}
    for column, rounds in runs.items():
        medians = {n: summary([r[n] for r in rounds])["median"] for n in sizes}
        per_row = marginal(sizes, [medians[n] for n in sizes])
        base_row = marginal(sizes, [summary([r[n] for r in base])["median"] for n in sizes])
        round_rows = [marginal(sizes, [r[n] for n in sizes]) for r in rounds]
        round_base = [marginal(sizes, [b[n] for n in sizes]) for b in base]
        paired = [
            a / b for a, b in zip(round_rows, round_base, strict=True) if a and b
        ]  # a round whose larger size ran faster has no slope
        out[column] = {
            "seconds": {str(n): summary([r[n] for r in rounds]) for n in sizes},
            "whole_run": summary([r[small] for r in rounds]),
            "whole_run_ratio": summary(
                [r[small] / b[small] for r, b in zip(rounds, base, strict=True)]
            ),
            "seconds_per_row": per_row,
            "rows_per_second": None if not per_row else 1.0 / per_row,
            "per_row_ratio": None if not (per_row and base_row) else per_row / base_row,
            "per_row_ratio_rounds": summary(paired) if paired else None,
        }
    return out


def _ratio_cell(s: dict[str, float] | None) -> str:
    return "-" if s is None else f"{s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]"


def markdown(data: dict[str, Any]) -> str:
    """The two targets' tables and the report's stages."""
    sizes, small = data["sizes"], min(data["sizes"])
    fig = data["figures"]
    agg = fig[AGGREGATION]
    lines = [
        "# The report against a hand-written aggregation of the same rows",
        "",
        f"`{data['command']}` on {data['master']} ({data['environment']['cpus']} CPUs), "
        f"{data['environment']['when']}. Tenant-shaped synthetic telemetry (8 queues, "
        f"{data['keys']:,} keys, one tenant with 40% of every queue's tasks); "
        f"{data['reps']} rounds, the runs' order rotating from round to round; each run "
        "a program of its own from start to exit. Medians; [min, max] of the rounds' "
        "ratios; spread = (max-min)/median. Each revision's report ran twice before the "
        "rounds (its JVM's class archive written and moved into place, where it has one); "
        "the first of those runs: "
        + ", ".join(f"{c} {t:.1f} s" for c, t in data.get("first_runs", {}).items())
        + ".",
        "",
        f"Whole run on {small:,} rows, Spark's start-up included (target: at most 1.5x):",
        "",
        "| code | seconds (spread) | aggregation s | ratio of medians | ratio per round |",
        "|---|---|---|---|---|",
    ]
    for column, f in fig.items():
        if column == AGGREGATION:
            continue
        w = f["whole_run"]
        lines.append(
            f"| {column} | {w['median']:.1f} ({w['spread']:.0%}) | "
            f"{agg['whole_run']['median']:.1f} ({agg['whole_run']['spread']:.0%}) | "
            f"{w['median'] / agg['whole_run']['median']:.2f}x | "
            f"{_ratio_cell(f['whole_run_ratio'])} |"
        )
    lines += [
        "",
        f"Per row past start-up ({sizes[0]:,} to {sizes[-1]:,} rows: least-squares slope "
        "of time on rows; target: at most 1.5x):",
        "",
        "| code | rows/s | aggregation rows/s | ratio of marginal costs | ratio per round |",
        "|---|---|---|---|---|",
    ]
    for column, f in fig.items():
        if column == AGGREGATION:
            continue
        ratio = f["per_row_ratio"]
        lines.append(
            f"| {column} | {_rate(f['rows_per_second'])} | {_rate(agg['rows_per_second'])} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | "
            f"{_ratio_cell(f['per_row_ratio_rounds'])} |"
        )
    lines += ["", "Seconds per run, medians (spread):", ""]
    lines += ["| code | " + " | ".join(f"{n:,} rows" for n in sizes) + " |"]
    lines += ["|---|" + "---|" * len(sizes)]
    for column, f in fig.items():
        cells = " | ".join(
            f"{f['seconds'][str(n)]['median']:.1f} ({f['seconds'][str(n)]['spread']:.0%})"
            for n in sizes
        )
        lines.append(f"| {column} | {cells} |")
    stages = data.get("stages") or {}
    if stages:
        lines += ["", "The report's own stage timings (`meta.timings`), medians in seconds:", ""]
        names = sorted({s for per in stages.values() for t in per.values() for s in t})
        lines += ["| code | rows | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for column, per in stages.items():
            for n in sizes:
                t = per.get(str(n), {})
                cells = " | ".join(f"{t[s]['median']:.1f}" if s in t else "-" for s in names)
                lines.append(f"| {column} | {n:,} | {cells} |")
    lines += [
        "",
        "The machine is shared: the seconds are indicative, the ratios (taken in one run, "
        "in turns) are the result.",
        "",
    ]
    return "\n".join(lines)


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


@contextmanager
def trees(revisions: Sequence[str], tmp: Path) -> Iterator[dict[str, Path]]:
    """Column name -> source tree: each revision's worktree, or this tree (``HEAD``)."""
    if not revisions:
        yield {"this tree": ROOT}
        return

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout.strip()

    made: dict[str, Path] = {}
    try:
        for rev in revisions:
            commit = git("rev-parse", "--short", rev)
            made[commit] = tmp / f"tree-{commit}"
            git("worktree", "add", "--detach", str(made[commit]), commit)
        yield made
    finally:
        for path in made.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT)


def _report_timings(out: Path) -> dict[str, float]:
    try:
        timings = json.loads((out / "report.json").read_text())["meta"]["timings"]
    except (OSError, KeyError, ValueError):
        return {}
    return {k: float(v) for k, v in timings.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Write the telemetry, run every column at every size in rotating rounds."""
    from tests.harness.synthetic import write_synthetic

    sizes = sorted(int(float(s)) for s in args.sizes.split(","))
    with tempfile.TemporaryDirectory(prefix="celery-fair-ratio-") as tmpdir:
        tmp = Path(tmpdir)
        paths = {}
        for n in sizes:
            paths[n] = tmp / f"n{n}"
            write_synthetic(spec_for("tenants", n, args.keys, 1.2), paths[n])
        # The report keeps a class archive of its JVM (jvm_archive): its first run on
        # a machine writes it, the later ones start from it. Here in this run's
        # directory, written by warm-up runs before the rounds, as a user's earlier
        # report would have.
        os.environ[ARCHIVE_ENV] = str(tmp / "jvm")
        with trees(args.revisions, tmp) as code:
            first_runs = warm_up(code, paths[sizes[0]], tmp, args.master)
            columns = [AGGREGATION, *code]
            runs: dict[str, list[dict[int, float]]] = {c: [] for c in columns}
            stages: dict[str, dict[str, list[dict[str, float]]]] = {c: {} for c in code}
            for rnd in range(args.reps):
                turn = columns[rnd % len(columns) :] + columns[: rnd % len(columns)]
                times: dict[str, dict[int, float]] = {c: {} for c in columns}
                for n in sizes:
                    for column in turn:
                        out = tmp / "out"
                        if column == AGGREGATION:
                            cmd = aggregation_command(str(paths[n]), str(out), args.master)
                            times[column][n] = timed(cmd, ROOT)
                        else:
                            cmd = report_command(str(paths[n]), str(out), args.master)
                            times[column][n] = timed(cmd, code[column])
                            stages[column].setdefault(str(n), []).append(_report_timings(out))
                        shutil.rmtree(out, ignore_errors=True)
                        print(
                            f"round {rnd + 1}/{args.reps} {n:>10,} rows {column:>12}: "
                            f"{times[column][n]:.1f}s",
                            flush=True,
                        )
                for column in columns:
                    runs[column].append(times[column])
    command = f"python -m bench.report_ratio --sizes {args.sizes} --reps {args.reps}"
    command += f" --keys {args.keys}" if args.keys != 2_000 else ""
    command += f" --revisions {' '.join(args.revisions)}" if args.revisions else ""
    command += f" --name {args.name}" if args.name != "report_ratio" else ""
    return {
        "command": command,
        "master": args.master,
        "keys": args.keys,
        "reps": args.reps,
        "sizes": sizes,
        "environment": environment(),
        "runs": {c: [{str(n): t for n, t in r.items()} for r in rs] for c, rs in runs.items()},
        "first_runs": first_runs,
        "figures": figures(sizes, runs),
        "stages": {
            c: {
                n: {s: summary([t[s] for t in ts if s in t]) for s in {k for t in ts for k in t}}
                for n, ts in per.items()
            }
            for c, per in stages.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=SIZES, help="rows; the smallest is the whole run's")
    parser.add_argument("--reps", type=int, default=4, help="rounds")
    parser.add_argument("--keys", type=int, default=2_000, help="tenants (keys of each queue)")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--revisions", nargs="*", default=[], help="the report at these commits")
    parser.add_argument("--name", default="report_ratio", help="result file in bench/results")
    parser.add_argument("--aggregate", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.aggregate:
        return aggregate_main(args.aggregate, args.out, args.master)
    if len(args.sizes.split(",")) < 2:
        parser.error("--sizes needs two sizes at least (the cost per row is a slope)")
    data = run(args)
    write(args.name, data, markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
