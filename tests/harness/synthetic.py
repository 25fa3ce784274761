"""Synthetic telemetry with known shares, waits and keys, for tests and benchmarks.

The generator draws the records a perfectly known scheduler would leave:

- queue ``q`` serves a fraction ``served_shares[q]`` of the total *cost*
  (by default its weight share ``w_q / sum(w)``, a fair scheduler); the
  number of tasks it serves follows from its mean cost;
- the run time (= the charged cost) of a task of ``q`` is gamma distributed
  with shape 4 and mean ``mean_runtime[q]``;
- the message reaches the worker ``latency`` seconds after it is published,
  waits an exponential buffer sojourn of mean ``mean_sojourn[q]``, and starts
  at once, so wait = ``latency`` + sojourn and its p-quantile is
  ``latency - mean_sojourn * ln(1 - p)`` exactly;
- start times are uniform over ``duration`` seconds, so every window of the
  report sees the same mix, and a window's Jain index is the index of the
  served shares normalised by weight (:meth:`Truth.jain`);
- fairness keys of a queue follow a Zipf law (exponent ``key_skew``), so the
  first key of each queue is the hot one;
- a fraction ``codel_requeue`` / ``codel_reject`` of a queue's records are
  CoDel decisions (they never ran; cost 0), ``failure_rate`` fail.

Two options shape a noisy neighbour and an outage, for the noisy-tenant
findings and the charts (both off by default; the records are then the same
as without them):

- ``flood_share``: this fraction of the records belong to one more key,
  ``flood_key``, in queue ``flood_queue``, started during ``flood_span`` (a
  fraction of the time line). The queue shares and Jain index of
  :class:`Truth` are those of the other records.
- ``gaps``: (start, end) seconds after ``start`` in which no task starts; the
  other records fill the rest of ``duration``.

Two more shape a multi-tenant deployment (:func:`tenant_spec`): with
``tenants`` the keys are tenants every queue serves (key ``k`` of each queue
is named ``t<k>``), and with ``flood_everywhere`` the flood key's records
stay in the queues drawn for them, so that one tenant holds
``flood_share`` of the work of every queue.

Every record carries its key's weight (``key_weights``, else 1), as a keyed
queue's fetch stamps it, unless ``keyed`` is false (queues routed by key
without ``fair_keys``: no weight), and a ``key_throttled`` of 0: synthetic keys
are never held back by limits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from celery_fair.telemetry.schema import AMOUNTS, SCHEMA

__all__ = ("SyntheticSpec", "Truth", "generate", "tenant_spec", "write_synthetic")

DEFAULT_WEIGHTS: dict[str, float] = {"p0": 1.0, "p1": 2.0, "p2": 3.0, "p3": 4.0}


@dataclass(frozen=True)
class SyntheticSpec:
    """What to generate; every field is a known truth the report must recover."""

    records: int = 100_000
    weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    served_shares: Mapping[str, float] | None = None  # None: fair (weight shares)
    mean_runtime: Mapping[str, float] | None = None  # None: 10 ms for every queue
    mean_sojourn: Mapping[str, float] | None = None  # None: 50 ms x queue index + 20 ms
    latency: float = 0.002
    keys_per_queue: int = 50
    key_skew: float = 1.2
    codel_requeue: float = 0.02
    codel_reject: float = 0.005
    failure_rate: float = 0.01
    duration: float = 600.0
    start: float = 1_700_000_000.0
    seed: int = 0
    hostnames: int = 4
    flood_share: float = 0.0
    flood_queue: str | None = None  # None: the first queue
    flood_key: str = "tenant-flood"
    flood_span: tuple[float, float] = (0.0, 1.0)
    gaps: tuple[tuple[float, float], ...] = ()
    key_weights: Mapping[str, float] = field(default_factory=dict)
    keyed: bool = True
    tenants: bool = False
    flood_everywhere: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.flood_share < 1.0:
            raise ValueError(f"flood_share={self.flood_share!r}: must be in [0, 1)")
        low, high = self.flood_span
        if not 0.0 <= low < high <= 1.0:
            raise ValueError(f"flood_span={self.flood_span!r}: must be 0 <= start < end <= 1")
        if self.flood_queue is not None and self.flood_queue not in self.weights:
            raise ValueError(f"flood_queue={self.flood_queue!r}: not one of the weights' queues")
        ends = [0.0]
        for a, b in sorted(self.gaps):
            if not ends[-1] <= a < b <= self.duration:
                raise ValueError(f"gaps={self.gaps!r}: must be disjoint, within the duration")
            ends.append(b)

    def queues(self) -> list[str]:
        return sorted(self.weights)

    def runtime_of(self, q: str) -> float:
        return (self.mean_runtime or {}).get(q, 0.010)

    def sojourn_of(self, q: str) -> float:
        default = 0.020 + 0.050 * self.queues().index(q)
        return (self.mean_sojourn or {}).get(q, default)

    def shares(self) -> dict[str, float]:
        raw = self.served_shares or self.weights
        total = sum(raw.values())
        return {q: raw[q] / total for q in self.queues()}

    def active_seconds(self) -> float:
        """Seconds of ``duration`` outside the gaps."""
        return self.duration - sum(b - a for a, b in self.gaps)

    def target_shares(self) -> dict[str, float]:
        total = sum(self.weights.values())
        return {q: self.weights[q] / total for q in self.queues()}


@dataclass(frozen=True)
class Truth:
    """The quantities a correct report recovers from the generated records."""

    spec: SyntheticSpec

    def share(self, q: str) -> float:
        """Share of served cost of queue ``q``."""
        return self.spec.shares()[q]

    def wait_quantile(self, q: str, p: float) -> float:
        """p-quantile of wait (publish -> start) of queue ``q``."""
        return self.spec.latency - self.spec.sojourn_of(q) * math.log(1.0 - p)

    def sojourn_quantile(self, q: str, p: float) -> float:
        """p-quantile of the buffer sojourn of queue ``q``."""
        return -self.spec.sojourn_of(q) * math.log(1.0 - p)

    def jain(self) -> float:
        """Jain's index of the weight-normalised served shares."""
        x = [self.spec.shares()[q] / self.spec.weights[q] for q in self.spec.queues()]
        return sum(x) ** 2 / (len(x) * sum(v * v for v in x))


