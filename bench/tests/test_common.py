"""bench.common: a broker given a core of its own (``--broker-core``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from bench.common import give_broker_a_core, pin

# A stand-in for a broker: a process with a second thread.
_TWO_THREADS = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); " \
    "time.sleep(60)"  # fmt: skip


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_brokers_every_thread_gets_the_core_and_this_process_the_others() -> None:
    before = os.sched_getaffinity(0)
    core = max(before)
    broker = subprocess.Popen([sys.executable, "-c", _TWO_THREADS])
    try:
        deadline = time.monotonic() + 30
        while len(os.listdir(f"/proc/{broker.pid}/task")) < 2:
            assert time.monotonic() < deadline, "the stand-in never started its thread"
            time.sleep(0.01)  # polled with a deadline
        assert give_broker_a_core(SimpleNamespace(proc=broker), core) == (core,)
        tasks = os.listdir(f"/proc/{broker.pid}/task")
        assert [os.sched_getaffinity(int(tid)) for tid in tasks] == [{core}] * len(tasks)
        assert os.sched_getaffinity(0) == before - {core}
        with pytest.raises(SystemExit, match="--broker-core 99"):
            give_broker_a_core(SimpleNamespace(proc=broker), 99)
        with pytest.raises(RuntimeError, match="not known"):
            give_broker_a_core(SimpleNamespace(pid=None), min(before))
    finally:
        pin(os.getpid(), before)
        broker.kill()
        broker.wait()
