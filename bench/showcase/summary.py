"""Medians over repetitions with spread, Markdown tables and the quiet-tenant chart.

Input: ``runs[scenario][mode]``, a list with one record per repetition as
returned by :func:`~bench.showcase.flood.run_flood` (A, D),
:func:`~bench.showcase.shares.run_heavy` (B) and
:func:`~bench.showcase.shares.run_tiers` (C).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.harness.ledger import spread

__all__ = ("markdown", "summarise", "terminal", "write_chart")

#: Scenarios whose records come from :func:`~bench.showcase.flood.run_flood`.
FLOOD_SCENARIOS = ("A", "D", "K", "KS", "I")

#: Scalar fields of a flood record summarised over repetitions ("a.b" is a nested field).
FLOOD_FIELDS = (
    "unloaded.p99",
    "quiet_others.p50",
    "quiet_others.p99",
    "worst_other_p99",
    "neighbours.p50",
    "neighbours.p99",
    "flood.throughput",
    "flood.worker_throughput",
    "flood.quiet_served",
    "flood.publish_seconds",
    "quiet_others_publishing.p99",
    "quiet_others_after.p99",
    "quiet_others_before_due.p99",
    "flood.due_margin",
    "flood.early",
    "flood.first_start_after_due",
    "within_2x_others_after",
    "within_2x",
    "within_2x_others",
    "requeued_fraction",
)

SCENARIO_TITLES = {
    "A": "A. Flood",
    "B": "B. Heavy tasks",
    "C": "C. Tiers",
    "D": "D. Slow worker during the flood",
    "K": "K. Flood inside one queue keyed by tenant",
    "KS": "KS. Fair when due: K's flood scheduled for one second",
    "I": "I. Flood, the router isolating the noisy tenant",
}


def _get(record: Mapping[str, Any], path: str) -> float:
    """A nested field; NaN if the record predates it (stored results stay readable)."""
    value: Any = record
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return math.nan
        value = value[part]
    return float(value)


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def summarise_flood(modes: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: every :data:`FLOOD_FIELDS` field as median/min/max/spread, totals, tenants."""
    out: dict[str, Any] = {"modes": {}}
    # One unloaded phase lasts a few seconds: a burst of load from the rest of the
    # machine can inflate its p99 and with it the run's own 2x threshold. The
    # common reference is the median unloaded p99 of every run of the scenario.
    reference = _median([r["unloaded"]["p99"] for reps in modes.values() for r in reps])
    out["unloaded_p99_reference"] = reference
    for mode, reps in modes.items():
        if not reps:
            continue
        within_ref = [
            float(
                sum(
                    1
                    for t in r["tenants"].values()
                    if not t["neighbour"] and t["flood"]["n"] and t["flood"]["p99"] <= 2 * reference
                )
            )
            for r in reps
        ]
        tenants = {}
        for t, first in reps[0]["tenants"].items():
            tenants[t] = {
                "shard": first["shard"],
                "neighbour": first["neighbour"],
                "p50": _median([r["tenants"][t]["flood"]["p50"] for r in reps]),
                "p99": _median([r["tenants"][t]["flood"]["p99"] for r in reps]),
                "unloaded_p99": _median([r["tenants"][t]["unloaded"]["p99"] for r in reps]),
            }
        out["modes"][mode] = {
            **{f: spread([_get(r, f) for r in reps]) for f in FLOOD_FIELDS},
            "published": sum(r["published"] for r in reps),
            "lost": sum(r["lost"] for r in reps),
            "duplicates": sum(r["duplicates"] for r in reps),
            "misrouted": sum(r["misrouted"] for r in reps),
            "complete": all(r["complete"] for r in reps),
            "within_2x_reference_others": spread(within_ref),
            "others": reps[0]["others"],
            "quiet": len(reps[0]["tenants"]),
            "tenants": tenants,
        }
    # Keys "fair-mode/plain-mode". Runs of one repetition are adjacent in time and
    # saw about the same load from the rest of the machine: the ratio within a
    # repetition is the steadier comparison when that load changes between them.
    # The worker's rate counts every tenant's tasks: the flood's own rate
    # rewards a deployment that postpones the quiet tenants until it is over.
    for field, name in (("throughput", "throughput_vs"), ("worker_throughput", "worker_vs")):
        out[name] = {}
        out[f"{name}_paired"] = {}
        for fair in (m for m in out["modes"] if m.startswith("fair")):
            ft = out["modes"][fair][f"flood.{field}"]["median"]
            for plain in (m for m in out["modes"] if m.startswith("plain")):
                pt = out["modes"][plain][f"flood.{field}"]["median"]
                key = f"{fair}/{plain}"
                out[name][key] = ft / pt if pt else math.nan
                out[f"{name}_paired"][key] = spread(
                    [
                        _get(f, f"flood.{field}") / _get(p, f"flood.{field}")
                        for f, p in zip(modes[fair], modes[plain], strict=False)
                        if _get(p, f"flood.{field}")
                    ]
                )
    return out


