"""Assert shares and limits over the records of a test worker (:class:`TaskRecord` or alike).

Pure functions of the records: unit-test your expectations with records you
make yourself, or run them over what a real worker recorded.  Any object with
``started`` and ``finished`` (seconds) and the attribute named by ``by`` works.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

__all__ = (
    "assert_concurrency_at_most", "assert_shares", "backlogged_window", "max_concurrency",
    "shares",
)  # fmt: skip

#: What groups the records: an attribute name (``"queue"``, ``"fair_key"``,
#: ``"name"``...) or a function of a record.
By = str | Callable[[Any], object]
Window = tuple[float, float]


def _grouper(by: By) -> Callable[[Any], str | None]:
    if callable(by):
        get = by
    else:

        def get(record: Any) -> object:
            return getattr(record, by)

    def group(record: Any) -> str | None:
        value = get(record)
        return None if value is None else str(value)

    return group


def backlogged_window(records: Iterable[Any], groups: Iterable[str], *, by: By = "queue") -> Window:
    """The time span in which every one of ``groups`` still had work waiting.

    From the first start among the records to the earliest of the groups'
    last starts: once a group's last task started, it had nothing left
    waiting, and the others could take its turns.  This holds when the
    backlog was published before the worker started (or before the first
    record): fill the queues first, then start the worker.  A group with no
    record fails the assertion.
    """
    group = _grouper(by)
    wanted = list(groups)
    last: dict[str, float] = {}
    first = None
    for record in records:
        name = group(record)
        first = record.started if first is None else min(first, record.started)
        if name in wanted:
            last[name] = max(last.get(name, record.started), record.started)
    missing = [name for name in wanted if name not in last]
    if missing or first is None:
        raise AssertionError(f"no task recorded for {missing or wanted} (grouped by {by!r})")
    return first, min(last.values())


def _in(record: Any, window: Window | None) -> bool:
    return window is None or window[0] <= record.started <= window[1]


def shares(
    records: Iterable[Any], *, by: By = "queue", window: Window | None = None
) -> dict[str, float]:
    """Each group's fraction of the tasks started in ``window`` (None: all of them)."""
    group = _grouper(by)
    counts = Counter(group(r) for r in records if _in(r, window))
    total = sum(counts.values())
    return {str(name): n / total for name, n in counts.items()} if total else {}


def assert_shares(
    records: Iterable[Any],
    expected: Mapping[str, float],
    *,
    by: By = "queue",
    tolerance: float = 0.2,
    window: Window | Literal["backlogged"] | None = "backlogged",
    min_tasks: int = 20,
) -> dict[str, float]:
    """Assert the groups shared the worker in the ratio of ``expected`` (weights).

    ``expected`` maps each group (a queue, with ``by="queue"``; a fairness
    key, with ``by="fair_key"``) to its weight, e.g. ``{"p0": 4, "p1": 1}``:
    p0 should start 80% of the tasks of the two.  Only the tasks of these
    groups count, started within ``window``: ``"backlogged"`` (default) is
    :func:`backlogged_window`, the span in which all of them had work
    waiting, outside which no scheduler can keep a ratio; None counts every
    record; or a ``(start, end)`` pair of seconds.

    Each observed share must lie within ``tolerance`` (relative: 0.2 is
    20%) of its expected share, over at least ``min_tasks`` tasks.  Returns
    the observed shares; the failure message shows both, with the counts.
    """
    if not expected or any(not w > 0 for w in expected.values()):
        raise ValueError(f"expected must map groups to weights > 0, got {dict(expected)!r}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance is relative, between 0 and 1, got {tolerance!r}")
    records = list(records)
    span = backlogged_window(records, expected, by=by) if window == "backlogged" else window
    assert span is None or isinstance(span, tuple)
    group = _grouper(by)
    counts = Counter(g for r in records if _in(r, span) and (g := group(r)) in expected)
    total = sum(counts.values())
    where = "" if span is None else f" started in [{span[0]:.3f}, {span[1]:.3f}]"
    if total < min_tasks:
        raise AssertionError(
            f"only {total} tasks of {sorted(expected)}{where}: too few to judge shares "
            f"(min_tasks={min_tasks}); publish a larger backlog"
        )
    weight = sum(expected.values())
    observed = {name: counts[name] / total for name in expected}
    wrong = {
        name: (observed[name], w / weight)
        for name, w in expected.items()
        if abs(observed[name] - w / weight) > tolerance * (w / weight)
    }
    if wrong:
        lines = [
            f"  {name}: {counts[name]} tasks, share {observed[name]:.3f}, "
            f"expected {w / weight:.3f} +/- {tolerance * w / weight:.3f}"
            + ("  <-- out of tolerance" if name in wrong else "")
            for name, w in expected.items()
        ]
        raise AssertionError(
            f"shares by {by!r} over {total} tasks{where} differ from the weights "
            f"{dict(expected)}:\n" + "\n".join(lines)
        )
    return observed


def max_concurrency(records: Iterable[Any], *, by: By = "fair_key") -> dict[str, int]:
    """Per group, the most tasks that ran at the same time (a sweep over start and finish).

    A task that finished exactly when another started does not overlap it.
    Records without a group (``None``) are counted under ``""``.
    """
    group = _grouper(by)
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for r in records:
        name = group(r) or ""
        events[name] += [(r.started, 1), (r.finished, -1)]
    most: dict[str, int] = {}
    for name, points in events.items():
        running = peak = 0
        for _, step in sorted(points):  # at a tie, a finish (-1) sorts before a start
            running += step
            peak = max(peak, running)
        most[name] = peak
    return most


def assert_concurrency_at_most(
    records: Iterable[Any],
    limit: int | Mapping[str, int],
    *,
    key: str | None = None,
    by: By = "fair_key",
) -> dict[str, int]:
    """Assert no group ran more tasks at once than its limit.

    ``limit`` is one number for every group (or for ``key`` alone when it is
    given), or a mapping as ``fair_key_concurrency`` is: group -> limit, with
    ``"*"`` for every group without its own (without ``"*"``, such a group is
    not checked).  Returns the most tasks each group ran at once; to show a
    limit was reached, not only respected, assert on it too.
    """
    most = max_concurrency(records, by=by)
    if key is not None:
        most = {key: most.get(key, 0)}
    limits: Mapping[str, int] = limit if isinstance(limit, Mapping) else {"*": limit}
    over: list[str] = []
    for name, peak in sorted(most.items()):
        cap = limits.get(name, limits.get("*"))
        if cap is not None and peak > cap:
            over.append(f"  {name!r}: {peak} at once, limit {cap}")
    if over:
        raise AssertionError(f"concurrency by {by!r} above its limit:\n" + "\n".join(over))
    return most
