"""The probe table (``algorithm="table"``) and the ``"auto"`` default: shares, determinism,
minimal disruption and its bound, layouts, validation. Rendezvous is covered by test_ring.py."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from celery_fair.routing import ConsistentHashRouter
from celery_fair.routing.ring import (
    ALGORITHMS,
    AUTO_RENDEZVOUS_MAX_QUEUES,
    HashRing,
    ideal_moved_fraction,
)
from celery_fair.routing.table import ProbeTable, TableLayout, table_layout

WEIGHTS = {"q1": 1, "q2": 1, "q3": 2, "q4": 2}


def mixed(n: int) -> dict[str, int]:
    """n queues of weights 1, 2, 3, 4, 1, 2, ... (the benchmark's rings)."""
    return {f"q{i:05d}": 1 + i % 4 for i in range(n)}


def random_hashes(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def random_keys(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"tenant-{rng.getrandbits(64):016x}" for _ in range(n)]


@pytest.fixture(scope="module")
def table4() -> HashRing:
    return HashRing(WEIGHTS, algorithm="table")


@pytest.fixture(scope="module")
def table16() -> HashRing:
    return HashRing(mixed(16), algorithm="table")


@pytest.fixture(scope="module")
def table256() -> HashRing:
    return HashRing(mixed(256), algorithm="table")


@pytest.fixture(scope="module")
def mapped() -> dict[int, dict[str, float]]:
    """Mapped shares of the module's tables, computed once (seconds at 256 queues)."""
    return {}


def mapped_shares(ring: HashRing, cache: dict[int, dict[str, float]]) -> dict[str, float]:
    key = id(ring)
    if key not in cache:
        cache[key] = ring.mapped_shares()
    return cache[key]


@pytest.fixture(scope="module")
def hashes_150k() -> list[int]:
    return random_hashes(150_000, seed=7)


# -- the default ------------------------------------------------------------------------------


def test_the_default_keeps_rendezvous_and_auto_switches_above_twelve_queues() -> None:
    assert ALGORITHMS == ("auto", "rendezvous", "table")
    small = mixed(AUTO_RENDEZVOUS_MAX_QUEUES)
    large = mixed(AUTO_RENDEZVOUS_MAX_QUEUES + 1)
    # Upgrading moves no key: the default is the mapping of earlier releases.
    assert HashRing(large).algorithm == "rendezvous"
    assert HashRing(small, algorithm="auto").algorithm == "rendezvous"
    assert HashRing(large, algorithm="auto").algorithm == "table"
    assert HashRing(small, algorithm="auto") == HashRing(small, algorithm="rendezvous")
    assert HashRing(large, algorithm="auto") == HashRing(large, algorithm="table")
    keys = random_keys(500, seed=1)
    auto, explicit = HashRing(large, algorithm="auto"), HashRing(large, algorithm="table")
    assert [auto.lookup(k) for k in keys] == [explicit.lookup(k) for k in keys]


def test_small_rings_keep_the_mapping_of_earlier_releases() -> None:
    # The same pinned values as test_ring.py, through the default: no key moves on upgrade
    # for rings of up to 12 queues.
    ring = HashRing({"t0": 10, "t1": 10, "t2": 20})
    assert ring.algorithm == "rendezvous"
    expected = "t1 t2 t2 t2 t2 t2 t2 t1 t2 t1 t2 t1 t2 t1 t0 t0 t2 t2 t0 t0"
    assert [ring.lookup(f"tenant-{i}") for i in range(20)] == expected.split()


def test_algorithms_map_differently_and_rings_say_which() -> None:
    table = HashRing(WEIGHTS, algorithm="table")
    rendezvous = HashRing(WEIGHTS, algorithm="rendezvous")
    assert table != rendezvous
    assert table.algorithm == "table" and rendezvous.algorithm == "rendezvous"
    assert rendezvous.layout is None and table.layout == table_layout(6)
    keys = random_keys(200, seed=2)
    assert [table.lookup(k) for k in keys] != [rendezvous.lookup(k) for k in keys]
    record = table.statistics()
    assert record.algorithm == "probe-table"
    assert record.table_band == 1 and record.table_buckets == 1 << 16
    assert record.table_slots == 16384 * 6
    assert repr(table) == "HashRing({'q1': 1, 'q2': 1, 'q3': 2, 'q4': 2}, algorithm='table')"


# -- shares -------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [WEIGHTS, mixed(16)], ids=["1-1-2-2", "16-queues"])
def test_chi_square_goodness_of_fit(weights: dict[str, int], hashes_150k: list[int]) -> None:
    ring = HashRing(weights, algorithm="table")
    counts = Counter(ring.lookup_hash(h) for h in hashes_150k)
    names = sorted(weights)
    total = sum(weights.values())
    expected = [len(hashes_150k) * weights[n] / total for n in names]
    result = stats.chisquare([counts[n] for n in names], expected)
    assert result.pvalue > 0.01, result


def test_mapped_shares_are_what_keys_actually_get(table16: HashRing) -> None:
    mapped = table16.mapped_shares()
    assert math.fsum(mapped.values()) == pytest.approx(1.0, abs=1e-12)
    hashes = random_hashes(200_000, seed=11)
    counts = Counter(table16.lookup_hash(h) for h in hashes)
    for name, share in mapped.items():
        sigma = math.sqrt(share * (1 - share) / len(hashes))
        assert abs(counts[name] / len(hashes) - share) < 4.5 * sigma, name


@pytest.mark.parametrize("pass_bits", [2, 3, 4])
def test_mapped_shares_hold_at_every_pass_probability(pass_bits: int) -> None:
    # 40 units of weight at 256 slots each in 4,096 buckets: 2.5 slots a bucket, the
    # crowded end of a band, where competing slots matter most.
    layout = TableLayout(band=2, slots_per_weight=256.0, bucket_bits=12, pass_bits=pass_bits)
    ring = HashRing(mixed(16), algorithm="rendezvous")
    ring._table = ProbeTable(ring.queues, ring.weights, layout)
    mapped = ring.mapped_shares()
    hashes = random_hashes(100_000, seed=13)
    counts = Counter(ring.lookup_hash(h) for h in hashes)
    for name, share in mapped.items():
        sigma = math.sqrt(share * (1 - share) / len(hashes))
        assert abs(counts[name] / len(hashes) - share) < 4.5 * sigma, name


def test_removal_at_10000_queues_moves_at_most_105_percent_of_the_ideal() -> None:
    # Removing a queue moves exactly its keys, so moved / ideal is its mapped share over its
    # weight share (see HashRing.mapped_shares); this checks every queue of the ring at once.
    # About 20 s: the bound of the routing issue, at the size it names.
    ring = HashRing(mixed(10_000), algorithm="table")
    assert ring.layout is not None and ring.layout.pass_bits == 3
    mapped, ideal = ring.mapped_shares(), ring.shares()
    ratios = [mapped[q] / ideal[q] for q in ideal]
    assert max(ratios) <= 1.05
    assert min(ratios) >= 0.95


@pytest.mark.parametrize(
    ("fixture", "bound"),
    [("table4", 0.005), ("table16", 0.02), ("table256", 0.045)],
)
def test_worst_share_error_of_the_table(
    fixture: str, bound: float, request: pytest.FixtureRequest, mapped: dict[int, dict[str, float]]
) -> None:
    # Exact over all keys (no sampling): the table's placement error, ~0.35 / sqrt(slots).
    ring: HashRing = request.getfixturevalue(fixture)
    actual, ideal = mapped_shares(ring, mapped), ring.shares()
    assert max(abs(actual[q] - ideal[q]) / ideal[q] for q in ideal) < bound


def test_fractional_and_tiny_weights_are_proportional() -> None:
    ring = HashRing({"a": 0.5, "b": 1.5, "c": 0.001}, algorithm="table")
    mapped, ideal = ring.mapped_shares(), ring.shares()
    for name in ("a", "b"):
        assert mapped[name] == pytest.approx(ideal[name], rel=0.01)
    # Weight 0.001 of a total 2.001 is 65.5 slots (65,536 per unit): right to a few percent.
    assert mapped["c"] == pytest.approx(ideal["c"], rel=0.2)
    hashes = random_hashes(40_000, seed=5)
    share_a = sum(ring.lookup_hash(h) == "a" for h in hashes) / len(hashes)
    assert abs(share_a - mapped["a"]) < 4.5 * math.sqrt(0.25 * 0.75 / len(hashes))


def test_single_queue_takes_everything() -> None:
    ring = HashRing(["only"], algorithm="table")
    assert {ring.lookup(k) for k in random_keys(100, seed=3)} == {"only"}
    assert ring.mapped_shares() == {"only": pytest.approx(1.0)}


# -- determinism ----------------------------------------------------------------------------------


_CHILD = """
import json, sys
from celery_fair.routing.ring import HashRing
weights, keys = json.loads(sys.stdin.read())
ring = HashRing(dict(reversed(list(weights.items()))), algorithm="auto")
print(json.dumps([ring.algorithm] + [ring.lookup(k) for k in keys]))
"""


@pytest.mark.parametrize("hashseed", ["0", "4242"])
def test_same_mapping_in_other_interpreters_with_other_hash_seeds(hashseed: str) -> None:
    keys = random_keys(3000, seed=11)
    weights = {f"tenant-shard-{i}": 1 + i % 5 for i in range(40)}
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps([weights, keys]),
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    ).stdout
    ring = HashRing(weights, algorithm="auto")
    assert json.loads(out) == ["table"] + [ring.lookup(k) for k in keys]


def test_order_of_queues_does_not_matter() -> None:
    forward = HashRing(dict(sorted(mixed(20).items())), algorithm="table")
    backward = HashRing(dict(sorted(mixed(20).items(), reverse=True)), algorithm="table")
    assert forward == backward
    hashes = random_hashes(3000, seed=3)
    assert [forward.lookup_hash(h) for h in hashes] == [backward.lookup_hash(h) for h in hashes]


def test_pinned_values_do_not_change_between_releases() -> None:
    # If this fails, the table's hashing, layout or probing changed, and every deployment
    # that opted in to it would see its keys move on upgrade.
    ring = HashRing({f"s{i:02d}": 1 + i % 3 for i in range(20)}, algorithm="auto")
    assert ring.algorithm == "table"
    assert ring.layout == TableLayout(band=2, slots_per_weight=4096.0, bucket_bits=16)
    assert [ring.lookup(f"tenant-{i}") for i in range(20)] == PINNED_20.split()
    small = HashRing({"t0": 10, "t1": 10, "t2": 20}, algorithm="table")
    assert [small.lookup(f"tenant-{i}") for i in range(20)] == PINNED_3.split()


PINNED_20 = "s14 s19 s17 s00 s07 s02 s17 s15 s11 s12 s05 s14 s05 s12 s10 s08 s19 s07 s14 s07"
PINNED_3 = "t0 t1 t0 t1 t0 t2 t1 t2 t0 t2 t2 t2 t2 t2 t2 t0 t0 t2 t1 t2"


# -- minimal disruption --------------------------------------------------------------------------


def moved(ring: HashRing, changed: HashRing, hashes: list[int]) -> list[tuple[str, str]]:
    pairs = ((ring.lookup_hash(h), changed.lookup_hash(h)) for h in hashes)
    return [(a, b) for a, b in pairs if a != b]


@pytest.mark.parametrize("position", [0, 8, 15], ids=["first", "middle", "last"])
def test_removing_any_queue_moves_exactly_its_own_keys(table16: HashRing, position: int) -> None:
    removed = table16.queues[position]
    smaller = table16.without_queue(removed)
    assert smaller.layout == table16.layout
    hashes = random_hashes(100_000, seed=13)
    before = [table16.lookup_hash(h) for h in hashes]
    changes = moved(table16, smaller, hashes)
    assert {src for src, _ in changes} == {removed}
    assert len(changes) == before.count(removed)


def test_adding_a_queue_moves_keys_only_onto_it(table16: HashRing) -> None:
    grown = table16.with_queue("new", 2)
    changes = moved(table16, grown, random_hashes(100_000, seed=17))
    assert changes and {dst for _, dst in changes} == {"new"}


@pytest.mark.parametrize("new_weight", [4, 1.5], ids=["raise", "lower"])
def test_reweighting_moves_only_onto_or_off_that_queue(
    table16: HashRing, new_weight: float
) -> None:
    name = table16.queues[6]  # weight 3
    changed = table16.with_weight(name, new_weight)
    changes = moved(table16, changed, random_hashes(100_000, seed=19))
    assert changes
    if new_weight > 3:
        assert {dst for _, dst in changes} == {name}
    else:
        assert {src for src, _ in changes} == {name}


@pytest.mark.parametrize("fixture", ["table4", "table16", "table256"])
def test_moved_fraction_is_within_5_percent_of_the_ideal(
    fixture: str, request: pytest.FixtureRequest, mapped: dict[int, dict[str, float]]
) -> None:
    # Exact, from the table: a removal moves exactly the removed queue's keys and an
    # addition exactly the new queue's, so the moved fraction is that queue's mapped share.
    ring: HashRing = request.getfixturevalue(fixture)
    names = ring.queues
    shares = mapped_shares(ring, mapped)
    for name in (names[0], names[len(names) // 2], names[-1]):
        smaller = ring.without_queue(name)
        assert smaller.layout == ring.layout
        ratio = shares[name] / ideal_moved_fraction(ring, smaller)
        assert 0.95 < ratio < 1.05, (name, ratio)
    grown = ring.with_queue("new", 2)
    ratio = grown.mapped_shares()["new"] / ideal_moved_fraction(ring, grown)
    assert 0.95 < ratio < 1.05, ratio


def test_table_weight_keeps_the_layout_across_a_band_boundary() -> None:
    ring = HashRing(["a", "b", "c"], algorithm="table")  # total 3: band 1
    grown = ring.with_queue("d", 20)  # total 23: band 2, every slot redrawn
    assert grown.layout != ring.layout
    hashes = random_hashes(20_000, seed=23)
    assert {dst for _, dst in moved(ring, grown, hashes)} != {"d"}
    pinned = HashRing(["a", "b", "c"], algorithm="table", table_weight=23)
    pinned_grown = pinned.with_queue("d", 20)
    assert pinned_grown.layout == pinned.layout
    assert repr(pinned_grown).endswith("algorithm='table', table_weight=23)")
    assert {dst for _, dst in moved(pinned, pinned_grown, hashes)} == {"d"}


# Property tests on small tables: the per-key rules do not depend on the layout's size, and a
# small layout (8 buckets, 2 slots per unit of weight) keeps hypothesis fast.
# Each pass probability a layout can choose, 1/2 to 1/16, is drawn.
SMALL = TableLayout(band=0, slots_per_weight=2.0, bucket_bits=3)
small_layouts = st.sampled_from(
    [TableLayout(band=0, slots_per_weight=2.0, bucket_bits=3, pass_bits=b) for b in (1, 2, 3, 4)]
)


def small_ring(weights: dict[str, float], layout: TableLayout = SMALL) -> HashRing:
    """A table ring on a small layout (the fallback to rendezvous included)."""
    ring = HashRing(weights, algorithm="rendezvous")
    ring._table = ProbeTable(ring.queues, ring.weights, layout)
    return ring


weight_maps = st.dictionaries(
    st.text(alphabet="abcdefgh", min_size=1, max_size=3),
    st.integers(min_value=1, max_value=50),
    min_size=1,
    max_size=8,
)
hash_lists = st.lists(st.integers(min_value=0, max_value=2**64 - 1), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    weights=weight_maps,
    hashes=hash_lists,
    weight=st.integers(min_value=1, max_value=50),
    layout=small_layouts,
)
def test_property_add_only_pulls_onto_the_new_queue(
    weights: dict[str, int], hashes: list[int], weight: int, layout: TableLayout
) -> None:
    before, after = small_ring(weights, layout), small_ring({**weights, "new": weight}, layout)
    for h in hashes:
        assert after.lookup_hash(h) in (before.lookup_hash(h), "new")


@settings(max_examples=150, deadline=None)
@given(weights=weight_maps, hashes=hash_lists, data=st.data(), layout=small_layouts)
def test_property_remove_only_frees_the_removed_queue(
    weights: dict[str, int], hashes: list[int], data: st.DataObject, layout: TableLayout
) -> None:
    if len(weights) < 2:
        return
    removed = data.draw(st.sampled_from(sorted(weights)))
    before = small_ring(weights, layout)
    after = small_ring({q: w for q, w in weights.items() if q != removed}, layout)
    for h in hashes:
        if before.lookup_hash(h) != removed:
            assert after.lookup_hash(h) == before.lookup_hash(h)


@settings(max_examples=150, deadline=None)
@given(weights=weight_maps, hashes=hash_lists, data=st.data(), layout=small_layouts)
def test_property_reweight_moves_only_onto_or_off_that_queue(
    weights: dict[str, int], hashes: list[int], data: st.DataObject, layout: TableLayout
) -> None:
    name = data.draw(st.sampled_from(sorted(weights)))
    # Fractional weights too: the last slot's pass probability carries the fraction.
    new_weight = data.draw(st.floats(min_value=0.1, max_value=50))
    before = small_ring(weights, layout)
    after = small_ring({**weights, name: new_weight}, layout)
    for h in hashes:
        old, new = before.lookup_hash(h), after.lookup_hash(h)
        if new_weight >= weights[name]:
            assert new in (old, name)
        else:
            assert old in (new, name)


@settings(max_examples=10, deadline=None)
@given(weights=weight_maps, hashes=hash_lists, data=st.data())
def test_property_public_rings_with_a_pinned_layout(
    weights: dict[str, int], hashes: list[int], data: st.DataObject
) -> None:
    # The same rules through HashRing, fallback included; table_weight pins the layout.
    ring = HashRing(weights, algorithm="table", table_weight=1000)
    grown = ring.with_queue("new", data.draw(st.integers(min_value=1, max_value=50)))
    for h in hashes:
        assert grown.lookup_hash(h) in (ring.lookup_hash(h), "new")
    if len(weights) > 1:
        removed = data.draw(st.sampled_from(sorted(weights)))
        smaller = ring.without_queue(removed)
        for h in hashes:
            if ring.lookup_hash(h) != removed:
                assert smaller.lookup_hash(h) == ring.lookup_hash(h)


def test_keys_that_no_probe_settles_fall_back_to_rendezvous() -> None:
    # One slot in 2**20 buckets: 64 probes almost never find it.
    layout = TableLayout(band=0, slots_per_weight=1e-9, bucket_bits=20)
    names = ("a", "b", "c")
    probe = ProbeTable(names, {"a": 1.0, "b": 1.0, "c": 1.0}, layout)
    assert probe.slots == 3
    hashes = random_hashes(200, seed=29)
    assert sum(probe.find(h) < 0 for h in hashes) > 190
    ring = HashRing(["a", "b", "c"], algorithm="table")
    ring._table = probe  # a ring with that table
    reference = HashRing(["a", "b", "c"], algorithm="rendezvous")
    for h in hashes:
        if probe.find(h) < 0:
            assert ring.lookup_hash(h) == reference.lookup_hash(h)


# -- layouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "band", "per_weight", "bits", "pass_bits"),
    [
        (1, 0, 65536, 16, 1),
        (2.99, 0, 65536, 16, 1),
        (3, 1, 16384, 16, 1),
        (6, 1, 16384, 16, 1),
        (12, 2, 4096, 16, 1),
        (47.9, 2, 4096, 16, 1),
        (48, 3, 1024, 16, 1),
        (640, 4, 1024, 18, 1),
        (768, 5, 512, 19, 2),
        (3072, 6, 256, 20, 2),
        (25_000, 7, 64, 20, 3),
        (49_152, 8, 16, 20, 4),
    ],
)
def test_layout_bands(
    total: float, band: int, per_weight: float, bits: int, pass_bits: int
) -> None:
    layout = table_layout(total)
    assert layout == TableLayout(
        band=band, slots_per_weight=per_weight, bucket_bits=bits, pass_bits=pass_bits
    )
    assert layout.band_top / 4 <= total < layout.band_top
    # 0.75 to 3 slots per bucket on average, at any total weight of the band.
    load = per_weight * total / layout.buckets
    assert 0.75 <= load < 3


def test_layout_bounds_the_table() -> None:
    for exponent in range(-30, 40):
        layout = table_layout(2.0**exponent)
        assert layout.slots_per_weight * layout.band_top <= 3 * 2**20
        assert layout.buckets <= 2**20


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan])
def test_layout_refuses_bad_totals(bad: float) -> None:
    with pytest.raises(ValueError, match="total weight"):
        table_layout(bad)


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"algorithm": "maglev"}, ValueError, "algorithm='maglev'"),
        ({"algorithm": None}, ValueError, "algorithm=None"),
        ({"table_weight": 0}, ValueError, "table_weight=0"),
        ({"table_weight": math.inf}, ValueError, "table_weight=inf"),
        ({"table_weight": "10"}, TypeError, "table_weight='10'"),
        ({"table_weight": True}, TypeError, "table_weight=True"),
    ],
)
def test_options_are_validated(kwargs: dict[str, object], error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        HashRing(WEIGHTS, **kwargs)  # type: ignore[arg-type]


def test_options_survive_changes() -> None:
    ring = HashRing(WEIGHTS, algorithm="table", table_weight=100)
    for changed in (ring.with_queue("q5"), ring.without_queue("q1"), ring.with_weight("q1", 3)):
        assert changed.algorithm == "table" and changed.layout == ring.layout
    auto = HashRing(mixed(AUTO_RENDEZVOUS_MAX_QUEUES), algorithm="auto")
    assert auto.with_queue("extra").algorithm == "table"
    assert auto.with_queue("extra").without_queue("extra").algorithm == "rendezvous"


# -- the router and the command ------------------------------------------------------------------


def test_router_takes_the_algorithm_or_a_ring() -> None:
    router = ConsistentHashRouter(WEIGHTS, key="tenant_id", algorithm="table")
    assert router.ring == HashRing(WEIGHTS, algorithm="table")
    assert "algorithm='table'" in repr(router)
    assert ConsistentHashRouter(mixed(20), key="tenant_id").ring.algorithm == "rendezvous"
    assert ConsistentHashRouter(mixed(20), key="t", algorithm="auto").ring.algorithm == "table"
    pinned = ConsistentHashRouter(mixed(20), key="t", algorithm="auto", table_weight=500)
    assert pinned.ring.layout == table_layout(500)
    with pytest.raises(ValueError, match="HashRing carries its own"):
        ConsistentHashRouter(HashRing(WEIGHTS), key="t", algorithm="table")
    with pytest.raises(ValueError, match="algorithm='ring'"):
        ConsistentHashRouter(WEIGHTS, key="t", algorithm="ring")
    for tenant in random_keys(50, seed=31):
        result = router("proj.task", (), {"tenant_id": tenant}, {})
        assert result is not None and result["queue"] == router.ring.lookup(tenant)


def test_ring_command_with_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    from celery_fair.cli import main

    queues = ",".join(f"q{i}={1 + i % 4}" for i in range(16))
    argv = ["ring", "--queues", queues, "--keys", "20000", "--remove", "q3"]
    assert main([*argv, "--algorithm", "auto", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["algorithm"] == report["algorithm_after"] == "table"
    assert report["only_changed_queue_involved"] is True
    assert report["layout_changed"] is False
    assert main([*argv, "--algorithm", "rendezvous"]) == 0
    assert "weighted rendezvous hashing" in capsys.readouterr().out
    crossing = ["ring", "--queues", "a,b,c", "--keys", "5000", "--add", "d=20"]
    assert main([*crossing, "--algorithm", "table"]) == 0
    assert "crosses a table band" in capsys.readouterr().out
    assert main([*crossing, "--algorithm", "table", "--table-weight", "23"]) == 0
    assert "only the changed queue gained or lost keys: yes" in capsys.readouterr().out
