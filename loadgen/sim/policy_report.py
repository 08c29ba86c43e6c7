"""The Markdown report of `compare-policies`: the policy targets first, then per trace a
table over its points (victim newest) and one over every queue x victim policy at the
trace's headline point.

The targets: at the largest length variance, SJF (learned) goodput >= 1.3x FCFS's and its
shortest-quartile p99 latency >= 2x lower, with the aging bound held in every sjf run; the
offered load from which SJF reaches 1.3x; the service gap between two tenants against the
VTC bound; and the tokens each victim policy makes the scheduler recompute."""

from __future__ import annotations

import argparse
import math
from typing import Any

from loadgen.sim.policy_traces import SPREAD4_CAPACITY

# The point of each trace the per-policy tables show: the most telling one.
HEADLINE = {
    "token-budget": "2048",
    "kv-capacity": "50",
    "length-variance": "4",
    "variance-load": "1.3",
    "tenant-flood": "4:1",
}
SJF_TARGET = 1.3  # goodput over FCFS's

COLUMNS = (
    ("goodput", "goodput req/s", ".2f"),
    ("attainment", "SLO met", ".3f"),
    ("short_p50_ms", "short p50 ms", ".0f"),
    ("short_p99_ms", "short p99 ms", ".0f"),
    ("longest_wait_s", "longest wait s", ".1f"),
    ("preemptions", "preempt", "d"),
    ("recompute_tokens", "recompute tok", "d"),
)
FAIR_COLUMNS = (("service_gap", "service gap", ".0f"), ("jain", "Jain", ".3f"))


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return format(value, spec) if spec != "d" else str(int(value))


