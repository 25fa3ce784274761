"""Run the showcase's scenarios with repetitions, alternating the modes, with live progress.

Used by ``bench/noisy_neighbour.py`` (full size, results in ``bench/results``)
and by ``make demo`` (short versions). Each repetition runs every selected
scenario once per mode; the order of the modes is reversed on every other
repetition so that a drift in the machine's load does not favour one side.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from .flood import FloodParams, run_flood
from .layout import MODES, TenantLayout
from .shares import HEAVY_MODES, TIER_MODES, HeavyParams, TierParams, run_heavy, run_tiers
from .summary import FLOOD_SCENARIOS

__all__ = ("SCENARIO_MODES", "LABELS", "Live", "ShowcaseConfig", "run_showcase", "server_for")

#: The modes each scenario compares, in the order of an even repetition.
SCENARIO_MODES: dict[str, tuple[str, ...]] = {
    "A": ("plain-shared", "plain-sharded", "fair"),
    "B": tuple(HEAVY_MODES),
    "C": tuple(TIER_MODES),
    "D": ("plain-sharded", "fair", "fair-codel"),
    # Fairness keys: every tenant in one queue, keyed (Redis only), against plain
    # Celery's one FIFO queue and against its sharded queues. The FIFO postpones
    # the quiet tenants while the flood drains, which flatters the flood's rate;
    # the sharded deployment serves them as the keyed queue does.
    "K": ("plain-shared", "plain-sharded", "fair-keyed"),
    # Fair when due: K with the flood's tasks all scheduled for one second (eta).
    # Plain Celery and fair-keyed hold them in the worker until due; with
    # fair_eta="broker" they wait on the broker and join the flood's key when due.
    "KS": ("plain-shared", "fair-keyed", "fair-keyed-eta"),
    # The router isolates the noisy tenant by itself (every broker).
    "I": ("plain-sharded", "fair", "fair-isolating"),
}

#: Column labels of the modes.
LABELS: dict[str, str] = {
    **{name: m.label for name, m in MODES.items()},
    "fair-runtime": "celery-fair (runtime cost)",
    "fair": "celery-fair",
    "fair-isolated": "celery-fair, flood tenant on its own queue",
}


@dataclass(frozen=True)
class ShowcaseConfig:
    """What to run: scenarios, repetitions and the size of each scenario."""

    scenarios: tuple[str, ...] = ("A", "B", "C", "D")
    reps: int = 3
    layout: TenantLayout = field(default_factory=TenantLayout.build)
    flood: FloodParams = field(default_factory=FloodParams)
    slow: FloodParams = field(
        default_factory=lambda: FloodParams(flood=8_000, workers=2, slow_ms=27.0, baseline=4.0)
    )
    # KS: K's flood, every task due 30 s after the burst starts (publishing 20,000
    # tasks to the schedule at nice 19 takes about 20 s on a small machine).
    scheduled: FloodParams = field(default_factory=lambda: FloodParams(due_after=30.0))
    heavy: HeavyParams = field(default_factory=HeavyParams)
    tiers: TierParams = field(default_factory=TierParams)
    telemetry_dir: str | None = None  # fair runs of A and D write telemetry here
    modes: tuple[str, ...] | None = None  # only these modes (of each scenario's own)

    @classmethod
    def quick(cls, **kw: Any) -> ShowcaseConfig:
        """Short versions of every scenario: a 3,000-task flood, smaller B and C."""
        return cls(
            flood=FloodParams(flood=3_000, baseline=3.0),
            slow=FloodParams(flood=2_000, workers=2, slow_ms=27.0, baseline=3.0),
            scheduled=FloodParams(flood=3_000, baseline=3.0, due_after=5.0),
            heavy=HeavyParams(target=800, warmup=100),
            tiers=TierParams(target=1_000, warmup=200),
            **kw,
        )

    def modes_of(self, scenario: str) -> tuple[str, ...]:
        """The modes to run for ``scenario``: its own, or those of ``modes`` that apply."""
        if self.modes is None:
            return SCENARIO_MODES[scenario]
        known = {"B": set(HEAVY_MODES), "C": set(TIER_MODES)}.get(scenario, set(MODES))
        return tuple(m for m in self.modes if m in known)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as a plain record (for result files)."""
        return {
            "scenarios": list(self.scenarios),
            "modes": {s: list(self.modes_of(s)) for s in self.scenarios},
            "reps": self.reps,
            "shards": list(self.layout.shards),
            "quiet_tenants": len(self.layout.quiet),
            "flood_tenant": self.layout.flood,
            "flood_shard": self.layout.flood_shard,
            "flood_shard_neighbours": list(self.layout.neighbours),
            "A": self.flood.to_dict(),
            "B": self.heavy.to_dict(),
            "C": self.tiers.to_dict(),
            "D": self.slow.to_dict(),
            "KS": self.scheduled.to_dict(),
        }


