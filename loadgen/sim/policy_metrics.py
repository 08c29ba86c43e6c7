"""The numbers `compare-policies` reports for one simulated run.

- goodput: requests per second that met every SLO (vLLM's `--goodput`: TTFT and TPOT
  here, each request judged on its own), over the run's duration; attainment: the share of
  requests that met it;
- the shortest quartile: the quarter of requests with the least work (prompt + output
  tokens); its p50 and p99 end-to-end latency;
- longest wait: the most any request waited from arrival to its first scheduled step;
- preemptions and the computed tokens recompute preemptions dropped;
- sjf's aging bound: the worst margin, over requests x, of the latest arrival among those
  first scheduled before x minus (x's arrival + W_x / aging rate); <= 0 means held;
- between tenants (traces that record service): over each interval in which every tenant
  has requests waiting, the spread (max - min) of the weight-normalised service
  difference, its largest value against `fairness.vtc_bound`, and Jain's index
  (sum x)^2 / (n * sum x^2) of the service each tenant got in the longest such interval;
- objectives (`slo_metrics`, judged by `scheduler.slo`): the share of requests that met all
  their objectives (`slo_attainment`; unfinished and given-up requests count as missed),
  per objective and per class; per class also the TPOT p99, the longest wait and the
  tokens served per second: over the run (prompt + output tokens of its finished requests,
  from the first arrival to its last finish) and while requests still arrive (its output
  tokens streamed before the last arrival); the first-token forecast's median relative
  error; under `--reject-unmeetable` the refusals and the Retry-After's error;
- slo's passing bound: the worst margin, over requests x, of the latest arrival among those
  first scheduled before x minus (x's arrival + its TTFT objective + slo_demotion_s); the
  queue promises it stays within the longest prefill (docs/scheduling.md).
"""

from __future__ import annotations

import math
from operator import itemgetter
from typing import Any

import numpy as np

from loadgen.report import RequestRecord, token_times_of
from loadgen.sim.result import RequestStat, ServicePoint, SimResult
from loadgen.sim.slo_metrics import slo_summary
from scheduler.config import SchedulerConfig
from scheduler.fairness import FairnessMeter, vtc_bound
from scheduler.queues import prefill_time_of


def shortest_quartile(records: list[RequestRecord]) -> list[RequestRecord]:
    done = sorted(
        (r for r in records if r.success),
        key=lambda r: (r.prompt_tokens + r.output_tokens, r.request_id),
    )
    return done[: max(1, math.ceil(len(done) / 4))] if done else []


