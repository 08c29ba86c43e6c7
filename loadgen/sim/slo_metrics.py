"""Objectives in a simulated run: who met them, how well the first token was forecast, and
how the admission check's refusals and their Retry-After fared.

Every judgement goes through `scheduler.slo` (`ttft_and_tpot`, `slo_met`): the one
definition of "met" the scheduler and the server use. A request is judged from when its
client first sent it, so a refused request's wait before its retry counts against its
TTFT. A request *meets its objectives* when it finished and met each one it has (one
without objectives meets them by finishing); an unfinished request, or one whose client
gave up after refusals, has missed its TTFT objective (if it has one) and, if it has a TPOT
objective, that one too. Attainment is the share of requests that met them, per class (the
`SLO.cls` the scheduler resolved: `default`, `request`, `user:NAME`, `priority:N`) and
overall; goodput is those requests per second of the run.

The first-token forecast (`Request.predicted_ttft`, made on arrival) is scored against the
admitted attempt's TTFT: relative error |predicted - actual| / actual.

Refusals (`--reject-unmeetable`): each has the predicted wait it was answered with
(Retry-After). Its *actual wait*, where measured, is the shortest wait after which the same
request, sent again and admitted without a check, would have met its TTFT objective, found
by re-simulating from the moment of the refusal with every other client behaving as in the
run (`Simulator(retry_after_every=...)`). Error = |predicted - actual| / actual (predicted:
the scheduler's seconds; the header rounds them up to whole seconds, and its error is
reported too); an actual wait
of 0 (the request would have met its objective had it been admitted: the refusal was not
needed) has an infinite relative error and is counted apart, as is one beyond the
re-simulation's horizon. Cheaper, and reported for every retry: whether the retried
attempt, once admitted, met its TTFT objective from the retry's own arrival.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadgen.sim.result import Refusal, RequestStat, SimResult
from scheduler.slo import slo_met, ttft_and_tpot


@dataclass(frozen=True, slots=True)
class Judged:
    """One request against its objectives (times in seconds, from its first send)."""

    stat: RequestStat
    gave_up: bool  # its client gave up after refusals
    finished: bool
    ttft: float | None
    tpot: float | None
    ttft_ok: bool
    tpot_ok: bool

    @property
    def met(self) -> bool:
        return self.finished and self.ttft_ok and self.tpot_ok


def judge(stat: RequestStat, gave_up: bool = False) -> Judged:
    """`stat` against its objectives (see the module docstring)."""
    first, done = stat.first_token_time, stat.finished_time
    if done is not None:
        ttft, tpot = ttft_and_tpot(stat.sent, first, done, stat.output_len)
        ttft_ok, tpot_ok = slo_met(stat.slo, ttft, tpot)
        return Judged(stat, gave_up, True, ttft, tpot, ttft_ok, tpot_ok)
    ttft = None if first is None else first - stat.sent
    ttft_ok, _ = slo_met(stat.slo, ttft, None)
    return Judged(stat, gave_up, False, ttft, None, ttft_ok, stat.slo.tpot_s is None)


def judged(result: SimResult) -> list[Judged]:
    """Every request the scheduler admitted, then every one whose client gave up."""
    return [judge(s) for s in result.request_stats] + [
        judge(s, gave_up=True) for s in result.gave_up.values()
    ]


def has_objectives(result: SimResult) -> bool:
    return bool(result.refusals) or any(
        not s.slo.empty for s in (*result.request_stats, *result.gave_up.values())
    )


def _pct(values: list[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if values else None


def _median(values: Iterable[float]) -> float | None:
    vals = list(values)
    return float(np.median(vals)) if vals else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def class_summary(rows: list[Judged], duration: float) -> dict[str, Any]:
    """Attainment and latencies of one class (or of all requests)."""
    n = len(rows)
    met = sum(j.met for j in rows)
    with_ttft = [j for j in rows if j.stat.slo.ttft_s is not None]
    with_tpot = [j for j in rows if j.stat.slo.tpot_s is not None]
    slos = {(j.stat.slo.ttft_s, j.stat.slo.tpot_s) for j in rows}
    ttfts = [j.ttft for j in rows if j.ttft is not None]
    tpots = [j.tpot for j in rows if j.tpot is not None]
    waits = [s.first_scheduled_time - s.sent for j in rows
             if (s := j.stat).first_scheduled_time is not None]
    done = [j.stat for j in rows if j.finished]
    return {
        "requests": n,
        "met": met,
        "attainment": met / n if n else None,
        "goodput": met / duration if duration > 0 else 0.0,
        "ttft_attainment": (sum(j.ttft_ok for j in with_ttft) / len(with_ttft)
                            if with_ttft else None),
        "tpot_attainment": (sum(j.tpot_ok and j.finished for j in with_tpot) / len(with_tpot)
                            if with_tpot else None),
        # the class's objectives in ms (one pair when the class is one class)
        "ttft_slo_ms": _ms(next(iter(slos))[0]) if len(slos) == 1 else None,
        "tpot_slo_ms": _ms(next(iter(slos))[1]) if len(slos) == 1 else None,
        "ttft_p99_ms": _ms(_pct(ttfts, 99)),
        "tpot_p99_ms": _ms(_pct(tpots, 99)),
        "tpot_p50_ms": _ms(_pct(tpots, 50)),
        "longest_wait_s": max(waits, default=None),
        "finished": len(done),
        "prompt_tokens": sum(s.prompt_len for s in done),
        "output_tokens": sum(s.output_len for s in done),
        "last_finish_s": max((s.finished_time or 0.0 for s in done), default=None),
        "gave_up": sum(j.gave_up for j in rows),
    }


def forecast_error(stats: Iterable[RequestStat]) -> dict[str, Any]:
    """The first-token forecast against the admitted attempt's TTFT."""
    rel: list[float] = []
    signed: list[float] = []
    for s in stats:
        if s.predicted_ttft is None or s.first_token_time is None:
            continue
        actual = s.first_token_time - s.arrival_time
        if actual <= 0:
            continue
        rel.append(abs(s.predicted_ttft - actual) / actual)
        signed.append((s.predicted_ttft - actual) / actual)
    return {
        "scored": len(rel),
        "median_rel_error": _median(rel),
        "median_signed_rel_error": _median(signed),  # < 0: forecasts too early
        "p90_rel_error": _pct(rel, 90),
    }


