"""Property tests over random workloads: budgets, KV accounting, liveness — under every
queue policy (fcfs, priority, sjf with either predictor, fair with tenant weights, slo with
objectives some requests cannot meet) and every victim policy.

After every step: the plan respects the token budget and max_num_seqs, blocks in use equal
what live requests hold (ref counts match holders, nothing freed twice), and the mirror
worker confirms every KV slot a request attends to holds that request's own prefix. At
the end every request has finished or was aborted, and every block is free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_driver import EOS, MirrorWorker, make_request

from common.arith import cdiv
from scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput
from scheduler.config import PREDICTORS, SCHEDULING_POLICIES, VICTIM_POLICIES
from scheduler.slo import SLO, SLOClasses
from scheduler.step_cost import BatchShape


@dataclass
class Spec:
    prompt_len: int
    max_tokens: int
    arrival: int
    priority: int
    abort_at: int | None
    shared: bool
    ignore_eos: bool
    tenant: str
    ttft: float | None
    tpot: float | None


specs = st.builds(
    Spec,
    prompt_len=st.integers(1, 70),
    max_tokens=st.integers(1, 30),
    arrival=st.integers(0, 25),
    priority=st.integers(0, 4),
    abort_at=st.none() | st.integers(0, 60),
    shared=st.booleans(),
    ignore_eos=st.booleans(),
    tenant=st.sampled_from(["a", "b", "c"]),
    ttft=st.sampled_from([None, 1.0, 4.0, 30.0]),  # "seconds" of the test's clock: one a step
    tpot=st.sampled_from([None, 0.5, 2.0]),
)


def linear_cost(b: BatchShape) -> float:
    return 0.5 + 0.05 * b.num_tokens


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[SchedulerConfig, list[Spec], bool]:
    reqs = draw(st.lists(specs, min_size=1, max_size=14))
    block_size = draw(st.sampled_from([4, 8, 16]))
    longest = max(r.prompt_len + r.max_tokens for r in reqs)
    min_blocks = max(cdiv(r.prompt_len + r.max_tokens, block_size) for r in reqs)
    chunked = draw(st.booleans())
    mode = draw(st.sampled_from(["recompute", "swap", "auto"]))
    policy = draw(st.sampled_from(SCHEDULING_POLICIES))
    budget = draw(st.integers(4, 128))
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget if chunked else max(budget, longest),
        max_num_seqs=draw(st.integers(1, 16)),
        max_model_len=longest,
        block_size=block_size,
        num_gpu_blocks=min_blocks + draw(st.integers(0, 20)),
        num_cpu_blocks=0 if mode == "recompute" else draw(st.integers(1, 40)),
        scheduling_policy=policy,
        aging_period=draw(st.sampled_from([1.0, 5.0, 100.0])),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 5, 17])) if chunked else 0,
        preemption_mode=mode,
        enable_prefix_caching=draw(st.booleans()),
        priority_preemption_threshold=draw(st.sampled_from([None, 2])) if policy == "priority" else None,
        swap_bandwidth=draw(st.sampled_from([1e6, 16e9, 1e15])),
        victim_policy=draw(st.sampled_from([None, *VICTIM_POLICIES])),
        output_len_predictor=draw(st.sampled_from(PREDICTORS)),
        sjf_aging_rate=draw(st.sampled_from([0.5, 10.0, 1000.0])),
        tenant_weights=draw(st.sampled_from([(), (("a", 3.0),), (("b", 0.5), ("c", 2.0))])),
        step_cost=draw(st.sampled_from([None, linear_cost])),
        max_step_ms=draw(st.sampled_from([0.0, 800.0, 3000.0])),
        slo_demotion_s=draw(st.sampled_from([0.0, 3.0, 50.0])),
        slo_classes=draw(st.sampled_from([SLOClasses(), SLOClasses(SLO(10.0, 1.0), (("user:c", SLO(None, math.inf)),))])),
    )
    return cfg, reqs, draw(st.booleans())


def _check_plan(cfg: SchedulerConfig, plan: SchedulerOutput) -> None:
    assert plan.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert plan.total_num_scheduled_tokens == sum(plan.num_scheduled_tokens.values())
    assert len(plan.num_scheduled_tokens) <= cfg.max_num_seqs
    assert all(n > 0 for n in plan.num_scheduled_tokens.values())
    if not cfg.enable_chunked_prefill:
        for new in plan.scheduled_new_reqs:
            assert new.num_computed_tokens + plan.num_scheduled_tokens[new.req_id] == len(new.prompt_token_ids)


@settings(max_examples=int(__import__("os").environ.get("STEPSERVE_HYPOTHESIS_EXAMPLES", "300")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_keep_invariants_and_finish(scenario: tuple[SchedulerConfig, list[Spec], bool]) -> None:
    _run(*scenario)


def test_two_running_prompts_that_hold_every_block_under_slo_finish() -> None:
    """A case the property found: under slo, two running prompts (18 and 27 tokens, 7 blocks of
    4 between them) rank behind the waiting queue's head, which cannot be admitted; neither
    may preempt the other while an admission could be evicted, and none was: they must."""
    cfg = SchedulerConfig(
        max_num_batched_tokens=4, max_num_seqs=3, max_model_len=28, block_size=4, num_gpu_blocks=7,
        scheduling_policy="slo", aging_period=1.0, enable_chunked_prefill=True, preemption_mode="recompute",
        output_len_predictor="learned", sjf_aging_rate=0.5, swap_bandwidth=1e6, max_step_ms=800.0,
        slo_demotion_s=0.0, step_cost=linear_cost,
        slo_classes=SLOClasses(SLO(10.0, 1.0), (("user:c", SLO(None, math.inf)),)),
    )
    one = Spec(1, 1, 0, 0, None, False, False, "a", None, None)
    _run(cfg, [one] * 8 + [Spec(6, 1, 4, 0, None, False, False, "a", 1.0, None),
                           Spec(18, 1, 0, 0, None, False, False, "a", None, None),
                           Spec(27, 1, 5, 0, None, False, False, "a", 1.0, None)], False)


def _run(cfg: SchedulerConfig, specs_: list[Spec], overlap: bool) -> None:
    """Drive the workload to its end against a mirror worker, checking every plan and the
    scheduler's integrity each step; every request finishes as its spec says."""
    s = Scheduler(cfg)
    prefix = list(range(7000, 7000 + 70))
    # EOS now and then for requests that do not ignore it
    w = MirrorWorker(cfg.block_size, cfg.num_gpu_blocks, next_token=lambda rid, pos: EOS if pos % 23 == 0 else 900 + pos)
    reqs = {}
    for i, sp in enumerate(specs_):
        prompt = prefix[: sp.prompt_len] if sp.shared else [3000 + i * 100 + j for j in range(sp.prompt_len)]
        reqs[f"q{i}"] = make_request(
            f"q{i}", 0, sp.max_tokens, arrival=float(sp.arrival), priority=sp.priority,
            prompt=prompt, ignore_eos=sp.ignore_eos, tenant=sp.tenant,
        )
        reqs[f"q{i}"].slo = SLO(sp.ttft, sp.tpot)
    pending: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    last_arrival = max(sp.arrival for sp in specs_)
    t = 0
    while t <= last_arrival or s.has_unfinished_requests() or pending:
        assert t < 1500, "livelock: workload did not finish"
        for i, sp in enumerate(specs_):
            if sp.arrival == t:
                s.add_request(reqs[f"q{i}"])
            if sp.abort_at == t:
                s.abort(f"q{i}")
        if t <= last_arrival or s.has_unfinished_requests():
            plan = s.schedule(now=float(t))
            _check_plan(cfg, plan)
            pending.append((plan, w.execute(plan)))
        if pending and (not overlap or len(pending) == 2 or not s.has_unfinished_requests()):
            done, out = pending.pop(0)
            for o in s.update_from_output(done, out, now=float(t)):
                assert o.num_output_tokens <= reqs[o.req_id].sampling_params.max_tokens
        s.check_integrity()
        t += 1
    assert s.num_free_blocks == cfg.num_gpu_blocks
    assert len(s.kv.host_free) == cfg.num_cpu_blocks
    for i, sp in enumerate(specs_):
        r = reqs[f"q{i}"]
        assert r.is_finished
        if r.finish_reason == "length":
            assert r.num_output_tokens == sp.max_tokens
        elif r.finish_reason == "stop":
            assert r.output_token_ids[-1] == EOS and not sp.ignore_eos
        else:
            assert sp.abort_at is not None
