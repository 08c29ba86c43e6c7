"""The calibration path end to end on the default model: `bench/worker_step.py` measures a
grid of real steps, `stepserve simulate calibrate` fits a profile to them, and the simulator
runs on that profile."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from loadgen.sim.cli import main as simulate_main

ROOT = Path(__file__).resolve().parents[2]


def _worker_step() -> ModuleType:
    spec = importlib.util.spec_from_file_location("worker_step_bench", ROOT / "bench" / "worker_step.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_worker_step_grid_calibrates_a_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _worker_step()
    assert bench.main(["--threads", "2", "--batches", "1", "3", "--context", "16", "80", "--chunks", "8", "40",
                       "--chunk-context", "0", "24", "--repeat", "1", "--kv-cache-gib", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    result = out["results"][0]
    assert result["dtype"] == "float32" and set(result["decode"]) == {"1", "3"} and set(result["prefill"]) == {"8", "40"}
    shapes = {(s["num_reqs"], s["tokens_per_req"], s["context"]) for s in result["steps"]}
    assert shapes == {(1, 1, 16), (3, 1, 16), (1, 1, 80), (3, 1, 80), (1, 8, 0), (1, 40, 0), (1, 8, 24), (1, 40, 24)}
    assert all(s["step_ms"] > 0 for s in result["steps"])
    assert "matmul_flops_bfloat16" not in out["machine"]  # not measured unless used or compared

    steps_json, profile = tmp_path / "steps.json", tmp_path / "profile.json"
    steps_json.write_text(json.dumps(out))
    assert simulate_main(["calibrate", "--from", str(steps_json), "--out", str(profile)]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["model_shape"] == "smollm2-135m" and fit["num_samples"] == 8
    assert fit["profile"]["peak_flops"] > 0 and fit["profile"]["step_overhead"] >= 0

    sim_json = tmp_path / "sim.json"
    assert simulate_main(["--model-shape", "smollm2-135m", "--hardware", str(profile), "--num-prompts", "6",
                          "--request-rate", "2", "--prompt-len", "uniform:16:64", "--output-len", "fixed:8",
                          "--num-gpu-blocks", "64", "--block-size", "16", "--seed", "1",
                          "--result-json", str(sim_json)]) == 0
    summary = json.loads(sim_json.read_text())["summaries"]["continuous"]
    assert summary["completed"] == 6 and summary["num_busy_steps"] > 0
    # every busy step costs at least the fitted per-step overhead
    assert summary["mean_step_ms"] >= fit["profile"]["step_overhead"] * 1e3
