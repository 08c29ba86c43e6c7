"""The virtual-clock simulator driving the real scheduler: exact timing on a lone request,
determinism, conservation, the strategies' ordering, the presets' headline effects and
the `stepserve simulate` commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from loadgen.distributions import LengthDist
from loadgen.sim.cli import main
from loadgen.sim.cost_model import MODEL_SHAPES, BatchShape, CostModel, get_hardware
from loadgen.sim.setup import add_run_args, build_workload, run_strategy
from loadgen.sim.simulator import SimLimits, Simulator
from loadgen.sim.sweep import PRESETS, run_point, with_param
from loadgen.workloads import WorkloadRequest, synthetic
from scheduler.config import SchedulerConfig

CM = CostModel(MODEL_SHAPES["llama-3.1-8b"], get_hardware("a100"))
THRASH = ["--num-prompts", "40", "--request-rate", "5", "--prompt-len", "uniform:50:2000",
          "--output-len", "uniform:50:500", "--num-gpu-blocks", "200", "--block-size", "16",
          "--max-num-batched-tokens", "2048", "--preemption-mode", "recompute", "--seed", "42"]


def _args(argv: list[str], preset: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_args(parser)
    if preset:
        parser.set_defaults(**PRESETS[preset].defaults)
    return parser.parse_args(argv)


def _trace(n: int = 30, seed: int = 0) -> list[WorkloadRequest]:
    return synthetic(n, LengthDist.parse("uniform:20:600"), LengthDist.parse("uniform:5:200"),
                     rate=10.0, seed=seed)


def test_lone_request_times_are_the_cost_model_steps() -> None:
    w = WorkloadRequest("solo", arrival_time=3.0, prompt_len=100, output_len=4)
    result = Simulator(SchedulerConfig(max_model_len=104), CM).run([w])
    rec = result.records[0]
    prefill = CM.prefill_time(100)
    decodes = []
    for ctx in (100, 101, 102):
        batch = BatchShape()
        batch.add(1, ctx)
        decodes.append(CM.step_time(batch))
    assert rec.success and rec.output_tokens == 4
    assert rec.ttft == pytest.approx(prefill)  # the clock jumped to the arrival, no waiting
    assert rec.itls == pytest.approx(decodes)
    assert rec.e2el == pytest.approx(prefill + sum(decodes))
    assert result.duration == pytest.approx(3.0 + rec.e2el)


def test_overlap_delays_an_arrival_by_the_step_in_flight() -> None:
    """With two plans in flight (the engine's overlap) the plan for the next step is made
    when the current one starts, so a request arriving during step 1 misses step 2 too."""
    long = WorkloadRequest("long", arrival_time=0.0, prompt_len=500, output_len=3)
    late = WorkloadRequest("late", arrival_time=1e-6, prompt_len=10, output_len=1)
    cfg = SchedulerConfig(max_model_len=600, max_num_batched_tokens=512)
    ttft = {}
    for overlap in (True, False):
        recs = Simulator(cfg, CM, overlap=overlap).run([long, late]).records
        ttft[overlap] = next(r.ttft for r in recs if r.request_id == "late")
    decode, mixed = BatchShape(), BatchShape()
    decode.add(1, 500)
    mixed.add(1, 500)
    mixed.add(10, 0)
    # without overlap: late waits out long's prefill, then shares long's first decode step
    assert ttft[False] + late.arrival_time == pytest.approx(CM.prefill_time(500) + CM.step_time(mixed))
    assert ttft[True] == pytest.approx(ttft[False] + CM.step_time(decode), rel=1e-4)  # one more step


def test_deterministic_for_a_seed() -> None:
    args = _args(THRASH)
    a = run_strategy(args, "continuous", build_workload(args)).summary()
    b = run_strategy(args, "continuous", build_workload(args)).summary()
    assert a == b
    assert a["num_preemptions"] > 0  # the thrash scenario does thrash


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_request_finishes_with_its_exact_length(mode: str) -> None:
    trace = _trace()
    cfg = SchedulerConfig(max_model_len=800, num_gpu_blocks=60, max_num_batched_tokens=512,
                          preemption_mode=mode, num_cpu_blocks=60 if mode == "swap" else 0)
    result = Simulator(cfg, CM, check_integrity=True).run(trace)
    assert result.stop_reason == "done" and not result.unfinished
    assert result.num_preemptions > 0
    assert (result.num_swap_preemptions > 0) == (mode == "swap")
    lengths = {w.request_id: w.output_len for w in trace}
    for rec in result.records:
        assert rec.success and rec.output_tokens == lengths[rec.request_id]
        assert len(rec.itls) == rec.output_tokens - 1
        assert 0 < rec.ttft <= rec.e2el


def test_conservation_when_a_guard_stops_the_run() -> None:
    trace = _trace(40)
    result = Simulator(SchedulerConfig(max_model_len=800, num_gpu_blocks=60), CM,
                       SimLimits(max_steps=150)).run(trace)
    summary = result.summary()
    assert result.stop_reason == "max_steps"
    assert summary["completed"] + summary["unfinished"] == len(trace)
    assert summary["failed"] == summary["unfinished"] > 0
    assert set(result.unfinished.values()) <= {"WAITING", "RUNNING", "PREEMPTED", "SWAPPED", "NOT_ARRIVED"}
    for rec in result.records:
        assert rec.success == (rec.request_id not in result.unfinished)


def test_a_request_that_never_fits_is_reported_not_dropped() -> None:
    trace = [WorkloadRequest("big", 0.0, 500, 10), WorkloadRequest("ok", 0.0, 50, 10)]
    result = Simulator(SchedulerConfig(max_model_len=510, num_gpu_blocks=10), CM).run(trace)
    assert list(result.unfinished) == ["big"]
    assert result.unfinished["big"].startswith("REJECTED")
    assert result.summary()["completed"] == 1


def test_static_batching_has_higher_mean_latency_than_continuous() -> None:
    args = _args(["--num-prompts", "60"], preset="token-budget")
    workload = build_workload(args)
    summaries = {s: run_strategy(args, s, workload).summary() for s in ("continuous", "static", "padding")}
    for s in summaries.values():
        assert s["completed"] == 60
    assert summaries["static"]["mean_e2el_ms"] > summaries["continuous"]["mean_e2el_ms"]
    assert summaries["padding"]["mean_e2el_ms"] > summaries["continuous"]["mean_e2el_ms"]
    assert summaries["static"]["mean_ttft_ms"] == summaries["static"]["mean_e2el_ms"]  # answered at batch end


def test_kv_capacity_preset_more_blocks_fewer_preemptions() -> None:
    args = _args(["--num-prompts", "60"], preset="kv-capacity")
    small, large = run_point(args, "num_gpu_blocks", "50"), run_point(args, "num_gpu_blocks", "1600")
    assert small["unfinished"] == large["unfinished"] == 0
    assert large["num_preemptions"] < small["num_preemptions"]
    assert large["request_throughput"] > small["request_throughput"]


def test_sweep_parameters_reach_config_and_workload() -> None:
    args = _args([])
    assert with_param(args, "token_budget", "512").max_num_batched_tokens == 512
    assert with_param(args, "prompt_len_max", "64").prompt_len == LengthDist("fixed", 64)
    assert with_param(args, "aging_period", "2.5").aging_period == 2.5
    assert with_param(args, "fair_output_weight", "3").config_overrides == {"fair_output_weight": 3.0}
    assert with_param(args, "enable-prefix-caching", "false").enable_prefix_caching is False
    with pytest.raises(ValueError, match="unknown sweep parameter"):
        with_param(args, "warp_factor", "9")


def test_thrash_command_prints_the_summary_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*THRASH, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    for key in ("completed", "failed", "duration", "request_throughput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "request_goodput",
                "num_preemptions", "unfinished", "mean_kv_cache_usage"):
        assert key in summary
    assert summary["completed"] == 40 and summary["unfinished"] == 0


def test_compare_sweep_and_timeline_write_their_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = ["--num-prompts", "12", "--prompt-len", "uniform:10:100", "--output-len", "uniform:5:30",
             "--request-rate", "20"]
    result = tmp_path / "result.json"
    assert main(["compare", *small, "--timeline", str(tmp_path / "tl.png"), "--result-json", str(result)]) == 0
    assert "static" in capsys.readouterr().out
    assert {p.name for p in tmp_path.glob("tl-*.png")} == {"tl-continuous.png", "tl-static.png", "tl-padding.png"}
    assert set(json.loads(result.read_text())["summaries"]) == {"continuous", "static", "padding"}
    plot = tmp_path / "sweep.png"
    assert main(["sweep", *small, "--param", "max_num_batched_tokens", "64,256", "--plot", str(plot), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["value"] for r in rows] == ["64", "256"] and plot.stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["sweep", *small])  # neither --param nor --preset