def _table(
    rows: list[dict[str, Any]], keys: tuple[str, ...], columns: tuple[tuple[str, str, str], ...]
) -> list[str]:
    head = [*keys, *(title for _, title, _ in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r[k]) for k in keys] + [_fmt(r.get(key), spec) for key, _, spec in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _find(rows: list[dict[str, Any]], **match: str) -> dict[str, Any] | None:
    return next((r for r in rows if all(r[k] == v for k, v in match.items())), None)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "—"


def _aging_held(row: dict[str, Any]) -> bool:
    """An sjf run's aging margin is <= 0 (up to float noise): nobody passed too late."""
    return float(row.get("aging_margin_s", math.inf)) <= 1e-9


def _variance_target(rows: list[dict[str, Any]], mode: str, rate: float) -> list[str]:
    fcfs = _find(rows, trace="length-variance", point="4", queue="fcfs", victim="newest", mode=mode)
    sjf = _find(rows, trace="length-variance", point="4", queue="sjf", victim="newest", mode=mode)
    if fcfs is None or sjf is None:
        return []
    window = sjf["aging_window_max_s"]
    within = "within" if sjf["longest_wait_s"] <= window else "BEYOND"
    held = "held" if _aging_held(sjf) else "VIOLATED"
    return [
        f"**SJF (learned) vs FCFS, length variance at its largest (spread 4, {rate:g} req/s = "
        f"{rate / SPREAD4_CAPACITY:.2f}x its {SPREAD4_CAPACITY} req/s capacity), "
        "victim newest:**",
        f"goodput {fcfs['goodput']:.2f} -> {sjf['goodput']:.2f} req/s "
        f"({_ratio(sjf['goodput'], fcfs['goodput'])}, target >= {SJF_TARGET}x; "
        f"FCFS met the SLO for {fcfs['attainment']:.1%} of requests, "
        f"so no order can gain more than {_ratio(1.0, fcfs['attainment'])}); "
        f"shortest quartile p99 {fcfs['short_p99_ms']:.0f} -> {sjf['short_p99_ms']:.0f} ms "
        f"({_ratio(fcfs['short_p99_ms'], sjf['short_p99_ms'])} lower, target >= 2x); "
        f"longest wait {fcfs['longest_wait_s']:.1f} -> {sjf['longest_wait_s']:.1f} s "
        f"({within} the {window:.1f} s aging window); aging bound {held} "
        f"(worst margin {sjf['aging_margin_s']:.1f} s; no request is passed by one arriving "
        f"more than W/rate after it, W/rate <= {window:.1f} s here).",
        "",
    ]


def _lab_checks(rows: list[dict[str, Any]]) -> list[str]:
    """The aging bound over every sjf run, and how the length-variance baseline fared."""
    out: list[str] = []
    sjf = [r for r in rows if "aging_margin_s" in r]
    if sjf:
        held = sum(map(_aging_held, sjf))
        out += [
            "**Aging bound over every sjf run** (both predictors, every victim and trace): "
            f"held in {held} of {len(sjf)}; "
            f"worst margin {max(r['aging_margin_s'] for r in sjf):.1f} s.",
            "",
        ]
    base = [r for r in rows if r["trace"] == "length-variance" and r["point"] == "1"]
    if base:
        out += [
            "**Length variance at spread 1** (the load's baseline): the lowest share of "
            f"requests within the SLO over its {len(base)} runs is "
            f"{min(r['attainment'] for r in base):.1%}.",
            "",
        ]
    return out


def _load_target(rows: list[dict[str, Any]], mode: str) -> list[str]:
    pairs = [
        (
            r,
            _find(
                rows,
                trace="variance-load",
                point=r["point"],
                queue="sjf",
                victim="newest",
                mode=mode,
            ),
        )
        for r in rows
        if r["trace"] == "variance-load"
        and r["queue"] == "fcfs"
        and r["victim"] == "newest"
        and r["mode"] == mode
    ]
    found = [(f, s) for f, s in pairs if s is not None]
    if not found:
        return []
    cells = "; ".join(
        f"{f['point']}x: {_ratio(s['goodput'], f['goodput'])} (FCFS met {f['attainment']:.1%})"
        for f, s in found
    )
    reached = next(
        (f["point"] for f, s in found
         if f["goodput"] and s["goodput"] / f["goodput"] >= SJF_TARGET),
        None,
    )
    where = f"from {reached}x of capacity on" if reached else "at none of these loads"
    return [
        "**SJF (learned) over FCFS goodput by offered load (spread 4, victim newest):** "
        + cells
        + ".",
        f"SJF reaches {SJF_TARGET}x {where}.",
        "",
    ]


def _flood_target(rows: list[dict[str, Any]], mode: str) -> list[str]:
    out = ["**Two tenants, one flooding at 4x, victim newest:**"]
    for queue in ("fcfs", "fair"):
        r = _find(rows, trace="tenant-flood", queue=queue, victim="newest", mode=mode)
        if r is None or r.get("service_gap") is None:
            continue
        out.append(
            f"- {queue}: largest service gap while both are backlogged "
            f"{r['service_gap']:.0f} weighted tokens "
            f"(bound {r['vtc_bound']:.0f}; with the KV term {r['vtc_bound_kv']:.0f}); Jain "
            f"{_fmt(r['jain'], '.3f')} over {r['backlogged_s']:.1f} s backlogged"
        )
    return [*out, ""] if len(out) > 1 else []


def _victim_target(rows: list[dict[str, Any]], mode: str) -> list[str]:
    got = [
        r
        for r in rows
        if r["trace"] == "kv-capacity"
        and r["point"] == "50"
        and r["queue"] == "fcfs"
        and r["mode"] == mode
    ]
    if not got:
        return []
    cells = ", ".join(
        f"{r['victim']} {r['recompute_tokens']} ({r['preemptions']} preemptions)" for r in got
    )
    return [
        "**Recomputed tokens per victim policy, KV capacity 50 blocks, fcfs:** " + cells + ".",
        "",
    ]


def format_report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    mode = rows[0]["mode"] if rows else "recompute"
    lines = [
        "# compare-policies",
        "",
        f"SLO: {' '.join(args.goodput)} (a request is good when it meets all); "
        f"scale {args.scale}; length-variance rate {args.variance_rate} req/s; "
        f"preemption modes: {args.preemption_modes}.",
        "",
        "## Targets",
        "",
        *_variance_target(rows, mode, args.variance_rate),
        *_lab_checks(rows),
        *_load_target(rows, mode),
        *_flood_target(rows, mode),
        *_victim_target(rows, mode),
    ]
    for name in dict.fromkeys(r["trace"] for r in rows):
        mine = [r for r in rows if r["trace"] == name]
        cols = COLUMNS + (FAIR_COLUMNS if "jain" in mine[0] else ())
        points = [r["point"] for r in mine]
        head = HEADLINE[name] if HEADLINE.get(name) in points else points[0]
        lines += [f"## {name}", "", "Victim newest, every point:", ""]
        lines += _table(
            [r for r in mine if r["victim"] == "newest"], ("point", "queue", "mode"), cols
        )
        lines += ["", f"Every queue x victim policy at {head}:", ""]
        lines += _table([r for r in mine if r["point"] == head], ("queue", "victim", "mode"), cols)
        lines.append("")
    return "\n".join(lines)
