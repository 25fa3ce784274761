"""HashRing: distribution, determinism and the remap bounds, asserted rather than logged."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import uuid
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from celery_fair.routing.ring import (
    HashRing,
    RingStatistics,
    canonical_key,
    ideal_moved_fraction,
    key_hash,
)

WEIGHTS = {"q1": 1, "q2": 1, "q3": 2, "q4": 2}


def random_keys(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"tenant-{rng.getrandbits(64):016x}" for _ in range(n)]


@pytest.fixture(scope="module")
def keys_100k() -> list[str]:
    return random_keys(100_000, seed=20240501)


def assignment(ring: HashRing, keys: list[str]) -> list[str]:
    return [ring.lookup(k) for k in keys]


def binomial_tolerance(p: float, n: int, sigmas: float = 4.5) -> float:
    """Half-width of a band a binomial fraction leaves with probability < 1e-5."""
    return sigmas * math.sqrt(p * (1 - p) / n)


# -- distribution -------------------------------------------------------------------------


def test_chi_square_goodness_of_fit_weights_1_1_2_2() -> None:
    ring = HashRing(WEIGHTS)
    counts = Counter(assignment(ring, random_keys(150_000, seed=7)))
    names = sorted(WEIGHTS)
    observed = [counts[n] for n in names]
    total_weight = sum(WEIGHTS.values())
    expected = [150_000 * WEIGHTS[n] / total_weight for n in names]
    result = stats.chisquare(observed, expected)
    assert result.pvalue > 0.01, (observed, expected, result)


def test_each_share_within_3_percent_relative_of_weight_share(keys_100k: list[str]) -> None:
    ring = HashRing(WEIGHTS)
    counts = Counter(assignment(ring, keys_100k))
    for name, share in ring.shares().items():
        actual = counts[name] / len(keys_100k)
        assert abs(actual - share) / share < 0.03, (name, actual, share)


def test_uneven_weights_of_the_issue(keys_100k: list[str]) -> None:
    ring = HashRing({"t0": 10, "t1": 10, "t2": 20})
    counts = Counter(assignment(ring, keys_100k))
    for name, share in ring.shares().items():
        assert abs(counts[name] / len(keys_100k) - share) / share < 0.03


def test_fractional_weights_are_proportional(keys_100k: list[str]) -> None:
    ring = HashRing({"a": 0.5, "b": 1.5})
    share_a = sum(1 for q in assignment(ring, keys_100k[:40_000]) if q == "a") / 40_000
    assert abs(share_a - 0.25) < binomial_tolerance(0.25, 40_000)


# -- determinism ----------------------------------------------------------------------------


def test_order_of_queues_does_not_matter() -> None:
    keys = random_keys(2000, seed=3)
    forward = HashRing(dict(sorted(WEIGHTS.items())))
    backward = HashRing(dict(sorted(WEIGHTS.items(), reverse=True)))
    assert forward == backward
    assert assignment(forward, keys) == assignment(backward, keys)
    assert assignment(HashRing(["a", "b", "c"]), keys) == assignment(
        HashRing(["c", "a", "b"]), keys
    )


_CHILD = """
import json, sys
from celery_fair.routing.ring import HashRing
weights, keys = json.loads(sys.stdin.read())
ring = HashRing(dict(reversed(list(weights.items()))))
print(json.dumps([ring.lookup(k) for k in keys]))
"""


@pytest.mark.parametrize("hashseed", ["0", "4242"])
def test_same_mapping_in_other_interpreters_with_other_hash_seeds(hashseed: str) -> None:
    keys = random_keys(3000, seed=11)
    weights = {"t0": 10, "t1": 10, "t2": 20, "t3": 5}
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps([weights, keys]),
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    ).stdout
    assert json.loads(out) == assignment(HashRing(weights), keys)


def test_pinned_values_do_not_change_between_releases() -> None:
    # If this fails, the hash or the scoring changed and every deployment's
    # key -> queue mapping would move on upgrade.
    ring = HashRing({"t0": 10, "t1": 10, "t2": 20})
    assert key_hash("tenant-1") == PINNED_HASH
    assert [ring.lookup(f"tenant-{i}") for i in range(20)] == PINNED_QUEUES.split()


PINNED_HASH = 0xD30B6407AE8FDCA8
PINNED_QUEUES = "t1 t2 t2 t2 t2 t2 t2 t1 t2 t1 t2 t1 t2 t1 t0 t0 t2 t2 t0 t0"


# -- minimal disruption ----------------------------------------------------------------------


def moved(before: list[str], after: list[str]) -> list[tuple[str, str]]:
    return [(a, b) for a, b in zip(before, after, strict=True) if a != b]


def test_adding_a_queue_moves_its_share_and_only_onto_it(keys_100k: list[str]) -> None:
    ring = HashRing({"t0": 10, "t1": 10, "t2": 20})
    grown = ring.with_queue("t3", 10)
    changes = moved(assignment(ring, keys_100k), assignment(grown, keys_100k))
    assert {dst for _, dst in changes} == {"t3"}
    ideal = 10 / 50
    assert ideal_moved_fraction(ring, grown) == pytest.approx(ideal)
    fraction = len(changes) / len(keys_100k)
    assert abs(fraction - ideal) < binomial_tolerance(ideal, len(keys_100k))


@pytest.mark.parametrize("removed", ["q1", "q3", "q4"], ids=["first", "middle", "last"])
def test_removing_any_queue_moves_exactly_its_own_keys(keys_100k: list[str], removed: str) -> None:
    ring = HashRing(WEIGHTS)
    before = assignment(ring, keys_100k)
    after = assignment(ring.without_queue(removed), keys_100k)
    changes = moved(before, after)
    assert {src for src, _ in changes} == {removed}
    assert len(changes) == before.count(removed)
    assert removed not in after


@pytest.mark.parametrize("new_weight", [4, 1], ids=["raise", "lower"])
def test_reweighting_moves_only_keys_that_must_move(keys_100k: list[str], new_weight: int) -> None:
    ring = HashRing(WEIGHTS)
    changed = ring.with_weight("q3", new_weight)
    changes = moved(assignment(ring, keys_100k), assignment(changed, keys_100k))
    if new_weight > WEIGHTS["q3"]:
        assert {dst for _, dst in changes} == {"q3"}
    else:
        assert {src for src, _ in changes} == {"q3"}
    ideal = ideal_moved_fraction(ring, changed)
    fraction = len(changes) / len(keys_100k)
    assert abs(fraction - ideal) < binomial_tolerance(ideal, len(keys_100k))


weight_maps = st.dictionaries(
    st.text(alphabet="abcdefgh", min_size=1, max_size=3),
    st.integers(min_value=1, max_value=50),
    min_size=1,
    max_size=8,
)
ring_keys = st.lists(st.text(max_size=12), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(weights=weight_maps, keys=ring_keys, weight=st.integers(min_value=1, max_value=50))
def test_property_add_only_pulls_onto_the_new_queue(
    weights: dict[str, int], keys: list[str], weight: int
) -> None:
    ring = HashRing(weights)
    grown = ring.with_queue("new", weight)
    for key in keys:
        assert grown.lookup(key) in (ring.lookup(key), "new")


@settings(max_examples=150, deadline=None)
@given(weights=weight_maps, keys=ring_keys, data=st.data())
def test_property_remove_only_frees_the_removed_queue(
    weights: dict[str, int], keys: list[str], data: st.DataObject
) -> None:
    if len(weights) < 2:
        return
    removed = data.draw(st.sampled_from(sorted(weights)))
    ring = HashRing(weights)
    smaller = ring.without_queue(removed)
    for key in keys:
        if ring.lookup(key) != removed:
            assert smaller.lookup(key) == ring.lookup(key)


@settings(max_examples=150, deadline=None)
@given(weights=weight_maps, keys=ring_keys, data=st.data())
def test_property_reweight_moves_only_onto_or_off_that_queue(
    weights: dict[str, int], keys: list[str], data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(weights)))
    new_weight = data.draw(st.integers(min_value=1, max_value=50))
    ring = HashRing(weights)
    changed = ring.with_weight(name, new_weight)
    for key in keys:
        old, new = ring.lookup(key), changed.lookup(key)
        if new_weight >= weights[name]:
            assert new in (old, name)
        else:
            assert old in (new, name)


# -- keys, validation, statistics -------------------------------------------------------------


def test_equivalent_keys_hash_alike() -> None:
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert canonical_key(42) == canonical_key("42") == canonical_key(b"42") == "42"
    assert canonical_key(u) == str(u)
    assert key_hash(42) == key_hash("42")
    ring = HashRing(WEIGHTS)
    assert ring.lookup(u) == ring.lookup(str(u))


@pytest.mark.parametrize("bad", [True, 1.5, None, ("a",), b"\xff\xfe"])
def test_unstable_or_ambiguous_keys_are_refused(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        HashRing(WEIGHTS).lookup(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("queues", "fragment"),
    [
        ({}, "at least one queue"),
        ([], "at least one queue"),
        ({"a": 0}, "'a'"),
        ({"a": -1}, "'a'"),
        ({"a": float("nan")}, "'a'"),
        ({"a": float("inf")}, "'a'"),
        ({"a": True}, "'a'"),
        ({"a": "2"}, "'a'"),
        ({"": 1}, "non-empty"),
        (["a", "a"], "twice"),
        ("abc", "string"),
    ],
)
def test_bad_configurations_fail_with_the_culprit_named(queues: object, fragment: str) -> None:
    with pytest.raises((TypeError, ValueError), match=fragment):
        HashRing(queues)  # type: ignore[arg-type]


def test_changes_are_validated() -> None:
    ring = HashRing(["a"])
    with pytest.raises(ValueError, match="already"):
        ring.with_queue("a")
    with pytest.raises(KeyError):
        ring.without_queue("zz")
    with pytest.raises(ValueError, match="at least one"):
        ring.without_queue("a")
    with pytest.raises(ValueError, match="'a'"):
        ring.with_weight("a", 0)


def test_statistics_is_a_frozen_record() -> None:
    record = HashRing({"b": 3, "a": 1}).statistics()
    assert record == RingStatistics(
        queues=("a", "b"), weights=(1.0, 3.0), total_weight=4.0, shares=(0.25, 0.75)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.total_weight = 5  # type: ignore[misc]


def test_ideal_fraction_is_total_variation_distance() -> None:
    ring = HashRing({"a": 1, "b": 1})
    assert ideal_moved_fraction(ring, ring) == 0
    assert ideal_moved_fraction(ring, ring.without_queue("a")) == pytest.approx(0.5)
    assert ideal_moved_fraction(ring, ring.with_weight("a", 3)) == pytest.approx(0.25)


# -- the `celery-fair ring` command ------------------------------------------------------------


def test_ring_command_reports_moves_against_the_ideal(capsys: pytest.CaptureFixture[str]) -> None:
    from celery_fair.cli import main

    argv = ["ring", "--queues", "t0=10,t1=10,t2=20", "--keys", "20000", "--add", "t3=10"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ideal_fraction"] == pytest.approx(0.2)
    assert abs(report["moved_fraction"] - 0.2) < binomial_tolerance(0.2, 20_000)
    assert report["only_changed_queue_involved"] is True
    assert set(report["moves"]) == {"t0->t3", "t1->t3", "t2->t3"}
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "ideal 20.00%" in text and "only the changed queue gained or lost keys: yes" in text


def test_ring_command_reads_the_ring_of_an_apps_router(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from celery_fair.cli import main

    module = f"ringapp_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "import celery, celery_fair\n"
        "app = celery.Celery('ringapp', broker='memory://', set_as_current=False)\n"
        "app.conf.task_routes = (celery_fair.ConsistentHashRouter(\n"
        "    {'t0': 10, 't1': 10, 't2': 20}, key='tenant_id', algorithm='table'),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["ring", "-A", module, "--keys", "20000", "--add", "t3=10", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["algorithm"] == "table"
    assert [row["weight"] for row in report["before"]] == [10, 10, 20]
    assert report["ideal_fraction"] == pytest.approx(0.2)
    (tmp_path / "norouter.py").write_text(
        "import celery\napp = celery.Celery('x', broker='memory://', set_as_current=False)\n"
    )
    with pytest.raises(SystemExit, match="has no ConsistentHashRouter"):
        main(["ring", "-A", "norouter"])


@pytest.mark.parametrize(
    "argv",
    [
        ["ring", "--queues", "t0=0"],
        ["ring", "--queues", "t0=x"],
        ["ring", "--queues", "t0,t0"],
        ["ring", "--queues", "t0", "--remove", "zz"],
        ["ring", "--queues", "t0", "--add", "t1=1", "--remove", "t0"],
    ],
)
def test_ring_command_rejects_bad_input(argv: list[str]) -> None:
    from celery_fair.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code != 0
