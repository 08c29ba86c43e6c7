"""Per-request records and the run summary, under the key names of `vllm bench serve`.

Shared by the load generator (measured records) and the simulator (virtual-clock records),
so the two summaries compare key by key. Times in a `RequestRecord` are in seconds;
summary latencies are in milliseconds, as in vLLM (``mean_ttft_ms``, ``p99_itl_ms``, ...).

Which latencies get statistics, and which percentiles, follow vLLM's
``--percentile-metrics`` and ``--metric-percentiles``: each selected metric gets
``mean_``, ``median_``, ``std_`` and one ``pNN_`` key per percentile; a metric not selected
gets no keys and no rows in the table.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")  # vLLM's default for generation
DEFAULT_PERCENTILES = (99.0,)  # vLLM's default --metric-percentiles
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass(slots=True)
class RequestRecord:
    """What one request did, as the client saw it (times in seconds)."""

    request_id: str
    success: bool
    error: str = ""  # why it failed ("" on success)
    prompt_tokens: int = 0  # from the server's usage (or the workload when none is given)
    output_tokens: int = 0
    start_time: float = 0.0  # when it was sent, seconds from the start of the run
    ttft: float = 0.0  # time to the first non-empty content chunk
    itls: list[float] = field(default_factory=list)  # gaps between later content chunks
    e2el: float = 0.0  # send to last byte
    priority: int = 0
    arrival_time: float = 0.0  # scheduled arrival (start_time >= it under a concurrency cap)
    group: int | None = None
    user: str | None = None
    generated_text: str = ""  # the streamed text (what arrived before a failure, if any)

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for fewer than 2 tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentile_key(p: float) -> str:
    """vLLM's percentile word: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    """``"ttft,itl"`` -> ("ttft", "itl"): the metrics that get statistics, as vLLM spells them."""
    names = tuple(name.strip() for name in text.split(","))
    unknown = [name for name in names if name not in METRICS]
    if unknown or not text.strip():
        raise ValueError(
            f"percentile metrics must be a comma-separated subset of {','.join(METRICS)}, "
            f"got {text!r}"
        )
    return tuple(dict.fromkeys(names))  # in the order given, each once


def parse_metric_percentiles(text: str) -> tuple[float, ...]:
    """``"25,50,99"`` -> (25.0, 50.0, 99.0); each must lie in [0, 100]."""
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise ValueError(
            f"metric percentiles must be comma-separated numbers, got {text!r}"
        ) from None
    _check_percentiles(values, text)
    return tuple(dict.fromkeys(values))


def _check_percentiles(values: tuple[float, ...], given: object) -> None:
    if any(not 0.0 <= p <= 100.0 for p in values):  # a NaN fails this too
        raise ValueError(f"metric percentiles must lie in [0, 100], got {given!r}")


