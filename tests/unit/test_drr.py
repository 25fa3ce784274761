"""Property tests of the DRR guarantees (Shreedhar & Varghese 1995, RFC 8290)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_fair.scheduling.drr import DeficitRoundRobin

names = [f"q{i}" for i in range(8)]
quanta_st = st.lists(
    st.floats(min_value=0.25, max_value=40, allow_nan=False), min_size=2, max_size=8
)


def backlogged(quanta: list[float]) -> DeficitRoundRobin:
    drr = DeficitRoundRobin({names[i]: q for i, q in enumerate(quanta)})
    for name in drr.queues:
        drr.activate(name)
    return drr


@settings(max_examples=150, deadline=None)
@given(quanta=quanta_st, data=st.data(), steps=st.integers(200, 3000))
def test_served_cost_per_quantum_is_equal_within_one_quantum_plus_max_cost(
    quanta: list[float], data: st.DataObject, steps: int
) -> None:
    max_cost = data.draw(st.floats(min_value=0.1, max_value=20), label="max_cost")
    costs = data.draw(
        st.lists(st.floats(min_value=0.01, max_value=max_cost), min_size=1, max_size=50),
        label="costs",
    )
    drr = backlogged(quanta)
    served = dict.fromkeys(drr.queues, 0.0)
    for step in range(steps):
        name = drr.head()
        assert name is not None
        cost = costs[step % len(costs)]
        drr.served(name, cost)
        served[name] += cost
        # Checked at every decision: any two backlogged queues have been
        # served the same cost per unit of quantum, within one visit (one
        # quantum) plus one maximum cost.
        for a in drr.queues:
            for b in drr.queues:
                qa, qb = drr.quantum(a), drr.quantum(b)
                gap = served[a] / qa - served[b] / qb
                assert gap < 1 + max_cost / min(qa, qb) + 1e-9


@settings(max_examples=100, deadline=None)
@given(quanta=st.lists(st.integers(1, 10), min_size=2, max_size=8), rounds=st.integers(3, 30))
def test_every_backlogged_queue_is_served_every_round(quanta: list[int], rounds: int) -> None:
    # With a fixed cost no larger than the smallest quantum, each visit serves
    # at least once, so the sequence of visits is a strict round robin.
    drr = backlogged([float(q) for q in quanta])
    sequence: list[str] = []
    while len(_runs(sequence)) < rounds * len(quanta) + 1:
        name = drr.next(cost=1.0)
        assert name is not None
        sequence.append(name)
    visits = _runs(sequence)[:-1]
    n = len(quanta)
    for start in range(0, len(visits) - n + 1):
        assert sorted(visits[start : start + n]) == sorted(drr.queues)
    for name, length in zip(visits, _run_lengths(sequence), strict=False):
        assert length == drr.quantum(name)


def _runs(sequence: list[str]) -> list[str]:
    return [name for i, name in enumerate(sequence) if i == 0 or sequence[i - 1] != name]


def _run_lengths(sequence: list[str]) -> list[int]:
    lengths: list[int] = []
    for i, name in enumerate(sequence):
        if i and sequence[i - 1] == name:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


@settings(max_examples=150, deadline=None)
@given(
    quanta=quanta_st,
    events=st.lists(st.tuples(st.integers(0, 7), st.booleans()), min_size=1, max_size=400),
    debts=st.lists(st.floats(0, 30), max_size=20),
)
def test_never_idles_while_a_queue_has_work(
    quanta: list[float], events: list[tuple[int, bool]], debts: list[float]
) -> None:
    drr = DeficitRoundRobin({names[i]: q for i, q in enumerate(quanta)})
    has_work: set[str] = set()
    for i, (index, arrive) in enumerate(events):
        name = names[index % len(quanta)]
        if arrive:
            has_work.add(name)
            drr.activate(name)
        elif name in has_work:
            has_work.discard(name)
            drr.deactivate(name)
        if debts and name in has_work:
            drr.charge(name, debts[i % len(debts)])  # post-charged debt
        head = drr.head()
        if has_work:
            assert head in has_work
            drr.served(head, 1.0)
        else:
            assert head is None


@settings(max_examples=60, deadline=None)
@given(
    quanta=st.lists(st.integers(1, 5), min_size=2, max_size=5),
    runtimes=st.lists(st.floats(0.1, 10), min_size=5, max_size=40),
)
def test_post_charge_converges_to_weighted_shares_of_cost(
    quanta: list[int], runtimes: list[float]
) -> None:
    # DRR++: the decision is made with cost 0, the run time charged after.
    drr = backlogged([float(q) for q in quanta])
    cost = dict.fromkeys(drr.queues, 0.0)
    for step in range(4000):
        name = drr.head()
        assert name is not None
        drr.served(name, 0.0)
        runtime = runtimes[(step * 7 + len(name)) % len(runtimes)]
        drr.charge(name, runtime)
        cost[name] += runtime
    total_cost = sum(cost.values())
    total_quanta = sum(drr.quantum(n) for n in drr.queues)
    slack = (max(runtimes) + max(quanta)) * len(quanta) / total_cost
    for name in drr.queues:
        share = cost[name] / total_cost
        assert share == pytest.approx(drr.quantum(name) / total_quanta, abs=slack + 0.01)


def test_empty_queue_loses_credit_but_keeps_debt() -> None:
    drr = DeficitRoundRobin({"a": 5, "b": 1})
    drr.activate("a")
    drr.activate("b")
    assert drr.next() == "a"
    assert drr.deficit("a") == 4
    drr.deactivate("a")
    assert drr.deficit("a") == 0
    drr.activate("a")
    assert drr.head() == "b"
    drr.charge("b", 10)
    drr.deactivate("b")
    assert drr.deficit("b") == pytest.approx(-9)


def test_pass_over_keeps_queue_listed_for_the_next_round() -> None:
    drr = DeficitRoundRobin({"a": 1, "b": 1, "c": 1})
    for name in "abc":
        drr.activate(name)
    assert list(drr.order()) == ["a", "b", "c"]
    drr.pass_over("a")
    assert list(drr.order()) == ["b", "c", "a"]


def test_quanta_change_at_run_time_and_are_validated() -> None:
    drr = DeficitRoundRobin({"a": 1, "b": 1})
    drr.set_quanta({"a": 3})
    assert drr.quantum("a") == 3
    with pytest.raises(ValueError, match="queue 'b'.*-1"):
        drr.set_quanta({"a": 2, "b": -1})
    assert drr.quantum("a") == 3  # nothing changed
    for bad in (0, -1, float("nan"), float("inf"), "4", True):
        with pytest.raises(ValueError, match="positive number"):
            DeficitRoundRobin({"x": bad})  # type: ignore[dict-item]


def test_unlisted_queue_gets_default_quantum() -> None:
    drr = DeficitRoundRobin({"a": 4}, default_quantum=2)
    drr.activate("new")
    assert drr.quantum("new") == 2


def test_statistics_is_a_plain_record() -> None:
    drr = backlogged([1.0, 2.0])
    for _ in range(6):
        drr.next()
    stats = drr.statistics()
    assert stats.decisions == 6
    assert {q.name: q.served_count for q in stats.queues} == {"q0": 2, "q1": 4}
    as_dict = stats.as_dict()
    assert as_dict["queues"]["q1"]["served_cost"] == 4  # type: ignore[index]
    with pytest.raises(AttributeError):
        stats.decisions = 0  # type: ignore[misc]


def test_decision_work_does_not_depend_on_queue_count() -> None:
    # O(1): count the visits (the unit of work) per decision, not the time.
    for n in (10, 1000, 10000):
        drr = DeficitRoundRobin({f"q{i}": 1 + i % 3 for i in range(n)})
        for i in range(n):
            drr.activate(f"q{i}")
        for _ in range(5 * n):
            drr.next()
        stats = drr.statistics()
        assert stats.visits / stats.decisions <= 1.0
