"""Named scenes for a single simulated run (`stepserve simulate --scenario NAME`), so the
design notes' examples can be replayed step by step in the dashboard:

- ``worked-example``: the notes' 5 requests in 6 blocks of 16 tokens under a token budget
  of 8 (tests/scheduler/test_worked_examples.py derives every plan by hand): chunked
  prefill, four recompute preemptions, a request preempting itself.
- ``thrash``: a KV cache too small for its load ("The thrash scenario" in
  docs/simulator.md): 100 requests at 5 req/s with prompts of up to 2,000 tokens in 200
  blocks, recompute preemption.

Flags given next to ``--scenario`` override the scene's.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from loadgen.workloads import WorkloadRequest


@dataclass(frozen=True)
class Scenario:
    """A scene: flag values, and optionally its own requests instead of a drawn workload."""

    defaults: dict[str, Any]
    requests: tuple[tuple[str, int, int], ...] = ()  # (id, prompt, output) all at t=0; () = flags
    description: str = field(default="", compare=False)


SCENARIOS: dict[str, Scenario] = {
    "worked-example": Scenario(
        {
            "max_num_batched_tokens": 8,
            "num_gpu_blocks": 6,
            "block_size": 16,
            "max_model_len": 128,
            "preemption_mode": "recompute",
            "enable_chunked_prefill": True,
            "enable_prefix_caching": False,
        },
        (("R1", 16, 32), ("R2", 8, 8), ("R3", 32, 16), ("R4", 8, 64), ("R5", 16, 8)),
        "the design notes' worked example: 5 requests, 6 blocks, budget 8",
    ),
    "thrash": Scenario(
        {
            "num_prompts": 100,
            "request_rate": 5.0,
            "prompt_len": "uniform:50:2000",
            "output_len": "uniform:50:500",
            "num_gpu_blocks": 200,
            "block_size": 16,
            "max_num_batched_tokens": 2048,
            "preemption_mode": "recompute",
            "seed": 42,
        },
        description="the thrash scenario: 100 long requests in 200 blocks",
    ),
}


def add_scenario_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scenario",
        choices=sorted(SCENARIOS),
        default=None,
        help="a named scene: " + "; ".join(f"{k}: {s.description}" for k, s in SCENARIOS.items()),
    )


def parse_with_scenario(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse `argv` with the chosen scenario's values as the defaults."""
    pre, _ = parser.parse_known_args(argv)
    if pre.scenario is not None:
        parser.set_defaults(**SCENARIOS[pre.scenario].defaults)
    return parser.parse_args(argv)


def scenario_workload(args: argparse.Namespace) -> list[WorkloadRequest] | None:
    """The scenario's own requests, or None when the workload flags describe it."""
    scenario = SCENARIOS.get(getattr(args, "scenario", None) or "")
    if scenario is None or not scenario.requests:
        return None
    return [WorkloadRequest(rid, 0.0, p, o) for rid, p, o in scenario.requests]