class Live:
    """One status line rewritten in place on a terminal; occasional lines otherwise."""

    def __init__(self, out: TextIO = sys.stdout, every: float = 5.0) -> None:
        self.out = out
        self.tty = out.isatty()
        self.every = every
        self._last = 0.0
        self._open = False

    def status(self, text: str) -> None:
        """Show ``text`` as the current status."""
        if self.tty:
            self.out.write("\r\033[K" + text[:150])
            self._open = True
        elif time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            self.out.write(text + "\n")
        self.out.flush()

    def line(self, text: str) -> None:
        """Print ``text`` as a permanent line (ending the status line)."""
        if self._open:
            self.out.write("\r\033[K")
            self._open = False
        self.out.write(text + "\n")
        self.out.flush()


def server_for(broker: str) -> Any:
    """A fresh broker server: ``RedisServer`` or ``RabbitMQServer`` (not started)."""
    if broker == "rabbitmq":
        from tests.harness.rabbitmq import RabbitMQServer

        return RabbitMQServer()
    from tests.harness.redis import RedisServer

    return RedisServer()


def _one_line(scenario: str, mode: str, r: dict[str, Any]) -> str:
    if scenario in FLOOD_SCENARIOS:
        o = r["quiet_others"]
        return (
            f"others p50 {o['p50'] * 1000:7.1f} ms p99 {o['p99'] * 1000:8.1f} ms "
            f"(unloaded p99 {r['unloaded']['p99'] * 1000:5.1f} ms), within 2x "
            f"{r['within_2x']:2}/{len(r['tenants'])}, flood-shard p99 "
            f"{r['neighbours']['p99'] * 1000:7.1f} ms, flood {r['flood']['throughput']:4.0f}/s, "
            f"lost {r['lost']} dup {r['duplicates']} misrouted {r['misrouted']}"
        )
    if scenario == "B":
        ts = r["time_share"]
        return "time share " + ", ".join(f"{q} {v:.1%}" for q, v in ts.items())
    return (
        f"premium {r['premium_share']:.1%} (target {r['target_premium_share']:.0%}), "
        f"{r['rate']:.0f} tasks/s"
    )


def run_showcase(
    config: ShowcaseConfig,
    broker_url: str,
    ledger_url: str,
    live: Live | None = None,
    on_run: Callable[[str, str, int, dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Run every selected scenario ``config.reps`` times; ``runs[scenario][mode]`` records.

    Every record carries the 1-minute load average when it ended (``load``),
    so disturbed runs can be recognised.
    """
    live = live or Live()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {m: [] for m in config.modes_of(s)} for s in config.scenarios
    }
    for rep in range(config.reps):
        for scenario in config.scenarios:
            modes: Sequence[str] = config.modes_of(scenario)
            if rep % 2:
                modes = tuple(reversed(modes))
            for mode in modes:
                tag = f"rep {rep + 1}/{config.reps} {scenario} {mode:13}"
                started = time.monotonic()
                record = _run(config, scenario, mode, broker_url, ledger_url, live, tag)
                record["load"] = os.getloadavg()[0]
                record["seconds"] = time.monotonic() - started
                runs[scenario][mode].append(record)
                live.line(
                    f"{tag} {record['seconds']:5.1f}s load {record['load']:4.1f}  "
                    + _one_line(scenario, mode, record)
                )
                if on_run is not None:
                    on_run(scenario, mode, rep, record)
    return runs


def _run(
    config: ShowcaseConfig,
    scenario: str,
    mode: str,
    broker_url: str,
    ledger_url: str,
    live: Live,
    tag: str,
) -> dict[str, Any]:
    def status(text: str) -> None:
        live.status(f"{tag} {text}")

    def sample(consumed: dict[str, int], elapsed: float) -> None:
        total = sum(consumed.values()) or 1
        shares = " ".join(f"{q} {n / total:4.0%}" for q, n in consumed.items())
        status(f"{elapsed:5.1f}s {total:6} tasks  {shares}")

    if scenario in FLOOD_SCENARIOS:
        params = {"D": config.slow, "KS": config.scheduled}.get(scenario, config.flood)
        if MODES[mode].fair and config.telemetry_dir:
            params = replace(params, telemetry_dir=config.telemetry_dir)
        return run_flood(broker_url, ledger_url, config.layout, MODES[mode], params, status)
    if scenario == "B":
        return run_heavy(broker_url, mode, config.heavy, sample)
    return run_tiers(broker_url, mode, config.tiers, sample)
