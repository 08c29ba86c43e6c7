"""Cost model, roofline and calibration: shapes match the published models, the roofline
reproduces the design notes' swap-vs-recompute numbers, and calibration recovers the
parameters of a profile from steps timed by that profile."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadgen.sim.calibrate import StepSample, calibrate_bench, fit_profile, samples_from_bench
from loadgen.sim.cli import main
from loadgen.sim.cost_model import (
    MODEL_SHAPES,
    BatchShape,
    CostModel,
    HardwareProfile,
    ModelShape,
    get_hardware,
    get_model_shape,
)
from loadgen.sim.roofline import roofline

LLAMA_8B = MODEL_SHAPES["llama-3.1-8b"]
A100 = get_hardware("a100")
TRUE_CPU = HardwareProfile("truth", peak_flops=150e9, memory_bandwidth=25e9,
                           host_bandwidth=30e9, step_overhead=4e-3)


def test_shapes_match_published_parameter_counts() -> None:
    assert LLAMA_8B.num_params == 8_030_261_248
    assert MODEL_SHAPES["llama-3.1-70b"].num_params == 70_553_706_496
    assert MODEL_SHAPES["smollm2-135m"].num_params == 134_515_008
    assert LLAMA_8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert MODEL_SHAPES["smollm2-135m"].with_dtype("float32").kv_bytes_per_token == 2 * 30 * 3 * 64 * 4


def test_shape_from_hf_config_equals_preset(tmp_path: Path) -> None:
    cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = get_model_shape(str(tmp_path))
    assert shape.num_params == LLAMA_8B.num_params
    assert shape.kv_bytes_per_token == LLAMA_8B.kv_bytes_per_token


def test_unknown_names_raise() -> None:
    with pytest.raises(ValueError, match="unknown model shape"):
        get_model_shape("gpt-9")
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("tpu-v9")
    with pytest.raises(ValueError, match="num_layers"):
        ModelShape("bad", 0, 1, 1, 1, 1, 1, 1)


def test_step_time_is_the_max_of_the_roofs_plus_overhead() -> None:
    cm = CostModel(LLAMA_8B, A100)
    decode = BatchShape()
    decode.add(1, 1000, count=8)
    cost = cm.step(decode)
    assert not cost.compute_bound  # a small decode batch streams weights
    assert cost.time == pytest.approx(cost.bytes / A100.memory_bandwidth + A100.step_overhead)
    prefill = BatchShape()
    prefill.add(2048, 0)
    cost = cm.step(prefill)
    assert cost.compute_bound
    assert cost.time == pytest.approx(cost.flops / A100.peak_flops + A100.step_overhead)


def test_context_and_swaps_cost_time() -> None:
    cm = CostModel(LLAMA_8B, A100, block_size=16)
    short, long = BatchShape(), BatchShape()
    short.add(1, 100, count=64)
    long.add(1, 4000, count=64)
    assert cm.step_time(long) > cm.step_time(short)
    assert cm.flops(long) > cm.flops(short)
    swapping = BatchShape()
    swapping.add(1, 100, count=64)
    swapping.swap_blocks = 100
    expected = 100 * 16 * LLAMA_8B.kv_bytes_per_token / A100.host_bandwidth
    assert cm.step_time(swapping) - cm.step_time(short) == pytest.approx(expected)


def test_roofline_reproduces_the_design_notes() -> None:
    table = roofline(CostModel(LLAMA_8B, A100))
    p = table["preemption"]
    assert p["swap_ms"] == pytest.approx(66, rel=0.05)  # 4100 tok * 128 KiB, out + in, 16 GB/s
    assert p["recompute_ms"] == pytest.approx(210, rel=0.10)  # 4100 * 2 * 8e9 / 312e12
    assert table["hardware"]["ridge_point"] == pytest.approx(312e12 / 2.039e12)
    d1024, d4096 = table["decode"]
    assert d4096["kv_bytes"] / d1024["kv_bytes"] == pytest.approx(4, rel=0.01)
    assert d1024["intensity_batch1"] < 2  # a lone decode is far below the ridge
    assert all(r["compute_bound"] for r in table["prefill"])


def test_roofline_command_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roofline", "--model-shape", "llama-3.1-8b", "--hardware", "a100",
                 "--context", "1024,4096", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert [r["context"] for r in table["decode"]] == [1024, 4096]
    assert main(["roofline", "--model-shape", "smollm2-135m", "--hardware", "cpu"]) == 0
    assert "ridge point" in capsys.readouterr().out


def _timed_steps(cm: CostModel) -> list[dict[str, float]]:
    """Step records as bench/worker_step.py writes them, timed by `cm` itself."""
    steps = []
    for reqs in (1, 4, 16, 64):
        for ctx in (0, 256, 1024):
            steps.append({"num_reqs": reqs, "tokens_per_req": 1, "context": ctx})
    for n in (16, 64, 256, 1024):
        steps.append({"num_reqs": 1, "tokens_per_req": n, "context": 0})
    for rec in steps:
        batch = BatchShape()
        batch.add(int(rec["tokens_per_req"]), int(rec["context"]), count=int(rec["num_reqs"]))
        rec["seconds"] = cm.step_time(batch)
    return steps


def _worker_step_output(cm: CostModel) -> dict[str, object]:
    """What bench/worker_step.py prints, with every step timed by `cm`."""
    context = 256
    decode, prefill = {}, {}
    for b in (1, 8, 32, 128):
        batch = BatchShape()
        batch.add(1, context, count=b)
        decode[str(b)] = {"step_ms": cm.step_time(batch) * 1e3, "tokens_per_s": 0.0}
    for n in (256, 2048):
        prefill[str(n)] = {"step_ms": cm.prefill_time(n) * 1e3, "tokens_per_s": 0.0}
    return {"model": "SmolLM2-135M-Instruct", "context": context,
            # the bench's own micro-benchmarks: only the fit's starting point
            "machine": {"matmul_flops_float32": 200.0, "copy_bandwidth_bytes": 40.0},
            "results": [{"dtype": "float32", "decode": decode, "prefill": prefill}]}


def test_calibrate_command_recovers_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shape = MODEL_SHAPES["smollm2-135m"].with_dtype("float32")
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_worker_step_output(CostModel(shape, TRUE_CPU))))
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--from", str(bench), "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    fitted = report["profile"]
    assert report["model_shape"] == "smollm2-135m" and report["num_samples"] == 6
    assert fitted["peak_flops"] == pytest.approx(TRUE_CPU.peak_flops, rel=1e-3)
    assert fitted["memory_bandwidth"] == pytest.approx(TRUE_CPU.memory_bandwidth, rel=1e-3)
    assert fitted["step_overhead"] == pytest.approx(TRUE_CPU.step_overhead, rel=1e-3)
    assert get_hardware(str(out)).peak_flops == pytest.approx(TRUE_CPU.peak_flops, rel=1e-3)


def test_calibration_separates_per_request_and_per_context_costs(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """With decode steps at several batch sizes and contexts (bench/worker_step.py's `steps`
    records), the per-step, per-request and per-KV-token overheads are each recovered."""
    truth = HardwareProfile("truth", peak_flops=110e9, memory_bandwidth=30e9, host_bandwidth=30e9,
                            step_overhead=50e-3, seq_overhead=2e-3, kv_token_overhead=9e-6,
                            multi_token_overhead=40e-3)
    shape = MODEL_SHAPES["smollm2-135m"].with_dtype("float32")
    steps = _timed_steps(CostModel(shape, truth))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "context": 256,
                                 "results": [{"dtype": "float32", "decode": {}, "prefill": {}, "steps": steps}]}))
    assert main(["calibrate", "--from", str(bench), "--out", str(tmp_path / "p.json")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_samples"] == len(steps) and report["rel_rmse"] < 1e-6
    for key in ("peak_flops", "memory_bandwidth", "step_overhead", "seq_overhead", "kv_token_overhead",
                "multi_token_overhead"):
        assert report["profile"][key] == pytest.approx(getattr(truth, key), rel=1e-3), key
    # a decode at context 1024 costs more than one at 64 by exactly the KV tokens' overhead
    cm = CostModel(shape, get_hardware(str(tmp_path / "p.json")))
    short, long = BatchShape(), BatchShape()
    short.add(1, 64, count=4)
    long.add(1, 1024, count=4)
    assert cm.step(long).overhead - cm.step(short).overhead == pytest.approx(4 * 960 * 9e-6, rel=1e-3)
    # and a one-token step skips the multi-token overhead that a two-token step pays
    one, two = BatchShape(), BatchShape()
    one.add(1, 64)
    two.add(1, 64, count=2)
    assert cm.step(two).overhead - cm.step(one).overhead == pytest.approx(40e-3 + 2e-3 + 65 * 9e-6, rel=1e-3)


def test_calibration_tolerates_noise() -> None:
    shape = MODEL_SHAPES["smollm2-135m"].with_dtype("float32")
    cm = CostModel(shape, TRUE_CPU)
    rng = np.random.default_rng(0)
    samples = []
    for rec in _timed_steps(cm):
        batch = BatchShape()
        batch.add(int(rec["tokens_per_req"]), int(rec["context"]), count=int(rec["num_reqs"]))
        samples.append(StepSample(batch, rec["seconds"] * float(rng.uniform(0.98, 1.02))))
    fit = fit_profile(samples, shape, get_hardware("cpu"))
    assert fit.profile.peak_flops == pytest.approx(TRUE_CPU.peak_flops, rel=0.05)
    assert fit.profile.memory_bandwidth == pytest.approx(TRUE_CPU.memory_bandwidth, rel=0.05)
    assert fit.rel_rmse < 0.02
    with pytest.raises(ValueError, match="at least 3"):
        fit_profile(samples[:2], shape, get_hardware("cpu"))


@pytest.mark.parametrize("seed", range(12))
def test_a_fit_is_never_worse_than_its_base_profile(seed: int) -> None:
    """On steps no profile fits well (times off by up to 3x either way, as a noisy shared
    machine's few samples can be) and a bench whose own micro-benchmarks are far off, the
    fit still keeps the best parameters it visited, the base profile among its starts."""
    shape = MODEL_SHAPES["smollm2-135m"].with_dtype("float32")
    base = get_hardware("cpu")
    rng = np.random.default_rng(seed)
    steps = _timed_steps(CostModel(shape, TRUE_CPU))[::2]
    for rec in steps:
        rec["seconds"] *= float(np.exp(rng.uniform(-1.1, 1.1)))
    data = {"model": "SmolLM2-135M-Instruct", "machine": {"matmul_flops_float32": 0.5, "copy_bandwidth_bytes": 5000.0},
            "results": [{"dtype": "float32", "decode": {}, "prefill": {}, "steps": steps}]}
    fit, _ = calibrate_bench(data, base)
    samples = samples_from_bench(data, "float32")
    base_cm = CostModel(shape, base)
    base_err = float(np.sqrt(np.mean([((base_cm.step_time(s.batch) - s.seconds) / s.seconds) ** 2 for s in samples])))
    assert fit.rel_rmse <= base_err + 1e-12
