"""A workload that thrashes a naive scheduler must still finish.

100 requests arriving at 5 req/s (Poisson), prompts uniform 50..2000 tokens, outputs
uniform 50..500, token budget 2048, 200 blocks of 16 (3200 token slots: two long requests
fill it), recompute preemption. A virtual clock advances by a simple step cost.
"""

from __future__ import annotations

import random

from sched_driver import MirrorWorker, make_request

from scheduler import Scheduler, SchedulerConfig


def test_thrash_scenario_completes_all_requests() -> None:
    rng = random.Random(42)
    cfg = SchedulerConfig(
        max_num_batched_tokens=2048, num_gpu_blocks=200, block_size=16, max_model_len=2500,
        max_num_seqs=256, preemption_mode="recompute",
    )
    s = Scheduler(cfg)
    w = MirrorWorker(16, 200, verify_kv=False)
    t, arrivals = 0.0, []
    for i in range(100):
        t += rng.expovariate(5.0)
        arrivals.append((t, make_request(f"r{i}", rng.randint(50, 2000), rng.randint(50, 500), arrival=t)))
    reqs = [r for _, r in arrivals]
    now, steps = 0.0, 0
    while arrivals or s.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= now:
            s.add_request(arrivals.pop(0)[1])
        if not s.has_unfinished_requests():
            now = arrivals[0][0]
            continue
        plan = s.schedule(now=now)
        now += 0.005 + plan.total_num_scheduled_tokens * 2e-5  # a crude step cost
        s.update_from_output(plan, w.execute(plan), now=now)
        steps += 1
        assert steps < 200_000, "thrashed without finishing"
        if steps % 97 == 0:
            s.check_integrity()
    assert all(r.finish_reason == "length" for r in reqs)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in reqs)
    assert s.num_free_blocks == 200
    print(f"thrash scenario: {steps} steps, {s.num_preemptions} preemptions, virtual {now:.1f}s")
    assert s.num_preemptions > 0  # the scenario really is tight