def _task_fractions(spec: SyntheticSpec) -> np.ndarray:
    # A queue serving cost share s with mean cost c serves s / c tasks per unit.
    raw = np.array([spec.shares()[q] / spec.runtime_of(q) for q in spec.queues()])
    fractions: np.ndarray = raw / raw.sum()
    return fractions


def _keys(spec: SyntheticSpec, rng: np.random.Generator, qi: np.ndarray, n: int) -> np.ndarray:
    """Index into the key names: Zipf keys within each queue (rank k weighs k ** -key_skew)."""
    ranks = np.arange(1, spec.keys_per_queue + 1, dtype=np.float64) ** -spec.key_skew
    key = rng.choice(spec.keys_per_queue, size=n, p=ranks / ranks.sum())
    index: np.ndarray = key if spec.tenants else qi * spec.keys_per_queue + key
    return index


def _key_names(spec: SyntheticSpec) -> list[str]:
    """Key index -> name; the flood key is the last (:func:`_flood_index`)."""
    if spec.tenants:
        names = [f"t{k:05d}" for k in range(spec.keys_per_queue)]
    else:
        names = [f"{q}-k{k:03d}" for q in spec.queues() for k in range(spec.keys_per_queue)]
    return [*names, spec.flood_key]


def _flood_index(spec: SyntheticSpec) -> int:
    return spec.keys_per_queue * (1 if spec.tenants else len(spec.queues()))


def tenant_spec(records: int, keys: int = 2_000, queues: int = 8, seed: int = 1) -> SyntheticSpec:
    """Telemetry shaped like a multi-tenant deployment.

    ``queues`` queues of equal weight, each serving the same ``keys`` tenants
    (Zipf 1.2), and one more tenant, ``tenant-big``, with 40% of every
    queue's tasks: 40% of all work, spread over every queue.
    """
    return SyntheticSpec(
        records=records,
        weights={f"q{i}": 1.0 for i in range(queues)},
        keys_per_queue=keys,
        tenants=True,
        flood_share=0.4,
        flood_everywhere=True,
        flood_key="tenant-big",
        seed=seed,
    )


