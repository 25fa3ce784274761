"""A benchmark at several git revisions, in turn, to place a change of speed.

A single run per revision cannot say whether a revision is slower: on two cores the
spread between repetitions of the same cell reaches 30%.  This runs the benchmark at
each revision in rotation (A B C, B C A, ...), so a drift of the machine's speed falls
on every revision alike, and compares the medians and each round's ratio to the first
revision.  Two benchmarks:

* ``--bench dwrr`` (default): one DWRR article cell, each run with plain Celery and
  celery-fair one after the other (``bench.dwrr_article --reps 1``); the ratio is each
  run's fair/plain.
* ``--bench analytics``: the Spark report on the tenant-shaped telemetry
  (``bench.analytics --shape tenants``, one repetition per size of ``--sizes``); the
  figure is each run's rate past start-up, over the first revision's in the same round.
* ``--bench capacity``: the broker's CPU per task for each fetch path of ``--paths``
  (``bench.redis_capacity --reps 1 --servers redis``, plain ``BRPOP`` always among
  them); the figure is each path's CPU per task over ``BRPOP``'s in the same run.
* ``--bench cost``: real workers (``bench.broker_cost --reps 1``, its variants of
  ``--variants``, plain Celery always among them); the figures are each variant's
  broker CPU per task (publish and drain) and its throughput, over plain Celery's in
  the same run.

    python -m bench.revisions 3b1ec81 HEAD --reps 6 [--pool threads] [--task-us 0]
    python -m bench.revisions d33092b HEAD --bench analytics --reps 4
    python -m bench.revisions 88d667e HEAD --bench capacity --bench-at HEAD --reps 3
    python -m bench.revisions 88d667e HEAD --bench cost --bench-at HEAD --reps 3

Each revision is checked out in a temporary ``git worktree`` (removed at the end)
and runs with the interpreter running this module.  ``--bench-at REV`` runs the
benchmark of one revision (its ``bench/`` directory) against every revision's package,
so that code from before a benchmark, or one of its options, existed can be measured
with it (the package's API that the benchmark calls must exist there):

    python -m bench.revisions 32f68c4 HEAD --bench analytics --bench-at HEAD --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import environment, summary, write

ROOT = Path(__file__).resolve().parent.parent
RUN_NAME = "_revision_run"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def _bench_json(tree: Path, cmd: list[str], timeout: float) -> Any:
    """Run a benchmark (``--name RUN_NAME``) with ``tree``'s package; its JSON results."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, timeout=timeout)
    return json.loads((tree / "bench" / "results" / f"{RUN_NAME}.json").read_text())


def _one_run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    if args.bench == "analytics":
        return _analytics_run(tree, args)
    if args.bench == "capacity":
        return _capacity_run(tree, args)
    if args.bench == "cost":
        return _cost_run(tree, args)
    cmd = [
        sys.executable, "-m", "bench.dwrr_article", "--broker", args.broker,
        "--reps", "1", "--pools", args.pool, "--task-us", str(args.task_us),
        "--name", RUN_NAME,
    ]  # fmt: skip
    data = _bench_json(tree, cmd, timeout=900)
    case = next(iter(data["cases"].values()))
    return {
        "plain": case["plain"]["throughput"]["median"],
        "fair": case["fair"]["throughput"]["median"],
        "p9_over_p0": case["fair"]["p9_over_p0"]["median"],
    }


def _analytics_run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """One ``bench.analytics`` run: the rate past start-up, each size's time and stages."""
    sizes = args.sizes.split(",")
    cmd = [
        sys.executable, "-m", "bench.analytics", "--shape", "tenants", "--sizes", args.sizes,
        "--reps", ",".join("1" for _ in sizes), "--name", RUN_NAME,
    ]  # fmt: skip
    data = _bench_json(tree, cmd, timeout=3600)
    res = {"past_start_up": float(data["past_start_up"] or "nan")}
    for size in data["sizes"]:
        n = size["records"]
        res[f"total {n}"] = size["total_seconds"]["median"]
        for stage, times in size["stages"].items():
            res[f"{stage} {n}"] = times["median"]
    return res


def _capacity_paths(args: argparse.Namespace) -> list[str]:
    paths = args.paths.split(",")
    return paths if "brpop" in paths else ["brpop", *paths]