def _pct(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else math.nan


def longest_wait(stats: list[RequestStat]) -> float:
    waits = [
        s.first_scheduled_time - s.arrival_time for s in stats if s.first_scheduled_time is not None
    ]
    return max(waits, default=0.0)


def aging_margin(stats: list[RequestStat], rate: float) -> float:
    """max over x of (latest arrival first scheduled strictly before x) - (a_x + W_x / rate)."""
    ran = sorted(  # (first scheduled time, stat)
        ((s.first_scheduled_time, s) for s in stats if s.first_scheduled_time is not None),
        key=itemgetter(0),
    )
    worst, latest_before, i = -math.inf, -math.inf, 0
    while i < len(ran):
        j = i
        while j < len(ran) and ran[j][0] == ran[i][0]:
            j += 1
        for _, s in ran[i:j]:
            work = s.prompt_len + (s.predicted_output or 0)
            worst = max(worst, latest_before - (s.arrival_time + work / rate))
        latest_before = max([latest_before, *(s.arrival_time for _, s in ran[i:j])])
        i = j
    return worst


def passing_margin(stats: list[RequestStat], demotion_s: float) -> float:
    """max over x of (latest arrival first scheduled strictly before x) - (a_x + TTFT_x +
    demotion_s), TTFT_x 0 without a TTFT objective (see the module docstring)."""
    ran = sorted(
        ((s.first_scheduled_time, s) for s in stats if s.first_scheduled_time is not None),
        key=itemgetter(0),
    )
    worst, latest_before, i = -math.inf, -math.inf, 0
    while i < len(ran):
        j = i
        while j < len(ran) and ran[j][0] == ran[i][0]:
            j += 1
        for _, s in ran[i:j]:
            worst = max(worst, latest_before - (s.arrival_time + (s.slo.ttft_s or 0.0)
                                                + demotion_s))
        latest_before = max([latest_before, *(s.arrival_time for _, s in ran[i:j])])
        i = j
    return worst


def class_throughput(result: SimResult) -> dict[str, dict[str, float | None]]:
    """Per class: tokens per second over the run and output tokens per second while
    requests still arrive (see the module docstring)."""
    by_id = {s.request_id: s for s in (*result.request_stats, *result.gave_up.values())}
    sends = [s.sent for s in by_id.values()]
    start, last = min(sends, default=0.0), max(sends, default=0.0)
    out: dict[str, dict[str, float | None]] = {}
    for cls in sorted({s.slo.cls for s in by_id.values()}):
        done = [s for s in by_id.values()
                if s.slo.cls == cls and s.finished_time is not None]
        end = max((s.finished_time or 0.0 for s in done), default=start)
        tokens = sum(s.prompt_len + s.output_len for s in done)
        streamed = sum(
            sum(1 for t in token_times_of(r) if t <= last)
            for r in result.records if (s := by_id.get(r.request_id)) is not None
            and s.slo.cls == cls
        )
        out[cls] = {
            "tok_s": tokens / (end - start) if end > start else None,
            "out_tok_s_arriving": streamed / (last - start) if last > start else None,
        }
    return out


_CLASS_KEYS = ("requests", "attainment", "ttft_attainment", "tpot_attainment", "ttft_slo_ms",
               "tpot_slo_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "longest_wait_s",
               "gave_up")


def slo_columns(
    result: SimResult, config: SchedulerConfig, longest_prefill_s: float | None = None
) -> dict[str, Any]:
    """The objectives' columns of a run (see the module docstring); `longest_prefill_s`:
    the run's longest prompt's prefill time (the passing bound's slack; default: the
    scheduler's step-cost model's)."""
    s = slo_summary(result)
    throughput = class_throughput(result)
    row: dict[str, Any] = {
        "slo_attainment": s["attainment"],
        "slo_goodput": s["goodput"],
        "ttft_attainment": s["ttft_attainment"],
        "tpot_attainment": s["tpot_attainment"],
        "ttft_forecast_error": s["ttft_forecast"]["median_rel_error"],
        "ttft_forecast_signed_error": s["ttft_forecast"]["median_signed_rel_error"],
        "classes": {
            cls: {**{k: c[k] for k in _CLASS_KEYS}, **throughput.get(cls, {})}
            for cls, c in s["classes"].items()
        },
    }
    if "refusals" in s:
        ra = s["retry_after"]
        row.update(
            refusals=s["refusals"],
            refused_requests=s["refused_requests"],
            gave_up=s["gave_up"],
            retry_met_ttft=s["retry_met_ttft"],
            retry_after_measured=ra["measured"],
            retry_after_error=ra["median_rel_error"],
            retry_after_error_when_needed=ra["median_rel_error_when_needed"],
            retry_after_signed_error_when_needed=ra["median_signed_rel_error_when_needed"],
            retry_after_unneeded=ra["unneeded"],
            retry_after_beyond=ra["beyond_horizon"],
            retry_after_median_s=ra["median_predicted_s"],
            actual_wait_median_s=ra["median_actual_s"],
        )
    if config.scheduling_policy == "slo":
        row["passing_margin_s"] = passing_margin(result.request_stats, config.slo_demotion_s)
        if longest_prefill_s is None:
            longest = max((st.prompt_len for st in result.request_stats), default=1)
            longest_prefill_s = prefill_time_of(config)(longest)
        row["passing_bound_s"] = longest_prefill_s
    return row


def backlogged_windows(points: list[ServicePoint], tenants: set[str]) -> list[list[ServicePoint]]:
    """Maximal runs of consecutive steps in which every tenant had requests waiting."""
    windows: list[list[ServicePoint]] = []
    current: list[ServicePoint] = []
    for p in points:
        if tenants <= p.backlogged:
            current.append(p)
        elif current:
            windows.append(current)
            current = []
    if current:
        windows.append(current)
    return windows


def fairness(
    points: list[ServicePoint], tenants: list[str], weights: dict[str, float]
) -> dict[str, Any]:
    """Service gap (two tenants) and Jain's index while all `tenants` are backlogged."""
    windows = backlogged_windows(points, set(tenants))
    if not windows:
        return {"service_gap": None, "jain": None, "backlogged_s": 0.0}

    def norm(p: ServicePoint, t: str) -> float:
        return p.served.get(t, 0.0) / weights.get(t, 1.0)

    gap = 0.0
    if len(tenants) == 2:
        a, b = tenants
        for w in windows:
            diffs = [norm(p, a) - norm(p, b) for p in w]
            gap = max(gap, max(diffs) - min(diffs))
    longest = max(windows, key=lambda w: w[-1].time - w[0].time)
    shares = [norm(longest[-1], t) - norm(longest[0], t) for t in tenants]
    total, squares = sum(shares), sum(x * x for x in shares)
    jain = total * total / (len(shares) * squares) if squares else None
    return {
        "service_gap": gap,
        "jain": jain,
        "backlogged_s": sum(w[-1].time - w[0].time for w in windows),
    }


def policy_row(
    result: SimResult, config: SchedulerConfig, slo: dict[str, float],
    longest_prefill_s: float | None = None,
) -> dict[str, Any]:
    """Every column of the policy table for one run."""
    summary = result.summary(slo)
    short = [r.e2el * 1e3 for r in shortest_quartile(result.records)]
    row: dict[str, Any] = {
        "goodput": summary["request_goodput"],
        "throughput": summary["request_throughput"],
        # the share of finished requests that met the SLO: goodput can rise by 1 / this at most
        "attainment": (
            summary["request_goodput"] / summary["request_throughput"]
            if summary["request_goodput"] is not None and summary["request_throughput"]
            else None
        ),
        "short_p50_ms": _pct(short, 50),
        "short_p99_ms": _pct(short, 99),
        "p99_e2el_ms": summary["p99_e2el_ms"],
        "longest_wait_s": longest_wait(result.request_stats),
        "preemptions": result.num_preemptions,
        "recompute_tokens": result.num_recompute_tokens,
        "unfinished": len(result.unfinished),
        "duration_s": result.duration,
        **slo_columns(result, config, longest_prefill_s),
    }
    if config.scheduling_policy == "sjf":
        row["aging_margin_s"] = aging_margin(result.request_stats, config.sjf_aging_rate)
        row["aging_window_max_s"] = config.max_model_len / config.sjf_aging_rate
    if result.tenant_service:
        tenants = sorted({s.tenant for s in result.request_stats})
        row.update(fairness(result.tenant_service, tenants, dict(config.tenant_weights)))
        meter = FairnessMeter(config.fair_prompt_weight, config.fair_output_weight)
        largest = max(meter.request_cost(s.prompt_len, s.output_len) for s in result.request_stats)
        row["vtc_bound"] = vtc_bound(config, largest)
        row["vtc_bound_kv"] = vtc_bound(config, largest, kv_term=True)
    return row
