"""The calibration path end to end on the default model: `bench.worker_step` measures a
grid of real steps, `stepserve simulate calibrate` fits a profile to them, and the simulator
runs on that profile. Each check can fail: the written profile must reproduce the reported
fit error on the measured steps, fit them at least as well as the profile it started
from, and change what the simulator predicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import worker_step
from loadgen.sim.calibrate import StepSample, samples_from_bench
from loadgen.sim.cli import main as simulate_main
from loadgen.sim.cost_model import OVERHEADS, CostModel, get_hardware, get_model_shape


def test_worker_step_grid_calibrates_a_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert worker_step.main(["--dtype", "float32", "--quantization", "none", "--enforce-eager", "--threads", "2", "--batches", "1", "3", "--context", "16", "80", "--chunks", "8", "40",
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
    samples = samples_from_bench(out)
    shape = get_model_shape("smollm2-135m").with_dtype("float32")
    fitted = CostModel(shape, get_hardware(str(profile)))  # read back from --out
    assert _rel_rmse(fitted, samples) == pytest.approx(fit["rel_rmse"], rel=1e-6)
    assert fit["rel_rmse"] <= _rel_rmse(CostModel(shape, get_hardware("cpu")), samples) + 1e-9

    # The simulator reads the file it is given: the same profile with every cost doubled
    # (half the roofs, twice the overheads) must slow its steps. Comparing with the "cpu"
    # preset instead could tie: on steps that preset already fits best, the fit keeps it.
    slower = tmp_path / "slower.json"
    doubled = {**fitted.hardware.to_dict(), "name": "slower"}
    for key in ("peak_flops", "memory_bandwidth", "host_bandwidth"):
        doubled[key] = float(doubled[key]) / 2
    for key in OVERHEADS:
        doubled[key] = float(doubled[key]) * 2
    slower.write_text(json.dumps({"profile": doubled}))
    summaries = [_simulate(tmp_path, hardware, capsys) for hardware in (str(profile), str(slower))]
    assert all(s["completed"] == 6 and s["num_busy_steps"] > 0 for s in summaries)
    assert summaries[1]["mean_step_ms"] > 1.5 * summaries[0]["mean_step_ms"]


def _rel_rmse(cost_model: CostModel, samples: list[StepSample]) -> float:
    errors = [(cost_model.step_time(s.batch) - s.seconds) / s.seconds for s in samples]
    return (sum(e * e for e in errors) / len(errors)) ** 0.5


def _simulate(tmp_path: Path, hardware: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    sim_json = tmp_path / "sim.json"
    assert simulate_main(["--model-shape", "smollm2-135m", "--hardware", hardware, "--num-prompts", "6",
                          "--request-rate", "2", "--prompt-len", "uniform:16:64", "--output-len", "fixed:8",
                          "--num-gpu-blocks", "64", "--block-size", "16", "--seed", "1",
                          "--result-json", str(sim_json)]) == 0
    capsys.readouterr()
    return json.loads(sim_json.read_text())["summaries"]["continuous"]


def test_worker_step_compares_chunk_attention_on_one_runner(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`--compare-chunk-attention` times both arms on one runner, switching the op before each
    turn in alternating order, and leaves the chunk kernel on."""
    import torch

    from worker.kernels.build import available

    if not available()[0]:
        pytest.skip(f"cpu attention unavailable: {available()[1]}")
    ops = torch.ops.stepserve_cpu
    real, calls = ops.set_chunk_kernel, []

    def recording(on: bool) -> None:
        calls.append(on)
        real(on)

    monkeypatch.setattr(ops, "set_chunk_kernel", recording)
    assert worker_step.main(["--dtype", "float32", "--quantization", "none", "--enforce-eager", "--threads", "2", "--batches", "1",
                       "--context", "16", "--chunks", "40", "--chunk-context", "24", "--repeat", "1", "--kv-cache-gib", "1",
                       "--compare-chunk-attention", "--ab-rounds", "2"]) == 0
    ab = json.loads(capsys.readouterr().out)["chunk_attention"]
    assert set(ab) == {"decode_1", "prefill_40"}
    assert all(v["kernel_ms"] > 0 and v["sdpa_ms"] > 0 for v in ab.values())
    turns = calls[:-1]  # one switch per timed turn, then the first arm's back on
    assert len(turns) == 3 * 2 * 2 and turns.count(True) == turns.count(False)  # a warm-up round and 2 timed
    assert turns[:4] == [False, True, False, True] and turns[4:8] == [True, False, True, False]
    assert calls[-1] is True


def test_worker_step_compares_wide_steps_between_two_runners(capsys: pytest.CaptureFixture[str]) -> None:
    """`--compare-wide-steps` times this runner's wide steps against a second runner's
    setting, each arm named by where its bf16 copy takes over."""
    from worker.kernels.build import available

    if not available()[0]:
        pytest.skip(f"the GGUF kernels are unavailable: {available()[1]}")
    assert worker_step.main(["--enforce-eager", "--threads", "2", "--batches", "4", "--context", "16",
                             "--chunks", "24", "--repeat", "1", "--kv-cache-gib", "1", "--max-model-len", "256",
                             "--gguf-wide-steps", "8", "--compare-wide-steps", "blocks", "--ab-rounds", "2"]) == 0
    ab = json.loads(capsys.readouterr().out)["wide_steps"]
    assert ab["arms"] == ["above_8", "blocks"]
    assert set(ab) == {"arms", "decode_4", "prefill_24"}
    assert all(v["above_8_ms"] > 0 and v["blocks_ms"] > 0 for k, v in ab.items() if k != "arms")