def _capacity_run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """One ``bench.redis_capacity`` run on Redis: each path's CPU µs per task."""
    cmd = [
        sys.executable, "-m", "bench.redis_capacity", "--reps", "1", "--servers", "redis",
        "--paths", ",".join(_capacity_paths(args)), "--tasks", str(args.tasks),
        "--name", RUN_NAME,
    ]  # fmt: skip
    data = _bench_json(tree, cmd, timeout=1800)
    return {path: reps[0]["cpu_us_per_task"] for path, reps in data["results"]["redis"].items()}


def _cost_variants(args: argparse.Namespace) -> list[str]:
    variants = args.variants.split(",")
    return variants if "plain" in variants else ["plain", *variants]


def _cost_run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """One ``bench.broker_cost`` round: per variant, CPU and throughput over plain's."""
    cmd = [
        sys.executable, "-m", "bench.broker_cost", "--reps", "1",
        "--variants", ",".join(_cost_variants(args)), "--tasks", str(args.tasks),
        "--name", RUN_NAME,
        # Only when asked: a revision's benchmark before --broker has no such option.
        *(["--broker", args.broker] if args.broker != "redis" else []),
    ]  # fmt: skip
    data = _bench_json(tree, cmd, timeout=3600)
    out: dict[str, float] = {}
    for variant, r in data["results"].items():
        out[f"{variant} cpu"] = r["x_plain"]["median"]
        out[f"{variant} tasks/s"] = r["throughput_x_plain"]["median"]
        out[f"{variant} per call"] = r["per_call"] or 1.0
        if r.get("publish_rate_x_plain"):
            out[f"{variant} publishes/s"] = r["publish_rate_x_plain"]["median"]
    return out


