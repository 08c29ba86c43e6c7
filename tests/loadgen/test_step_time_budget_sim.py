"""The time budget in the simulator: the same target and the same online model as the
server; the target bounds ITL p99 where a large token budget does not; target 0 is the
fixed-token simulation exactly; the step-time preset sweeps both side by side."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from loadgen.sim.cli import main
from loadgen.sim.cost_model import MODEL_SHAPES, CostModel, get_hardware
from loadgen.sim.setup import (
    add_run_args,
    build_workload,
    cost_model_from_args,
    run_strategy,
    scheduler_config_from_args,
)
from loadgen.sim.simulator import Simulator
from loadgen.sim.step_cost import seeded_model
from scheduler.step_cost_calibration import calibration_steps

CPU = ["--model-shape", "smollm2-135m", "--hardware", "cpu", "--num-gpu-blocks", "1456", "--num-prompts", "24",
       "--prompt-len", "uniform:20:600", "--output-len", "uniform:16:64", "--seed", "3"]


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_args(parser)
    return parser.parse_args([*CPU, *extra])


def test_target_bounds_itl_p99_where_a_large_token_budget_does_not() -> None:
    args = _args("--max-step-ms", "300", "--min-prefill-share", "0")  # the target as a cap
    timed = run_strategy(args, "continuous", build_workload(args)).summary()
    fixed_args = _args("--max-step-ms", "0", "--max-num-batched-tokens", "2048")
    fixed = run_strategy(fixed_args, "continuous", build_workload(fixed_args)).summary()
    assert timed["completed"] == fixed["completed"] == 24
    assert timed["p99_itl_ms"] <= 1.1 * 300 < fixed["p99_itl_ms"] / 2


def test_target_zero_is_the_fixed_token_simulation() -> None:
    args = _args("--max-step-ms", "0", "--max-num-batched-tokens", "512")
    workload = build_workload(args)
    cm = cost_model_from_args(args)
    config = scheduler_config_from_args(args, workload, cm)
    assert config.step_time_limit_s == 0 and config.step_cost is not None
    plain = dataclasses.replace(config, step_cost=None)
    ours, reference = Simulator(config, cm).run(workload), Simulator(plain, cm).run(workload)
    assert [(r.ttft, r.itls) for r in ours.records] == [(r.ttft, r.itls) for r in reference.records]


def test_seeded_model_prices_the_calibration_shapes_as_the_cost_model() -> None:
    cm = CostModel(MODEL_SHAPES["smollm2-135m"].with_dtype("float32"), get_hardware("cpu"))
    model = seeded_model(cm)
    for step in calibration_steps(16, 1 << 20, 1 << 20, 49152)[1:]:
        assert model.predict(step.shape) == pytest.approx(cm.step_time(step.shape), rel=0.15)


def test_step_time_preset_sweeps_target_next_to_token_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot, out = tmp_path / "step.png", tmp_path / "step.json"
    assert main(["sweep", "--preset", "step-time", "--num-prompts", "6", "--output-len", "8", "--plot", str(plot),
                 "--result-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["param"] == "max_step_ms" and [r["value"] for r in data["rows"]][:2] == ["100", "200"]
    assert data["companion"]["param"] == "max_num_batched_tokens" and len(data["companion"]["rows"]) == 4
    assert plot.stat().st_size > 10_000
    assert "with --max-step-ms 0" in capsys.readouterr().out


def test_prefill_share_keeps_prefill_going_where_the_decodes_fill_the_target() -> None:
    """A 150 ms target on the `cpu` profile, 24 requests at once: the decodes alone soon take
    most of it; with share 0.5 prefill keeps half of each step, and requests start sooner."""
    runs = {}
    for share in ("0", "0.5"):
        args = _args("--max-step-ms", "150", "--min-prefill-share", share)
        assert scheduler_config_from_args(args, build_workload(args), cost_model_from_args(args)).min_prefill_share \
            == float(share)
        runs[share] = run_strategy(args, "continuous", build_workload(args)).summary()
    assert runs["0"]["completed"] == runs["0.5"]["completed"] == 24
    assert runs["0.5"]["median_ttft_ms"] < 0.8 * runs["0"]["median_ttft_ms"]
    assert runs["0.5"]["total_token_throughput"] > runs["0"]["total_token_throughput"]
    assert runs["0"]["p99_itl_ms"] <= 1.1 * 150 < runs["0.5"]["p99_itl_ms"]  # the limit followed the decodes