def retry_after_error(refusals: list[Refusal]) -> dict[str, Any]:
    """The Retry-After of the measured refusals against the actual wait."""
    measured = [r for r in refusals if r.actual_wait is not None]
    unneeded = [r for r in measured if r.actual_wait == 0.0]
    beyond = [r for r in measured if r.actual_wait == math.inf]
    rel = [abs(r.retry_after - a) / a if a > 0 else math.inf
           for r in measured if (a := r.actual_wait) is not None and math.isfinite(a)]
    rel += [math.inf] * len(beyond)
    finite = [r for r in measured
              if r.actual_wait is not None and 0 < r.actual_wait < math.inf]
    return {
        "measured": len(measured),
        "median_rel_error": _median(rel),  # unneeded and beyond-horizon refusals count as inf
        "median_rel_error_when_needed": _median(
            abs(r.retry_after - a) / a for r in finite if (a := r.actual_wait) is not None
        ),
        "median_signed_rel_error_when_needed": _median(
            (r.retry_after - a) / a for r in finite if (a := r.actual_wait) is not None
        ),
        # the header's whole seconds (what the client waits) against the actual wait
        "median_rel_error_header": _median(
            [abs(r.retry_after_header - a) / a if a > 0 else math.inf
             for r in measured if (a := r.actual_wait) is not None and math.isfinite(a)]
            + [math.inf] * len(beyond)
        ),
        "median_abs_error_s": _median(
            abs(r.retry_after - a) for r in measured
            if (a := r.actual_wait) is not None and math.isfinite(a)
        ),
        "median_predicted_s": _median(r.retry_after for r in measured),
        "median_actual_s": _median(
            a for r in measured if (a := r.actual_wait) is not None and math.isfinite(a)
        ),
        "unneeded": len(unneeded),
        "beyond_horizon": len(beyond),
    }