def _line(commit: str, res: dict[str, float], first: dict[str, float] | None) -> str:
    if "plain cpu" in res:
        return f"{commit} " + "  ".join(
            f"{k} {v:.2f}" for k, v in res.items() if not k.startswith("plain")
        )
    if "brpop" in res:
        return f"{commit} " + "  ".join(
            f"{path} {us:.1f} us ({us / res['brpop']:.2f}x)" for path, us in res.items()
        )
    if "past_start_up" not in res:
        return (
            f"{commit} plain {res['plain']:6.0f} fair {res['fair']:6.0f}"
            f" tasks/s  fair/plain {res['fair'] / res['plain']:.1%}"
        )
    ratio = "" if first is None else f"  x{res['past_start_up'] / first['past_start_up']:.2f}"
    return f"{commit} past start-up {res['past_start_up']:10,.0f} events/s{ratio}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    commits = {rev: _git("rev-parse", "--short", rev) for rev in args.revisions}
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in commits.values()}
    # Resolved here: inside a worktree, HEAD would name the worktree's revision.
    bench_at = _git("rev-parse", "--short", args.bench_at) if args.bench_at else None
    args.bench_at = bench_at  # the results name the commit
    with tempfile.TemporaryDirectory(prefix="celery-fair-revisions-") as tmp:
        trees = {}
        for commit in runs:
            trees[commit] = Path(tmp) / commit
            _git("worktree", "add", "--detach", str(trees[commit]), commit)
            if bench_at:
                _git("-C", str(trees[commit]), "checkout", bench_at, "--", "bench")
        try:
            order = list(runs)
            for rep in range(args.reps):
                turn = order[rep % len(order) :] + order[: rep % len(order)]
                for commit in turn:
                    res = _one_run(trees[commit], args)
                    runs[commit].append(res)
                    first = runs[order[0]][rep] if len(runs[order[0]]) > rep else None
                    print(f"rep {rep} {_line(commit, res, first)}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    if args.bench == "analytics":
        return _analytics_results(args, commits, runs)
    if args.bench == "capacity":
        return _capacity_results(args, commits, runs)
    if args.bench == "cost":
        return _cost_results(args, commits, runs)
    cases = {}
    for commit, reps in runs.items():
        cases[commit] = {
            "plain": summary([r["plain"] for r in reps]),
            "fair": summary([r["fair"] for r in reps]),
            "ratio": summary([r["fair"] / r["plain"] for r in reps]),
            "p9_over_p0": statistics.median(r["p9_over_p0"] for r in reps),
            "runs": reps,
        }
    return {"env": environment(), "params": vars(args), "commits": commits, "cases": cases}


def _analytics_results(
    args: argparse.Namespace, commits: dict[str, str], runs: dict[str, list[dict[str, float]]]
) -> dict[str, Any]:
    base = runs[next(iter(runs))]
    cases = {
        commit: {
            "figures": {k: summary([r[k] for r in reps]) for k in reps[0]},
            # Round by round: a revision's rate over the first revision's.
            "ratio": summary(
                [r["past_start_up"] / b["past_start_up"] for r, b in zip(reps, base, strict=True)]
            ),
            "runs": reps,
        }
        for commit, reps in runs.items()
    }
    return {"env": environment(), "params": vars(args), "commits": commits, "cases": cases}


def _capacity_results(
    args: argparse.Namespace, commits: dict[str, str], runs: dict[str, list[dict[str, float]]]
) -> dict[str, Any]:
    cases = {
        commit: {
            "cpu_us": {p: summary([r[p] for r in reps]) for p in reps[0]},
            # Run by run: a path's CPU per task over BRPOP's in the same run.
            "x_brpop": {p: summary([r[p] / r["brpop"] for r in reps]) for p in reps[0]},
            "runs": reps,
        }
        for commit, reps in runs.items()
    }
    return {"env": environment(), "params": vars(args), "commits": commits, "cases": cases}


def _cost_results(
    args: argparse.Namespace, commits: dict[str, str], runs: dict[str, list[dict[str, float]]]
) -> dict[str, Any]:
    cases = {
        commit: {"figures": {k: summary([r[k] for r in reps]) for k in reps[0]}, "runs": reps}
        for commit, reps in runs.items()
    }
    return {"env": environment(), "params": vars(args), "commits": commits, "cases": cases}


def _reproduce(results: dict[str, Any], options: str, each_run: str) -> str:
    """The line that says how a run was made: the command, when, what each run was."""
    p, at = results["params"], results["params"].get("bench_at")
    return (
        f"Reproduce: `python -m bench.revisions {' '.join(p['revisions'])} --bench {p['bench']} "
        f"{options} --reps {p['reps']}"
        + (f" --bench-at {at}" if at else "")
        + f"` ({results['env']['when']}; revisions in rotation, each run {each_run}"
        + (f", the benchmark's code from {at}" if at else "")
        + ")."
    )


def _cost_markdown(results: dict[str, Any]) -> str:
    p = results["params"]
    variants = [v for v in p["variants"].split(",") if v != "plain"]
    lines = [
        "# Real workers' broker cost at several revisions, against plain Celery",
        "",
        _reproduce(
            results,
            f"--variants {p['variants']} --tasks {p['tasks']} --broker {p.get('broker', 'redis')}",
            "`python -m bench.broker_cost --reps 1`: one `celery worker -P threads -c 4` "
            f"per variant on a fresh {p.get('broker', 'redis')} broker, plain Celery in the "
            "same run",
        )
        + " Each cell: median [min, max] over the runs of a revision of the figure over "
        "plain Celery's in the same run. A revision whose `inspect fair_stats` has no "
        "`atomic_fetch.calls` took one message per fetch call: 1.0.",
        "",
        "| revision | variant | broker CPU per task x plain | tasks/s x plain "
        "| one producer's publishes/s x plain | messages per fetch call |",
        "|---|---|---|---|---|---|",
    ]

    def cell(s: dict[str, float] | None) -> str:
        return "-" if s is None else f"{s['median']:.2f}x [{s['min']:.2f}, {s['max']:.2f}]"

    for commit, c in results["cases"].items():
        f = c["figures"]
        for v in variants:
            lines.append(
                f"| {commit} | {v} | {cell(f[f'{v} cpu'])} | {cell(f[f'{v} tasks/s'])} "
                f"| {cell(f.get(f'{v} publishes/s'))} | {f[f'{v} per call']['median']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def _capacity_markdown(results: dict[str, Any]) -> str:
    p = results["params"]
    paths = list(next(iter(results["cases"].values()))["cpu_us"])
    lines = [
        "# The broker's CPU per task at several revisions",
        "",
        _reproduce(
            results,
            f"--paths {p['paths']} --tasks {p['tasks']}",
            "`python -m bench.redis_capacity --reps 1 --servers redis`",
        )
        + " Each cell: the path's CPU per task over BRPOP's in the same run, median "
        "[min, max], then the median µs per task.",
        "",
        "| revision | " + " | ".join(paths) + " |",
        "|---|" + "---|" * len(paths),
    ]
    for commit, c in results["cases"].items():
        cells = []
        for path in paths:
            x, us = c["x_brpop"][path], c["cpu_us"][path]["median"]
            cells.append(f"{x['median']:.2f}x [{x['min']:.2f}, {x['max']:.2f}], {us:.1f} µs")
        lines.append(f"| {commit} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _analytics_markdown(results: dict[str, Any]) -> str:
    p = results["params"]
    sizes = [int(n) for n in p["sizes"].split(",")]
    first = next(iter(results["cases"]))
    lines = [
        "# The Spark report at several revisions",
        "",
        _reproduce(
            results,
            f"--sizes {p['sizes']}",
            "`python -m bench.analytics --shape tenants` with one repetition per size",
        )
        + " Medians over the runs of a revision, [min, max].",
        "",
        f"| revision | past start-up, events/s | over {first}'s in the same round | "
        + " | ".join(f"{n:,} records, s" for n in sizes)
        + " |",
        "|---|---|---|" + "---|" * len(sizes),
    ]
    for commit, c in results["cases"].items():
        f, r = c["figures"], c["ratio"]
        lines.append(
            f"| {commit} | {f['past_start_up']['median']:,.0f} "
            f"[{f['past_start_up']['min']:,.0f}, {f['past_start_up']['max']:,.0f}] "
            f"| {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}] | "
            + " | ".join(f"{f[f'total {n}']['median']:.1f}" for n in sizes)
            + " |"
        )
    figures = results["cases"][first]["figures"]
    stages = sorted({k.split()[0] for k in figures if " " in k} - {"total"})
    lines += [
        "",
        f"Stages at {sizes[-1]:,} records, medians in seconds:",
        "",
        "| revision | " + " | ".join(stages) + " |",
        "|---|" + "---|" * len(stages),
    ]
    for commit, c in results["cases"].items():
        lines.append(
            f"| {commit} | "
            + " | ".join(f"{c['figures'][f'{s} {sizes[-1]}']['median']:.1f}" for s in stages)
            + " |"
        )
    return "\n".join(lines) + "\n"


def markdown(results: dict[str, Any]) -> str:
    p = results["params"]
    if p.get("bench") == "analytics":
        return _analytics_markdown(results)
    if p.get("bench") == "capacity":
        return _capacity_markdown(results)
    if p.get("bench") == "cost":
        return _cost_markdown(results)
    lines = [
        f"# The DWRR article's {p['pool']}/"
        f"{'noop' if p['task_us'] == 0 else str(p['task_us']) + 'us'} cell at several revisions",
        "",
        f"Reproduce: `python -m bench.revisions {' '.join(p['revisions'])} --reps {p['reps']} "
        f"--pool {p['pool']} --task-us {p['task_us']} --broker {p['broker']}` "
        f"({results['env']['when']}, celery {results['env']['celery']}, "
        f"kombu {results['env']['kombu']}; revisions in rotation, each run plain then fair).",
        "",
        "| revision | plain tasks/s median (spread) | celery-fair tasks/s median (spread) "
        "| fair/plain per run, median [min, max] | p9/p0 |",
        "|---|---|---|---|---|",
    ]
    for commit, c in results["cases"].items():
        lines.append(
            f"| {commit} | {c['plain']['median']:.0f} ({c['plain']['spread']:.0%}) "
            f"| {c['fair']['median']:.0f} ({c['fair']['spread']:.0%}) "
            f"| {c['ratio']['median']:.1%} [{c['ratio']['min']:.1%}, {c['ratio']['max']:.1%}] "
            f"| {c['p9_over_p0']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="+", help="git revisions, e.g. 3b1ec81 HEAD")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--pool", default="threads")
    parser.add_argument("--task-us", type=int, default=0)
    parser.add_argument("--broker", choices=["redis", "rabbitmq"], default="redis")
    parser.add_argument(
        "--bench", choices=["dwrr", "analytics", "capacity", "cost"], default="dwrr"
    )
    parser.add_argument(
        "--paths", default="atomic,keyed-10,keyed-10000", help="fetch paths, with --bench capacity"
    )
    parser.add_argument(
        "--variants", default="fair,keyed-1000,limits-1000", help="variants, with --bench cost"
    )
    parser.add_argument("--tasks", type=int, default=12_000, help="tasks per path or variant")
    parser.add_argument(
        "--sizes", default="1000000,4000000,10000000", help="records, with --bench analytics"
    )
    parser.add_argument(
        "--bench-at", default=None, help="run this revision's bench/ against every revision"
    )
    parser.add_argument("--name", default=None, help="result file (revisions, revisions_analytics)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if args.name is None:
        args.name = "revisions" if args.bench == "dwrr" else f"revisions_{args.bench}"
    results = run(args)
    write(args.name, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
