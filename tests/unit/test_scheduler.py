"""The worker's fair scheduler: fetch order, credit, runtime post-charge."""

from __future__ import annotations

import heapq

import pytest

from celery_fair.kombu.cycle import DWRRCycle
from celery_fair.scheduling.fetch import WINDOW_CAP_FLOOR, window_cap
from celery_fair.scheduling.scheduler import FairScheduler


def fetch_many(s: FairScheduler, n: int, window: int | None = None) -> dict[str, int]:
    counts = dict.fromkeys(s.queues, 0)
    for _ in range(n):
        q = s.fetch_order(window)[0]
        s.fetched(q)
        s.released(q)
        counts[q] += 1
    return counts


def test_fetches_follow_weights_exactly() -> None:
    weights = {f"p{i}": 4 * (i + 1) for i in range(10)}
    s = FairScheduler(weights)
    s.set_queues(weights)
    counts = fetch_many(s, 55 * 40)
    # Exact up to one message (DRR's bound: one quantum plus one cost).
    for i in range(10):
        assert abs(counts[f"p{i}"] - 40 * (i + 1)) <= 1, counts


def test_fetches_stay_exact_when_the_window_is_always_full() -> None:
    # Regression: with bursty quanta (lightest queue = 1 message per visit)
    # the heaviest queue hit its credit mid-visit and the queue after it was
    # fetched out of turn: p0 got twice its share when the worker was slow.
    weights = {f"p{i}": 4 * (i + 1) for i in range(10)}
    s = FairScheduler(weights, reserve=2)
    s.set_queues(weights)
    split = simulate(s, dict.fromkeys(weights, 0.001), slots=2, window=8)
    for queue, weight in weights.items():
        assert split[queue] == pytest.approx(weight / 220, rel=0.02), split


def test_skipped_queues_end_their_visit() -> None:
    s = FairScheduler({"a": 3, "b": 1, "c": 1})
    s.set_queues(["a", "b", "c"])
    order = s.fetch_order()
    assert order == ["a", "b", "c"]
    # BRPOP found a and b empty and returned c.
    s.fetched("c", skipped=order[:2])
    stats = s.statistics().drr.as_dict()["queues"]
    assert stats["a"]["deficit"] <= 0 and stats["b"]["deficit"] <= 0  # type: ignore[index]
    assert s.statistics().fetched["c"] == 1
    # c (weight 1) used its quantum; the next round starts again at a.
    assert s.fetch_order() == ["a", "b", "c"]


def test_queue_over_credit_is_polled_last_not_dropped() -> None:
    queues = ["flood", "q1", "q2", "q3"]
    s = FairScheduler(dict.fromkeys(queues, 1), reserve=2)
    s.set_queues(queues)
    for _ in range(6):
        s.fetched("flood")
    assert s.held("flood") == 6
    assert s.credit("flood", window=8) == 6  # window minus the reserve
    order = s.fetch_order(window=8)
    assert order[-1] == "flood" and sorted(order) == sorted(queues)
    s.released("flood")
    assert sorted(s.fetch_order(window=8)) == sorted(queues)


def test_a_queue_at_its_concurrency_limit_is_polled_last() -> None:
    s = FairScheduler({"video": 1, "other": 1}, reserve=4)
    s.set_queues(["video", "other"])
    s.fetch.limits = {"video": 2}
    # A window of 16 on 4 slots holds 4 tasks a slot: video's 2 at once, 8 held.
    assert s.credit("video", window=16) == 8
    assert s.credit("other", window=16) == 16  # uncapped: twice its share of the window
    for _ in range(8):
        s.fetched("video")
    assert s.fetch_order(window=16) == ["other", "video"]
    s.released("video")  # below its credit again: polled in its turn
    s.fetch_order(window=16)
    assert "video" not in s.fetch._demoted
    assert s.credit("video", window=None) is None  # no window known: no credit


def test_credit_never_binds_on_a_fair_share() -> None:
    s = FairScheduler({"long": 1, "short": 1}, cost="runtime", reserve=2)
    s.set_queues(["long", "short"])
    for _ in range(20):
        s.fetched("long")
        s.finished("long", 0.010)
        s.released("long")
        s.fetched("short")
        s.finished("short", 0.001)
        s.released("short")
    # Short tasks take ~10/11 of the fetches at a 50/50 time split.
    assert s.credit("short", window=8) >= 8 * 10 / 11


def simulate(s: FairScheduler, durations: dict[str, float], *, slots: int, window: int) -> dict:
    """A worker with ``slots`` pool slots and a prefetch window, in virtual time."""
    t, buffer, running = 0.0, [], []  # type: ignore[var-annotated]
    busy = dict.fromkeys(durations, 0.0)
    while t < 60:
        while len(buffer) < window:
            q = s.fetch_order(window)[0]
            s.fetched(q)
            buffer.append(q)
        while len(running) < slots and buffer:
            q = buffer.pop(0)
            s.released(q)  # early acknowledgement
            heapq.heappush(running, (t + durations[q], q, t))
        end, q, start = heapq.heappop(running)
        t = end
        s.finished(q, end - start)
        busy[q] += end - start
    total = sum(busy.values())
    return {q: b / total for q, b in busy.items()}


