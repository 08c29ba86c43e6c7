"""Preemption by recompute, swap and auto; victim policies; priority with aging."""

from __future__ import annotations

import pytest
from sched_driver import MirrorWorker, drive, make_request

from scheduler import RequestStatus, Scheduler, SchedulerConfig


def _tight(**kw: object) -> Scheduler:
    base: dict[str, object] = dict(max_num_batched_tokens=64, num_gpu_blocks=8, block_size=16, max_model_len=128)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))  # type: ignore[arg-type]


def _run_until_preempted(s: Scheduler, w: MirrorWorker) -> set[str]:
    for _ in range(500):
        plan = s.schedule(now=0)
        s.update_from_output(plan, w.execute(plan), now=0)
        if plan.preempted_req_ids:
            return set(plan.preempted_req_ids)
    raise AssertionError("no preemption happened")


def test_recompute_keeps_generated_tokens_and_goes_to_head() -> None:
    s = _tight()
    w = MirrorWorker(16, 8)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 30, 60))
    s.add_request(make_request("late", 60, 5))  # 4 blocks: waits behind the running three
    victims = _run_until_preempted(s, w)
    (vid,) = victims
    victim = s.requests[vid]
    assert vid == "r2" and victim.status == RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0 and victim.num_output_tokens > 0
    assert s.waiting.peek(0) is victim  # ahead of "late"
    kept = list(victim.output_token_ids)
    plan = None
    while "r2" not in (plan.num_scheduled_tokens if plan else {}):
        plan = s.schedule(now=0)
        s.update_from_output(plan, w.execute(plan), now=0)
    assert victim.output_token_ids[: len(kept)] == kept
    # r2's own entry says it resumes (the worker kept its state), whatever else is in the plan
    (entry,) = [c for c in plan.scheduled_cached_reqs if c.req_id == "r2"]
    assert entry.resumed_from_preemption and entry.num_computed_tokens == 0
    assert all(n.req_id != "r2" for n in plan.scheduled_new_reqs)
    drive(s, w)
    assert victim.num_output_tokens == 60 and victim.metrics.num_preemptions >= 1


def test_swap_preemption_moves_blocks_and_back() -> None:
    s = _tight(preemption_mode="swap", num_cpu_blocks=16)
    w = MirrorWorker(16, 8)  # verifies that swapped-in KV is the request's own
    for i in range(3):
        s.add_request(make_request(f"r{i}", 30, 60))
    seen_out: list[tuple[int, int]] = []
    seen_in: list[tuple[int, int]] = []

    def on_step(i: int, plan: object) -> None:
        seen_out.extend(plan.swap_out)  # type: ignore[attr-defined]
        seen_in.extend(plan.swap_in)  # type: ignore[attr-defined]

    drive(s, w, on_step=on_step)
    assert seen_out and seen_in and s.num_swap_preemptions >= 1
    assert {h for _, h in seen_out} >= {h for h, _ in seen_in}
    assert len(s.kv.host_free) == 16 and s.num_free_blocks == 8


def test_swap_falls_back_to_recompute_when_host_is_full() -> None:
    s = _tight(preemption_mode="swap", num_cpu_blocks=1)
    w = MirrorWorker(16, 8)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 30, 60))
    victims = _run_until_preempted(s, w)
    assert all(s.requests[v].status == RequestStatus.PREEMPTED for v in victims)
    drive(s, w)


@pytest.mark.parametrize(("bandwidth", "expect_swap"), [(1e15, True), (1e6, False)])
def test_auto_mode_follows_cost_estimate(bandwidth: float, expect_swap: bool) -> None:
    s = _tight(preemption_mode="auto", num_cpu_blocks=16, swap_bandwidth=bandwidth)
    w = MirrorWorker(16, 8)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 30, 60))
    (vid,) = _run_until_preempted(s, w)
    assert (s.requests[vid].status == RequestStatus.SWAPPED) == expect_swap
    drive(s, w)


def test_priority_victim_is_least_urgent_then_youngest() -> None:
    s = _tight(scheduling_policy="priority")
    w = MirrorWorker(16, 8)
    s.add_request(make_request("low-old", 30, 60, arrival=0.0, priority=5))
    s.add_request(make_request("urgent", 30, 60, arrival=0.1, priority=0))
    s.add_request(make_request("low-young", 30, 60, arrival=0.2, priority=5))
    assert _run_until_preempted(s, w) == {"low-young"}
    victim = s.requests["low-young"]
    assert victim.priority == 5 and victim.arrival_time == 0.2  # re-queued unchanged


def test_aging_admits_low_priority_under_constant_urgent_stream() -> None:
    """One slot (max_num_seqs=1); a new priority-0 request arrives every step. Without
    aging the priority-10 request would wait forever; with aging_period=2 steps it gains a
    level every 2 steps and gets in once it outranks the stream's fresh arrivals."""
    s = _tight(scheduling_policy="priority", max_num_seqs=1, aging_period=2.0, num_gpu_blocks=64)
    w = MirrorWorker(16, 64)
    low = make_request("low", 8, 1, arrival=0.0, priority=10)
    s.add_request(low)
    for t in range(200):
        s.add_request(make_request(f"hi{t}", 8, 1, arrival=float(t), priority=0))
        plan = s.schedule(now=float(t))
        s.update_from_output(plan, w.execute(plan), now=float(t))
        if low.is_finished:
            break
    assert low.is_finished and low.finish_reason == "length"
    assert 20 <= t < 60  # needs ~2 * 10 steps of aging, then waits behind older urgent ones


def test_priority_preemption_threshold() -> None:
    s = _tight(scheduling_policy="priority", priority_preemption_threshold=3, max_num_seqs=1, num_gpu_blocks=64)
    w = MirrorWorker(16, 64)
    s.add_request(make_request("bg", 8, 50, arrival=0.0, priority=5))
    plan = s.schedule(now=0)
    s.update_from_output(plan, w.execute(plan), now=0)
    s.add_request(make_request("slight", 8, 5, arrival=1.0, priority=3))  # only 2 more urgent
    plan = s.schedule(now=1)
    assert not plan.preempted_req_ids
    s.update_from_output(plan, w.execute(plan), now=1)
    s.add_request(make_request("vip", 8, 5, arrival=2.0, priority=1))
    plan = s.schedule(now=2)
    assert plan.preempted_req_ids == {"bg"} and "vip" in plan.num_scheduled_tokens
    bg = s.requests["bg"]
    assert (bg.priority, bg.arrival_time) == (5, 0.0)
    s.update_from_output(plan, w.execute(plan), now=2)
    drive(s, w)


def test_request_never_loses_place_to_a_newer_one() -> None:
    """Under FCFS/newest-victim, every preemption victim was admitted after (or is) the
    request that needed the blocks."""
    s = _tight(num_gpu_blocks=10)
    w = MirrorWorker(16, 10)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 20 + 5 * i, 40, arrival=float(i)))
    order: dict[str, int] = {}

    def on_step(i: int, plan: object) -> None:
        for v in plan.preempted_req_ids:  # type: ignore[attr-defined]
            assert all(order[v] >= order[r.request_id] for r in s.running), "older request preempted"
        for r in s.running:
            order[r.request_id] = r.admit_seq

    drive(s, w, on_step=on_step)
    assert s.num_preemptions > 0
