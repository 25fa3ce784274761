"""``bench.revisions``' cost table: each variant's figures over plain Celery's."""

from __future__ import annotations

from bench.revisions import _cost_markdown


def _s(x: float) -> dict[str, float]:
    return {"median": x, "min": x - 0.1, "max": x + 0.1}


def test_the_cost_table_gives_the_publish_rate_when_the_runs_measured_it() -> None:
    figures = {"capped-1000 cpu": _s(2.9), "capped-1000 tasks/s": _s(0.6),
               "capped-1000 per call": _s(1.0)}  # fmt: skip
    results = {
        "env": {"when": "now"},
        "params": {"revisions": ["a", "b"], "bench": "cost", "reps": 3, "tasks": 12000,
                   "variants": "plain,capped-1000", "broker": "rabbitmq", "bench_at": None},
        "cases": {"a": {"figures": figures},
                  "b": {"figures": {**figures, "capped-1000 publishes/s": _s(0.25)}}},
    }  # fmt: skip
    table = _cost_markdown(results)
    assert "--broker rabbitmq" in table and "fresh rabbitmq broker" in table
    rows = [
        line for line in table.splitlines() if line.startswith("| a ") or line.startswith("| b ")
    ]
    assert rows[0].split(" | ")[4] == "-"  # run before the rate was recorded
    assert rows[1].split(" | ")[4] == "0.25x [0.15, 0.35]"
    assert rows[1].split(" | ")[2] == "2.90x [2.80, 3.00]"