def test_runtime_cost_splits_worker_time_by_weight() -> None:
    s = FairScheduler({"long": 1, "short": 1}, cost="runtime", reserve=2)
    s.set_queues(["long", "short"])
    split = simulate(s, {"long": 0.010, "short": 0.001}, slots=2, window=8)
    assert split["long"] == pytest.approx(0.5, abs=0.01)


def test_runtime_cost_with_weights() -> None:
    s = FairScheduler({"a": 3, "b": 1}, cost="runtime", reserve=2)
    s.set_queues(["a", "b"])
    split = simulate(s, {"a": 0.002, "b": 0.020}, slots=2, window=8)
    assert split["a"] == pytest.approx(0.75, abs=0.015)


def test_count_cost_counts_messages() -> None:
    s = FairScheduler({"long": 1, "short": 1}, reserve=2)
    s.set_queues(["long", "short"])
    split = simulate(s, {"long": 0.010, "short": 0.001}, slots=2, window=8)
    assert split["long"] == pytest.approx(10 / 11, abs=0.01)


def test_post_charge_totals_equal_measured_runtime() -> None:
    # Fetched before any measurement, each message is charged an estimate;
    # the post-charge of the difference makes the total exactly the runtimes.
    s = FairScheduler({"a": 1}, cost="runtime")
    s.set_queues(["a"])
    runtimes = [0.003, 0.010, 0.001, 0.007]
    for _ in runtimes:
        s.fetched("a")
    for runtime in runtimes:
        s.finished("a", runtime)
    served = s.statistics().drr.queues[0].served_cost
    assert served == pytest.approx(sum(runtimes))


def test_weights_change_at_run_time_all_or_nothing() -> None:
    s = FairScheduler({"a": 1, "b": 1})
    s.set_queues(["a", "b"])
    with pytest.raises(ValueError, match="'b'"):
        s.set_weights({"a": 5, "b": 0})
    assert s.weights == {"a": 1, "b": 1}
    s.set_weights({"a": 3})
    counts = fetch_many(s, 400)
    assert counts == {"a": 300, "b": 100}


def test_queues_change_and_unknown_queue_is_adopted() -> None:
    s = FairScheduler({"a": 2})
    s.set_queues(["a", "b"])
    s.set_queues(["a"])
    assert s.queues == ("a",)
    s.fetched("c")  # delivered from a queue added behind our back
    assert "c" in s.queues and s.held("c") == 1


def test_cycle_protocol_reports_skips_and_service() -> None:
    s = FairScheduler({"a": 1, "b": 1, "c": 1})
    cycle = DWRRCycle(s)
    cycle.update(["a", "b", "c"])
    assert cycle.consume(3) == ["a", "b", "c"]
    assert cycle.rotate("c") == "c"
    assert s.statistics().fetched["c"] == 1
    assert s.statistics().drr.as_dict()["queues"]["a"]["empty_resets"] == 1  # type: ignore[index]
    assert cycle.consume(2) == cycle.consume(3)[:2]


def test_cost_mode_is_validated() -> None:
    with pytest.raises(ValueError, match="'bogus'"):
        FairScheduler(cost="bogus")  # type: ignore[arg-type]


def test_adaptive_prefetch_follows_round_trip_over_service_time() -> None:
    from celery_fair.scheduling.prefetch import AdaptivePrefetch

    p = AdaptivePrefetch(slots=1, minimum=1, maximum=64)
    assert p.window() == 64  # no estimates yet: Celery's own window
    for _ in range(10):
        p.observe_fetch(0.104)
        p.observe_service(0.004)
    assert p.window() == 26 + 1  # the seed's 104 ms / 4 ms, plus one spare
    for _ in range(60):
        p.observe_service(0.040)  # processing slowed down: a smaller window
    assert p.window() <= 5
    p.observe_fetch(5.0)  # a fetch that waited on an empty queue is not round trip
    assert p.round_trip == pytest.approx(0.104)
    assert p.statistics().changes >= 2
    with pytest.raises(ValueError, match="minimum"):
        AdaptivePrefetch(slots=1, minimum=5, maximum=2)


def poll(s: FairScheduler, backlog: dict[str, int], window: int | None = None) -> str | None:
    """One BRPOP: the first non-empty queue in the fetch order, the ones before skipped."""
    order = s.fetch_order(window)
    for i, queue in enumerate(order):
        if backlog.get(queue, 0) > 0:
            backlog[queue] -= 1
            s.fetched(queue, skipped=order[:i])
            s.released(queue)
            return queue
    return None  # a BRPOP timeout: DRR learns nothing


