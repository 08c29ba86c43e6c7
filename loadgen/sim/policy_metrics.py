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
  (sum x)^2 / (n * sum x^2) of the service each tenant got in the longest such interval.
"""

from __future__ import annotations

import math
from operator import itemgetter
from typing import Any

import numpy as np

from loadgen.report import RequestRecord
from loadgen.sim.result import RequestStat, ServicePoint, SimResult
from scheduler.config import SchedulerConfig
from scheduler.fairness import FairnessMeter, vtc_bound


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


def policy_row(result: SimResult, config: SchedulerConfig, slo: dict[str, float]) -> dict[str, Any]:
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
