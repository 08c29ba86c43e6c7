"""`bench.fidelity` end to end at toy size: calibrate from a worker_step-format file, load
a live `stepserve serve` on the default model, simulate the same workload, and report both
side by side (the numbers themselves are the benchmark's job, not the test's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import fidelity
from loadgen.sim.cost_model import BatchShape, CostModel, get_hardware, get_model_shape


def test_fidelity_reports_measured_and_simulated_side_by_side(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    cm = CostModel(get_model_shape("smollm2-135m").with_dtype("float32"), get_hardware("cpu"))
    steps = []
    for reqs, tokens, context in ((1, 1, 64), (2, 1, 64), (8, 1, 512), (1, 128, 0), (1, 32, 256)):
        batch = BatchShape()
        batch.add(tokens, context, count=reqs)
        steps.append({"num_reqs": reqs, "tokens_per_req": tokens, "context": context,
                      "step_ms": cm.step_time(batch) * 1e3})
    grid = tmp_path / "worker_step.json"
    grid.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "context": 64,
                                "results": [{"dtype": "float32", "decode": {}, "prefill": {}, "steps": steps}]}))
    assert fidelity.main(["--bench-json", str(grid), "--worker-args=--enforce-eager", "--num-prompts", "3", "--request-rates", "4",
                   "--prompt-len", "uniform:16:32", "--output-len", "uniform:4:6", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["profile"]["num_samples"] == 5 and report["num_gpu_blocks"] > 0
    [run] = report["runs"]
    results = run["results"]
    assert run["request_rate"] == 4
    for key in ("request_throughput", "median_ttft_ms", "mean_step_ms", "num_busy_steps", "mean_execute_ms"):
        row = results[key]
        assert row["measured"] > 0 and row["simulated"] > 0, key
        assert row["ratio_sim_over_measured"] == pytest.approx(row["simulated"] / row["measured"])
    # how the measured times compare is the benchmark's report, not this test's verdict
    step, execute = results["mean_step_ms"]["measured"], results["mean_execute_ms"]["measured"]
    assert run["engine_overhead_ms"] == pytest.approx(step - execute)
    assert run["execute_fits_in_step"] == (execute <= step * 1.05)
