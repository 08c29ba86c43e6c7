"""The Markdown report of `compare-policies`: the policy targets first, then per trace a
table over its points (victim newest) and one over every queue x victim policy at the
trace's headline point.

The targets: at the largest length variance, SJF (learned) goodput >= 1.3x FCFS's and its
shortest-quartile p99 latency >= 2x lower, with the aging bound held in every sjf run; the
offered load from which SJF reaches 1.3x; the service gap between two tenants against the
VTC bound; the tokens each victim policy makes the scheduler recompute; and the
objectives' (`two-class`, `below-capacity`): at 1.2x of the two-class mix's capacity slo
meets all objectives for >= 1.5x the requests FCFS does, with the interactive class's TPOT
p99 within its objective, the batch class's throughput >= 0.9x FCFS's and nobody starved;
below capacity slo no worse than FCFS on any mix; with --reject-unmeetable at 1.5x the
Retry-After's median relative error within 30%."""

from __future__ import annotations

import argparse
import math
from typing import Any

from loadgen.sim.policy_traces import REJECT_LOAD, SPREAD4_CAPACITY

# The point of each trace the per-policy tables show: the most telling one.
HEADLINE = {
    "token-budget": "2048",
    "kv-capacity": "50",
    "length-variance": "4",
    "variance-load": "1.3",
    "tenant-flood": "4:1",
    "two-class": "1.2",
    "below-capacity": "spread4@0.9",
    "variance-reject": "2.0",
}
SJF_TARGET = 1.3  # goodput over FCFS's
SLO_TARGET = 1.5  # two-class at 1.2x: slo's share of requests meeting all objectives / FCFS's
BATCH_TARGET = 0.9  # two-class at 1.2x: batch throughput, slo over FCFS
RETRY_AFTER_TARGET = 0.3  # median relative error of Retry-After at 1.5x
SLO_LOAD = "1.2"
INTERACTIVE, BATCH = "user:interactive", "user:batch"

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
OBJECTIVE_COLUMNS = (("slo_attainment", "objectives met", ".3f"),)
REJECT_COLUMNS = (
    ("refusals", "refusals", "d"),
    ("gave_up", "gave up", "d"),
    ("retry_after_error", "Retry-After err", ".0%"),
    ("retry_after_unneeded", "unneeded", "d"),
    ("retry_after_measured", "re-simulated", "d"),
)
# the two-class trace: per class, from row["classes"]
TWO_CLASS_COLUMNS = (
    ("slo_attainment", "all met", ".3f"),
    ("i_attainment", "interactive met", ".3f"),
    ("i_ttft_attainment", "TTFT met", ".3f"),
    ("i_tpot_attainment", "TPOT met", ".3f"),
    ("i_tpot_p99_ms", "TPOT p99 ms", ".1f"),
    ("b_attainment", "batch met", ".3f"),
    ("b_tok_s", "batch tok/s", ".0f"),
    ("b_out_tok_s_arriving", "batch out tok/s arriving", ".0f"),
    ("i_longest_wait_s", "longest wait s (i)", ".1f"),
    ("b_longest_wait_s", "longest wait s (b)", ".1f"),
    ("ttft_forecast_error", "TTFT forecast err", ".0%"),
    ("preemptions", "preempt", "d"),
)


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


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    """A two-class row with its classes' numbers as i_* (interactive) and b_* (batch)."""
    out = dict(row)
    for prefix, cls in (("i_", INTERACTIVE), ("b_", BATCH)):
        for key, value in row.get("classes", {}).get(cls, {}).items():
            out[prefix + key] = value
    return out


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def _two_class_target(rows: list[dict[str, Any]], mode: str) -> list[str]:
    def find(queue: str, point: str) -> dict[str, Any] | None:
        r = _find(rows, trace="two-class", point=point, queue=queue, mode=mode)
        return _flat(r) if r is not None else None

    fcfs, slo = find("fcfs", SLO_LOAD), find("slo", SLO_LOAD)
    out: list[str] = []
    if fcfs is not None and slo is not None:
        cap = slo.get("capacity", {}).get("two-class")
        tpot_slo = slo.get("i_tpot_slo_ms")
        ratio = slo["slo_attainment"] / fcfs["slo_attainment"] if fcfs["slo_attainment"] else None
        batch = slo["b_tok_s"] / fcfs["b_tok_s"] if fcfs.get("b_tok_s") else None
        arriving = (slo["b_out_tok_s_arriving"] / fcfs["b_out_tok_s_arriving"]
                    if fcfs.get("b_out_tok_s_arriving") else None)
        margin, bound = slo.get("passing_margin_s"), slo.get("passing_bound_s")
        starved = (slo["unfinished"] or slo.get("gave_up") or margin is None or bound is None
                   or margin > bound)

        def met(ok: bool) -> str:
            return "met" if ok else "MISSED"

        out += [
            f"**Two classes at {SLO_LOAD}x capacity"
            + (f" ({cap:.1f} req/s)" if cap else "") + ", slo (victim slack) vs FCFS (victim "
            "newest, the default step-time target):**",
            f"- requests meeting all their objectives: {fcfs['slo_attainment']:.1%} -> "
            f"{slo['slo_attainment']:.1%} ({_ratio(slo['slo_attainment'], fcfs['slo_attainment'])}"
            f", target >= {SLO_TARGET}x: {met(ratio is not None and ratio >= SLO_TARGET)}); "
            f"interactive {fcfs['i_attainment']:.1%} -> {slo['i_attainment']:.1%}, batch "
            f"{fcfs['b_attainment']:.1%} -> {slo['b_attainment']:.1%}",
            f"- interactive TPOT p99 {fcfs['i_tpot_p99_ms']:.1f} -> {slo['i_tpot_p99_ms']:.1f} ms "
            f"against its {_fmt(tpot_slo, '.0f')} ms objective ("
            f"{met(tpot_slo is not None and slo['i_tpot_p99_ms'] <= tpot_slo)}; "
            f"{_pct(slo['i_tpot_attainment'])} of interactive requests met it)",
            f"- batch throughput {fcfs['b_tok_s']:.0f} -> {slo['b_tok_s']:.0f} tokens/s over the "
            f"run ({_fmt(batch, '.2f')}x, target >= {BATCH_TARGET}x: "
            f"{met(batch is not None and batch >= BATCH_TARGET)}); while requests still arrive "
            f"{fcfs['b_out_tok_s_arriving']:.0f} -> {slo['b_out_tok_s_arriving']:.0f} output "
            f"tokens/s ({_fmt(arriving, '.2f')}x)",
            f"- longest wait (arrival to first step) interactive "
            f"{fcfs['i_longest_wait_s']:.1f} -> {slo['i_longest_wait_s']:.1f} s, batch "
            f"{fcfs['b_longest_wait_s']:.1f} -> {slo['b_longest_wait_s']:.1f} s; starvation: "
            + ("NONE" if not starved else "SEE BELOW") + " (every request finished; nobody "
            f"was passed by a request arriving more than its TTFT objective + the demotion "
            f"after it: worst margin {_fmt(margin, '.2f')} s, bound {_fmt(bound, '.2f')} s, "
            "the longest prefill)",
            "",
        ]
    out += _reject_lines(rows, mode, "two-class", REJECT_LOAD)
    return out