def summarise_heavy(modes: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: each tenant queue's time and task share, median/min/max/spread."""
    out: dict[str, Any] = {"modes": {}}
    for mode, reps in modes.items():
        if not reps:
            continue
        queues = list(reps[0]["time_share"])
        out["modes"][mode] = {
            "time_share": {q: spread([r["time_share"][q] for r in reps]) for q in queues},
            "task_share": {q: spread([r["task_share"][q] for r in reps]) for q in queues},
            "rate": spread([r["rate"] for r in reps]),
        }
    return out


def summarise_tiers(modes: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode: the premium tier's share and each shard's, median/min/max/spread."""
    out: dict[str, Any] = {"modes": {}}
    for mode, reps in modes.items():
        if not reps:
            continue
        queues = list(reps[0]["share"])
        out["modes"][mode] = {
            "premium_share": spread([r["premium_share"] for r in reps]),
            "target_premium_share": reps[0]["target_premium_share"],
            "share": {q: spread([r["share"][q] for r in reps]) for q in queues},
            "rate": spread([r["rate"] for r in reps]),
        }
    return out


#: The order modes are shown in: plain deployments first.
MODE_ORDER = (
    "plain-shared",
    "plain-sharded",
    "fair",
    "fair-isolated",
    "fair-keyed",
    "fair-keyed-eta",
    "fair-isolating",
    "fair-runtime",
    "fair-codel",
)


def _ordered(modes: Mapping[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    rank = {m: i for i, m in enumerate(MODE_ORDER)}
    return {m: modes[m] for m in sorted(modes, key=lambda m: (rank.get(m, len(rank)), m))}


def summarise(runs: Mapping[str, Mapping[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Summaries of every scenario that has runs."""
    makers = {"A": summarise_flood, "B": summarise_heavy, "C": summarise_tiers,
              "D": summarise_flood, "K": summarise_flood, "KS": summarise_flood,
              "I": summarise_flood}  # fmt: skip
    return {s: makers[s](_ordered(runs[s])) for s in sorted(runs)}


def _ms(d: Mapping[str, float]) -> str:
    if math.isnan(d["median"]):
        return "-"
    return f"{d['median'] * 1000:,.0f} ms [{d['min'] * 1000:,.0f}, {d['max'] * 1000:,.0f}]"


def _pct(d: Mapping[str, float]) -> str:
    return f"{d['median']:.1%} [{d['min']:.1%}, {d['max']:.1%}]"


def _flood_table(s: dict[str, Any], labels: Mapping[str, str]) -> list[str]:
    lines = [
        "| mode | unloaded p99 | others p50 | others p99 | worst other p99 "
        "| within 2x (others) | others within 2x of common ref | flood-shard p50 "
        "| flood-shard p99 | flood tasks/s "
        "| requeued | lost / dup / misrouted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, d in s["modes"].items():
        wr = d["within_2x_reference_others"]
        w, wo = d["within_2x"], d["within_2x_others"]
        t = d["flood.throughput"]
        lines.append(
            f"| {labels.get(mode, mode)} | {_ms(d['unloaded.p99'])} | {_ms(d['quiet_others.p50'])} "
            f"| {_ms(d['quiet_others.p99'])} | {_ms(d['worst_other_p99'])} "
            f"| {w['median']:.0f} of {d['quiet']} ({wo['median']:.0f} of {d['others']}) "
            f"| {wr['median']:.0f} of {d['others']} [{wr['min']:.0f}, {wr['max']:.0f}] "
            f"| {_ms(d['neighbours.p50'])} | {_ms(d['neighbours.p99'])} "
            f"| {t['median']:.0f} ({t['spread']:.0%}) | {d['requeued_fraction']['median']:.2%} "
            f"| {d['lost']} / {d['duplicates']} / {d['misrouted']} of {d['published']:,} |"
        )
    lines.append("")
    for name, what in (
        ("throughput_vs", "Flood throughput"),
        ("worker_vs", "Worker throughput during the flood (every tenant's tasks)"),
    ):
        for key, ratio in s.get(name, {}).items():
            if math.isnan(ratio):
                continue
            fair, plain = key.split("/")
            paired = s.get(f"{name}_paired", {}).get(key)
            within = f"; within each repetition {_pct(paired)}" if paired and paired["n"] else ""
            lines.append(
                f"- {what} of {labels.get(fair, fair)} vs {labels.get(plain, plain)}: "
                f"{ratio:.1%} (ratio of medians){within}."
            )
    for mode, d in s["modes"].items():
        worker, publish = d["flood.worker_throughput"], d["flood.publish_seconds"]
        if math.isnan(worker["median"]):
            continue
        margin = d.get("flood.due_margin", {"median": math.nan})
        if not math.isnan(margin["median"]):
            # KS: the flood was published with one eta; its phase starts when due.
            lines.append(
                f"- {labels.get(mode, mode)}: the burst was published in "
                f"{publish['median']:.1f} s, "
                f"{margin['median']:.1f} s [{margin['min']:.1f}, {margin['max']:.1f}] before "
                f"its due time; others p99 {_ms(d['quiet_others_before_due.p99'])} meanwhile. "
                f"From the due time the worker ran {worker['median']:.0f} tasks/s, "
                f"{d['flood.quiet_served']['median']:.0f}/s of them quiet tenants'; the flood's "
                f"first task started {_ms(d['flood.first_start_after_due'])} after it was due, "
                f"{d['flood.early']['max']:.0f} before."
            )
            continue
        lines.append(
            f"- {labels.get(mode, mode)}: the worker ran {worker['median']:.0f} tasks/s during "
            f"the flood, {d['flood.quiet_served']['median']:.0f}/s of them quiet tenants'; "
            f"others p99 {_ms(d['quiet_others_publishing.p99'])} while the burst was being "
            f"published ({publish['median']:.1f} s), {_ms(d['quiet_others_after.p99'])} after "
            f"it ({d['within_2x_others_after']['median']:.0f} of {d['others']} within 2x)."
        )
    return lines


def _tenant_table(s: dict[str, Any], labels: Mapping[str, str]) -> list[str]:
    modes = list(s["modes"])
    head = "| tenant | shard | " + " | ".join(
        f"{labels.get(m, m)} p50 | p99" for m in modes
    ) + " |"  # fmt: skip
    lines = [head, "|---|---|" + "---|---|" * len(modes)]
    sharded = next((m for m in modes if m != "plain-shared"), modes[0])
    for t, info in s["modes"][sharded]["tenants"].items():
        shard = info["shard"] + (" (flood's shard)" if info["neighbour"] else "")
        cells = []
        for m in modes:
            d = s["modes"][m]["tenants"][t]
            cells.append(f"{d['p50'] * 1000:,.1f} ms | {d['p99'] * 1000:,.1f} ms")
        lines.append(f"| {t} | {shard} | " + " | ".join(cells) + " |")
    return lines


def markdown(
    summary: Mapping[str, Any],
    labels: Mapping[str, str],
    *,
    heading: int = 2,
    per_tenant: bool = True,
    chart: str | None = None,
) -> str:
    """Markdown tables of every summarised scenario (medians, [min, max] over repetitions)."""
    h = "#" * heading
    lines: list[str] = []
    for scenario in ("A", "B", "C", "D", "K", "KS", "I"):
        if scenario not in summary:
            continue
        s = summary[scenario]
        lines += [f"{h} {SCENARIO_TITLES[scenario]}", ""]
        if scenario in FLOOD_SCENARIOS:
            if scenario == "KS":
                lines += [
                    "*During the flood*: quiet tasks published from the flood's due time until "
                    "its last task started; flood rates are counted from the due time.",
                    "",
                ]
            lines += [
                "Waits are publish -> start. *Others*: quiet tenants on shards other than the "
                "flood's; *flood-shard*: quiet tenants that hash to the flood's shard. "
                "*Within 2x*: quiet tenants whose p99 during the flood stays within twice the "
                "unloaded p99 of the same run; *common ref*: within twice the median unloaded "
                f"p99 of all runs of the scenario ({s['unloaded_p99_reference'] * 1000:.1f} ms).",
                "",
                *_flood_table(s, labels),
                "",
            ]
            if scenario == "A" and chart:
                lines += [f"![quiet-tenant waits]({chart})", ""]
            if per_tenant and scenario == "A":
                lines += ["Per quiet tenant, during the flood (medians):", ""]
                lines += [*_tenant_table(s, labels), ""]
        elif scenario == "B":
            modes = list(s["modes"])
            queues = list(next(iter(s["modes"].values()))["time_share"])
            lines += [
                "Share of the worker's time per tenant (tasks run x task duration) and of "
                "tasks; one tenant's tasks take 10x longer.",
                "",
                "| tenant queue | " + " | ".join(
                    f"{labels.get(m, m)} time | tasks" for m in modes) + " |",
                "|---|" + "---|---|" * len(modes),
            ]  # fmt: skip
            for q in queues:
                cells = [
                    f"{_pct(s['modes'][m]['time_share'][q])} "
                    f"| {s['modes'][m]['task_share'][q]['median']:.1%}"
                    for m in modes
                ]
                lines.append(f"| {q} | " + " | ".join(cells) + " |")
            lines.append("")
        elif scenario == "C":
            lines += [
                "| mode | premium tier share | target | per shard | tasks/s |",
                "|---|---|---|---|---|",
            ]
            for m, d in s["modes"].items():
                per = ", ".join(f"{q} {v['median']:.1%}" for q, v in d["share"].items())
                lines.append(
                    f"| {labels.get(m, m)} | {_pct(d['premium_share'])} "
                    f"| {d['target_premium_share']:.0%} | {per} | {d['rate']['median']:.0f} |"
                )
            lines.append("")
    return "\n".join(lines)


def write_chart(
    summary: Mapping[str, Any], labels: Mapping[str, str], path: Path, *, title: str
) -> Path:
    """PNG of scenario A: each quiet tenant's p99 (bars) and p50 (dots) per mode, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summary["A"]
    modes = list(s["modes"])
    ref = next((m for m in modes if m != "plain-shared"), modes[0])
    tenants = list(s["modes"][ref]["tenants"])
    # The flood's neighbours first: they are the story's exception.
    tenants.sort(key=lambda t: (not s["modes"][ref]["tenants"][t]["neighbour"], t))
    fig, ax = plt.subplots(figsize=(13, 5.5))
    width = 0.8 / len(modes)
    colours = {"plain-shared": "#d62728", "plain-sharded": "#ff7f0e", "fair": "#2ca02c",
               "fair-codel": "#1f77b4", "fair-isolated": "#9467bd"}  # fmt: skip
    xs = range(len(tenants))
    for i, m in enumerate(modes):
        p99 = [max(1e-4, s["modes"][m]["tenants"][t]["p99"]) for t in tenants]
        p50 = [max(1e-4, s["modes"][m]["tenants"][t]["p50"]) for t in tenants]
        off = [x + (i - (len(modes) - 1) / 2) * width for x in xs]
        ax.bar(off, p99, width, label=f"{labels.get(m, m)}: p99", color=colours.get(m), alpha=0.8)
        ax.plot(off, p50, "k.", markersize=4)
    unloaded = _median([s["modes"][m]["unloaded.p99"]["median"] for m in modes])
    ax.axhline(2 * unloaded, color="k", linestyle="--", linewidth=1)
    ax.text(len(tenants) - 0.5, 2 * unloaded * 1.1, "2 x unloaded p99", ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("wait, publish -> start (s); dots: p50")
    names = [
        t + ("\n(flood's shard)" if s["modes"][ref]["tenants"][t]["neighbour"] else "")
        for t in tenants
    ]
    ax.set_xticks(list(xs), names, rotation=60, fontsize=7)
    ax.set_title(title, pad=28)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(modes))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cell(d: Mapping[str, float], scale: float = 1000.0, unit: str = "ms") -> str:
    return "-" if math.isnan(d["median"]) else f"{d['median'] * scale:,.0f} {unit}"


def terminal(summary: Mapping[str, Any], labels: Mapping[str, str]) -> str:
    """Compact side-by-side tables for a terminal (medians)."""
    out: list[str] = []
    for scenario in ("A", "B", "C", "D", "K", "KS", "I"):
        if scenario not in summary:
            continue
        s = summary[scenario]
        out += ["", SCENARIO_TITLES[scenario], ""]
        if scenario in FLOOD_SCENARIOS:
            out.append(
                f"  {'':44} {'unloaded':>9} {'quiet tenants, other shards':>30} "
                f"{'within':>8} {'flood shard':>12} {'flood':>8} {'lost':>5}"
            )
            out.append(
                f"  {'':44} {'p99':>9} {'p50':>14} {'p99':>15} {'2x':>8} {'p99':>12} "
                f"{'tasks/s':>8} {'':>5}"
            )
            for m, d in s["modes"].items():
                out.append(
                    f"  {labels.get(m, m):44} {_cell(d['unloaded.p99']):>9} "
                    f"{_cell(d['quiet_others.p50']):>14} {_cell(d['quiet_others.p99']):>15} "
                    f"{d['within_2x_others']['median']:>3.0f}/{d['others']:<4} "
                    f"{_cell(d['neighbours.p99']):>12} "
                    f"{d['flood.throughput']['median']:>8.0f} {d['lost']:>5}"
                )
            for key, ratio in s.get("throughput_vs", {}).items():
                fair, plain = key.split("/")
                out.append(
                    f"  flood throughput, {labels.get(fair, fair)} / {labels.get(plain, plain)}: "
                    f"{ratio:.0%}"
                )
        elif scenario == "B":
            modes = list(s["modes"])
            out.append(
                f"  {'tenant queue':14}"
                + "".join(f" {labels.get(m, m) + ': time (tasks)':>44}" for m in modes)
            )
            for q in next(iter(s["modes"].values()))["time_share"]:
                cells = "".join(
                    f" {s['modes'][m]['time_share'][q]['median']:>34.1%} "
                    f"({s['modes'][m]['task_share'][q]['median']:5.1%})"
                    for m in modes
                )
                out.append(f"  {q:14}{cells}")
        else:
            for m, d in s["modes"].items():
                per = "  ".join(f"{q} {v['median']:5.1%}" for q, v in d["share"].items())
                out.append(
                    f"  {labels.get(m, m):30} premium tier {d['premium_share']['median']:6.1%} "
                    f"(target {d['target_premium_share']:.0%})   {per}"
                )
    return "\n".join(out)