def _chunk(spec: SyntheticSpec, rng: np.random.Generator, first: int, n: int) -> pa.Table:
    queues = spec.queues()
    qi = rng.choice(len(queues), size=n, p=_task_fractions(spec))
    flooded = np.zeros(n, dtype=bool)
    if spec.flood_share:
        flooded = rng.random(n) < spec.flood_share
        if not spec.flood_everywhere:
            qi = np.where(flooded, queues.index(spec.flood_queue or queues[0]), qi)
    mean_rt = np.array([spec.runtime_of(q) for q in queues])[qi]
    mean_so = np.array([spec.sojourn_of(q) for q in queues])[qi]
    weights = np.array([float(spec.weights[q]) for q in queues])[qi]

    u = rng.random(n)
    outcome_idx = np.zeros(n, dtype=np.int64)  # success
    outcome_idx[u < spec.failure_rate] = 1  # failure
    cut = 1.0 - spec.codel_requeue - spec.codel_reject
    outcome_idx[u >= cut] = 3  # codel-requeue
    outcome_idx[u >= 1.0 - spec.codel_reject] = 4  # codel-reject
    ran = outcome_idx < 3

    runtime = rng.gamma(4.0, mean_rt / 4.0)
    sojourn = rng.exponential(mean_so)
    if not spec.gaps and not spec.flood_share:
        started = spec.start + rng.random(n) * spec.duration
    else:
        # Positions on the time line without the gaps, then moved past them.
        at = rng.random(n) * spec.active_seconds()
    key_index = _keys(spec, rng, qi, n)
    if spec.flood_share:
        low, high = spec.flood_span
        at[flooded] = (low + (high - low) * rng.random(int(flooded.sum()))) * spec.active_seconds()
        key_index = np.where(flooded, _flood_index(spec), key_index)
    if spec.gaps or spec.flood_share:
        for a, b in sorted(spec.gaps):
            at[at >= a] += b - a
        started = spec.start + at
    received = started - sojourn
    published = received - spec.latency
    finished = np.where(ran, started + runtime, started)

    names = _key_names(spec)
    key_names = pa.array(names)
    key_weights = pa.array(
        [float(spec.key_weights.get(k, 1.0)) if spec.keyed else None for k in names],
        type=pa.float64(),
    )
    host_names = pa.array([f"worker{h}@example" for h in range(spec.hostnames)])
    host = rng.integers(0, spec.hostnames, size=n)
    outcomes = pa.array(["success", "failure", "retry", "codel-requeue", "codel-reject"])

    def maybe(values: np.ndarray) -> pa.Array:
        return pa.array(values, mask=~ran)

    columns = {
        "task_id": pa.array([f"{i:016x}" for i in range(first, first + n)]),
        "task_name": pc.take(pa.array(["work", "nap"]), pa.array(qi % 2)),
        "queue": pc.take(pa.array(queues), pa.array(qi)),
        "outcome": pc.take(outcomes, pa.array(outcome_idx)),
        "received": pa.array(received),
        "finished": pa.array(finished),
        "routing_key": pc.take(pa.array(queues), pa.array(qi)),
        "fair_key": pc.take(key_names, pa.array(key_index)),
        "published": pa.array(published),
        "dispatched": maybe(started),
        "started": maybe(started),
        "runtime": maybe(runtime),
        "cost": pa.array(np.where(ran, runtime, 0.0)),
        "target_weight": pa.array(weights),
        "key_weight": pc.take(key_weights, pa.array(key_index)),
        "key_throttled": pa.array(np.zeros(n)),
        "hostname": pc.take(host_names, pa.array(host)),
        "pid": pa.array(1000 + host, type=pa.int32()),
        "source": pa.array(["synthetic"] * n),
        "priority": pa.nulls(n, type=pa.int32()),
        "key_user": pa.nulls(n, type=pa.string()),
        "key_paused": pa.array(np.zeros(n)),
        "resources": pa.nulls(n, type=AMOUNTS),
        "capacity": pa.nulls(n, type=AMOUNTS),
    }
    return pa.Table.from_pydict(columns, schema=SCHEMA)


def generate(spec: SyntheticSpec, chunk: int = 1_000_000) -> Iterator[pa.Table]:
    """Yield the records as Arrow tables of at most ``chunk`` rows (deterministic)."""
    rng = np.random.default_rng(spec.seed)
    for first in range(0, spec.records, chunk):
        yield _chunk(spec, rng, first, min(chunk, spec.records - first))


def write_synthetic(spec: SyntheticSpec, directory: str | Path, chunk: int = 1_000_000) -> Truth:
    """Write the records as Parquet files in ``directory``; return the truth."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for i, table in enumerate(generate(spec, chunk)):
        pq.write_table(table, out / f"synthetic-{spec.seed}-{i:05d}.parquet", compression="zstd")
    return Truth(spec)
