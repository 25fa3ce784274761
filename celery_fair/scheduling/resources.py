"""Resources: what a task holds while it runs, what a worker can hold, and fair shares of them.

A task declares what one run holds (``fair_resources={"cpu": 1, "mem": 4}``)
and a worker its capacity (``fair_capacity={"cpu": 9, "mem": 18}``).  A
task that declares nothing holds one unit of :data:`SLOTS`, the pool process
it runs in, and a worker's capacity always has as many slots as its pool
has processes: a worker whose tasks declare nothing behaves as before.

Dominant Resource Fairness (Ghodsi et al., "Dominant Resource Fairness: Fair
Allocation of Multiple Resource Types", NSDI 2011): a task's *dominant share*
is the largest fraction of any one resource it holds; DRF equalises the sum
of each tenant's dominant shares, divided by its weight.  The paper's
example, a system of <9 CPUs, 18 GB> with A's tasks at <1 CPU, 4 GB> and
B's at <3 CPUs, 1 GB>, gives A three tasks and B two (both at 2/3):
:func:`progressive_filling` computes it, and is what the worker's admission
is measured against.

:class:`Ledger` keeps what is held on one worker, and :class:`Admission`
chooses which waiting task starts: the first in fair order that fits, so a
large task does not block the smaller ones behind it, until it has been
passed over ``patience`` times; then it holds a reservation and nothing
else starts until it fits (no starvation).  Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import FairConfigError
from ..grammar import parse_pairs

__all__ = (
    "QUEUE_RESOURCE",
    "SLOTS",
    "Admission",
    "Ledger",
    "Resources",
    "cluster_capacity",
    "demand_of",
    "dominant_cost",
    "dominant_share",
    "parse_capacity",
    "parse_demand",
    "parse_queue_concurrency",
    "progressive_filling",
    "queue_resource",
    "unfit_reason",
)

#: The resource every worker has, one per pool process; a task that declares
#: nothing holds one.
SLOTS = "slots"

#: What one run holds, or what a worker can hold: resource name -> amount.
Resources = Mapping[str, float]

#: The prefix of a queue's own resource (``fair_queue_concurrency``): each of
#: the queue's tasks holds one unit.  A ':' is not allowed in a declared name,
#: so it cannot meet a user's resource.
QUEUE_RESOURCE = "queue:"

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def _amounts(value: object, *, setting: str, zero: bool) -> dict[str, float]:
    """``{"cpu": 1}`` or ``"cpu=1,mem=4"`` as names to finite amounts (> 0, or >= 0)."""
    pairs = parse_pairs(value, setting=setting, what="RESOURCE=AMOUNT")
    amounts: dict[str, float] = {}
    for name, raw in pairs.items():
        if not _NAME.match(name):
            raise FairConfigError(
                f"{setting}: resource names are letters, digits, '_', '.' and '-', "
                f"starting with a letter or '_'; got {name!r}"
            )
        number: float | None = None
        if not isinstance(raw, bool):
            try:
                number = float(raw)
            except (TypeError, ValueError):
                number = None
        if number is None or not math.isfinite(number) or number < 0 or (number == 0 and not zero):
            kind = "a number of at least 0" if zero else "a positive number"
            raise FairConfigError(f"{setting}: {name} must be {kind}, got {raw!r}")
        amounts[name] = number
    return amounts


def parse_demand(value: object, *, setting: str = "fair_resources") -> dict[str, float]:
    """What one run holds, checked: resource names to amounts of at least 0.

    ``slots`` defaults to 1 (the pool process the task runs in); a task may
    declare ``slots`` itself (0 for one that waits on I/O in a thread).
    """
    amounts = _amounts(value, setting=setting, zero=True)
    amounts.setdefault(SLOTS, 1.0)
    return amounts


def parse_capacity(
    value: object, *, slots: int | None, setting: str = "fair_capacity"
) -> dict[str, float]:
    """What one worker can hold, checked; ``slots`` is its pool's process count
    (None: not known yet, left out).

    A ``slots`` given in the setting is kept (it can only be lower than the
    pool's processes to mean anything).
    """
    amounts = _amounts(value, setting=setting, zero=False)
    if slots is not None:
        amounts.setdefault(SLOTS, float(slots))
    return amounts


def queue_resource(queue: str) -> str:
    """The resource that ``fair_queue_concurrency`` gives ``queue`` on a worker."""
    return QUEUE_RESOURCE + queue


def parse_queue_concurrency(
    value: object, *, setting: str = "fair_queue_concurrency"
) -> dict[str, int]:
    """``{"video": 3}`` or ``"video=3"``: queue names to whole numbers of at least 1."""
    counts: dict[str, int] = {}
    for queue, raw in parse_pairs(value, setting=setting, what="QUEUE=N").items():
        number = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
        if isinstance(raw, str) and raw.strip().isdigit():
            number = int(raw)
        if number is None or number < 1:
            raise FairConfigError(
                f"{setting}: {queue} must be a whole number of at least 1 (tasks of the queue "
                f"at once on one worker), got {raw!r}"
            )
        counts[queue] = number
    return counts


def demand_of(declared: Resources | None) -> dict[str, float]:
    """A checked demand, or one slot for a task that declares nothing."""
    if not declared:
        return {SLOTS: 1.0}
    return dict(declared)


def unfit_reason(demand: Resources, capacity: Resources) -> str | None:
    """Why ``demand`` can never start on a worker of ``capacity`` (None: it can)."""
    unknown = sorted(name for name, amount in demand.items() if amount > 0 and name not in capacity)
    if unknown:
        return f"resource(s) {', '.join(unknown)} not in the worker's capacity"
    over = sorted(name for name, amount in demand.items() if amount > capacity.get(name, 0.0))
    if over:
        parts = ", ".join(f"{n} {demand[n]:g} > {capacity[n]:g}" for n in over)
        return f"more than the worker's capacity: {parts}"
    return None


def dominant_share(demand: Resources, capacity: Resources) -> float:
    """The largest fraction of one resource of ``capacity`` that ``demand`` holds."""
    return max(
        (amount / capacity[name] for name, amount in demand.items() if capacity.get(name)),
        default=0.0,
    )


def dominant_cost(demand: Resources, capacity: Resources) -> float:
    """What a task is charged under ``fair_cost="dominant"``: its dominant share of the
    worker's resources, in pool slots (a task that holds one slot and nothing else costs 1).

    A queue's own resource (``fair_queue_concurrency``) is a limit, not a
    share of the machine: it is left out.
    """
    shared = {
        name: amount for name, amount in capacity.items() if not name.startswith(QUEUE_RESOURCE)
    }
    return dominant_share(demand, shared) * capacity.get(SLOTS, 1.0)


def cluster_capacity(
    capacities: Iterable[tuple[Resources, float]], now: float, *, fresh: float
) -> dict[str, float]:
    """What the workers that said so within ``fresh`` seconds of ``now`` can hold together.

    ``capacities``: each worker's capacity and when it last said it.  A
    queue's own resource is per worker, and is left out.  Under
    ``fair_cost="dominant"`` every worker charges a task its share of this
    sum: the dominant shares that DRF equalises are then the cluster's, and
    the charges workers of different sizes make on a keyed queue's keys (on
    the broker, shared) are on one scale.
    """
    total: dict[str, float] = {}
    for capacity, said in capacities:
        if now - said > fresh:
            continue
        for name, amount in capacity.items():
            if not name.startswith(QUEUE_RESOURCE):
                total[name] = total.get(name, 0.0) + amount
    return total


@dataclass
class Ledger:
    """What one worker's running tasks hold, against its capacity, by task.

    Held by identity (a task id): a second end of the same task, or the end
    of one never started here, frees nothing, and :meth:`reset` rebuilds the
    books from the tasks the pool really runs when an end went unseen.
    """

    capacity: Mapping[str, float]
    running: dict[object, Resources] = field(default_factory=dict)
    held: dict[str, float] = field(default_factory=dict)

    def free(self, name: str) -> float:
        """How much of ``name`` is not held."""
        return self.capacity.get(name, 0.0) - self.held.get(name, 0.0)

    def fits(self, demand: Resources) -> bool:
        """Whether ``demand`` fits in what is free now."""
        # A small tolerance: fractional amounts added and taken away again
        # must not leave a task out by a rounding error.
        return all(amount <= self.free(name) + 1e-9 for name, amount in demand.items())

    def hold(self, ident: object, demand: Resources) -> None:
        """Task ``ident`` started, holding ``demand`` (again: no change)."""
        if ident in self.running:
            return
        self.running[ident] = demand
        for name, amount in demand.items():
            self.held[name] = self.held.get(name, 0.0) + amount

    def release(self, ident: object) -> bool:
        """Task ``ident`` ended; False if it held nothing here."""
        demand = self.running.pop(ident, None)
        if demand is None:
            return False
        for name, amount in demand.items():
            left = self.held.get(name, 0.0) - amount
            self.held[name] = left if left > 1e-9 else 0.0
        return True

    def reset(self, running: Mapping[object, Resources]) -> list[object]:
        """Hold exactly what ``running`` holds; returns the tasks whose end went unseen."""
        lost = [ident for ident in self.running if ident not in running]
        self.running, self.held = {}, {}
        for ident, demand in running.items():
            self.hold(ident, demand)
        return lost


@dataclass
class Admission:
    """Which waiting task starts next: first fit in fair order, with a reservation.

    ``waiting`` is given in fair order (the order the DWRR and the keys'
    order would serve them).  The first that fits starts; a task passed over
    because it did not fit counts a skip, and after ``patience`` skips it is
    reserved: nothing starts until it fits (then it starts first).  A task
    never waits behind smaller ones for ever, and the worker is not idle
    behind one large task while it waits only briefly.
    """

    patience: int = 8
    #: Skips of each waiting task passed over (by its identity), and the reserved one.
    skips: dict[object, int] = field(default_factory=dict)
    reserved: object | None = None

    def choose(self, waiting: Sequence[tuple[object, Resources]], ledger: Ledger) -> int | None:
        """The index in ``waiting`` of the task to start now, or None (none may start).

        ``waiting``: (identity, demand) pairs in fair order.
        """
        ids = [ident for ident, _ in waiting]
        if self.reserved is not None and self.reserved not in ids:
            self.reserved = None  # it left another way (revoked, sent back)
        if self.reserved is not None:
            index = ids.index(self.reserved)
            if not ledger.fits(waiting[index][1]):
                return None
            self.reserved = None
            self.skips.pop(ids[index], None)
            return index
        for index, (ident, demand) in enumerate(waiting):
            if ledger.fits(demand):
                for passed, _ in waiting[:index]:
                    self.skips[passed] = self.skips.get(passed, 0) + 1
                    if self.reserved is None and self.skips[passed] >= self.patience:
                        self.reserved = passed
                self.skips.pop(ident, None)
                return index
        return None

    def forget(self, ident: object) -> None:
        """``ident`` no longer waits here."""
        self.skips.pop(ident, None)
        if self.reserved == ident:
            self.reserved = None


def progressive_filling(
    capacity: Resources,
    demands: Mapping[str, Resources],
    weights: Mapping[str, float] | None = None,
) -> dict[str, int]:
    """Tasks per tenant that weighted DRF gives, each with an unbounded backlog.

    Repeatedly start a task of the tenant with the lowest dominant share
    divided by its weight, among those whose next task still fits; stop when
    none fits (Ghodsi et al., section 4, with tasks as the unit).  Ties go to
    the tenant named first.
    """
    weights = weights or {}
    ledger = Ledger(capacity)
    counts = dict.fromkeys(demands, 0)
    started = 0
    shares = {tenant: dominant_share(d, capacity) for tenant, d in demands.items()}
    open_ = [t for t in demands if shares[t] > 0]
    while open_:
        tenant = min(open_, key=lambda t: counts[t] * shares[t] / weights.get(t, 1.0))
        if not ledger.fits(demands[tenant]):
            open_.remove(tenant)
            continue
        ledger.hold(started, demands[tenant])
        started += 1
        counts[tenant] += 1
    return counts