def _reject_lines(rows: list[dict[str, Any]], mode: str, trace: str, point: str) -> list[str]:
    """--reject-unmeetable at `point` of `trace`: the refusals and their Retry-After."""
    out: list[str] = []
    for queue in ("slo-reject", "fcfs-reject"):
        r = _find(rows, trace=trace, point=point, queue=queue, mode=mode)
        if r is None:
            continue
        policy = queue.removesuffix("-reject")
        base = _find(rows, trace=trace, point=point, queue=policy, mode=mode) or {}
        head = f"**--reject-unmeetable, {trace} at {point}x, {policy}:**"
        if not r.get("refusals"):
            out += [f"{head} refused nothing: every request's TTFT objective was forecast "
                    "meetable on arrival, so there is no Retry-After to judge (objectives met: "
                    f"{_pct(r['slo_attainment'])}; without the check: "
                    f"{_pct(base.get('slo_attainment'))}).", ""]
            continue
        err = r.get("retry_after_error")
        out += [
            f"{head} {r['refusals']} refusals of {r['refused_requests']} requests, "
            f"{r['gave_up']} gave up after their retries; {_pct(r.get('retry_met_ttft'))} of "
            "the retried requests met their TTFT objective once admitted. Retry-After against "
            f"the wait that would have sufficed (re-simulated, {r['retry_after_measured']} "
            f"refusals): median relative error {_pct(err)} (target <= "
            f"{RETRY_AFTER_TARGET:.0%}: "
            f"{'met' if err is not None and err <= RETRY_AFTER_TARGET else 'MISSED'}); median "
            f"Retry-After {_fmt(r.get('retry_after_median_s'), '.2f')} s against "
            f"{_fmt(r.get('actual_wait_median_s'), '.2f')} s; {r['retry_after_unneeded']} were "
            "not needed (admitted at once, the request would have met its objective), "
            f"{r['retry_after_beyond']} beyond the horizon; where a wait was needed, median "
            f"error {_pct(r.get('retry_after_error_when_needed'))} (signed "
            f"{_pct(r.get('retry_after_signed_error_when_needed'))}). Objectives met "
            f"{_pct(r['slo_attainment'])} (without the check: "
            f"{_pct(base.get('slo_attainment'))}).",
            "",
        ]
    return out