def refusal_summary(result: SimResult) -> dict[str, Any]:
    refusals = result.refusals
    retried = [s for s in result.request_stats if s.retries]
    retry_ok = [judge_attempt(s) for s in retried]
    return {
        "refusals": len(refusals),
        "refused_requests": len({r.request_id for r in refusals}),
        "gave_up": len(result.gave_up),
        "admitted_after_retry": len(retried),
        # the retried attempt's own TTFT (from the retry's arrival) against the objective
        "retry_met_ttft": (sum(retry_ok) / len(retry_ok)) if retry_ok else None,
        "retry_after": retry_after_error(refusals),
    }


def judge_attempt(stat: RequestStat) -> bool:
    """Whether the admitted attempt met its TTFT objective from its own arrival."""
    ttft = None if stat.first_token_time is None else stat.first_token_time - stat.arrival_time
    return slo_met(stat.slo, ttft, None)[0]


def slo_summary(result: SimResult) -> dict[str, Any]:
    """Attainment overall and per class, the forecast's error, and the refusals."""
    rows = judged(result)
    classes = sorted({j.stat.slo.cls for j in rows})
    out: dict[str, Any] = class_summary(rows, result.duration)
    out["classes"] = {
        cls: class_summary([j for j in rows if j.stat.slo.cls == cls], result.duration)
        for cls in classes
    }
    out["ttft_forecast"] = forecast_error(result.request_stats)
    if result.refusals:
        out.update(refusal_summary(result))
    return out


def format_slo(summary: dict[str, Any]) -> str:
    """The summary's objectives block, for the single-run table."""

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    lines = [
        "{:-^50}".format("Objectives (SLO)"),
        f"{'met all objectives':<28}{pct(summary['attainment']):>10}  "
        f"({summary['met']} of {summary['requests']}; goodput {summary['goodput']:.2f} req/s)",
        f"{'met TTFT / TPOT':<28}{pct(summary['ttft_attainment']):>10} / "
        f"{pct(summary['tpot_attainment'])}",
    ]
    for cls, c in summary["classes"].items():
        lines.append(
            f"  {cls:<26}{pct(c['attainment']):>10}  n={c['requests']} ttft {ms(c['ttft_slo_ms'])}"
            f" ms: {pct(c['ttft_attainment'])}, tpot {ms(c['tpot_slo_ms'])} ms: "
            f"{pct(c['tpot_attainment'])} (p99 {ms(c['tpot_p99_ms'])} ms)"
        )
    f = summary["ttft_forecast"]
    if f["scored"]:
        lines.append(f"{'TTFT forecast error':<28}{pct(f['median_rel_error']):>10}  "
                     f"median of {f['scored']} (signed {pct(f['median_signed_rel_error'])})")
    if "refusals" in summary:
        ra = summary["retry_after"]
        lines.append(
            f"{'refusals (429)':<28}{summary['refusals']:>10}  {summary['refused_requests']} "
            f"requests; {summary['admitted_after_retry']} admitted on a retry, "
            f"{summary['gave_up']} gave up; retries that met TTFT: "
            f"{pct(summary['retry_met_ttft'])}"
        )
        if ra["measured"]:
            lines.append(
                f"{'Retry-After error':<28}{pct(ra['median_rel_error']):>10}  median of "
                f"{ra['measured']} re-simulated ({ra['unneeded']} unneeded, "
                f"{ra['beyond_horizon']} beyond the horizon; when needed "
                f"{pct(ra['median_rel_error_when_needed'])})"
            )
    return "\n".join(lines)
