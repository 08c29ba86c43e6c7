"""Worked examples of the queue and victim policies, every order derived by hand.

The queue examples run one request at a time (max_num_seqs=1) on a unit clock: requests
arrive at whole steps, and step t is planned with now=t. A request with prompt P and
max_tokens O (ignore_eos) is admitted at some step s, prefills and samples its first
token in s, decodes in s+1 .. s+O-1, and the next request is admitted at s+O.
"""

from __future__ import annotations

import pytest
from sched_driver import MirrorWorker, make_request

from scheduler import Request, Scheduler, SchedulerConfig
from scheduler.victims import pick_victim

Spec = tuple[str, int, int, int, str]  # id, arrival step, prompt, max_tokens, tenant


def _first_steps(cfg: SchedulerConfig, specs: list[Spec], max_steps: int = 400) -> dict[str, int]:
    """Run `specs` one step per time unit; the step each request was first scheduled in."""
    sched, worker = Scheduler(cfg), MirrorWorker(cfg.block_size, cfg.num_gpu_blocks)
    first: dict[str, int] = {}
    for t in range(max_steps):
        for rid, arrival, prompt, out, tenant in specs:
            if arrival == t:
                sched.add_request(make_request(rid, prompt, out, arrival=float(t), tenant=tenant))
        if t > max(s[1] for s in specs) and not sched.has_unfinished_requests():
            return first
        plan = sched.schedule(now=float(t))
        for rid in plan.num_scheduled_tokens:
            first.setdefault(rid, t)
        sched.update_from_output(plan, worker.execute(plan), now=float(t))
        sched.check_integrity()
    raise AssertionError("did not finish")


def _serial(**kw: object) -> SchedulerConfig:
    base: dict[str, object] = dict(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128,
                                   block_size=16, num_gpu_blocks=64)
    base.update(kw)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def test_sjf_with_aging_hand_computed_order() -> None:
    """Aging rate 2 tokens/s, max_tokens as the prediction: key = prompt + max_tokens + 2 * arrival.

    B0 (t=0, 4+30) runs steps 0-29 alone. Waiting at step 30: L (t=1, 10+50: key 62),
    S1 (t=10, 2+3: key 25), S2 (t=20: key 45), S3 (t=29: key 63). Shortest first would run
    L last; aging puts L (62) before S3 (63): S3 arrived more than (60 - 5) / 2 s after L.
    So: S1 at 30, S2 at 33, L at 36 (50 steps), S3 at 86. FCFS would run L at 30.
    """
    specs: list[Spec] = [("B0", 0, 4, 30, "t"), ("L", 1, 10, 50, "t"), ("S1", 10, 2, 3, "t"),
                         ("S2", 20, 2, 3, "t"), ("S3", 29, 2, 3, "t")]
    sjf = _first_steps(_serial(scheduling_policy="sjf", sjf_aging_rate=2.0, output_len_predictor="max_tokens"), specs)
    assert sjf == {"B0": 0, "S1": 30, "S2": 33, "L": 36, "S3": 86}
    fcfs = _first_steps(_serial(), specs)
    assert fcfs == {"B0": 0, "L": 30, "S1": 80, "S2": 83, "S3": 86}


