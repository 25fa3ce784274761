"""CoDelController against RFC 8289 §5: replayed traces and properties.

The reference model below is the RFC's pseudo-code (§5.2-§5.6) written out
as directly as Python allows, owning its queue and looping inside
``dequeue()``.  The controller under test owns no queue: a small driver
plays the worker, taking the head task, asking ``should_drop`` and asking
again after each drop.  Both see the same traces; decisions and the RFC
state must agree at every step.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_fair.scheduling.codel import CoDelController, CoDelStatistics
from tests.harness.clock import FakeClock


def no_clock() -> float:
    raise AssertionError("the controller read its clock although `now` was given")


# -- the reference: RFC 8289 §5, transliterated --------------------------------


class RfcCoDelQueue:
    """RFC 8289 §5 codel_queue_t.  Packets are their enqueue timestamps and
    one packet is one byte, so ``bytes() <= maxpacket`` counts packets.
    0 is the RFC's "time not set" flag (trace times are never negative)."""

    def __init__(
        self, target: float, interval: float, maxpacket: int, clock: Callable[[], float]
    ) -> None:
        self.TARGET = target
        self.INTERVAL = interval
        self.maxpacket = maxpacket
        self.clock = clock
        self.queue: deque[float] = deque()
        self.dropped: list[float] = []
        # §5.2 per-queue state
        self.first_above_time_ = 0.0
        self.drop_next_ = 0.0
        self.count_ = 0
        self.lastcount_ = 0
        self.dropping_ = False

    def bytes(self) -> int:
        return len(self.queue)

    def drop(self, p: float | None) -> None:
        assert p is not None
        self.dropped.append(p)

    # §5.4
    def enqueue(self, tstamp: float) -> None:
        self.queue.append(tstamp)

    # §5.5
    def dequeue(self) -> float | None:
        now = self.clock()
        p, ok_to_drop = self.dodequeue(now)
        if self.dropping_:
            if not ok_to_drop:
                self.dropping_ = False
            while now >= self.drop_next_ and self.dropping_:
                self.drop(p)
                self.count_ += 1
                p, ok_to_drop = self.dodequeue(now)
                if not ok_to_drop:
                    self.dropping_ = False
                else:
                    self.drop_next_ = self.control_law(self.drop_next_, self.count_)
        elif ok_to_drop:
            self.drop(p)
            p, ok_to_drop = self.dodequeue(now)
            self.dropping_ = True
            delta = self.count_ - self.lastcount_
            self.count_ = 1
            if delta > 1 and now - self.drop_next_ < 16 * self.INTERVAL:
                self.count_ = delta
            self.drop_next_ = self.control_law(now, self.count_)
            self.lastcount_ = self.count_
        return p

    # §5.6
    def dodequeue(self, now: float) -> tuple[float | None, bool]:
        p = self.queue.popleft() if self.queue else None
        ok_to_drop = False
        if p is None:
            self.first_above_time_ = 0.0
            return p, ok_to_drop
        sojourn_time = now - p
        if sojourn_time < self.TARGET or self.bytes() <= self.maxpacket:
            self.first_above_time_ = 0.0
        else:
            if self.first_above_time_ == 0:
                self.first_above_time_ = now + self.INTERVAL
            elif now >= self.first_above_time_:
                ok_to_drop = True
        return p, ok_to_drop

    def control_law(self, t: float, count: int) -> float:
        return t + self.INTERVAL / math.sqrt(count)

    def state(self) -> tuple[float, bool, int, int, float]:
        return (
            self.first_above_time_,
            self.dropping_,
            self.count_,
            self.lastcount_,
            self.drop_next_,
        )


def rfc_state(s: CoDelStatistics) -> tuple[float, bool, int, int, float]:
    """The controller's state in the reference's terms (None is the RFC's 0)."""
    return (
        s.first_above_time or 0.0,
        s.dropping,
        s.count,
        s.lastcount,
        s.drop_next or 0.0,
    )


# -- the worker's side: a buffer and the drop loop ------------------------------


@dataclass(frozen=True)
class Decision:
    now: float
    sojourn: float
    backlog: int | None
    drop: bool
    before: CoDelStatistics
    after: CoDelStatistics


