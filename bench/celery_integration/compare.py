"""Compare the plain and the celery-fair run test by test; render the result file."""

from __future__ import annotations

import os
import time
from typing import Any

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
BAD = ("failed", "error")
NOT_RUN = "not run"


def compare(
    runs: dict[str, dict[str, Any]],
    env_info: dict[str, Any],
    settings: dict[str, Any],
    command: str,
) -> dict[str, Any]:
    """The result record: versions, counts per run, and every test whose outcome differs."""
    dists = env_info["dists"]
    nodeids = sorted({n for run in runs.values() for n in run["tests"]})
    tests = {n: {mode: _entry(run["tests"].get(n)) for mode, run in runs.items()} for n in nodeids}
    differences, reruns_only, both_bad = [], [], []
    if {"plain", "fair"} <= runs.keys():
        for nodeid, by_mode in tests.items():
            plain, fair = by_mode["plain"], by_mode["fair"]
            if plain["outcome"] != fair["outcome"]:
                differences.append(_difference(nodeid, plain, fair))
            elif plain["reruns"] != fair["reruns"]:
                reruns_only.append(
                    {
                        "test": nodeid,
                        "outcome": plain["outcome"],
                        "plain_reruns": plain["reruns"],
                        "fair_reruns": fair["reruns"],
                        "plain_rerun_why": plain["rerun_why"],
                        "fair_rerun_why": fair["rerun_why"],
                    }
                )
            if plain["outcome"] in BAD and fair["outcome"] in BAD:
                both_bad.append(
                    {
                        "test": nodeid,
                        "plain": plain["outcome"],
                        "fair": fair["outcome"],
                        "plain_error": plain["error"],
                        "fair_error": fair["error"],
                    }
                )
    return {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command,
        "machine": {"cpus": os.cpu_count()},
        "versions": {
            "celery": dists["celery"],
            "kombu": dists["kombu"],
            "redis-py": dists["redis"],
            "billiard": dists["billiard"],
            "python": env_info["python"],
            "pytest": dists["pytest"],
            "pytest-rerunfailures": dists["pytest-rerunfailures"],
            "pytest-timeout": dists["pytest-timeout"],
            "redis-server": env_info.get("redis_server"),
            "celery-fair": dists["celery-fair"],
            "celery-fair source": env_info.get("celery_fair_source"),
            "interpreter": env_info["executable"],
        },
        "settings": settings,
        "runs": {mode: _run_summary(run) for mode, run in runs.items()},
        "differences": differences,
        "regressions": [d["test"] for d in differences if d["kind"] == "regression"],
        "same_outcome_different_reruns": reruns_only,
        "failing_in_both": both_bad,
        "tests": tests,
    }


def _entry(rec: dict[str, Any] | None) -> dict[str, Any]:
    if rec is None:
        rec = {"outcome": NOT_RUN, "reruns": 0, "duration": 0.0}
    text = rec.get("longrepr") or ""
    return {
        "outcome": rec["outcome"],
        "reruns": rec.get("reruns", 0),
        "duration_s": round(rec.get("duration", 0.0), 2),
        "rerun_why": rec.get("rerun_why", []),
        "subtests_failed": rec.get("subtests_failed", []),
        "error": error_line(text) if rec["outcome"] in BAD else "",
        "longrepr": text if rec["outcome"] in BAD else "",
    }


def error_line(text: str) -> str:
    """The most telling line of a pytest failure text (its last ``E`` line)."""
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    if lines:
        # The exception type line, if the last E lines are its continuation.
        typed = [line for line in lines if ":" in line.split(" ")[0] or "Error" in line[:60]]
        return (typed[-1] if typed else lines[-1])[:300]
    stripped = [line for line in text.strip().splitlines() if line.strip()]
    return stripped[-1][:300] if stripped else ""


def _difference(nodeid: str, plain: dict[str, Any], fair: dict[str, Any]) -> dict[str, Any]:
    if plain["outcome"] == "passed" and fair["outcome"] in BAD:
        kind = "regression"
    elif plain["outcome"] in BAD and fair["outcome"] == "passed":
        kind = "improvement"
    elif NOT_RUN in (plain["outcome"], fair["outcome"]):
        kind = "not run in one"
    else:
        kind = "other"
    return {
        "test": nodeid,
        "plain": plain["outcome"],
        "fair": fair["outcome"],
        "kind": kind,
        "plain_reruns": plain["reruns"],
        "fair_reruns": fair["reruns"],
        "plain_error": plain["error"],
        "fair_error": fair["error"],
        "plain_longrepr": plain["longrepr"],
        "fair_longrepr": fair["longrepr"],
    }