@pytest.mark.parametrize("cost", ["count", "runtime"])
def test_a_queue_served_alone_runs_up_no_debt(cost: str) -> None:
    # Regression (found by the soak benchmark): a light queue fetched while the
    # others were empty was charged out of turn on every fetch, its deficit fell
    # without bound (-100 after 400 fetches), and once the others had work again
    # it was starved until the debt was repaid.
    weights = {"s1": 1, "s2": 2, "s3": 4}
    s = FairScheduler(weights, cost=cost)  # type: ignore[arg-type]
    s.set_queues(weights)
    backlog = {"s1": 2000, "s2": 0, "s3": 0}
    for _ in range(1000):
        assert poll(s, backlog) == "s1"
        if cost == "runtime":
            s.finished("s1", 0.004)
    deficit = {q.name: q.deficit for q in s.statistics().drr.queues}
    assert deficit["s1"] >= -1.0 if cost == "count" else deficit["s1"] >= -0.01
    # Everyone has work again: the shares are the weights' from the first round.
    backlog = dict.fromkeys(weights, 10_000)
    counts = dict.fromkeys(weights, 0)
    for _ in range(70):
        queue = poll(s, backlog)
        assert queue is not None
        counts[queue] += 1
        if cost == "runtime":
            s.finished(queue, 0.004)
    assert counts == pytest.approx({"s1": 10, "s2": 20, "s3": 40}, abs=2)


def test_a_fetch_of_a_cancelled_queue_does_not_bring_it_back() -> None:
    # A fetch sent while "c" was consumed returns after its consumer was cancelled.
    scheduler = FairScheduler({"a": 1, "b": 2, "c": 1})
    cycle = DWRRCycle(scheduler)
    cycle.update(["a", "b", "c"])
    cycle.consume(3)
    cycle.update(["a", "b"])  # cancel_consumer("c")
    cycle.rotate("c")
    assert set(scheduler.queues) == {"a", "b"}
    assert cycle.last_fetched is None  # not counted as held either
    assert "c" not in scheduler.statistics().weights


@pytest.mark.parametrize("total", [1, 2, 8, 16, 40])
def test_push_windows_keep_the_weights_under_the_cap_for_small_celery_windows(total: int) -> None:
    # A window of one task (prefetch multiplier 1, one process) gave {2, 4}
    # under a cap of 4 x total: 2/3 for weights 1:3.
    s = FairScheduler({"la": 1, "lb": 3})
    s.set_queues(["la", "lb"])
    windows = s.push_windows(total, cap=window_cap(total))
    assert windows["lb"] == 3 * windows["la"]


def test_the_window_cap_is_four_celery_windows_and_never_below_the_floor() -> None:
    assert window_cap(1) == WINDOW_CAP_FLOOR
    assert window_cap(100) == 400
    s = FairScheduler({"light": 1, "heavy": 1000})
    s.set_queues(["light", "heavy"])
    assert s.push_windows(100, cap=window_cap(100))["heavy"] == 400


@pytest.mark.parametrize(
    "weights", [{"a": 1, "b": 2, "c": 4}, {"a": 3, "b": 5}, {"x": 0.5, "y": 1.5}, {"solo": 1}]
)
def test_a_batch_of_the_heads_run_keeps_the_one_at_a_time_order(weights: dict) -> None:
    """Taking ``fetch_run(head)`` messages in one fetch serves the queues in the same
    order as one fetch per message (every queue backlogged)."""
    one, batched = FairScheduler(weights), FairScheduler(weights)
    for s in (one, batched):
        s.set_queues(weights)
    seq_one: list[str] = []
    while len(seq_one) < 400:
        q = one.fetch_order()[0]
        one.fetched(q)
        one.released(q)
        seq_one.append(q)
    seq_b: list[str] = []
    runs: list[int] = []
    while len(seq_b) < 400:
        head = batched.fetch_order()[0]
        n = min(batched.fetch_run(head), 16)
        runs.append(n)
        for _ in range(n):
            batched.fetched(head)
            batched.released(head)
            seq_b.append(head)
    assert seq_b[:400] == seq_one
    if len(weights) == 1:
        assert min(runs) == 16, runs  # alone, a queue takes what the fetch asks for


def test_a_batch_stays_within_the_heads_credit() -> None:
    s = FairScheduler({"a": 1, "b": 1}, credit=3)
    s.set_queues(["a", "b"])
    head = s.fetch_order(8)[0]
    s.fetched(head)
    s.fetched(head)
    assert s.fetch_run(head, 8) <= 1


def test_a_queue_that_is_not_the_head_takes_one() -> None:
    s = FairScheduler({"a": 1, "b": 4})
    s.set_queues(["a", "b"])
    head = s.fetch_order()[0]
    other = "a" if head == "b" else "b"
    assert s.fetch_run(other) == 1
    assert s.fetch_run(head) >= 1