@dataclass
class Worker:
    """Owns the buffer and drives the controller as the worker will."""

    codel: CoDelController
    pass_backlog: bool = True
    pass_now: bool = True
    buffer: deque[float] = dataclasses.field(default_factory=deque)
    log: list[Decision | float] = dataclasses.field(default_factory=list)  # float: empty()

    def dispatch(self, now: float) -> tuple[list[float], float | None]:
        """Take tasks until one is not dropped; return (dropped, dispatched)."""
        dropped: list[float] = []
        while self.buffer:
            received = self.buffer.popleft()
            backlog = len(self.buffer) if self.pass_backlog else None
            before = self.codel.statistics()
            if self.pass_now:
                drop = self.codel.should_drop(now - received, now, backlog=backlog)
            else:
                drop = self.codel.should_drop(now - received, backlog=backlog)
            self.log.append(
                Decision(now, now - received, backlog, drop, before, self.codel.statistics())
            )
            if not drop:
                return dropped, received
            dropped.append(received)
        self.codel.empty(now if self.pass_now else None)
        self.log.append(now)
        return dropped, None

    def decisions(self) -> list[Decision]:
        return [d for d in self.log if isinstance(d, Decision)]


# -- traces ---------------------------------------------------------------------

# A trace is a list of (time, event): "arrive" puts a task in the buffer,
# "dequeue" frees a pool slot.  Times are whole numbers so that both sides
# compute bit-identical floats.
Trace = list[tuple[float, str]]


@st.composite
def traces(draw: st.DrawFn) -> Trace:
    """Phases of overload and drain: each step brings `rate` arrivals and
    frees one slot, `gap` time units apart (rate 0 drains the buffer)."""
    events: Trace = []
    now = 1.0
    for _ in range(draw(st.integers(1, 10))):
        rate = draw(st.integers(0, 4))
        gap = draw(st.integers(1, 40))
        for _ in range(draw(st.integers(1, 40))):
            now += gap
            events += [(now, "arrive")] * rate
            events.append((now, "dequeue"))
        if draw(st.booleans()):
            now += draw(st.integers(0, 3000))  # a pause, possibly long
    return events


params = st.tuples(st.integers(1, 40), st.integers(1, 200)).map(
    lambda p: (float(p[0]), float(p[0] + p[1]))
)


def replay(
    trace: Trace,
    target: float,
    interval: float,
    min_backlog: int | None,
    pass_now: bool = True,
) -> Worker:
    """Run ``trace`` through the reference and the controller in lockstep,
    asserting identical drops, dispatches and state after every event."""
    clock = FakeClock()
    maxpacket = -1 if min_backlog is None else min_backlog - 1
    rfc = RfcCoDelQueue(target, interval, maxpacket, clock)
    codel = CoDelController(
        target,
        interval,
        min_backlog=0 if min_backlog is None else min_backlog,
        clock=clock if not pass_now else no_clock,
    )
    worker = Worker(codel, pass_backlog=min_backlog is not None, pass_now=pass_now)
    for now, event in trace:
        clock.now = now
        if event == "arrive":
            rfc.enqueue(now)
            worker.buffer.append(now)
            continue
        drops_before = len(rfc.dropped)
        delivered = rfc.dequeue()
        dropped, dispatched = worker.dispatch(now)
        assert dropped == rfc.dropped[drops_before:], f"at {now}"
        assert dispatched == delivered, f"at {now}"
        assert rfc_state(codel.statistics()) == rfc.state(), f"at {now}"
        assert list(worker.buffer) == list(rfc.queue)
    stats = codel.statistics()
    assert stats.drops == len(rfc.dropped)
    return worker


# -- replay against the reference -------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(trace=traces(), p=params, min_backlog=st.sampled_from([None, 0, 1, 2, 3]))
def test_matches_rfc_pseudo_code_at_every_step(
    trace: Trace, p: tuple[float, float], min_backlog: int | None
) -> None:
    replay(trace, *p, min_backlog)


@settings(max_examples=40, deadline=None)
@given(trace=traces(), p=params)
def test_matches_rfc_pseudo_code_reading_the_injected_clock(
    trace: Trace, p: tuple[float, float]
) -> None:
    replay(trace, *p, min_backlog=1, pass_now=False)


