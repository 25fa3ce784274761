"""Resources and Dominant Resource Fairness: the pure core (no broker, no worker)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_fair import FairConfigError
from celery_fair.scheduling.cost import CostModel
from celery_fair.scheduling.resources import (
    SLOTS,
    Admission,
    Ledger,
    demand_of,
    dominant_cost,
    dominant_share,
    parse_capacity,
    parse_demand,
    parse_queue_concurrency,
    progressive_filling,
    queue_resource,
    unfit_reason,
)

#: Ghodsi et al., NSDI 2011, section 4: <9 CPUs, 18 GB>; A <1, 4>, B <3, 1>.
PAPER = {"cpu": 9.0, "mem": 18.0}
A, B = {"cpu": 1.0, "mem": 4.0}, {"cpu": 3.0, "mem": 1.0}


def test_the_papers_example_gives_a_three_tasks_and_b_two_at_equal_dominant_shares() -> None:
    counts = progressive_filling(PAPER, {"A": A, "B": B})
    assert counts == {"A": 3, "B": 2}
    assert counts["A"] * dominant_share(A, PAPER) == pytest.approx(2 / 3)
    assert counts["B"] * dominant_share(B, PAPER) == pytest.approx(2 / 3)


def test_weights_scale_the_dominant_shares() -> None:
    # Twice A's weight: A's dominant share may be twice B's (12 CPUs, no memory bound).
    capacity = {"cpu": 12.0, "mem": 1000.0}
    counts = progressive_filling(capacity, {"A": {"cpu": 1.0}, "B": {"cpu": 1.0}}, {"A": 2})
    assert counts == {"A": 8, "B": 4}


def test_a_demand_is_checked_and_holds_a_slot_unless_it_says_otherwise() -> None:
    assert parse_demand({"cpu": 1, "mem": 4}) == {"cpu": 1.0, "mem": 4.0, SLOTS: 1.0}
    assert parse_demand("gpu_mem=10") == {"gpu_mem": 10.0, SLOTS: 1.0}
    assert parse_demand({"slots": 0, "io": 1}) == {"slots": 0.0, "io": 1.0}
    assert demand_of(None) == {SLOTS: 1.0}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"cpu": -1}, "fair_resources: cpu must be a number of at least 0, got -1"),
        ({"cpu": "lots"}, "fair_resources: cpu must be a number of at least 0, got 'lots'"),
        ({"cpu": True}, "fair_resources: cpu must be a number of at least 0, got True"),
        ({"cpu": float("nan")}, "fair_resources: cpu must be a number of at least 0"),
        ({"9cpu": 1}, "fair_resources: resource names are letters"),
        ("cpu", "fair_resources: expected RESOURCE=AMOUNT"),
        (["cpu"], "fair_resources must be a mapping of resource name to amount"),
    ],
)
def test_a_bad_demand_names_the_setting_and_the_value(value: object, message: str) -> None:
    with pytest.raises(FairConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_demand(value)


def test_a_capacity_is_positive_and_has_the_pools_slots() -> None:
    assert parse_capacity("cpu=9,mem=18", slots=10) == {"cpu": 9.0, "mem": 18.0, SLOTS: 10.0}
    assert parse_capacity({"slots": 3}, slots=10) == {SLOTS: 3.0}
    with pytest.raises(FairConfigError, match="fair_capacity: mem must be a positive number"):
        parse_capacity({"mem": 0}, slots=4)
    with pytest.raises(FairConfigError, match="--fair-capacity: expected RESOURCE=AMOUNT"):
        parse_capacity("cpu=", slots=4, setting="--fair-capacity")


def test_a_demand_that_can_never_fit_says_why() -> None:
    capacity = parse_capacity({"cpu": 9, "mem": 18}, slots=10)
    assert unfit_reason(parse_demand(A), capacity) is None
    assert unfit_reason(parse_demand({"gpu": 1}), capacity) == (
        "resource(s) gpu not in the worker's capacity"
    )
    assert unfit_reason(parse_demand({"mem": 24}), capacity) == (
        "more than the worker's capacity: mem 24 > 18"
    )
    # Zero of an unknown resource asks for nothing.
    assert unfit_reason({"gpu": 0.0, SLOTS: 1.0}, capacity) is None


def test_the_ledger_holds_and_releases_by_task_and_is_repaired_from_what_runs() -> None:
    ledger = Ledger(PAPER)
    for n in range(3):
        assert ledger.fits(A)
        ledger.hold(f"a{n}", A)
    ledger.hold("b0", B)
    assert ledger.fits(B) and ledger.free("cpu") == 3 and ledger.free("mem") == 5
    ledger.hold("b1", B)
    ledger.hold("b1", B)  # told twice: held once
    assert not ledger.fits(B) and not ledger.fits(A)  # all 9 CPUs held, 14 GB
    assert ledger.release("b1") and ledger.fits(B)
    # A second end of the same task, or an unknown one, frees nothing.
    assert not ledger.release("b1") and not ledger.release("nobody")
    assert ledger.held == {"cpu": 6.0, "mem": 13.0}
    # An end went unseen (a child replaced): the books follow what really runs.
    assert ledger.reset({"a0": A, "b0": B}) == ["a1", "a2"]
    assert ledger.held == {"cpu": 4.0, "mem": 5.0}


def test_fractional_amounts_added_and_taken_leave_nothing_out() -> None:
    ledger = Ledger({"cpu": 1.0})
    tenth = {"cpu": 0.1}
    for n in range(10):
        ledger.hold(n, tenth)
    for n in range(10):
        ledger.release(n)
    for n in range(10):
        assert ledger.fits(tenth)
        ledger.hold(n, tenth)


def test_a_smaller_task_starts_past_a_large_one_until_the_large_one_is_reserved() -> None:
    ledger = Ledger({"gpu_mem": 24.0})
    big, small = {"gpu_mem": 20.0}, {"gpu_mem": 5.0}
    ledger.hold("s0", small)  # 19 free: the big one does not fit
    admission = Admission(patience=2)
    waiting = [("big", big), ("s1", small), ("s2", small)]
    assert admission.choose(waiting, ledger) == 1  # s1 starts past big (1 skip)
    ledger.hold("s1", small)
    waiting = [("big", big), ("s2", small), ("s3", small)]
    assert admission.choose(waiting, ledger) == 1  # s2 too (2 skips: big is reserved)
    ledger.hold("s2", small)
    assert admission.reserved == "big"
    waiting = [("big", big), ("s3", small)]
    assert admission.choose(waiting, ledger) is None  # s3 fits, but big is reserved
    for n in range(3):
        ledger.release(f"s{n}")
    assert admission.choose(waiting, ledger) == 0  # all free again: big first
    assert admission.reserved is None and "big" not in admission.skips


def test_a_reserved_task_that_leaves_another_way_frees_the_reservation() -> None:
    ledger = Ledger({"cpu": 4.0})
    ledger.hold("t", {"cpu": 3.0})
    admission = Admission(patience=1)
    assert admission.choose([("big", {"cpu": 4.0}), ("s", {"cpu": 1.0})], ledger) == 1
    assert admission.reserved == "big"
    ledger.hold("s", {"cpu": 1.0})
    ledger.release("t")
    assert admission.choose([("big", {"cpu": 4.0}), ("s2", {"cpu": 1.0})], ledger) is None
    # big was revoked: the others go on.
    assert admission.choose([("s2", {"cpu": 1.0})], ledger) == 0
    assert admission.reserved is None


@given(
    st.lists(
        # Whole and half units (at most 36 tasks of any one shape fit).
        st.tuples(st.integers(0, 8), st.integers(0, 16))
        .filter(lambda d: d != (0, 0))
        .map(lambda d: (d[0] / 2, d[1] / 2)),
        min_size=1,
        max_size=6,
    )
)
def test_progressive_filling_never_exceeds_the_capacity(shapes: list[tuple[float, float]]) -> None:
    capacity = {"cpu": 9.0, "mem": 18.0}
    demands = {f"t{i}": {"cpu": c, "mem": m} for i, (c, m) in enumerate(shapes)}
    counts = progressive_filling(capacity, demands)
    for name in capacity:
        used = sum(counts[t] * demands[t][name] for t in demands)
        assert used <= capacity[name] + 1e-6
    # Work-conserving: no tenant's next task still fits.
    ledger = Ledger(capacity)
    for tenant, n in counts.items():
        for i in range(n):
            ledger.hold((tenant, i), demands[tenant])
    assert not any(ledger.fits(d) for d in demands.values())


def test_dominant_cost_is_the_dominant_share_in_pool_slots() -> None:
    capacity = {"cpu": 9.0, "mem": 18.0, SLOTS: 10.0, queue_resource("video"): 2.0}
    # The paper's shapes: A's dominant share is 2/9 (memory), B's 1/3 (CPU).
    assert dominant_cost({"cpu": 1, "mem": 4, SLOTS: 1}, capacity) == pytest.approx(20 / 9)
    assert dominant_cost({"cpu": 3, "mem": 1, SLOTS: 1}, capacity) == pytest.approx(10 / 3)
    # A task that declares nothing costs one slot, as in count mode.
    assert dominant_cost(demand_of(None), capacity) == pytest.approx(1.0)
    # A queue's own limit is not a share of the machine.
    assert dominant_cost({SLOTS: 1, queue_resource("video"): 1}, capacity) == pytest.approx(1.0)


def test_dominant_costs_give_drr_the_papers_three_to_two() -> None:
    from celery_fair.scheduling.dispatch import DispatchRound

    capacity = {"cpu": 9.0, "mem": 18.0, SLOTS: 10.0}
    costs = CostModel("dominant")
    assert costs.runtime and costs.unit == 1.0
    round_: DispatchRound[str] = DispatchRound(costs)
    round_.set_quanta(costs.quanta({"a": 1.0, "b": 1.0}))
    shapes = {"a": {"cpu": 1.0, "mem": 4.0, SLOTS: 1.0}, "b": {"cpu": 3.0, "mem": 1.0, SLOTS: 1.0}}
    for i in range(600):
        round_.put("a", f"a{i}")
        round_.put("b", f"b{i}")
    taken = {"a": 0, "b": 0}
    for _ in range(500):
        got = round_.take()
        assert got is not None
        queue = got[0]
        taken[queue] += 1
        # Post-charged at the end of each run, as the worker does.
        round_.finished(queue, dominant_cost(shapes[queue], capacity))
        costs.observe(queue, dominant_cost(shapes[queue], capacity))
    assert taken["a"] / taken["b"] == pytest.approx(1.5, rel=0.02)


def test_queue_concurrency_is_read_and_checked() -> None:
    assert parse_queue_concurrency("video=3,other=1") == {"video": 3, "other": 1}
    assert parse_queue_concurrency({"video": 2}) == {"video": 2}
    for bad in ("video=0", {"video": 1.5}, {"video": True}, "video=x"):
        with pytest.raises(FairConfigError, match="fair_queue_concurrency"):
            parse_queue_concurrency(bad)


def test_cluster_capacity_sums_the_workers_heard_from_lately() -> None:
    from celery_fair.scheduling.resources import cluster_capacity

    one = {"cpu": 9.0, "mem": 18.0, SLOTS: 10.0, queue_resource("video"): 2.0}
    two = {"cpu": 6.0, "mem": 24.0, SLOTS: 10.0}
    gone = {"cpu": 100.0, SLOTS: 4.0}
    total = cluster_capacity([(one, 100.0), (two, 95.0), (gone, 60.0)], 100.0, fresh=30.0)
    # A queue's own limit is per worker; a worker silent for 40 s is gone.
    assert total == {"cpu": 15.0, "mem": 42.0, SLOTS: 20.0}
    # The paper's shapes on the two workers together: A's share is memory's 4/42.
    assert dominant_cost({"cpu": 1, "mem": 4, SLOTS: 1}, total) == pytest.approx(20 * 4 / 42)
