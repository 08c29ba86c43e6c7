"""The design notes' worked examples, with every step's plan derived by hand.

Example 1: token budget 8, 6 blocks of 16 tokens, FCFS, recompute, chunked prefill.
R1 (16 prompt, 32 out), R2 (8, 8), R3 (32, 16), R4 (8, 64), R5 (16, 8) arrive together.
The rules that produce each row: running requests first in admission order (a decode is
1 token, a prefill chunk is min(remaining, budget)), then head-of-line admission while
budget and blocks last, no admission in a step that preempted, and the victim is the most
recently admitted running request (possibly the one asking).

  step 0-1   R1 prefills 8+8 (1 block).
  step 2     R1 decodes pos 16 (2nd block); R2 admitted with 7 of 8 (1 block).
  step 3     R2 finishes its prompt; R3 admitted with 6 (1 block).
  step 5     R3 reaches 18 tokens: its 2nd block (free 1).
  step 8     R3 completes its prompt (32); R4 admitted with the last 4 tokens of budget and
             the last free block.
  step 9     R3 decodes pos 32 and needs a 3rd block: none free -> preempt the newest, R4
             (first preemption). R4 returns to the head of waiting.
  step 11    R2 finished after step 10 (8 outputs) -> 1 block free: R4 re-admitted, 6 of 8.
  step 18    R1 decodes pos 32, needs a 3rd block -> preempt newest R4 (now holding 6
             generated tokens, kept for recompute).
  step 24    R3 finished -> 3 free: R4 recomputes 14 tokens (8 prompt + 6 generated), 7 + 7.
  step 26    R5 admitted (6 of 16).
  step 29    R5 needs its 2nd block, none free: R5 is the newest, so it preempts itself.
  step 32    same again for R5 after its re-admission.
  step 33    R1 finished -> R5 recomputes 17 tokens; then R4 and R5 decode; R4 finishes last.
"""

from __future__ import annotations

from sched_driver import MirrorWorker, drive, make_request

from scheduler import Request, Scheduler, SchedulerConfig

# step -> (tokens per request, preempted ids, free blocks after the plan)
EXPECTED: list[tuple[dict[str, int], set[str], int]] = [
    ({"R1": 8}, set(), 5),
    ({"R1": 8}, set(), 5),
    ({"R1": 1, "R2": 7}, set(), 3),
    ({"R1": 1, "R2": 1, "R3": 6}, set(), 2),
    ({"R1": 1, "R2": 1, "R3": 6}, set(), 2),
    ({"R1": 1, "R2": 1, "R3": 6}, set(), 1),
    ({"R1": 1, "R2": 1, "R3": 6}, set(), 1),
    ({"R1": 1, "R2": 1, "R3": 6}, set(), 1),
    ({"R1": 1, "R2": 1, "R3": 2, "R4": 4}, set(), 0),
    ({"R1": 1, "R2": 1, "R3": 1}, {"R4"}, 0),
    ({"R1": 1, "R2": 1, "R3": 1}, set(), 0),
    ({"R1": 1, "R3": 1, "R4": 6}, set(), 0),
    ({"R1": 1, "R3": 1, "R4": 2}, set(), 0),
    *[({"R1": 1, "R3": 1, "R4": 1}, set(), 0)] * 5,  # steps 13-17
    ({"R1": 1, "R3": 1}, {"R4"}, 0),
    *[({"R1": 1, "R3": 1}, set(), 0)] * 5,  # steps 19-23
    ({"R1": 1, "R4": 7}, set(), 2),
    ({"R1": 1, "R4": 7}, set(), 2),
    ({"R1": 1, "R4": 1, "R5": 6}, set(), 1),
    ({"R1": 1, "R4": 1, "R5": 6}, set(), 1),
    ({"R1": 1, "R4": 1, "R5": 4}, set(), 0),
    ({"R1": 1, "R4": 1}, {"R5"}, 1),
    ({"R1": 1, "R4": 1, "R5": 6}, set(), 0),
    ({"R1": 1, "R4": 1, "R5": 6}, set(), 0),
    ({"R1": 1, "R4": 1}, {"R5"}, 1),
    ({"R4": 1, "R5": 7}, set(), 3),
    ({"R4": 1, "R5": 7}, set(), 3),
    ({"R4": 1, "R5": 3}, set(), 2),
    *[({"R4": 1, "R5": 1}, set(), 2)] * 6,  # steps 36-41: R5 decodes to 8 outputs
]
# Then R4 decodes alone, one token a step, until its 64th output (steps 42-82); a last,
# empty plan (step 83) only tells the worker that R4 finished.
TOTAL_STEPS = 84