def test_replay_reaches_every_branch() -> None:
    # A fixed trace that exercises entry, the drop loop (several drops at
    # one instant), leaving, and re-entry both with and without resuming.
    trace: Trace = []
    now = 1.0
    for rate, gap, steps, pause in [
        (3, 2, 200, 0),  # overload: enter, drop faster and faster
        (0, 2, 300, 0),  # drain: leave the dropping state
        (3, 2, 100, 0),  # overload again soon: resume count
        (0, 2, 300, 5000),  # drain, then a long pause
        (3, 2, 100, 0),  # overload long after: count restarts at 1
        (4, 1, 30, 400),  # a pause inside the dropping state ...
        (4, 1, 30, 0),  # ... then several drops due at once
    ]:
        for _ in range(steps):
            now += gap
            trace += [(now, "arrive")] * rate + [(now, "dequeue")]
        now += pause
    worker = replay(trace, target=5.0, interval=50.0, min_backlog=1)
    decisions = worker.decisions()
    entries = [d for d in decisions if not d.before.dropping and d.after.dropping]
    assert len(entries) >= 3
    assert any(e.after.count > 1 for e in entries), "no entry resumed the count"
    assert any(e.after.count == 1 and e.before.count > 2 for e in entries)
    same_instant = [
        (a.now, b.now) for a, b in zip(decisions, decisions[1:], strict=False) if a.drop and b.drop
    ]
    assert any(x == y for x, y in same_instant), "never dropped twice at one instant"


# -- a trace worked by hand from the RFC ------------------------------------------


def test_hand_worked_trace() -> None:
    codel = CoDelController(5.0, 100.0, clock=no_clock)
    # (now, sojourn, expected decision, expected (dropping, count, lastcount, drop_next))
    steps: list[tuple[float, float, bool, tuple[bool, int, int, float | None]]] = [
        (0, 10, False, (False, 0, 0, None)),  # above target: first_above_time = 100
        (50, 10, False, (False, 0, 0, None)),  # above, not yet for an interval
        (100, 10, True, (False, 0, 0, None)),  # above for an interval: drop, enter
        (100, 10, False, (True, 1, 1, 200)),  # the next task goes; drop_next = 100 + 100
        (150, 10, False, (True, 1, 1, 200)),  # dropping, but no drop due
        (200, 10, True, (True, 2, 1, 200)),  # due: drop, count 2
        (200, 10, False, (True, 2, 1, 200 + 100 / math.sqrt(2))),  # next one goes
        (271, 10, True, (True, 3, 1, 200 + 100 / math.sqrt(2))),
        (271, 10, False, (True, 3, 1, 200 + 100 / math.sqrt(2) + 100 / math.sqrt(3))),
        (300, 2, False, (False, 3, 1, 200 + 100 / math.sqrt(2) + 100 / math.sqrt(3))),
        (310, 10, False, (False, 3, 1, 200 + 100 / math.sqrt(2) + 100 / math.sqrt(3))),
        (409, 10, False, (False, 3, 1, 200 + 100 / math.sqrt(2) + 100 / math.sqrt(3))),
        (410, 10, True, (False, 3, 1, 200 + 100 / math.sqrt(2) + 100 / math.sqrt(3))),
        # re-entry 82 after drop_next < 16 intervals: count = 3 - 1 = 2
        (410, 10, False, (True, 2, 2, 410 + 100 / math.sqrt(2))),
    ]
    for now, sojourn, drop, (dropping, count, lastcount, drop_next) in steps:
        assert codel.should_drop(sojourn, now) is drop, f"at {now}"
        s = codel.statistics()
        assert (s.dropping, s.count, s.lastcount, s.drop_next) == (
            dropping,
            count,
            lastcount,
            pytest.approx(drop_next) if drop_next is not None else None,
        ), f"at {now}"
    s = codel.statistics()
    assert (s.decisions, s.drops, s.dropping_entries) == (len(steps), 4, 2)


def test_drops_follow_the_control_law_under_constant_overload() -> None:
    target, interval, tick = 1.0, 10.0, 0.25
    codel = CoDelController(target, interval, clock=no_clock)
    drop_times = []
    for i in range(1, 481):  # 120 time units, a decision every tick
        now = i * tick
        while codel.should_drop(5.0, now, backlog=10):
            drop_times.append(now)
    # Scheduled drops: S1 = first sample + interval, S(k+1) = S(k) + interval/sqrt(k);
    # each happens at the first tick at or after its schedule.
    scheduled = [tick + interval]
    while len(scheduled) < len(drop_times) + 1:
        k = len(scheduled)
        scheduled.append(scheduled[-1] + interval / math.sqrt(k))
    assert len(drop_times) >= 10
    for k, t in enumerate(drop_times):
        assert scheduled[k] <= t < scheduled[k] + tick
    assert scheduled[len(drop_times)] > 120.0  # no drop was missed
    gaps = [b - a for a, b in zip(drop_times, drop_times[1:], strict=False)]
    assert gaps[-1] < gaps[0] / 2