def _run_summary(run: dict[str, Any]) -> dict[str, Any]:
    tests = run["tests"].values()
    counts = {o: sum(1 for t in tests if t["outcome"] == o) for o in OUTCOMES}
    meta = run["meta"]
    workers = meta.get("workers", [])
    return {
        "counts": counts,
        "total": len(run["tests"]),
        "reruns": sum(t.get("reruns", 0) for t in tests),
        "wall_s": run["wall_s"],
        "timed_out": run["timed_out"],
        "complete": bool(meta) and not run["timed_out"],
        "pytest_exitstatus": meta.get("exitstatus"),
        "pytest_summary": run.get("summary_line"),
        "celery_fair_installed_apps": meta.get("installed_apps", 0),
        "celery_fair_path": meta.get("celery_fair_path"),
        "workers": workers,
    }


# Markdown ----------------------------------------------------------------------


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _short(nodeid: str) -> str:
    return nodeid.removeprefix("t/integration/")


def render_markdown(result: dict[str, Any]) -> str:
    v = result["versions"]
    s = result["settings"]
    out = [
        f"# Celery {v['celery']} integration tests: plain vs celery-fair (Redis)",
        "",
        f"`{result['command']}` ({result['when']}, {result['machine']['cpus']} CPUs). "
        f"Modules: {', '.join(s['modules'])}"
        + (
            f" (absent in this version: {', '.join(s['modules_missing'])})"
            if s["modules_missing"]
            else ""
        )
        + f"; {s['timeout_per_test_s']:g} s per test, {s['run_timeout_s']:g} s per run; "
        f"reruns: {s['reruns']}; sources: {s['sdist']}.",
        "",
        *_deselected(s["deselected"]),
        "| celery | kombu | redis-py | billiard | Python | pytest | redis-server |",
        "|---|---|---|---|---|---|---|",
        f"| {v['celery']} | {v['kombu']} | {v['redis-py']} | {v['billiard']} | {v['python']} "
        f"| {v['pytest']} | {v['redis-server']} |",
        "",
        "| run | passed | failed | error | skipped | xfailed | xpassed | reruns | wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, run in result["runs"].items():
        c = run["counts"]
        wall = f"{run['wall_s'] / 60:.1f} min" + ("" if run["complete"] else " (interrupted)")
        out.append(
            f"| {mode} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} "
            f"| {c['xfailed']} | {c['xpassed']} | {run['reruns']} | {wall} |"
        )
    fair = result["runs"].get("fair")
    if fair is not None:
        workers = fair["workers"]
        applied = bool(workers) and all(w["fair_step"] for w in workers)
        out += [
            "",
            f"celery-fair run: `celery_fair.install(app)` applied to "
            f"{fair['celery_fair_installed_apps']} apps; the embedded test worker ran the "
            f"celery-fair bootsteps: {'yes' if applied else 'NO'} ({fair['celery_fair_path']}, "
            f"{v['celery-fair source'] or 'installed'}).",
        ]
    out += ["", "## Tests whose outcome differs", ""]
    diffs = result["differences"]
    if not diffs:
        out.append("None: every test has the same outcome in both runs.")
    else:
        out += [
            "| test | plain | celery-fair | kind | error (the failing run) |",
            "|---|---|---|---|---|",
        ]
        for d in diffs:
            error = d["fair_error"] or d["plain_error"]
            out.append(
                f"| `{_cell(_short(d['test']))}` | {_rr(d['plain'], d['plain_reruns'])} "
                f"| {_rr(d['fair'], d['fair_reruns'])} | {d['kind']} | {_cell(error)} |"
            )
    rr = result["same_outcome_different_reruns"]
    if rr:
        out += [
            "",
            "## Same outcome, different number of reruns",
            "",
            "| test | outcome | plain reruns | celery-fair reruns | why (first rerun) |",
            "|---|---|---|---|---|",
        ]
        for r in rr:
            why = (r["fair_rerun_why"] or r["plain_rerun_why"] or [""])[0]
            out.append(
                f"| `{_cell(_short(r['test']))}` | {r['outcome']} | {r['plain_reruns']} "
                f"| {r['fair_reruns']} | {_cell(why)} |"
            )
    both = result["failing_in_both"]
    if both:
        out += [
            "",
            "## Failing in both runs (not celery-fair)",
            "",
            "| test | error (plain) |",
            "|---|---|",
        ]
        for b in both:
            out.append(f"| `{_cell(_short(b['test']))}` | {_cell(b['plain_error'])} |")
    out += [
        "",
        "Per-test outcomes, durations and failure texts: the JSON file of the same name. "
        "How to read this: bench/celery_integration/README.md.",
        "",
    ]
    return "\n".join(out)


def _deselected(deselected: dict[str, str]) -> list[str]:
    if not deselected:
        return []
    lines = ["Deselected in both runs:", ""]
    lines += [f"* `{_short(nodeid)}`: {reason}" for nodeid, reason in deselected.items()]
    return [*lines, ""]


def _rr(outcome: str, reruns: int) -> str:
    return f"{outcome} ({reruns} reruns)" if reruns else outcome
