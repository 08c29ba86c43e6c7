"""Scheduler overhead: microseconds per `schedule()` + `update_from_output()` call and per
scheduled request, at 256 and 1024 running requests (block 16, budget 8192, chunked
prefill on), with prefix caching off and on. Prints JSON.

`--max-step-ms T` turns the time budget on, priced by the online step-cost model the server
uses (seeded with "measured" times of 20 ms a step + 1 ms per request and per token, so at
256 running a new prompt's chunk is cut, and at 1024 the decodes alone are over 600 ms).
The model is switched on after the warm-up: with decodes over the target from the start,
the initial burst would prefill one block a step.

Steady state is measured: every request is decoding (prompts prefilled first), and a
stream of new arrivals keeps a chunked prefill in most steps, as in a loaded server.

    python -m bench.scheduler_overhead                          # 256 and 1024 running
    python -m bench.scheduler_overhead --running 48 --max-step-ms 0 100 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from scheduler import ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.step_cost import BatchShape
from scheduler.step_cost_calibration import calibration_steps
from scheduler.step_cost_fit import OnlineStepCost


def _request(i: int, prompt_len: int, shared_prefix: int) -> Request:
    prompt = list(range(1000, 1000 + shared_prefix)) + [
        (i * 7919 + j) % 30000 for j in range(prompt_len - shared_prefix)
    ]
    sp = SamplingParams(max_tokens=100_000 // 2, ignore_eos=True)
    return Request(f"r{i}", prompt, sp, arrival_time=0.0)


def _step(sched: Scheduler) -> int:
    plan = sched.schedule(now=0.0)
    out = ModelRunnerOutput(plan.step_id, {rid: 7 for rid in plan.num_scheduled_tokens})
    sched.update_from_output(plan, out, now=0.0)
    return plan.num_reqs


class _Cost:
    """The online model, free (0 s) until switched on."""

    def __init__(self) -> None:
        self.model = OnlineStepCost()
        for step in calibration_steps(16, 1 << 20, 1 << 20, 32000)[1:]:
            self.model.seed(
                step.shape, 0.02 + 1e-3 * step.shape.num_reqs + 1e-3 * step.shape.num_tokens
            )
        self.on = False

    def __call__(self, batch: BatchShape) -> float:
        return self.model.predict(batch) if self.on else 0.0


def measure(num_running: int, prefix_caching: bool, steps: int, prompt_len: int = 128,
            max_step_ms: float = 0.0) -> dict[str, float]:
    cost = _Cost()
    cfg = SchedulerConfig(
        max_step_ms=max_step_ms, step_cost=cost if max_step_ms else None,
        max_num_batched_tokens=8192, max_num_seqs=num_running + 64, max_model_len=200_000,
        block_size=16, num_gpu_blocks=num_running * (prompt_len + steps + 64) // 16 + 4096,
        enable_chunked_prefill=True, enable_prefix_caching=prefix_caching,
    )
    sched = Scheduler(cfg)
    shared = 64 if prefix_caching else 0
    for i in range(num_running):
        sched.add_request(_request(i, prompt_len, shared))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or len(
        sched.waiting
    ):
        _step(sched)
    cost.on = True
    per_call: list[float] = []
    per_req: list[float] = []
    next_id = num_running
    for k in range(steps):
        if k % 4 == 0:  # a new arrival every few steps keeps prefill chunks in the mix
            sched.add_request(_request(next_id, prompt_len, shared))
            next_id += 1
        t0 = time.perf_counter()
        n = _step(sched)
        dt = (time.perf_counter() - t0) * 1e6
        per_call.append(dt)
        per_req.append(dt / max(n, 1))
    per_call.sort()
    per_req.sort()
    return {
        "running": num_running,
        "prefix_caching": prefix_caching,
        "max_step_ms": max_step_ms,
        "steps": steps,
        "mean_us_per_step": statistics.fmean(per_call),
        "p99_us_per_step": per_call[int(0.99 * (len(per_call) - 1))],
        "mean_us_per_request": statistics.fmean(per_req),
        "p99_us_per_request": per_req[int(0.99 * (len(per_req) - 1))],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    ap.add_argument(
        "--max-step-ms",
        type=float,
        nargs="+",
        default=[0.0],
        help="one run per value (0: time budget off), e.g. 0 600 for the side-by-side ratio",
    )
    args = ap.parse_args(argv)
    results = [
        measure(n, pc, args.steps, max_step_ms=t)
        for n in args.running
        for pc in (False, True)
        for t in args.max_step_ms
    ]
    print(json.dumps({"benchmark": "scheduler_overhead", "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
