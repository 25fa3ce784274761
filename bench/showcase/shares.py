"""Scenarios B and C: who gets the worker when every tenant is backlogged.

Both use :func:`tests.harness.harness.run_backlogged`: the queues are
filled, one real ``celery worker -P prefork -c 2`` consumes them, and what
each queue got over a measured interval (past a warm-up) is the drop in its
length. Nothing in the worker is instrumented, so plain Celery and
celery-fair are measured in exactly the same way.

B. **Heavy tasks**: four tenants on their own queues; one tenant's tasks
   busy the CPU for 20 ms, the others' for 2 ms. Round-robin by count hands
   the heavy tenant most of the worker's time; ``fair_cost="runtime"``
   charges each queue its measured run time, so each tenant gets a quarter.
C. **Tiers**: two premium and two standard shards weighted 4:1, all
   backlogged; the achieved split between the tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tests.harness.brokers import broker_for
from tests.harness.harness import run_backlogged

__all__ = (
    "HEAVY_MODES",
    "TIER_MODES",
    "HeavyParams",
    "TierParams",
    "run_heavy",
    "run_tiers",
)

Sample = Callable[[dict[str, int], float], None]

#: Scenario B compares Celery's round-robin by count with celery-fair's runtime cost.
HEAVY_MODES: dict[str, dict[str, Any]] = {
    "plain-sharded": {"fair": False, "env": {}},
    "fair-runtime": {"fair": True, "env": {"CELERY_FAIR_COST": "runtime"}},
}
#: Scenario C compares Celery's round-robin with celery-fair's weights.
TIER_MODES: dict[str, dict[str, Any]] = {
    "plain-sharded": {"fair": False},
    "fair": {"fair": True},
}


@dataclass(frozen=True)
class HeavyParams:
    """Scenario B: one heavy tenant, ``light`` light ones, CPU-bound tasks."""

    heavy_us: int = 20_000
    light_us: int = 2_000
    light: int = 3
    target: int = 2_000
    warmup: int = 200

    def durations(self) -> dict[str, int]:
        """Queue (one per tenant) -> task duration in microseconds."""
        out = {"b-heavy": self.heavy_us}
        out.update({f"b-light{i}": self.light_us for i in range(1, self.light + 1)})
        return out

    def to_dict(self) -> dict[str, Any]:
        """The parameters as a plain record."""
        return asdict(self)


@dataclass(frozen=True)
class TierParams:
    """Scenario C: ``premium`` and ``standard`` shards, weights ``weight``:1, sleeping tasks."""

    premium: int = 2
    standard: int = 2
    weight: int = 4
    task_ms: float = 3.0
    target: int = 2_000
    warmup: int = 300

    def weights(self) -> dict[str, int]:
        """Queue -> celery-fair weight."""
        out = {f"premium-{i}": self.weight for i in range(self.premium)}
        out.update({f"standard-{i}": 1 for i in range(self.standard)})
        return out

    def to_dict(self) -> dict[str, Any]:
        """The parameters as a plain record."""
        return asdict(self)


def run_heavy(
    broker_url: str, mode: str, params: HeavyParams, on_sample: Sample | None = None
) -> dict[str, Any]:
    """One run of scenario B; the share of tasks and of worker time per tenant queue."""
    spec = HEAVY_MODES[mode]
    durations = params.durations()
    # Enough that no queue runs dry before the interval ends, whichever mode.
    counts = {q: params.target + params.warmup for q in durations}
    counts["b-heavy"] = params.target // 2 + params.warmup
    result = run_backlogged(
        broker_url,
        counts,
        target=params.target,
        warmup=params.warmup,
        fair=spec["fair"],
        args={q: (us,) for q, us in durations.items()},
        env=spec["env"],
        on_sample=on_sample,
    )
    broker_for(broker_url).purge(durations)
    return shares_record(result.consumed, durations, result.rate)


def shares_record(
    consumed: Mapping[str, int], durations: Mapping[str, float], rate: float
) -> dict[str, Any]:
    """Task and time shares from counts; time is count x nominal task duration."""
    total = sum(consumed.values()) or 1
    time_total = sum(consumed[q] * durations[q] for q in consumed) or 1.0
    return {
        "consumed": dict(consumed),
        "task_share": {q: n / total for q, n in consumed.items()},
        "time_share": {q: consumed[q] * durations[q] / time_total for q in consumed},
        "rate": rate,
    }


def run_tiers(
    broker_url: str, mode: str, params: TierParams, on_sample: Sample | None = None
) -> dict[str, Any]:
    """One run of scenario C; each shard's and each tier's share of the tasks."""
    spec = TIER_MODES[mode]
    weights = params.weights()
    counts = dict.fromkeys(weights, params.target + params.warmup)
    arg = ",".join(f"{q}={w}" for q, w in weights.items())
    result = run_backlogged(
        broker_url,
        counts,
        target=params.target,
        warmup=params.warmup,
        fair=spec["fair"],
        task="nap",
        args=(params.task_ms,),
        extra_args=["--fair-weights", arg] if spec["fair"] else [],
        on_sample=on_sample,
    )
    broker_for(broker_url).purge(weights)
    total = result.total or 1
    premium = sum(n for q, n in result.consumed.items() if q.startswith("premium"))
    return {
        "consumed": result.consumed,
        "share": {q: n / total for q, n in result.consumed.items()},
        "premium_share": premium / total,
        "target_premium_share": params.weight
        * params.premium
        / (params.weight * params.premium + params.standard),
        "rate": result.rate,
    }
