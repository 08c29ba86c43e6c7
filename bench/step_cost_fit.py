"""What the online step-cost fit costs the engine per step: `OnlineStepCost.observe` plus the
next `predict` (which refits), with the NNLS solve started from the last fit's support
(the default) and from scratch (`start=()`, as before), side by side on the same steps.
Prints JSON, with the largest difference between the two fits' predictions (the optimum
is unique, so it must be ~0).

    python -m bench.step_cost_fit     # 3000 steps of 64 decodes, some with a prefill chunk
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from unittest import mock

from scheduler import step_cost_fit as step_fit
from scheduler.step_cost import BatchShape
from scheduler.step_cost_calibration import calibration_steps
from scheduler.step_cost_fit import OnlineStepCost


def _steps(n: int, seed: int) -> list[tuple[BatchShape, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        b = BatchShape()
        b.add(1, rng.randint(10, 300), count=64)
        if rng.random() < 0.2:
            b.add(rng.randint(16, 512), 0)
        seconds = 1e-3 + 2e-6 * b.num_tokens + 1e-8 * b.kv_tokens_read
        out.append((b, seconds * (1 + rng.gauss(0, 0.05))))
    return out


def run(steps: list[tuple[BatchShape, float]], cold: bool) -> tuple[float, list[float]]:
    model = OnlineStepCost()
    for step in calibration_steps(16, 1 << 20, 1 << 20, 32000)[1:]:
        model.seed(step.shape, 1e-3 + 2e-6 * step.shape.num_tokens)
    nnls = step_fit.nnls
    patch = (
        mock.patch.object(step_fit, "nnls", lambda m, c, start=(): nnls(m, c))
        if cold
        else contextlib.nullcontext()
    )
    predictions = []
    with patch:
        t0 = time.perf_counter()
        for shape, seconds in steps:
            predictions.append(model.predict(shape))
            model.observe(shape, seconds)
        elapsed = time.perf_counter() - t0
    return elapsed / len(steps) * 1e6, predictions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median is kept")
    args = p.parse_args(argv)
    steps = _steps(args.steps, 0)
    warm, cold = [], []
    for _ in range(args.rounds):
        w, pw = run(steps, cold=False)
        c, pc = run(steps, cold=True)
        warm.append(w)
        cold.append(c)
    diff = max(abs(a - b) / b for a, b in zip(pw, pc, strict=True))
    warm.sort()
    cold.sort()
    print(
        json.dumps(
            {
                "benchmark": "step_fit",
                "steps": args.steps,
                "us_per_step_warm": round(warm[len(warm) // 2], 2),
                "us_per_step_cold": round(cold[len(cold) // 2], 2),
                "cold_over_warm": round(cold[len(cold) // 2] / warm[len(warm) // 2], 2),
                "max_relative_prediction_difference": diff,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