# -- properties over random traces ----------------------------------------------


def run(trace: Trace, target: float, interval: float, min_backlog: int) -> Worker:
    worker = Worker(CoDelController(target, interval, min_backlog=min_backlog, clock=no_clock))
    for now, event in trace:
        if event == "arrive":
            worker.buffer.append(now)
        else:
            worker.dispatch(now)
    return worker


@settings(max_examples=150, deadline=None)
@given(trace=traces(), p=params, min_backlog=st.integers(0, 3))
def test_properties_of_every_decision(
    trace: Trace, p: tuple[float, float], min_backlog: int
) -> None:
    target, interval = p
    worker = run(trace, target, interval, min_backlog)
    streak_start: float | None = None  # first sample of the current above-target run
    for entry in worker.log:
        if not isinstance(entry, Decision):  # empty(): the run is broken
            streak_start = None
            continue
        d = entry
        good = d.sojourn < target or (d.backlog is not None and d.backlog < min_backlog)
        if good:
            # Never a drop while the sojourn is below target (or the buffer short).
            assert not d.drop
            streak_start = None
        elif streak_start is None:
            streak_start = d.now
        if d.drop:
            # Only after the sojourn has stayed above target for an interval.
            assert streak_start is not None
            assert d.now - streak_start >= interval
        if d.drop and d.before.dropping:
            # A drop inside the dropping state happens when due, and counts.
            assert d.before.drop_next is not None
            assert d.now >= d.before.drop_next
            assert d.after.count == d.before.count + 1
        if not d.before.dropping and d.after.dropping:
            # Entry (RFC 8289 §5.5): resume from count - lastcount when the last
            # episode was recent, else start over at one drop per interval.
            delta = d.before.count - d.before.lastcount
            recent = d.before.drop_next is not None and d.now - d.before.drop_next < 16 * interval
            assert d.after.count == (delta if delta > 1 and recent else 1)
            assert d.after.lastcount == d.after.count
            assert d.after.drop_next == d.now + interval / math.sqrt(d.after.count)
        elif d.before.dropping and d.after.dropping and d.after.drop_next != d.before.drop_next:
            # Inside an episode the next drop is scheduled interval / sqrt(count)
            # after the last one, count being the drops made so far (the count
            # this call starts from: a drop made by this call counts later).
            assert d.before.drop_next is not None and d.after.drop_next is not None
            assert d.after.drop_next - d.before.drop_next == pytest.approx(
                interval / math.sqrt(d.before.count)
            )
    decisions = worker.decisions()
    stats = worker.codel.statistics()
    assert stats.drops == sum(d.drop for d in decisions)
    assert stats.decisions == len(decisions)


@settings(max_examples=100, deadline=None)
@given(
    p=params,
    samples=st.lists(st.tuples(st.integers(0, 50), st.floats(0, 0.999)), min_size=1, max_size=200),
)
def test_never_drops_below_target(p: tuple[float, float], samples: list[tuple[int, float]]) -> None:
    target, interval = p
    codel = CoDelController(target, interval, clock=no_clock)
    now = 0.0
    for gap, fraction in samples:
        now += gap
        assert not codel.should_drop(fraction * target, now)
    assert codel.statistics().first_above_time is None


# -- the backlog condition (RFC 8289 §5.6, bytes() <= maxpacket) ----------------


def overloaded(codel: CoDelController, backlog: int | None) -> list[bool]:
    return [codel.should_drop(50.0, float(t), backlog=backlog) for t in range(0, 300, 10)]


def test_the_last_buffered_task_is_never_dropped_by_default() -> None:
    assert not any(overloaded(CoDelController(5.0, 100.0, clock=no_clock), backlog=0))
    assert any(overloaded(CoDelController(5.0, 100.0, clock=no_clock), backlog=1))


@pytest.mark.parametrize(
    ("min_backlog", "backlog", "drops"),
    [(0, 0, True), (2, 1, False), (2, 2, True), (3, 2, False), (1, None, True), (3, None, True)],
)
def test_min_backlog(min_backlog: int, backlog: int | None, drops: bool) -> None:
    codel = CoDelController(5.0, 100.0, min_backlog=min_backlog, clock=no_clock)
    assert any(overloaded(codel, backlog)) is drops


