"""The scheduling core's shared parts: cost model, dispatch round, shedding policy."""

from __future__ import annotations

import pytest

from celery_fair.scheduling.cost import CostModel, quanta
from celery_fair.scheduling.dispatch import DispatchRound, SendBack
from celery_fair.scheduling.shedding import CoDelOptions, SheddingPolicy, check_codel
from tests.harness.clock import FakeClock


def test_quanta_give_the_heaviest_one_unit_and_add_up_exactly() -> None:
    q = quanta({"a": 1, "b": 10}, 1.0)
    assert q["b"] == 1.0
    # Dyadic: ten visits of the light queue add up to exactly one unit.
    assert sum([q["a"]] * 10) == pytest.approx(1.0, abs=2**-16)
    assert (q["a"] * 1048576).is_integer()


def test_runtime_costs_are_estimated_then_settled() -> None:
    costs = CostModel("runtime", runtime_quantum=0.01)
    assert costs.cost("a") == 0.01  # nothing measured yet
    costs.observe("b", 0.5)
    assert costs.cost("a") == 0.5  # the global estimate stands in
    costs.observe("a", 0.1)
    assert costs.cost("a") == 0.1 and costs.estimates(["a", "c"]) == {"a": 0.1, "c": None}


def test_dispatch_round_charges_what_runs_and_refunds_what_is_sent_back() -> None:
    round_: DispatchRound[int] = DispatchRound(CostModel("count"))
    round_.set_quanta({"a": 1.0, "b": 1.0})
    for i in range(4):
        round_.put("a", i)
        round_.put("b", 10 + i)
    taken = [round_.take() for _ in range(4)]
    assert [t[0] for t in taken if t] == ["a", "b", "a", "b"]
    before = {q.name: q.served_cost for q in round_.statistics().queues}
    taken_a = round_.take()
    assert taken_a == ("a", 2)
    round_.refund("a")
    after = {q.name: q.served_cost for q in round_.statistics().queues}
    assert after == before  # the refunded message cost nothing
    assert len(round_) == 3


def test_dispatch_round_post_charges_the_measured_run_time() -> None:
    costs = CostModel("runtime", runtime_quantum=1.0)
    round_: DispatchRound[str] = DispatchRound(costs)
    round_.set_quanta(costs.quanta({"a": 1.0}))
    round_.put("a", "x")
    assert round_.take() == ("a", "x")
    round_.finished("a", 3.0)
    (record,) = round_.statistics().queues
    assert record.served_cost == pytest.approx(3.0)


def test_shedding_policy_runs_fresh_tasks_and_caps_returns() -> None:
    clock = FakeClock()
    policy = SheddingPolicy(CoDelOptions(0.1, 1.0, "requeue", 2), clock=clock)
    assert policy.verdict("q", received=0.0, backlog=5, requeues=lambda: 0) == "run"
    # Stale for a whole interval: CoDel drops; a task at the cap runs here.
    verdicts = []
    for step in range(1, 40):
        clock.now = step * 0.1
        verdicts.append(policy.verdict("q", received=0.0, backlog=5, requeues=lambda: 0))
    assert "requeue" in verdicts
    clock.now += 0.01
    capped = policy.verdict("q", received=0.0, backlog=5, requeues=lambda: 2)
    assert capped in ("run", "keep")
    stats = policy.statistics()
    assert stats.requeued == verdicts.count("requeue") == stats.requeued_by_queue["q"]
    assert stats.kept_at_cap == (capped == "keep")
    policy.failed("q", SendBack("codel-requeue", "q"))
    assert policy.statistics().requeued == stats.requeued - 1
    assert policy.statistics().errors == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0.1, None), "codel_interval=None: must be set with codel_target=0.1"),
        ((None, 1), "codel_target=None: must be set with codel_interval=1"),
        ((2, 1), "codel_target=2: must be below codel_interval=1"),
        ((0.1, 1, "drop"), "codel_action='drop': must be one of"),
        ((0.1, 1, "requeue", -1), "codel_max_requeues=-1: must be an integer >= 0"),
    ],
)
def test_check_codel_names_the_option_and_the_value(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_codel(*args)
    with pytest.raises(ValueError, match="fair_" + message.split("=")[0]):
        check_codel(*args, name="fair_{}".format)


def test_check_codel_is_off_without_times() -> None:
    assert check_codel(None, None) is None
    assert check_codel(0.1, 1.0) == CoDelOptions(0.1, 1.0, "requeue", 3)
