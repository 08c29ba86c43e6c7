"""PNG plots of simulated runs (matplotlib, Agg backend): a run's per-step timeline, a
sweep's curves, and a step-time sweep next to a token-budget sweep."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from loadgen.sim.result import TimelinePoint  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402


def plot_timeline(points: list[TimelinePoint], path: str | Path, title: str = "") -> None:
    """Queue sizes, KV blocks used and prefill vs decode tokens per step, over virtual time."""
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    t = [p.time for p in points]
    q = axes[0]
    for name in ("running", "waiting", "swapped"):
        q.step(t, [getattr(p, name) for p in points], where="pre", label=name)
    q.set_ylabel("requests")
    q.legend(loc="upper right")
    axes[1].step(t, [p.kv_blocks_used for p in points], where="pre", color="tab:purple")
    axes[1].set_ylabel("KV blocks used")
    axes[2].step(t, [p.prefill_tokens for p in points], where="pre", color="tab:blue")
    axes[2].set_ylabel("prefill tokens per step", color="tab:blue")
    axes[2].set_xlabel("virtual time (s)")
    decode = axes[2].twinx()  # decodes are one token per request: a much smaller scale
    decode.step(t, [p.decode_tokens for p in points], where="pre", color="tab:orange")
    decode.set_ylabel("decode tokens per step", color="tab:orange")
    fig.suptitle(title or "simulated timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def log_scale_suits(x: list[float]) -> bool:
    """Whether x values are all positive and span a factor of 8 or more."""
    return bool(x) and min(x) > 0 and max(x) / min(x) >= 8


def _values(rows: list[dict[str, Any]]) -> tuple[list[float] | list[str], bool]:
    """The x values, numeric when every value parses, else the labels as they are; and
    whether they suit a log scale."""
    try:
        x = [float(r["value"]) for r in rows]
    except ValueError:
        return [str(r["value"]) for r in rows], False
    return x, log_scale_suits(x)


def plot_sweep(rows: list[dict[str, Any]], param: str, path: str | Path, title: str = "") -> None:
    """Throughput, TTFT, end-to-end latency, ITL, preemptions and KV use against the parameter."""
    x, log_x = _values(rows)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = (
        ("throughput (output tok/s)", ("output_throughput",), 1.0),
        ("TTFT (s)", ("median_ttft_ms", "p99_ttft_ms"), 1e-3),
        ("end-to-end latency (s)", ("median_e2el_ms", "p99_e2el_ms"), 1e-3),
        ("per-token latency (ms)", ("median_tpot_ms", "p99_itl_ms"), 1.0),
        ("preemptions", ("num_preemptions",), 1.0),
        ("mean KV cache usage", ("mean_kv_cache_usage",), 1.0),
    )
    for ax, (label, keys, scale) in zip(axes.flat, panels, strict=True):
        ys = [[r[key] * scale for r in rows] for key in keys]
        for key, y in zip(keys, ys, strict=True):
            ax.plot(x, y, marker="o", label=key)
        ax.set_ylabel(label)
        ax.set_xlabel(param)
        if log_x:
            ax.set_xscale("log", base=2)
        flat = [v for y in ys for v in y]
        if "(s)" in label and min(flat) > 0 and max(flat) / min(flat) > 100:
            ax.set_yscale("log")  # latencies that span orders of magnitude
        else:
            ax.set_ylim(bottom=0, top=max(max(flat) * 1.1, 1e-9))
        if len(keys) > 1:
            ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title or f"sweep over {param}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


_PANELS = (("ITL p99 (ms)", "p99_itl_ms", 1.0), ("TTFT p50 (s)", "median_ttft_ms", 1e-3),
           ("throughput (total tok/s)", "total_token_throughput", 1.0))


def plot_budget_vs_target(budget_rows: list[dict[str, Any]], target_rows: list[dict[str, Any]],
                          path: str | Path, title: str = "") -> None:
    """ITL p99, TTFT p50 and throughput: against the token budget (time target off, left)
    and against the step-time target (right), on shared y axes."""
    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharey="row")
    columns = (
        (budget_rows, "--max-num-batched-tokens (--max-step-ms 0)"),
        (target_rows, "--max-step-ms"),
    )
    for row, (label, key, scale) in enumerate(_PANELS):
        for col, (rows, xlabel) in enumerate(columns):
            ax = axes[row][col]
            ax.plot([float(r["value"]) for r in rows], [r[key] * scale for r in rows], marker="o")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[row][1].axvline(
            SchedulerConfig().max_step_ms, color="tab:gray", linestyle="--", label="default"
        )
        top = max(r[key] * scale for rows, _ in columns for r in rows)
        axes[row][0].set_ylim(0, max(top * 1.1, 1e-9))
    axes[0][1].legend()
    fig.suptitle(title or "token budget vs step-time target")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
