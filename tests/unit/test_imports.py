"""Import hygiene: the package and its pure core load nothing they do not need.

Each check runs in a fresh interpreter: this test process has long imported
everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("celery.worker", "celery.app.control", "kombu.transport", "pyarrow", "pyspark", "redis")


def loaded_after(statement: str) -> list[str]:
    code = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        f"{statement}\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout.splitlines()[-1]))


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith(HEAVY)]


def test_the_pure_core_imports_nothing_of_celery_or_kombu() -> None:
    loaded = loaded_after("import celery_fair.scheduling.drr, celery_fair.scheduling.codel")
    assert not [m for m in loaded if m.split(".")[0] in ("celery", "kombu", "click", "redis")]
    assert len(loaded) < 60, len(loaded)


def test_import_celery_fair_loads_no_worker_until_install() -> None:
    assert heavy(loaded_after("import celery_fair")) == []
    # The public names resolve, still without the worker ...
    assert heavy(loaded_after("import celery_fair; celery_fair.ConsistentHashRouter")) == []
    # ... which install() brings in.
    installed = loaded_after(
        "import celery, celery_fair; celery_fair.install(celery.Celery(set_as_current=False))"
    )
    assert "celery.worker.control" in installed


def test_the_ring_command_works_without_pyarrow() -> None:
    code = (
        "import sys\n"
        "sys.modules['pyarrow'] = None  # as on a base install: importing it fails\n"
        "from celery_fair.cli import main\n"
        "sys.exit(main(['ring', '--queues', 'a=1,b=3', '--keys', '4000', '--json']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert {row["queue"] for row in report["before"]} == {"a", "b"}


def test_the_command_lines_parser_loads_no_celery_kombu_or_broker_client() -> None:
    # Every `celery-fair` and `celery fair` command builds the whole parser: a
    # subcommand's module keeps its broker and worker imports in its handler.
    loaded = loaded_after("from celery_fair.cli import build_parser; build_parser()")
    assert [m for m in loaded if m.split(".")[0] in ("celery", "kombu", "redis", "pyspark")] == []