def test_sjf_learned_predictor_ranks_by_the_tenants_history() -> None:
    """Learned predictor, aging negligible (0.001 tokens/s). Every prompt has 4 tokens
    (bucket 2) and max_tokens 40; "short" requests stop after 4 outputs (EOS), "new" after
    16, the rest run to 40. Predictions are made when a request is added.

    s1 s2 l1 l2 (t=0) are predicted 40 each (nothing learned) and run in arrival order:
    s1 0-3, s2 4-7, l1 8-47, l2 48-87; blk (t=88) runs 88-127. Meanwhile long (t=90),
    short (t=91) and new (t=92, a tenant never seen) arrive and are predicted 40 (long's
    mean), 4 (short's) and 22 (bucket 2 over s1 s2 l1 l2: (4+4+40+40)/4); blk was predicted
    22 too. At step 128: short (128-131), new (132-147), long (148-187). FCFS: long first.
    Errors: 36 + 36 + 0 + 0 (first four) + 18 (blk) + 0 + 6 (new) + 0 = 96 over 8."""
    cfg = _serial(scheduling_policy="sjf", sjf_aging_rate=0.001)
    specs = [("s1", 0, "short"), ("s2", 0, "short"), ("l1", 0, "long"), ("l2", 0, "long"),
             ("blk", 88, "blk"), ("long", 90, "long"), ("short", 91, "short"), ("new", 92, "new")]
    stop_at = {"s1": 4, "s2": 4, "short": 4, "new": 16}  # outputs, the last one EOS

    def next_token(rid: str, pos: int) -> int:
        return 2 if pos - 4 + 1 >= stop_at.get(rid, 10**9) else 900 + pos

    sched, worker = Scheduler(cfg), MirrorWorker(16, 64, next_token=next_token)
    first: dict[str, int] = {}
    reqs: dict[str, Request] = {}
    for t in range(200):
        for rid, arrival, tenant in specs:
            if arrival == t:
                reqs[rid] = make_request(rid, 4, 40, arrival=float(t), tenant=tenant, ignore_eos=False)
                sched.add_request(reqs[rid])
        plan = sched.schedule(now=float(t))
        for rid in plan.num_scheduled_tokens:
            first.setdefault(rid, t)
        sched.update_from_output(plan, worker.execute(plan), now=float(t))
    assert [reqs[r].predicted_output_tokens for r in ("blk", "long", "short", "new")] == [22, 40, 4, 22]
    assert first == {"s1": 0, "s2": 4, "l1": 8, "l2": 48, "blk": 88, "short": 128, "new": 132, "long": 148}
    assert sched.predictor.error.count == 8 and sched.predictor.error.abs_sum == 96
    assert sched.stats().output_len_prediction_abs_error == 96


def test_fair_hand_computed_counters_and_lift() -> None:
    """VTC, prompt weight 1, output weight 2: every request here (4 + 2 outputs) costs 8.

    t=0: A1 A2 A3 B1 B2. Ties go to the older head. A1 (steps 0-1, A=8), B1 (2-3, B=8),
    A2 (tie at 8, A's head is older: 4-5, A=16), B2 (6-7, B=16), A3 (8-9, A=24). B left
    the backlog at step 6 with 8, A at step 8 with 16. At t=9, A4 then C1 C2 C3 arrive:
    A4 finds no one backlogged and is lifted to the last leaver's 16 (A is at 22 already:
    no change); C1 is lifted from 0 to A's 22. C1 (10-11, C=30), A4 (24 < 30: 12-13),
    C2, C3. Without the lift, C would have run C1 and C2 before A4."""
    specs: list[Spec] = [("A1", 0, 4, 2, "A"), ("A2", 0, 4, 2, "A"), ("A3", 0, 4, 2, "A"),
                         ("B1", 0, 4, 2, "B"), ("B2", 0, 4, 2, "B"), ("A4", 9, 4, 2, "A"),
                         ("C1", 9, 4, 2, "C"), ("C2", 9, 4, 2, "C"), ("C3", 9, 4, 2, "C")]
    first = _first_steps(_serial(scheduling_policy="fair"), specs)
    assert sorted(first, key=first.__getitem__) == ["A1", "B1", "A2", "B2", "A3", "C1", "A4", "C2", "C3"]
    assert first["C1"] == 10 and first["A4"] == 12


def test_fair_tenant_weights_share_two_to_one() -> None:
    """Tenant A weighs 2: its counter grows by cost / 2. Order: A1 (A=4), B1 (B=8), A2
    (A=8), A3 (tie at 8, A's head older: A=12), B2 (B=16), A4."""
    specs: list[Spec] = [*[(f"A{i}", 0, 4, 2, "A") for i in range(1, 5)],
                         ("B1", 0, 4, 2, "B"), ("B2", 0, 4, 2, "B")]
    first = _first_steps(_serial(scheduling_policy="fair", tenant_weights=(("A", 2.0),)), specs)
    assert sorted(first, key=first.__getitem__) == ["A1", "B1", "A2", "A3", "B2", "A4"]


