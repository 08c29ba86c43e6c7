"""PNGs of `compare-policies` (matplotlib, Agg): per sweep trace, the queue policies' curves
(victim newest) and the victim policies' recomputed tokens (fcfs); for the tenant flood,
the weighted service difference between the tenants over time under each queue policy,
against the VTC bound."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from loadgen.sim.plots import log_scale_suits  # noqa: E402
from loadgen.sim.policy_metrics import backlogged_windows  # noqa: E402
from loadgen.sim.result import ServicePoint  # noqa: E402

PANELS = (("goodput", "goodput (req/s at the SLO)"), ("short_p99_ms", "shortest quartile p99 (ms)"),
          ("longest_wait_s", "longest wait (s)"), ("preemptions", "preemptions"))


def _x(points: list[str]) -> tuple[list[float] | list[str], bool]:
    """The points as numbers when every one parses, else as labels; and whether they suit a
    log scale."""
    try:
        x = [float(p) for p in points]
    except ValueError:
        return points, False
    return x, log_scale_suits(x)


def plot_trace(rows: list[dict[str, Any]], trace: str, path: Path) -> Path:
    mine = [r for r in rows if r["trace"] == trace and r["mode"] == rows[0]["mode"]]
    points = list(dict.fromkeys(r["point"] for r in mine))
    x, log_x = _x(points)
    fig, axes = plt.subplots(1, len(PANELS) + 1, figsize=(5 * (len(PANELS) + 1), 4))
    for ax, (key, label) in zip(axes, PANELS, strict=False):
        for queue in dict.fromkeys(r["queue"] for r in mine):
            ys = [
                next(
                    (
                        r[key]
                        for r in mine
                        if r["point"] == p and r["queue"] == queue and r["victim"] == "newest"
                    ),
                    None,
                )
                for p in points
            ]
            if any(y is not None for y in ys):
                ax.plot(x, ys, marker="o", label=queue)
        ax.set(xlabel=trace, ylabel=label)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    victims = axes[-1]
    queue = "fcfs" if any(r["queue"] == "fcfs" for r in mine) else mine[0]["queue"]
    for victim in dict.fromkeys(r["victim"] for r in mine):
        ys = [
            next(
                (
                    r["recompute_tokens"]
                    for r in mine
                    if r["point"] == p and r["queue"] == queue and r["victim"] == victim
                ),
                None,
            )
            for p in points
        ]
        victims.plot(x, ys, marker="o", label=victim)
    victims.set(xlabel=trace, ylabel=f"recomputed tokens ({queue})")
    if log_x:
        victims.set_xscale("log", base=2)
    victims.legend(fontsize=8)
    victims.grid(alpha=0.3)
    fig.suptitle(f"compare-policies: {trace}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_service_gap(
    timelines: dict[str, list[ServicePoint]], bound: float | None, path: Path
) -> Path:
    """served[a] - served[b] over time for each queue policy (the two tenants, sorted)."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for queue, points in timelines.items():
        tenants = sorted({t for p in points for t in p.served})
        if len(tenants) != 2:
            continue
        a, b = tenants
        (line,) = ax.plot(
            [p.time for p in points],
            [p.served.get(a, 0.0) - p.served.get(b, 0.0) for p in points],
            label=f"{queue}: {a} - {b}",
        )
        if queue == "fair":  # shade where both tenants had requests waiting
            for window in backlogged_windows(points, {a, b}):
                ax.axvspan(
                    window[0].time, window[-1].time, color=line.get_color(), alpha=0.08, linewidth=0
                )
    if bound is not None:
        for y in (bound, -bound):
            ax.axhline(y, color="grey", linestyle="--", linewidth=1)
    ax.set(
        xlabel="virtual time (s)",
        ylabel="weighted tokens served, difference",
        title="tenant flood: service difference "
        "(dashed: VTC bound; shaded: both backlogged under fair)",
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_plots(
    rows: list[dict[str, Any]], timelines: dict[str, list[ServicePoint]], out: Path
) -> list[Path]:
    paths = [plot_trace(rows, t, out / f"{t}.png")
             for t in dict.fromkeys(r["trace"] for r in rows) if t != "tenant-flood"]
    if timelines:
        bound = next((r.get("vtc_bound") for r in rows if r["trace"] == "tenant-flood"), None)
        paths.append(plot_service_gap(timelines, bound, out / "tenant-flood.png"))
    return paths
