"""The real scheduler driving the real model runner (tiny random Llama, float32).

Batch invariance end to end: each request's greedy output is the same alone as it is
batched with others, chunked, preempted and recomputed, or swapped out and back in, with
one or two plans in flight — plans made by `Scheduler`, not by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sched_driver import drive
from tiny_models import make_tiny_hf_model
from worker_modes import REFERENCE

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from worker.config import WorkerConfig
from worker.execution.model_runner import ModelRunner

PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 23, 9, 40, 17, 31))]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    target: Path = tmp_path_factory.mktemp("tiny") / "llama"
    make_tiny_hf_model().save_pretrained(target)
    cfg = WorkerConfig(model=str(target), block_size=4, kv_cache_memory=512 * 4 * 256, swap_space=0.002, **REFERENCE)
    return ModelRunner(cfg)


def _generate(runner: ModelRunner, prompts: list[list[int]], overlap: bool = False, **cfg_kw: Any) -> tuple[list[list[int]], Scheduler]:
    base: dict[str, Any] = dict(max_num_batched_tokens=256, num_gpu_blocks=200, block_size=4, max_model_len=128)
    base.update(cfg_kw)
    sched = Scheduler(SchedulerConfig(**base))
    reqs = [
        Request(f"p{i}", list(p), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), arrival_time=float(i))
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        sched.add_request(r)
    drive(sched, runner, overlap=overlap)
    assert not runner.requests, "runner kept state of finished requests"
    return [r.output_token_ids for r in reqs], sched


@pytest.fixture(scope="module")
def alone(runner: ModelRunner) -> list[list[int]]:
    return [_generate(runner, [p])[0][0] for p in PROMPTS]


SCENARIOS: dict[str, dict[str, Any]] = {
    "batched": {},
    "batched_overlap": {"overlap": True},
    "chunked_7": {"max_num_batched_tokens": 7},
    "chunked_16_threshold_5": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 5},
    "recompute_tight": {"num_gpu_blocks": 20, "max_num_batched_tokens": 16},
    "recompute_tight_overlap": {"num_gpu_blocks": 20, "max_num_batched_tokens": 16, "overlap": True},
    "swap_tight": {"num_gpu_blocks": 20, "max_num_batched_tokens": 16, "preemption_mode": "swap", "num_cpu_blocks": 64},
    "swap_tight_overlap": {
        "num_gpu_blocks": 20, "max_num_batched_tokens": 16, "preemption_mode": "swap", "num_cpu_blocks": 64, "overlap": True,
    },
    "prefix_cache": {"enable_prefix_caching": True, "max_num_batched_tokens": 16, "num_gpu_blocks": 24},
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_greedy_outputs_are_batch_invariant(runner: ModelRunner, alone: list[list[int]], name: str) -> None:
    kw = dict(SCENARIOS[name])
    overlap = kw.pop("overlap", False)
    prompts = PROMPTS + ([PROMPTS[3][:30] + [9, 9]] if name == "prefix_cache" else [])
    outs, sched = _generate(runner, prompts, overlap=overlap, **kw)
    assert outs[: len(PROMPTS)] == alone
    if "tight" in name:
        assert sched.num_preemptions > 0
    if name.startswith("swap"):
        assert sched.num_swap_preemptions > 0
    if name == "prefix_cache":
        assert sched.stats().prefix_cache_hits > 0
        assert outs[-1] == _generate(runner, [prompts[-1]])[0][0]


def test_runner_blocks_cover_scheduler_pool(runner: ModelRunner) -> None:
    assert runner.info.num_gpu_blocks >= 200 and runner.info.num_cpu_blocks >= 64

