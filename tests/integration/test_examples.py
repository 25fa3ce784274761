"""The example projects run as documented, against a real broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis as redis_lib

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUEUES = ["premium", "std.0", "std.1", "std.2", "std.3"]


def test_multitenant_project_runs_as_its_readme_says(redis_url: str, tmp_path: Path) -> None:
    cwd = EXAMPLES / "multitenant"
    env = {**os.environ, "BROKER_URL": redis_url, "PYTHONPATH": str(cwd)}
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "proj", "worker", "-P", "prefork", "-c", "2",
         "-Q", ",".join(QUEUES), "-l", "INFO", "-n", f"example-{os.getpid()}@%h"],
        cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        published = subprocess.run(
            [sys.executable, "publish.py", "--tasks", "66"], cwd=cwd, env=env,
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert "initech" in published.stdout
        client = redis_lib.Redis.from_url(redis_url)
        deadline = time.monotonic() + 90
        text = ""
        while text.count("succeeded in") < 66:
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, text[-3000:]
            time.sleep(0.2)
            text = (tmp_path / "worker.log").read_text(errors="replace")
        assert sum(client.llen(q) for q in QUEUES) == 0
        # Premium tenants went to their own queue; the flood to one standard shard.
        # The start line names the consumed queues and the weights in force.
        assert "celery-fair: DWRR fetch order on premium, std.0, std.1, std.2, std.3" in text
        assert "'premium': 4.0, 'std.0': 1.0" in text
        stats = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "proj", "inspect", "fair_stats",
             "-d", f"example-{os.getpid()}@{os.uname().nodename}", "--timeout", "5"],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert stats.returncode == 0, stats.stdout + stats.stderr
        assert "premium" in stats.stdout and "served_count" in stats.stdout
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
        log.close()


def test_kombu_consumer_example_prints_weighted_shares() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "kombu_consumer.py"), "--broker", "memory://"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "share" in done.stdout.lower()


@pytest.mark.parametrize("own_broker", [False, True])
def test_the_kombu_example_runs_as_its_docstring_says(
    redis_url: str, tmp_path: Path, own_broker: bool
) -> None:
    # From a directory of the user's, as a newcomer runs it: nothing of the
    # project's test tree may be needed.
    args = [sys.executable, str(EXAMPLES / "kombu_consumer.py"), "--backlog", "300"]
    args += ["--consume", "600"] + ([] if own_broker else ["--broker", redis_url])
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("example-")]
    assert len(rows) == 4
    for _name, _weight, target, share, _handled in rows:
        assert float(share.rstrip("%")) == pytest.approx(float(target.rstrip("%")), abs=2.0)
    if not own_broker:  # "and deletes its queues": nothing of them is left
        client = redis_lib.Redis.from_url(redis_url)
        assert [k for k in client.scan_iter("example-*")] == []
