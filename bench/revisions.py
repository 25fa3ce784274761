"""One DWRR article cell at several git revisions, in turn, to place a throughput change.

A single run per revision cannot say whether a revision is slower: on two cores the
spread between repetitions of the same cell reaches 30%.  This runs the cell at each
revision in rotation (A B C, B C A, ...), every run with plain Celery and celery-fair
one after the other (``bench.dwrr_article --reps 1``), so a drift of the machine's
speed falls on every revision alike, and compares the medians and each run's
fair/plain ratio.

    python -m bench.revisions 3b1ec81 HEAD --reps 6 [--pool threads] [--task-us 0]

Each revision is checked out in a temporary ``git worktree`` (removed at the end)
and runs with the interpreter running this module.
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


def _one_run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    cmd = [
        sys.executable, "-m", "bench.dwrr_article", "--broker", args.broker,
        "--reps", "1", "--pools", args.pool, "--task-us", str(args.task_us),
        "--name", RUN_NAME,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, timeout=900)
    data = json.loads((tree / "bench" / "results" / f"{RUN_NAME}.json").read_text())
    case = next(iter(data["cases"].values()))
    return {
        "plain": case["plain"]["throughput"]["median"],
        "fair": case["fair"]["throughput"]["median"],
        "p9_over_p0": case["fair"]["p9_over_p0"]["median"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    commits = {rev: _git("rev-parse", "--short", rev) for rev in args.revisions}
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in commits.values()}
    with tempfile.TemporaryDirectory(prefix="celery-fair-revisions-") as tmp:
        trees = {}
        for commit in runs:
            trees[commit] = Path(tmp) / commit
            _git("worktree", "add", "--detach", str(trees[commit]), commit)
        try:
            order = list(runs)
            for rep in range(args.reps):
                turn = order[rep % len(order) :] + order[: rep % len(order)]
                for commit in turn:
                    res = _one_run(trees[commit], args)
                    runs[commit].append(res)
                    print(
                        f"rep {rep} {commit} plain {res['plain']:6.0f} fair {res['fair']:6.0f}"
                        f" tasks/s  fair/plain {res['fair'] / res['plain']:.1%}",
                        flush=True,
                    )
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
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


def markdown(results: dict[str, Any]) -> str:
    p = results["params"]
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
    parser.add_argument("--name", default="revisions")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    results = run(args)
    write(args.name, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