def _variance_reject_target(rows: list[dict[str, Any]], mode: str) -> list[str]:
    points = dict.fromkeys(r["point"] for r in rows if r["trace"] == "variance-reject")
    return [line for p in points for line in _reject_lines(rows, mode, "variance-reject", p)]


def _below_target(rows: list[dict[str, Any]], mode: str) -> list[str]:
    pairs = [
        (f, _find(rows, trace="below-capacity", point=f["point"], queue="slo", mode=mode))
        for f in rows
        if f["trace"] == "below-capacity" and f["queue"] == "fcfs" and f["mode"] == mode
    ]
    found = [(f, s) for f, s in pairs if s is not None]
    if not found:
        return []
    worse = [(f, s) for f, s in found if s["slo_attainment"] < f["slo_attainment"]]
    worst = min(found, key=lambda fs: fs[1]["slo_attainment"] - fs[0]["slo_attainment"])
    cells = "; ".join(
        f"{f['point']}: {f['slo_attainment']:.3f} / {s['slo_attainment']:.3f}" for f, s in found
    )
    return [
        "**Below capacity (0.6x-0.9x of each mix's capacity), requests meeting all objectives, "
        "FCFS / slo:** " + cells + ".",
        f"slo is worse than FCFS at {len(worse)} of {len(found)} points"
        + (f" (the largest shortfall: {worst[0]['point']}, "
           f"{worst[1]['slo_attainment'] - worst[0]['slo_attainment']:+.3f})" if worse else "")
        + ".",
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
        *_two_class_target(rows, mode),
        *_variance_reject_target(rows, mode),
        *_below_target(rows, mode),
    ]
    for name in dict.fromkeys(r["trace"] for r in rows):
        mine = [r for r in rows if r["trace"] == name]
        if name == "two-class":
            cols: tuple[tuple[str, str, str], ...] = TWO_CLASS_COLUMNS
            mine = [_flat(r) for r in mine]
        else:
            cols = COLUMNS + OBJECTIVE_COLUMNS + (FAIR_COLUMNS if "jain" in mine[0] else ())
            if any(r["queue"].endswith("-reject") for r in mine):
                cols += REJECT_COLUMNS
        points = [r["point"] for r in mine]
        head = HEADLINE[name] if HEADLINE.get(name) in points else points[0]
        # each queue policy with victim newest, and slo with its own (slack) where it ran so
        lines += [f"## {name}", "", "Victim newest (slo: slack where run so), every point:", ""]
        lines += _table(
            [r for r in mine if r["victim"] == "newest"
             or (r["queue"].startswith("slo") and r["victim"] == "slack")],
            ("point", "queue", "victim", "mode"), cols,
        )
        lines += ["", f"Every queue x victim policy at {head}:", ""]
        lines += _table([r for r in mine if r["point"] == head], ("queue", "victim", "mode"), cols)
        lines.append("")
    return "\n".join(lines)
