"""Compare each run with the plain one test by test; render the result file."""

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
    """The result record: versions, counts per run, and every test whose outcome differs.

    Every run other than ``plain`` is compared with ``plain``, test by test.
    """
    dists = env_info["dists"]
    nodeids = sorted({n for run in runs.values() for n in run["tests"]})
    tests = {n: {mode: _entry(run["tests"].get(n)) for mode, run in runs.items()} for n in nodeids}
    others = [mode for mode in runs if mode != "plain"]
    differences, reruns_only, all_bad = [], [], []
    if "plain" in runs and others:
        for nodeid, by_mode in tests.items():
            plain = by_mode["plain"]
            kinds = {
                mode: _kind(plain["outcome"], by_mode[mode]["outcome"])
                for mode in others
                if by_mode[mode]["outcome"] != plain["outcome"]
            }
            if kinds:
                differences.append(_difference(nodeid, by_mode, kinds))
            elif len({e["reruns"] for e in by_mode.values()}) > 1:
                reruns_only.append(
                    {
                        "test": nodeid,
                        "outcome": plain["outcome"],
                        "reruns": {mode: e["reruns"] for mode, e in by_mode.items()},
                        "rerun_why": {mode: e["rerun_why"] for mode, e in by_mode.items()},
                    }
                )
            if all(e["outcome"] in BAD for e in by_mode.values()):
                all_bad.append(
                    {
                        "test": nodeid,
                        "outcomes": {mode: e["outcome"] for mode, e in by_mode.items()},
                        "errors": {mode: e["error"] for mode, e in by_mode.items()},
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
        "run_order": list(runs),  # the JSON file sorts its keys
        "runs": {mode: _run_summary(run) for mode, run in runs.items()},
        "differences": differences,
        "regressions": {
            mode: [d["test"] for d in differences if d["kinds"].get(mode) == "regression"]
            for mode in others
        },
        "same_outcome_different_reruns": reruns_only,
        "failing_in_all": all_bad,
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


def _kind(plain: str, other: str) -> str:
    if plain == "passed" and other in BAD:
        return "regression"
    if plain in BAD and other == "passed":
        return "improvement"
    if NOT_RUN in (plain, other):
        return "not run in one"
    return "other"


def _difference(
    nodeid: str, by_mode: dict[str, dict[str, Any]], kinds: dict[str, str]
) -> dict[str, Any]:
    return {
        "test": nodeid,
        "outcomes": {mode: e["outcome"] for mode, e in by_mode.items()},
        "kinds": kinds,
        "reruns": {mode: e["reruns"] for mode, e in by_mode.items()},
        "errors": {mode: e["error"] for mode, e in by_mode.items() if e["error"]},
        "longreprs": {mode: e["longrepr"] for mode, e in by_mode.items() if e["longrepr"]},
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
        "celery_fair_keyed_apps": meta.get("keyed_apps", 0),
        "celery_fair_keys": meta.get("celery_fair_keys", False),
        "celery_fair_path": meta.get("celery_fair_path"),
        "worker_mode": meta.get("worker_mode", "embedded"),
        "session_worker_fixture_replaced": meta.get("session_worker_fixture_replaced", False),
        "workers": workers,
    }


# Markdown ----------------------------------------------------------------------


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _short(nodeid: str) -> str:
    return nodeid.removeprefix("t/integration/")


#: What each run is, for the Markdown.
RUN_LABELS = {
    "plain": "plain Celery",
    "fair": "`celery_fair.install(app)` on every app",
    "keyed": "the same, and `fair_keys` on the suite's queue: every task keyed by its name",
}


def render_markdown(result: dict[str, Any]) -> str:
    v = result["versions"]
    s = result["settings"]
    modes = _run_order(result)
    worker = s.get("worker", "embedded")
    names = {"fair": "celery-fair", "keyed": "celery-fair with keys"}
    title = ", ".join(names.get(m, m) for m in modes)
    worker_title = "`celery worker` subprocess" if worker == "subprocess" else "embedded worker"
    out = [
        f"# Celery {v['celery']} integration tests: {title} (Redis, {worker_title})",
        "",
        f"`{result['command']}` ({result['when']}, {result['machine']['cpus']} CPUs). "
        f"Modules: {', '.join(s['modules'])}"
        + (
            f" (absent in this version: {', '.join(s['modules_missing'])})"
            if s["modules_missing"]
            else ""
        )
        + f"; {s['timeout_per_test_s']:g} s per test, {s['run_timeout_s']:g} s per run; "
        f"reruns: {s['reruns']}; sources: {s['sdist']}; celery-fair: "
        f"{v['celery-fair source'] or 'installed'}.",
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
    for mode in modes:
        run = result["runs"][mode]
        c = run["counts"]
        wall = f"{run['wall_s'] / 60:.1f} min" + ("" if run["complete"] else " (interrupted)")
        out.append(
            f"| {mode} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} "
            f"| {c['xfailed']} | {c['xpassed']} | {run['reruns']} | {wall} |"
        )
    out += ["", *_runs_described({m: result["runs"][m] for m in modes}, worker)]
    out += ["", "## Tests whose outcome differs from plain", ""]
    diffs = result["differences"]
    if not diffs:
        out.append("None: every test has the same outcome in every run.")
    else:
        out += [
            "| test | " + " | ".join(modes) + " | differs | error (first failing run) |",
            "|---|" + "---|" * len(modes) + "---|---|",
        ]
        for d in diffs:
            cells = " | ".join(_rr(d["outcomes"][m], d["reruns"][m]) for m in modes)
            kinds = ", ".join(f"{m}: {k}" for m, k in d["kinds"].items())
            error = _first_failure(result, d["test"], modes)
            out.append(f"| `{_cell(_short(d['test']))}` | {cells} | {kinds} | {_cell(error)} |")
    rr = result["same_outcome_different_reruns"]
    if rr:
        out += [
            "",
            "## Same outcome, different number of reruns",
            "",
            "| test | outcome | " + " | ".join(f"{m} reruns" for m in modes) + " | why (first) |",
            "|---|---|" + "---|" * len(modes) + "---|",
        ]
        for r in rr:
            why = next((w[0] for w in r["rerun_why"].values() if w), "")
            counts = " | ".join(str(r["reruns"][m]) for m in modes)
            test = _cell(_short(r["test"]))
            out.append(f"| `{test}` | {r['outcome']} | {counts} | {_cell(why)} |")
    bad = result["failing_in_all"]
    if bad:
        out += [
            "",
            "## Failing in every run (not celery-fair)",
            "",
            "| test | error (plain) |",
            "|---|---|",
        ]
        for b in bad:
            error = b["errors"].get("plain") or next(iter(b["errors"].values()), "")
            out.append(f"| `{_cell(_short(b['test']))}` | {_cell(error)} |")
    out += [
        "",
        "Per-test outcomes, durations and failure texts: the JSON file of the same name. "
        "How to read this: bench/celery_integration/README.md.",
        "",
    ]
    return "\n".join(out)


def _run_order(result: dict[str, Any]) -> list[str]:
    order = result.get("run_order")
    if order:
        return list(order)
    known = ("plain", "fair", "keyed")
    return sorted(result["runs"], key=lambda m: (known.index(m) if m in known else len(known), m))


def _first_failure(result: dict[str, Any], nodeid: str, modes: list[str]) -> str:
    """The last E line of the first failing run, and its first attempt's if it was rerun.

    A flaky test's later attempts often fail only because of the earlier ones
    (what they left on the worker); the first attempt says what went wrong.
    """
    for mode in modes:
        entry = result["tests"][nodeid][mode]
        if entry["outcome"] in BAD:
            first = (entry.get("rerun_why") or [""])[0].removeprefix("E").strip()
            if first and first != entry["error"]:
                return f"first attempt: {first}; last: {entry['error']}"
            return str(entry["error"])
    return ""


def _runs_described(runs: dict[str, Any], worker: str) -> list[str]:
    """One line per run: what it installed, and the worker the suite's tests ran against."""
    lines = []
    for mode, run in runs.items():
        text = f"* **{mode}**: {RUN_LABELS.get(mode, mode)}"
        if run["celery_fair_keys"]:
            text += (
                f" ({run['celery_fair_installed_apps']} apps, {run['celery_fair_keyed_apps']} "
                "of them keyed: those on the Redis broker)"
            )
        elif mode != "plain":
            text += f" ({run['celery_fair_installed_apps']} apps)"
        session = [w for w in run["workers"] if w.get("kind") in ("subprocess", "embedded")]
        if worker == "subprocess" and not run["session_worker_fixture_replaced"]:
            text += "; the suite's worker fixture was NOT replaced: the run is void"
        for w in session:
            text += "; " + _worker_line(w, fair=mode != "plain")
        if not session:
            text += "; no session worker became ready"
        lines.append(text + ".")
    return lines


def _worker_line(w: dict[str, Any], *, fair: bool) -> str:
    if w["kind"] == "embedded":
        text = "the embedded test worker (mingle, gossip, heartbeat off)"
    else:
        on = [name for name in ("mingle", "gossip", "heart") if w.get(name)]
        off = [name for name in ("mingle", "gossip", "heart") if not w.get(name)]
        pool = str(w.get("pool", "?")).rsplit(".", 1)[-1]
        text = (
            f"worker `{' '.join(w.get('argv', []))}` ({pool}, "
            f"concurrency {w.get('concurrency', '?')}; on: {', '.join(on) or 'none'}"
            + (f"; OFF: {', '.join(off)}" if off else "")
            + f"), stopped by {w.get('stopped_by', '?')} with exit status "
            f"{w.get('exit_status', '?')}"
        )
        if w.get("log_errors"):
            text += f"; its log has {len(w['log_errors'])} CRITICAL line(s)"
    applied = w.get("fair_step") and w.get("fair_service")
    if fair or applied:
        text += f"; celery-fair bootsteps in the worker: {'yes' if applied else 'NO (void)'}"
    fallbacks = (w.get("fair_stats") or {}).get("compat_fallbacks")
    if fallbacks:
        text += f"; compatibility fallbacks taken: {', '.join(sorted(fallbacks))}"
    keys = (w.get("fair_stats") or {}).get("keys")
    if keys:
        served = sum((keys.get("served") or {}).values())
        unkeyed = sum((keys.get("unkeyed") or {}).values())
        top = keys.get("top") or []
        text += (
            f"; keyed queues {', '.join(keys.get('queues') or [])}: {served} tasks served by key"
            f" ({unkeyed} without a key), {len(top)} busiest keys e.g. "
            + ", ".join(f"{k} {n}" for _q, k, n in top[:3])
        )
    return text


def _deselected(deselected: dict[str, str]) -> list[str]:
    if not deselected:
        return []
    lines = ["Deselected in every run:", ""]
    lines += [f"* `{_short(nodeid)}`: {reason}" for nodeid, reason in deselected.items()]
    return [*lines, ""]


def _rr(outcome: str, reruns: int) -> str:
    return f"{outcome} ({reruns} reruns)" if reruns else outcome
