"""ConsistentHashRouter under both mappings (``algorithm="rendezvous"`` and ``"table"``).

The ring-level properties live in test_ring.py and test_ring_table.py; these tests go
through the router (canonical keys, isolation, validation) and cover the table memo and
the ``celery-fair ring`` comparisons.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from collections import Counter
from typing import Any

import pytest
from scipy import stats

from celery_fair.routing import ConsistentHashRouter, HashRing
from celery_fair.routing.isolation import IsolationPolicy, NoisyKeyDetector
from celery_fair.routing.ring import ideal_moved_fraction
from celery_fair.routing.table import TABLE_MEMO_SIZE, probe_table
from tests.harness.clock import FakeClock

ALGORITHMS = ("rendezvous", "table")
#: 24 queues weighted 1..4, total 60: inside the table band [48, 192) after any one change.
SHARDS = {f"shard-{i:02d}": 1 + i % 4 for i in range(24)}


def tenants(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"tenant-{rng.getrandbits(64):016x}" for _ in range(n)]


def routed_queue(router: ConsistentHashRouter, tenant: object) -> str:
    result = router("proj.work", (), {"tenant_id": tenant}, {})
    assert result is not None
    queue = result["queue"]
    assert isinstance(queue, str)
    return queue


# -- determinism --------------------------------------------------------------------------------

_CHILD = """
import json, sys, uuid
from celery_fair.routing import ConsistentHashRouter
weights, algorithm, keys = json.loads(sys.stdin.read())
router = ConsistentHashRouter(
    dict(reversed(list(weights.items()))), key="tenant_id", algorithm=algorithm, cache_size=0
)
keys = [uuid.UUID(k[5:]) if k.startswith("uuid:") else k for k in keys]
print(json.dumps([router("proj.work", (), {"tenant_id": k}, {})["queue"] for k in keys]))
"""


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("hashseed", ["1", "31337"])
def test_same_routes_in_another_interpreter_with_another_hash_seed(
    algorithm: str, hashseed: str
) -> None:
    # Text keys and UUIDs; the child lists the queues in reverse and builds its own table.
    keys: list[Any] = tenants(1500, seed=5) + [uuid.UUID(int=i * 7919) for i in range(500)]
    wire = [f"uuid:{k}" if isinstance(k, uuid.UUID) else k for k in keys]
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps([SHARDS, algorithm, wire]),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": hashseed},
        check=True,
        timeout=120,
    ).stdout
    router = ConsistentHashRouter(SHARDS, key="tenant_id", algorithm=algorithm)
    assert json.loads(out) == [routed_queue(router, k) for k in keys]


def test_a_fresh_table_build_does_not_depend_on_queue_order() -> None:
    # The memo would hand the second ring the first one's table: clear it in between.
    keys = tenants(3000, seed=8)
    probe_table.cache_clear()
    forward = ConsistentHashRouter(SHARDS, key="tenant_id", algorithm="table")
    probe_table.cache_clear()
    shuffled = list(SHARDS.items())
    random.Random(2).shuffle(shuffled)
    backward = ConsistentHashRouter(dict(shuffled), key="tenant_id", algorithm="table")
    assert forward.ring._table is not backward.ring._table
    assert [forward.queue_for(k) for k in keys] == [backward.queue_for(k) for k in keys]


# -- shares and remapping ----------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_routed_shares_fit_the_weights(algorithm: str) -> None:
    router = ConsistentHashRouter(SHARDS, key="tenant_id", algorithm=algorithm, cache_size=0)
    keys = tenants(60_000, seed=13)
    counts = Counter(routed_queue(router, k) for k in keys)
    shares = router.ring.shares()
    names = sorted(shares)
    observed = [counts[q] for q in names]
    expected = [len(keys) * shares[q] for q in names]
    assert stats.chisquare(observed, expected).pvalue > 0.001


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("change", ["remove first", "remove middle", "remove last", "add"])
def test_a_queue_change_moves_only_its_keys_within_5_percent_of_the_ideal(
    algorithm: str, change: str
) -> None:
    names = sorted(SHARDS)
    if change == "add":
        changed_queue, after_weights = "shard-new", {**SHARDS, "shard-new": 3}
    else:
        changed_queue = {"remove first": names[0], "remove middle": names[12]}.get(
            change, names[-1]
        )
        after_weights = {q: w for q, w in SHARDS.items() if q != changed_queue}
    before = ConsistentHashRouter(SHARDS, key="tenant_id", algorithm=algorithm)
    after = ConsistentHashRouter(after_weights, key="tenant_id", algorithm=algorithm)
    assert before.ring.layout == after.ring.layout  # the change stays inside a table band
    keys = tenants(20_000, seed=21)
    moves = [(before.queue_for(k), after.queue_for(k)) for k in keys]
    moved = [(a, b) for a, b in moves if a != b]
    # Per key: every moved key left the removed queue, or went to the added one...
    assert moved and all(changed_queue in pair for pair in moved)
    if change != "add":  # ... and every key of the removed queue moved.
        assert len(moved) == sum(a == changed_queue for a, _ in moves)
    # So the moved fraction is the changed queue's mapped share, computed exactly.
    larger = after.ring if change == "add" else before.ring
    exact = larger.mapped_shares()[changed_queue]
    assert exact <= 1.05 * ideal_moved_fraction(before.ring, after.ring)


# -- isolation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_isolation_works_with_either_mapping(algorithm: str) -> None:
    policy = IsolationPolicy("iso", half_life=1e9)
    router = ConsistentHashRouter(
        SHARDS,
        key="tenant_id",
        algorithm=algorithm,
        isolate=NoisyKeyDetector(policy, clock=FakeClock(1000.0)),
    )
    ring = HashRing(SHARDS, algorithm=algorithm)
    quiet = [f"tenant-{i}" for i in range(40)]
    for tenant in quiet:
        assert routed_queue(router, tenant) == ring.lookup(tenant)
    floods = [routed_queue(router, "flood") for _ in range(60)]
    assert floods[0] == ring.lookup("flood") and floods[-1] == "iso"
    assert all(routed_queue(router, tenant) == ring.lookup(tenant) for tenant in quiet)
    assert router.queue_for("flood") == ring.lookup("flood")
    assert router.worker_queues() == [*sorted(SHARDS), "iso"]


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"algorithm": "maglev"}, ValueError, "algorithm='maglev'"),
        ({"algorithm": 2}, ValueError, "algorithm=2"),
        ({"algorithm": "table", "table_weight": -4}, ValueError, "table_weight=-4"),
        ({"algorithm": "table", "table_weight": "big"}, TypeError, "table_weight='big'"),
        ({"algorithm": "table", "table_weight": float("nan")}, ValueError, "table_weight=nan"),
        ({"algorithm": "table", "isolate": "shard-03"}, ValueError, "isolate='shard-03'"),
    ],
)
def test_bad_options_name_the_argument_and_the_value(
    kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error) as exc:
        ConsistentHashRouter(SHARDS, key="tenant_id", **kwargs)
    assert fragment in str(exc.value)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_bad_weights_name_the_queue_and_the_value(algorithm: str) -> None:
    with pytest.raises(ValueError) as exc:
        ConsistentHashRouter({"a": 1, "b": 0}, key="tenant_id", algorithm=algorithm)
    assert "queues=" in str(exc.value) and "'b'" in str(exc.value) and "not 0" in str(exc.value)


def test_a_ring_carries_its_own_algorithm() -> None:
    with pytest.raises(ValueError, match="algorithm= and table_weight="):
        ConsistentHashRouter(HashRing(SHARDS), key="tenant_id", algorithm="table")
    router = ConsistentHashRouter(HashRing(SHARDS, algorithm="table"), key="tenant_id")
    assert router.ring.algorithm == "table"
    assert "algorithm='table'" in repr(router)


# -- the table memo ------------------------------------------------------------------------------


def test_routers_over_the_same_queues_share_one_table() -> None:
    probe_table.cache_clear()
    a = ConsistentHashRouter(SHARDS, key="tenant_id", algorithm="table", tasks="proj.a.*")
    b = ConsistentHashRouter(
        dict(reversed(list(SHARDS.items()))), key="tenant_id", algorithm="table"
    )
    c = ConsistentHashRouter({**SHARDS, "shard-00": 2}, key="tenant_id", algorithm="table")
    assert a.ring._table is b.ring._table
    assert c.ring._table is not a.ring._table
    assert probe_table.cache_info().misses == 2


def test_the_memo_is_bounded_and_a_rebuilt_table_maps_alike() -> None:
    probe_table.cache_clear()
    first = HashRing(SHARDS, algorithm="table")
    for extra in range(TABLE_MEMO_SIZE):  # as many other tables as the memo holds
        HashRing({**SHARDS, f"extra-{extra}": 1}, algorithm="table")
    assert probe_table.cache_info().currsize == TABLE_MEMO_SIZE
    again = HashRing(SHARDS, algorithm="table")
    assert again._table is not first._table  # evicted, so built anew
    keys = tenants(2000, seed=4)
    assert [first.lookup(k) for k in keys] == [again.lookup(k) for k in keys]


# -- celery-fair ring ----------------------------------------------------------------------------


def ring_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    from celery_fair.cli import main

    assert main(["ring", *argv, "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_ring_command_compares_two_queue_sets(
    capsys: pytest.CaptureFixture[str], algorithm: str
) -> None:
    queues = ",".join(f"{q}={w}" for q, w in SHARDS.items())
    to = ",".join(f"{q}={w}" for q, w in SHARDS.items() if q != "shard-07") + ",shard-new=3"
    report = ring_json(
        capsys, "--queues", queues, "--to", to, "--algorithm", algorithm, "--keys", "20000"
    )
    assert report["algorithm"] == report["algorithm_after"] == algorithm
    # One queue out, one in: only those two are involved in any move.
    assert report["only_changed_queue_involved"] is True
    assert all("shard-07" in pair or "shard-new" in pair for pair in report["moves"])
    before = HashRing(SHARDS)
    after = HashRing({**{q: w for q, w in SHARDS.items() if q != "shard-07"}, "shard-new": 3})
    assert report["ideal_fraction"] == pytest.approx(ideal_moved_fraction(before, after))


def test_ring_command_previews_a_switch_of_algorithm(capsys: pytest.CaptureFixture[str]) -> None:
    queues = "t0=10,t1=10,t2=20"
    report = ring_json(capsys, "--queues", queues, "--to-algorithm", "table", "--keys", "20000")
    assert (report["algorithm"], report["algorithm_after"]) == ("rendezvous", "table")
    assert report["ideal_fraction"] == 0.0
    assert report["only_changed_queue_involved"] is None
    assert report["unrelated_fraction"] == pytest.approx(1 - (0.25**2 + 0.25**2 + 0.5**2))
    assert report["moved_fraction"] > 0.5  # a switch keeps little of the old mapping
    from celery_fair.cli import main

    assert main(["ring", "--queues", queues, "--to-algorithm", "table", "--keys", "100"]) == 0
    text = capsys.readouterr().out
    assert "ratio n/a" in text and "two unrelated mappings would move 62.50%" in text


def test_ring_command_shows_where_given_keys_go(capsys: pytest.CaptureFixture[str]) -> None:
    queues = ",".join(f"{q}={w}" for q, w in SHARDS.items())
    report = ring_json(
        capsys, "--queues", queues, "--algorithm", "table", "--remove", "shard-03",
        "--key", "acme", "--key", "42", "--keys", "100",
    )  # fmt: skip
    before = HashRing(SHARDS, algorithm="table")
    after = before.without_queue("shard-03")
    assert report["lookups"] == [
        {"key": k, "before": before.lookup(k), "after": after.lookup(k)} for k in ("acme", "42")
    ]
    from celery_fair.cli import main

    assert main(["ring", "--queues", queues, "--key", "acme", "--keys", "100"]) == 0
    assert f"key 'acme': {HashRing(SHARDS).lookup('acme')}\n" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--to", "a=1", "--add", "b=1"],
        ["--to", "a=0"],
        ["--to-algorithm", "maglev"],
    ],
)
def test_ring_command_rejects_bad_comparisons(argv: list[str]) -> None:
    from celery_fair.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["ring", "--queues", "a,b", *argv])
    assert exc.value.code != 0
