"""PNG plots of a load run: latency CDFs, and throughput and in-flight requests over time.

Uses matplotlib's Agg backend (no display needed); records are `report.RequestRecord`s,
so measured and simulated runs plot the same way.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from loadgen.report import RequestRecord, token_times_of  # noqa: E402

_LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def latency_series(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Latencies of successful requests in ms, per metric (ttft, tpot, itl, e2el)."""
    done = [r for r in records if r.success]
    return {
        "ttft": [r.ttft * 1e3 for r in done],
        "tpot": [t * 1e3 for r in done if (t := r.tpot) is not None],
        "itl": [g * 1e3 for r in done for g in r.itls],
        "e2el": [r.e2el * 1e3 for r in done],
    }


def plot_latency_cdfs(records: list[RequestRecord], path: Path) -> Path:
    """One empirical CDF per latency metric, in a 2x2 grid."""
    series = latency_series(records)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, _LATENCIES, strict=True):
        values = np.sort(np.asarray(series[key]))
        if values.size:
            ax.step(values, np.arange(1, values.size + 1) / values.size, where="post")
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def in_flight_over_time(records: list[RequestRecord]) -> tuple[np.ndarray, np.ndarray]:
    """Step function of requests in flight: (times, counts after each time)."""
    events = sorted(
        [(r.start_time, 1) for r in records] + [(r.start_time + r.e2el, -1) for r in records]
    )
    times = np.asarray([t for t, _ in events], dtype=np.float64)
    counts = np.cumsum([d for _, d in events]) if events else np.asarray([], dtype=np.int64)
    return times, counts


def plot_timeline(records: list[RequestRecord], duration: float, path: Path) -> Path:
    """Output tokens/s and completed requests/s (per bin), and in-flight requests, over time."""
    bins = max(1, min(100, int(np.ceil(duration))))
    edges = np.linspace(0.0, max(duration, 1e-9), bins + 1)
    width = edges[1] - edges[0]
    tokens = np.histogram([t for r in records for t in token_times_of(r)], bins=edges)[0]
    finished = np.histogram([r.start_time + r.e2el for r in records if r.success], bins=edges)[0]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    top.stairs(tokens / width, edges, color="tab:blue")
    top.set_ylabel("output tokens/s", color="tab:blue")
    twin = top.twinx()
    twin.stairs(finished / width, edges, color="tab:orange")
    twin.set_ylabel("completed requests/s", color="tab:orange")
    top.set_title("Throughput over time")
    times, counts = in_flight_over_time(records)
    bottom.step(times, counts, where="post")
    bottom.set(title="Requests in flight", xlabel="seconds from start", ylabel="requests")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(records: list[RequestRecord], duration: float, out_dir: str | Path) -> list[Path]:
    """Write latency_cdf.png and timeline.png into `out_dir`; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_latency_cdfs(records, out / "latency_cdf.png"),
        plot_timeline(records, duration, out / "timeline.png"),
    ]
