"""`bench.step_time_budget`'s arithmetic: per-round ratios against the best fixed budget, and
figures and ratios merged over rounds (the servers are the benchmark's to run)."""

from __future__ import annotations

import argparse
from typing import Any

from bench import step_time_budget
from scheduler.config import SchedulerConfig


def _run(tokens: float, itl_p99: float) -> dict[str, Any]:
    return {"flags": ["--x"], "total_token_throughput": tokens, "p99_itl_ms": itl_p99, "median_itl_ms": itl_p99 / 4}


def test_ratios_per_round_and_medians_over_rounds() -> None:
    rounds = [
        {"budget-256": _run(1000, 200), "budget-512": _run(900, 300), "target-100": _run(950, 150)},
        {"budget-256": _run(800, 180), "budget-512": _run(1000, 320), "target-100": _run(970, 190)},
        {"budget-256": _run(1100, 210), "budget-512": _run(1000, 330), "target-100": _run(990, 170)},
    ]
    per_round = [step_time_budget.ratios(r) for r in rounds]
    assert [r["best_fixed_budget"] for r in per_round] == ["budget-256", "budget-512", "budget-256"]
    assert per_round[0]["target-100"]["throughput_vs_best_fixed"] == 0.95
    assert per_round[1]["target-100"]["beats_every_fixed_on_itl_p99"] is False  # 190 against 180
    merged = step_time_budget.median_ratios(per_round)
    assert merged["target-100"]["throughput_vs_best_fixed"] == 0.95  # the median of 0.95, 0.97 and 0.9
    assert merged["target-100"]["beats_every_fixed_on_itl_p99"] == "2 of 3 rounds"
    assert merged["best_fixed_budget"] == ["budget-256", "budget-512", "budget-256"]
    medians = step_time_budget.median_results(rounds)
    assert medians["budget-256"]["total_token_throughput"] == 1000
    assert medians["target-100"]["p99_itl_ms"] == 170
    assert medians["budget-512"]["flags"] == ["--x"] and medians["budget-512"]["median_ttft_ms"] is None


def test_configurations_name_their_flags() -> None:
    configs = dict(step_time_budget._configs(argparse.Namespace(budgets=[256], targets=["100", "150:0.5", "default"])))
    assert configs["budget-256"] == ["--max-num-batched-tokens", "256", "--max-step-ms", "0"]
    assert configs["target-100"] == ["--max-step-ms", "100"]  # the server's default share
    assert configs["target-150-share-0.5"] == ["--max-step-ms", "150", "--min-prefill-share", "0.5"]
    default = f"target-default-{SchedulerConfig().max_step_ms:g}-share-{SchedulerConfig().min_prefill_share:g}"
    assert configs[default] == ["--max-step-ms", f"{SchedulerConfig().max_step_ms:g}",
                                "--min-prefill-share", f"{SchedulerConfig().min_prefill_share:g}"]
