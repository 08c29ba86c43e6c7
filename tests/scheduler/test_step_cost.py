"""Preemption costs from measured numbers: `preemption_mode="auto"` prices a swap at the
worker's measured copy bandwidth and a recompute with the step-cost model fitted to
measured steps, through the one rule the server and the simulator share. Also the
start-up calibration plans: valid under the plan protocol, on any worker."""

from __future__ import annotations

import random

import pytest
from sched_driver import MirrorWorker, drive, make_request

from scheduler import RequestStatus, Scheduler, SchedulerConfig
from scheduler.step_cost import (
    BatchShape,
    flop_rate_cost,
    recompute_time,
    swap_is_cheaper,
    swap_time,
)
from scheduler.step_cost_calibration import PREFIX, calibration_steps, finish_plan
from scheduler.step_cost_fit import OnlineStepCost
from worker.config import WorkerConfig
from worker.execution.instant_runner import InstantRunner

KV_BYTES = 131072
# A slow host link: 2 * 131072 B / 87.4 MB/s = 3 ms per token to swap out and back in
BANDWIDTH = 2 * KV_BYTES / 3e-3


def _measured_model() -> OnlineStepCost:
    """Fitted to "measured" steps of a worker whose attention is costly: 5 ms a step, 1 ms a
    token, 20 us per (query, key) pair; so recomputing n tokens costs 1 ms + ~10 us * n per token."""
    def measured(b: BatchShape) -> float:
        return 5e-3 + 1e-3 * b.num_tokens + 2e-5 * b.attention_pairs

    model, rng = OnlineStepCost(forgetting=1.0), random.Random(0)
    for _ in range(300):
        b = BatchShape()
        b.add(1, rng.randint(0, 600), count=rng.randint(0, 8))
        b.add(rng.randint(2, 400), rng.choice([0, 100]), samples=rng.random() < 0.5)
        model.observe(b, measured(b))
    return model


def test_swap_wins_for_long_contexts_and_recompute_for_short() -> None:
    model = _measured_model()
    assert not swap_is_cheaper(40, KV_BYTES, BANDWIDTH, model)  # recompute ~1.4 ms/token < 3 ms
    assert swap_is_cheaper(600, KV_BYTES, BANDWIDTH, model)  # ~7 ms/token > 3 ms
    assert recompute_time(model, 600) == pytest.approx(600e-3 + 2e-5 * 600 * 601 / 2, rel=0.05)
    assert swap_time(600, KV_BYTES, BANDWIDTH) == pytest.approx(1.8)
    # the old constants (A100 FLOPs against PCIe) say "swap" for every length
    a100 = flop_rate_cost(16e9, 312e12)
    assert swap_is_cheaper(40, KV_BYTES, 16e9, a100) and swap_is_cheaper(600, KV_BYTES, 16e9, a100)


def _victim_status(prompt_len: int, num_blocks: int) -> RequestStatus:
    """Three requests outgrow the KV cache; the auto mode decides for the first victim."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, num_gpu_blocks=num_blocks, num_cpu_blocks=200,
                                  block_size=16, max_model_len=2048, preemption_mode="auto",
                                  kv_bytes_per_token=KV_BYTES, swap_bandwidth=BANDWIDTH, step_cost=_measured_model(), max_step_ms=0))
    w = MirrorWorker(16, num_blocks)
    for i in range(3):
        s.add_request(make_request(f"r{i}", prompt_len, 60))
    for _ in range(1000):
        plan = s.schedule(now=0)
        s.update_from_output(plan, w.execute(plan), now=0)
        if plan.preempted_req_ids:
            (vid,) = plan.preempted_req_ids
            status = s.requests[vid].status
            drive(s, w)
            return status
    raise AssertionError("no preemption happened")


@pytest.mark.parametrize(("prompt_len", "num_blocks", "expected"), [
    (30, 8, RequestStatus.PREEMPTED),  # a victim of ~40 tokens: recompute is cheaper
    (600, 80, RequestStatus.SWAPPED),  # a victim of ~640 tokens: swap is cheaper
])
def test_auto_preemption_decides_from_measured_rates(prompt_len: int, num_blocks: int, expected: RequestStatus) -> None:
    assert _victim_status(prompt_len, num_blocks) == expected


@pytest.mark.parametrize(("block_size", "num_blocks"), [(16, 64), (4, 200), (32, 16)])
def test_calibration_plans_follow_the_plan_protocol(block_size: int, num_blocks: int) -> None:
    steps = calibration_steps(block_size, num_blocks, 1024, 500)
    assert len(steps) == 8 and [s.measured for s in steps] == [False] + [True] * 7
    mirror = MirrorWorker(block_size, num_blocks)  # asserts the protocol and the KV slots
    instant = InstantRunner(WorkerConfig(block_size=block_size, kv_cache_memory=num_blocks * block_size * 46080))
    for step in steps:
        sampled = mirror.execute(step.plan).sampled_token_ids
        assert instant.execute(step.plan).sampled_token_ids.keys() == sampled.keys()
        assert step.shape.num_sampled == len(sampled)
        assert step.shape.num_tokens == step.plan.total_num_scheduled_tokens
        assert all(rid.startswith(PREFIX) for rid in step.plan.num_scheduled_tokens) and step.plan.step_id < 0
    mirror.execute(finish_plan(steps))
    instant.execute(finish_plan(steps))
    assert not mirror.requests and not instant.requests  # the worker holds nothing afterwards


def test_calibration_needs_room_in_the_kv_pool() -> None:
    assert calibration_steps(16, 10, 1024, 500) == []
    assert calibration_steps(16, 64, 100, 500) == []