def _example_scheduler() -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=8, num_gpu_blocks=6, block_size=16, max_model_len=128,
                          enable_prefix_caching=False)
    sched = Scheduler(cfg)
    for rid, (p, o) in {"R1": (16, 32), "R2": (8, 8), "R3": (32, 16), "R4": (8, 64), "R5": (16, 8)}.items():
        sched.add_request(make_request(rid, p, o))
    return sched


def test_budget_8_six_blocks_every_step() -> None:
    sched = _example_scheduler()
    seen: list[tuple[dict[str, int], set[str], int]] = []
    reqs: dict[str, Request] = dict(sched.requests)
    drive(
        sched,
        MirrorWorker(16, 6),
        on_step=lambda i, plan: seen.append(
            (dict(plan.num_scheduled_tokens), set(plan.preempted_req_ids), sched.num_free_blocks)
        ),
    )
    for i, want in enumerate(EXPECTED):
        assert seen[i] == want, f"step {i}: got {seen[i]}, want {want}"
    assert all(s[0] == {"R4": 1} and not s[1] for s in seen[len(EXPECTED) : -1])
    assert seen[-1] == ({}, set(), 6)
    assert len(seen) == TOTAL_STEPS
    assert sched.num_preemptions == 4
    assert [reqs[r].num_output_tokens for r in ("R1", "R2", "R3", "R4", "R5")] == [32, 8, 16, 64, 8]
    assert sched.num_free_blocks == 6


def test_first_preemption_picks_most_recently_admitted() -> None:
    sched = _example_scheduler()
    worker = MirrorWorker(16, 6)
    admitted: list[str] = []
    for _ in range(20):
        running_before = [r.request_id for r in sched.running]
        plan = sched.schedule(now=0.0)
        if plan.preempted_req_ids:
            assert plan.preempted_req_ids == {running_before[-1]} == {"R4"}
            assert admitted[-1] == "R4"
            break
        admitted += [n.req_id for n in plan.scheduled_new_reqs]
        sched.update_from_output(plan, worker.execute(plan), now=0.0)
    else:
        raise AssertionError("no preemption in the first 20 steps")


def test_no_chunking_admits_three_in_one_step() -> None:
    """Budget 8192, 1000 blocks of 16; running requests hold 500, 1500 and 300 tokens
    (32 + 94 + 19 = 145 blocks). Waiting prompts of 5000, 1000 and 200 tokens need 313, 63
    and 13 blocks: all admitted in one step, leaving 542, 479 and then 466 blocks free."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=8192, num_gpu_blocks=1000, block_size=16, max_model_len=8192,
        enable_chunked_prefill=False,
    )
    sched = Scheduler(cfg)
    worker = MirrorWorker(16, 1000)
    for rid, n in (("A", 500), ("B", 1500), ("C", 300)):
        sched.add_request(make_request(rid, n, 100))
    plan = sched.schedule(now=0.0)
    assert plan.num_scheduled_tokens == {"A": 500, "B": 1500, "C": 300}
    sched.update_from_output(plan, worker.execute(plan), now=0.0)
    assert 1000 - sched.num_free_blocks == 145

    free_after: list[int] = []
    for rid, n in (("W1", 5000), ("W2", 1000), ("W3", 200)):
        sched.add_request(make_request(rid, n, 10))
    plan = sched.schedule(now=1.0)
    assert plan.num_scheduled_tokens == {"A": 1, "B": 1, "C": 1, "W1": 5000, "W2": 1000, "W3": 200}
    free = 855
    for new in plan.scheduled_new_reqs:
        free -= len(new.block_ids)
        free_after.append(free)
    assert free_after == [542, 479, 466]
    assert sched.num_free_blocks == 466
    sched.check_integrity()
