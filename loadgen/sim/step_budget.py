"""The time budget in the simulator: the scheduler's online step-cost model, seeded and fed
from the simulator's own cost model, and the plot of a step-time sweep next to a
token-budget sweep on the same workload.

The scheduler in the simulator gets exactly what the server's gets: an
`OnlineStepCost`, seeded with the start-up calibration's shapes (priced here by the
`CostModel` instead of measured by a worker) and refitted after every simulated step from
the time the virtual clock advanced. So the simulated time budget includes the fit's lag
and its error on shapes the calibration did not cover, as the live one does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from loadgen.sim.cost_model import CostModel  # noqa: E402
from scheduler.config import DEFAULT_MAX_STEP_MS  # noqa: E402
from scheduler.step_calibration import calibration_steps  # noqa: E402
from scheduler.step_fit import OnlineStepCost  # noqa: E402

_LARGE = 1 << 30


def seeded_model(cm: CostModel) -> OnlineStepCost:
    """A fresh model seeded with the calibration shapes, priced by `cm`."""
    model = OnlineStepCost(block_bytes=cm.shape.kv_bytes_per_token * cm.block_size,
                           copy_bandwidth=cm.hardware.host_bandwidth)
    for step in calibration_steps(cm.block_size, _LARGE, _LARGE, cm.shape.vocab_size):
        if step.measured:
            model.seed(step.shape, cm.step_time(step.shape))
    return model


_PANELS = (("ITL p99 (ms)", "p99_itl_ms", 1.0), ("TTFT p50 (s)", "median_ttft_ms", 1e-3),
           ("throughput (total tok/s)", "total_token_throughput", 1.0))


def plot_budget_vs_target(budget_rows: list[dict[str, Any]], target_rows: list[dict[str, Any]],
                          path: str | Path, title: str = "") -> None:
    """ITL p99, TTFT p50 and throughput: against the token budget (time target off, left)
    and against the step-time target (right), on shared y axes."""
    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharey="row")
    columns = ((budget_rows, "--max-num-batched-tokens (--max-step-ms 0)"), (target_rows, "--max-step-ms"))
    for row, (label, key, scale) in enumerate(_PANELS):
        for col, (rows, xlabel) in enumerate(columns):
            ax = axes[row][col]
            ax.plot([float(r["value"]) for r in rows], [r[key] * scale for r in rows], marker="o")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[row][1].axvline(DEFAULT_MAX_STEP_MS, color="tab:gray", linestyle="--", label="default")
        top = max(r[key] * scale for rows, _ in columns for r in rows)
        axes[row][0].set_ylim(0, max(top * 1.1, 1e-9))
    axes[0][1].legend()
    fig.suptitle(title or "token budget vs step-time target")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