def _stats(name: str, values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean/median/std/pP of `values_s` (seconds) in ms; zeros when empty, like vLLM."""
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = ms.size == 0
    out = {
        f"mean_{name}_ms": 0.0 if empty else float(np.mean(ms)),
        f"median_{name}_ms": 0.0 if empty else float(np.median(ms)),
        f"std_{name}_ms": 0.0 if empty else float(np.std(ms)),
    }
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(ms, p))
    return out


def meets_slos(rec: RequestRecord, goodput: dict[str, float]) -> bool:
    """Whether a successful request met every SLO in `goodput` (ms, inclusive)."""
    values = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.e2el}
    return all(values[k] * 1000.0 <= slo for k, slo in goodput.items())


def _peaks(done: list[RequestRecord], records: list[RequestRecord]) -> dict[str, Any]:
    """Peak output tokens in one whole second of the run, and the most requests in flight at
    once (vLLM's key names; the concurrency here is exact, not per second)."""
    token_times = [t for r in done for t in token_times_of(r)]
    peak_tps = 0.0
    if token_times:
        counts = np.bincount(np.floor(np.asarray(token_times)).astype(np.int64))
        peak_tps = float(counts.max())
    events = sorted(
        [(r.start_time, 1) for r in records] + [(r.start_time + r.e2el, -1) for r in records],
        key=lambda e: (e[0], e[1]),
    )
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    return {"max_output_tokens_per_s": peak_tps, "max_concurrent_requests": peak}


def token_times_of(rec: RequestRecord) -> list[float]:
    """When each content chunk of `rec` arrived, seconds from the start of the run."""
    if not rec.success or rec.output_tokens == 0:
        return []
    times = [rec.start_time + rec.ttft]
    for gap in rec.itls:
        times.append(times[-1] + gap)
    return times


def summarize(
    records: list[RequestRecord],
    duration: float,
    goodput: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    metrics: tuple[str, ...] = METRICS,
) -> dict[str, Any]:
    """The run's summary, with `vllm bench serve` key names.

    Latencies and throughputs count successful requests only; `metrics` (a subset of
    `METRICS`) get the mean/median/std/`percentiles` keys. `goodput` maps "ttft", "tpot"
    and/or "e2el" to an SLO in ms, and `request_goodput` (None without SLOs) is the rate of
    successful requests meeting all of them.
    """
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"percentile metrics must be among {', '.join(METRICS)}, got {unknown}")
    _check_percentiles(percentiles, percentiles)
    done = [r for r in records if r.success]
    dur = duration if duration > 0 else float("inf")  # rates of 0, not a division error
    total_in = sum(r.prompt_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / dur,
        "request_goodput": None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    if goodput:
        bad = set(goodput) - set(GOODPUT_METRICS)
        if bad:
            raise ValueError(f"goodput SLOs must be ttft, tpot or e2el, got {sorted(bad)}")
        summary["request_goodput"] = sum(meets_slos(r, goodput) for r in done) / dur
    summary.update(_peaks(done, records))
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [gap for r in done for gap in r.itls],
        "e2el": [r.e2el for r in done],
    }
    for name in metrics:
        summary.update(_stats(name, series[name], percentiles))
    return summary


def error_counts(records: list[RequestRecord]) -> dict[str, int]:
    """How many requests failed with each error message."""
    return dict(Counter(r.error or "unknown error" for r in records if not r.success))


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` into {"ttft": 500.0, "tpot": 50.0} (ms)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"bad goodput SLO {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        if float(value) < 0:
            raise ValueError(f"goodput SLO {item!r} must be >= 0 ms")
        slos[name] = float(value)
    return slos


def _row(label: str, value: Any) -> str:
    text = "n/a" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
    return f"{label:<40} {text:<10}"


def _metric_rows(summary: dict[str, Any], name: str) -> list[str]:
    """A metric's section as vLLM prints it: mean, median, then each percentile."""
    short, title = _TITLES[name]
    lines = [
        f"{title:-^50}",
        _row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"]),
        _row(f"Median {short} (ms):", summary[f"median_{name}_ms"]),
    ]
    pattern = re.compile(rf"p(\d+(?:\.\d+)?)_{name}_ms")
    for key, value in summary.items():
        if match := pattern.fullmatch(key):
            lines.append(_row(f"P{match.group(1)} {short} (ms):", value))
    return lines


def format_table(
    summary: dict[str, Any],
    max_concurrency: int | None = None,
    request_rate: float | None = None,
) -> str:
    """A summary as `vllm bench serve` prints it; a metric has a section when the summary
    holds its statistics. The run's concurrency cap and (finite) rate are shown when given."""
    lines = [
        "{:=^50}".format(" Serving Benchmark Result "),
        _row("Successful requests:", summary["completed"]),
        _row("Failed requests:", summary["failed"]),
    ]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if request_rate is not None and request_rate != float("inf"):
        lines.append(_row("Request rate configured (RPS):", float(request_rate)))
    lines += [
        _row("Benchmark duration (s):", summary["duration"]),
        _row("Total input tokens:", summary["total_input_tokens"]),
        _row("Total generated tokens:", summary["total_output_tokens"]),
        _row("Request throughput (req/s):", summary["request_throughput"]),
    ]
    if summary.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", summary["request_goodput"]))
    lines.append(_row("Output token throughput (tok/s):", summary["output_throughput"]))
    if "max_output_tokens_per_s" in summary:
        lines += [
            _row("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"]),
            _row("Peak concurrent requests:", summary["max_concurrent_requests"]),
        ]
    lines.append(_row("Total Token throughput (tok/s):", summary["total_token_throughput"]))
    for name in METRICS:
        if f"mean_{name}_ms" in summary:
            lines += _metric_rows(summary, name)
    lines.append("=" * 50)
    return "\n".join(lines)