def test_fair_admits_alternately_within_one_step() -> None:
    """Counters move at admission, so one step's admissions alternate between tenants:
    budget 12, four requests of 4 prompt tokens each: A1 (A=4), B1 (B=4), A2 (A=8)."""
    cfg = SchedulerConfig(max_num_batched_tokens=12, max_model_len=64, block_size=4, num_gpu_blocks=64,
                          scheduling_policy="fair")
    sched = Scheduler(cfg)
    for rid, tenant in (("A1", "A"), ("A2", "A"), ("A3", "A"), ("B1", "B"), ("B2", "B")):
        sched.add_request(make_request(rid, 4, 2, tenant=tenant))
    plan = sched.schedule(now=0.0)
    assert [d.req_id for d in plan.scheduled_new_reqs] == ["A1", "B1", "A2"]
    assert sched.fairness_meter.served == {"A": 8 + 2 * 2, "B": 4 + 2}  # prompts + one sample each


def _running(rid: str, admit: int, prompt: int, outputs: int, predicted: int, priority: int = 0) -> Request:
    req = make_request(rid, prompt, 500, priority=priority)
    for i in range(outputs):
        req.append_output(900 + i)
    req.num_computed_tokens = req.num_tokens
    req.admit_seq = admit
    req.predicted_output_tokens = predicted
    return req


# A is the oldest. Remaining work = predicted - outputs: A 1, B 98, C 3, D 170.
# Blocks each would free: A 8, B 1, C 2, D 6. Priorities: B 2, C 1, others 0.
_RUNNING = [_running("A", 0, 40, 10, 11), _running("B", 1, 8, 2, 100, priority=2),
            _running("C", 2, 20, 5, 8, priority=1), _running("D", 3, 30, 30, 200)]
_BLOCKS = {"A": 8, "B": 1, "C": 2, "D": 6}


@pytest.mark.parametrize(("policy", "victim"), [
    ("newest", "D"),  # the last admitted
    ("priority", "B"),  # the largest priority value
    ("fewest_output", "B"),  # 2 outputs
    ("least_remaining", "C"),  # A has less left (1) but is the oldest: protected
    ("largest_kv", "D"),  # A frees more (8) but is protected; then D (6)
])
def test_victim_policies_hand_picked(policy: str, victim: str) -> None:
    got = pick_victim(_RUNNING, policy, lambda r: _BLOCKS[r.request_id])  # type: ignore[arg-type]
    assert got.request_id == victim


def test_progress_dependent_victims_take_the_oldest_only_when_alone() -> None:
    for policy in ("fewest_output", "least_remaining", "largest_kv"):
        assert pick_victim(_RUNNING[:1], policy, lambda r: 1).request_id == "A"  # type: ignore[arg-type]


@pytest.mark.parametrize(("policy", "first_victim"), [
    ("newest", "r2"), ("fewest_output", "r2"), ("least_remaining", "r2"), ("largest_kv", "r1"),
])
def test_victim_policy_in_the_scheduler_with_recompute_tokens_counted(policy: str, first_victim: str) -> None:
    """5 blocks of 16; r0 (16 prompt, 60 out), r1 (16, 20), r2 (16, 8), max_tokens as the
    prediction. Step 0 prefills all three (1 block each, 2 free). In step 1 each decode
    needs a 2nd block: r0 and r1 get the last two, r2 finds none. Candidates: r1, r2 (r0,
    the oldest, is protected under the new policies and is not the newest). newest: r2
    (itself); fewest_output: a tie at 1 output, so the newer, r2; least_remaining: r1 has
    1 + 19 left, r2 1 + 7, so r2; largest_kv: r1 would free 2 blocks, r2 1, so r1. Either
    victim drops 16 computed tokens."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, num_gpu_blocks=5, block_size=16, max_model_len=128,
                          victim_policy=policy, output_len_predictor="max_tokens")  # type: ignore[arg-type]
    sched, worker = Scheduler(cfg), MirrorWorker(16, 5)
    for rid, out in (("r0", 60), ("r1", 20), ("r2", 8)):
        sched.add_request(make_request(rid, 16, out))
    victims: list[tuple[str, int]] = []
    for t in range(300):
        if not sched.has_unfinished_requests():
            break
        computed = {r.request_id: r.num_computed_tokens for r in sched.running}
        plan = sched.schedule(now=float(t))
        victims.extend((v, computed[v]) for v in plan.preempted_req_ids)
        sched.update_from_output(plan, worker.execute(plan), now=float(t))
        sched.check_integrity()
    assert not sched.has_unfinished_requests()
    assert victims[0] == (first_victim, 16)
    assert "r0" not in {v for v, _ in victims}
    assert sched.num_recompute_tokens == sum(n for _, n in victims)
    assert sched.stats().num_recompute_tokens == sched.num_recompute_tokens
