"""Per-request records and the run summary, under the key names of `vllm bench serve`.

Shared by the load generator (measured records) and the simulator (virtual-clock records),
so the two summaries compare key by key. Times in a `RequestRecord` are in seconds;
summary latencies are in milliseconds, as in vLLM (``mean_ttft_ms``, ``p99_itl_ms``, ...).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0, 99.9)
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

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for fewer than 2 tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentile_key(p: float) -> str:
    """vLLM's percentile word: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


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


def _meets_slos(rec: RequestRecord, goodput: dict[str, float]) -> bool:
    """Whether a successful request met every SLO in `goodput` (ms, inclusive)."""
    values = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.e2el}
    return all(values[k] * 1000.0 <= slo for k, slo in goodput.items())


def _peaks(done: list[RequestRecord], records: list[RequestRecord]) -> dict[str, float]:
    """Peak output tokens per whole second and peak in-flight requests (vLLM's keys)."""
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
    return {"max_output_tokens_per_s": peak_tps, "max_concurrent_requests": float(peak)}


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
) -> dict[str, Any]:
    """The run's summary, with `vllm bench serve` key names.

    Latencies and throughputs count successful requests only; `goodput` maps "ttft",
    "tpot" and/or "e2el" to an SLO in ms, and `request_goodput` (None without SLOs) is
    the rate of successful requests meeting all of them.
    """
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
        unknown = set(goodput) - {"ttft", "tpot", "e2el"}
        if unknown:
            raise ValueError(f"goodput SLOs must be ttft, tpot or e2el, got {sorted(unknown)}")
        summary["request_goodput"] = sum(_meets_slos(r, goodput) for r in done) / dur
    summary.update(_peaks(done, records))
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [gap for r in done for gap in r.itls],
        "e2el": [r.e2el for r in done],
    }
    for name in METRICS:
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
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad goodput SLO {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        if float(value) < 0:
            raise ValueError(f"goodput SLO {item!r} must be >= 0 ms")
        slos[name] = float(value)
    return slos


def _row(label: str, value: Any, fmt: str = ".2f") -> str:
    text = (
        "n/a" if value is None else (f"{value:{fmt}}" if isinstance(value, float) else str(value))
    )
    return f"{label:<40} {text:<10}"


def format_table(summary: dict[str, Any]) -> str:
    """A readable table of a summary, laid out like `vllm bench serve`'s."""
    lines = [
        "{:=^50}".format(" Serving Benchmark Result "),
        _row("Successful requests:", summary["completed"]),
        _row("Failed requests:", summary["failed"]),
        _row("Benchmark duration (s):", summary["duration"]),
        _row("Total input tokens:", summary["total_input_tokens"]),
        _row("Total generated tokens:", summary["total_output_tokens"]),
        _row("Request throughput (req/s):", summary["request_throughput"]),
    ]
    if summary.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", summary["request_goodput"]))
    lines += [
        _row("Output token throughput (tok/s):", summary["output_throughput"]),
        _row("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    for name in METRICS:
        short, title = _TITLES[name]
        lines.append(f"{title:-^50}")
        for stat in ("mean", "median", "std"):
            lines.append(
                _row(f"{stat.capitalize()} {short} (ms):", summary.get(f"{stat}_{name}_ms"))
            )
        for key in summary:
            if key.startswith("p") and key.endswith(f"_{name}_ms"):
                lines.append(_row(f"P{key[1:].split('_')[0]} {short} (ms):", summary[key]))
    lines.append("=" * 50)
    return "\n".join(lines)