def test_a_short_buffer_restarts_the_interval() -> None:
    codel = CoDelController(5.0, 100.0, clock=no_clock)
    assert not codel.should_drop(50.0, 0.0, backlog=4)
    assert not codel.should_drop(50.0, 90.0, backlog=0)  # short: counts as good
    assert not codel.should_drop(50.0, 100.0, backlog=4)  # a new interval starts
    assert not codel.should_drop(50.0, 199.0, backlog=4)
    assert codel.should_drop(50.0, 200.0, backlog=4)


# -- empty buffer, reset, clock ------------------------------------------------------


def test_an_empty_buffer_forgets_the_above_target_run() -> None:
    codel = CoDelController(5.0, 100.0, clock=no_clock)
    assert not codel.should_drop(50.0, 0.0)
    codel.empty(50.0)
    assert codel.statistics().first_above_time is None
    assert not codel.should_drop(50.0, 100.0)  # the interval starts again
    assert codel.should_drop(50.0, 200.0)


def test_a_drop_that_empties_the_buffer_still_enters_the_dropping_state() -> None:
    # RFC 8289 §5.5 enters the drop state after dequeuing the next packet,
    # even when there is none; empty() stands for that dequeue.
    codel = CoDelController(5.0, 100.0, min_backlog=0, clock=no_clock)
    assert not codel.should_drop(50.0, 0.0, backlog=0)
    assert codel.should_drop(50.0, 100.0, backlog=0)
    codel.empty(100.0)
    s = codel.statistics()
    assert (s.dropping, s.count, s.drop_next, s.first_above_time) == (True, 1, 200.0, None)
    codel.empty(150.0)  # found empty again: leave the dropping state
    assert not codel.dropping


def test_reset_restores_the_initial_state_and_keeps_the_counters() -> None:
    codel = CoDelController(5.0, 100.0, clock=no_clock)
    assert not codel.should_drop(50.0, 0.0)
    assert codel.should_drop(50.0, 100.0)
    codel.reset()
    s = codel.statistics()
    assert rfc_state(s) == (0.0, False, 0, 0, 0.0)
    assert (s.decisions, s.drops, s.dropping_entries, s.resets) == (2, 1, 1, 1)
    # The call after the drop is a fresh decision again, not the entry step.
    assert not codel.should_drop(50.0, 100.0)
    assert not codel.dropping


def test_the_injected_clock_is_read_only_when_now_is_omitted() -> None:
    clock = FakeClock(1000.0)
    codel = CoDelController(5.0, 100.0, clock=clock)
    assert not codel.should_drop(50.0, 1000.0)
    assert clock.reads == 0
    clock.advance(100.0)
    assert codel.should_drop(50.0)
    assert clock.reads == 1
    codel.empty()
    assert clock.reads == 2
    assert codel.statistics().drop_next == 1100.0 + 100.0


# -- parameters and the statistics record -------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"target": 0, "interval": 1.0}, ["target", "0"]),
        ({"target": -0.1, "interval": 1.0}, ["target", "-0.1"]),
        ({"target": math.nan, "interval": 1.0}, ["target", "nan"]),
        ({"target": "0.1", "interval": 1.0}, ["target", "'0.1'"]),
        ({"target": True, "interval": 1.0}, ["target", "True"]),
        ({"target": 0.1, "interval": 0}, ["interval", "0"]),
        ({"target": 0.1, "interval": math.inf}, ["interval", "inf"]),
        ({"target": 1.0, "interval": 1.0}, ["target", "interval", "1.0"]),
        ({"target": 2.0, "interval": 1.0}, ["target", "interval", "2.0"]),
        ({"target": 0.1, "interval": 1.0, "min_backlog": -1}, ["min_backlog", "-1"]),
        ({"target": 0.1, "interval": 1.0, "min_backlog": 1.5}, ["min_backlog", "1.5"]),
    ],
)
def test_invalid_parameters_are_named(kwargs: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        CoDelController(**kwargs, clock=no_clock)  # type: ignore[arg-type]
    for word in words:
        assert word in str(info.value)


def test_statistics_is_a_frozen_record() -> None:
    codel = CoDelController(0.1, 1.0, min_backlog=2, clock=no_clock)
    s = codel.statistics()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.count = 3  # type: ignore[misc]
    assert s.as_dict() == {
        "target": 0.1,
        "interval": 1.0,
        "min_backlog": 2,
        "first_above_time": None,
        "dropping": False,
        "count": 0,
        "lastcount": 0,
        "drop_next": None,
        "decisions": 0,
        "drops": 0,
        "dropping_entries": 0,
        "resets": 0,
    }
    assert "CoDelController" in repr(codel)
