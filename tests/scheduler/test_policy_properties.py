"""Properties of the new policies over random workloads (the shared invariants — budgets,
no KV leak, liveness — run under every policy in test_properties.py).

- sjf: the aging bound. A request x with predicted work W_x (prompt + predicted output at
  arrival) is first scheduled no later than any request that arrived more than
  W_x / sjf_aging_rate after it.
- fair: the Virtual Token Counter's rules. Counters never decrease; a tenant with nothing
  waiting is lifted on arrival to max(its counter, the lowest backlogged counter, or the
  last leaver's when none is backlogged), and a backlogged tenant is not; every admission
  from the queue takes the head of a backlogged tenant with the lowest counter; and each
  prompt token and each output token is charged exactly once, preemptions or not.
- fair: two tenants backlogged from the start (their requests interleaved, or one
  tenant's all queued first) receive weighted service within `vtc_bound(kv_term=True)` of
  each other for as long as both stay backlogged; every example keeps both backlogged for
  at least two steps.
- the learned predictor stays within [max(min_tokens, 1), max_tokens].
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_driver import EOS, MirrorWorker, make_request

from common.arith import cdiv
from scheduler import Request, Scheduler, SchedulerConfig
from scheduler.config import PREDICTORS, VICTIM_POLICIES
from scheduler.fairness import FairQueue, vtc_bound

EXAMPLES = int(os.environ.get("STEPSERVE_HYPOTHESIS_EXAMPLES", "300"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Spec:
    prompt_len: int
    max_tokens: int
    min_tokens: int
    arrival: int
    tenant: str
    stops_at: int | None  # output count at which the worker sends EOS


specs = st.builds(
    Spec,
    prompt_len=st.integers(1, 50),
    max_tokens=st.integers(1, 30),
    min_tokens=st.integers(0, 3),
    arrival=st.integers(0, 30),
    tenant=st.sampled_from(["a", "b", "c"]),
    stops_at=st.none() | st.integers(1, 30),
)


@st.composite
def scenarios(draw: st.DrawFn, policy: str) -> tuple[SchedulerConfig, list[Spec]]:
    reqs = draw(st.lists(specs, min_size=1, max_size=16))
    for r in reqs:
        r.min_tokens = min(r.min_tokens, r.max_tokens)
    block_size = draw(st.sampled_from([4, 8]))
    mode = draw(st.sampled_from(["recompute", "swap"]))
    longest = max(r.prompt_len + r.max_tokens for r in reqs)
    cfg = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(8, 96)),
        max_num_seqs=draw(st.integers(1, 8)),
        max_model_len=longest,
        block_size=block_size,
        num_gpu_blocks=max(cdiv(r.prompt_len + r.max_tokens, block_size) for r in reqs) + draw(st.integers(0, 12)),
        num_cpu_blocks=0 if mode == "recompute" else 40,
        scheduling_policy=policy,  # type: ignore[arg-type]
        preemption_mode=mode,  # type: ignore[arg-type]
        enable_prefix_caching=draw(st.booleans()),
        victim_policy=draw(st.sampled_from(VICTIM_POLICIES)),
        output_len_predictor=draw(st.sampled_from(PREDICTORS)),
        sjf_aging_rate=draw(st.sampled_from([0.5, 2.0, 20.0])),
        tenant_weights=draw(st.sampled_from([(), (("a", 3.0),), (("b", 0.5), ("c", 2.0))])),
        fair_output_weight=draw(st.sampled_from([0.0, 2.0])),
    )
    return cfg, reqs


def _requests(specs_: list[Spec]) -> dict[str, Request]:
    return {
        f"q{i}": make_request(f"q{i}", sp.prompt_len, sp.max_tokens, arrival=float(sp.arrival),
                              tenant=sp.tenant, ignore_eos=False, min_tokens=sp.min_tokens)
        for i, sp in enumerate(specs_)
    }


def _run(sched: Scheduler, specs_: list[Spec], reqs: dict[str, Request], on_step: object = None) -> None:
    """Unit clock, one plan in flight; EOS at each spec's `stops_at`."""
    stops = {f"q{i}": sp.stops_at for i, sp in enumerate(specs_)}
    plen = {f"q{i}": sp.prompt_len for i, sp in enumerate(specs_)}

    def next_token(rid: str, pos: int) -> int:
        stop = stops[rid]
        return EOS if stop is not None and pos - plen[rid] + 1 >= stop else 900 + pos

    w = MirrorWorker(sched.config.block_size, sched.config.num_gpu_blocks, next_token=next_token)
    last = max(sp.arrival for sp in specs_)
    t = 0
    while t <= last or sched.has_unfinished_requests():
        assert t < 3000, "livelock"
        for i, sp in enumerate(specs_):
            if sp.arrival == t:
                sched.add_request(reqs[f"q{i}"])
        plan = sched.schedule(now=float(t))
        sched.update_from_output(plan, w.execute(plan), now=float(t))
        sched.check_integrity()
        if on_step is not None:
            on_step()  # type: ignore[operator]
        t += 1
    assert all(r.is_finished for r in reqs.values())
    assert sched.num_free_blocks == sched.config.num_gpu_blocks


@SETTINGS
@given(scenarios("sjf"))
def test_sjf_aging_bound_holds(scenario: tuple[SchedulerConfig, list[Spec]]) -> None:
    cfg, specs_ = scenario
    sched, reqs = Scheduler(cfg), _requests(specs_)
    _run(sched, specs_, reqs)
    rate = cfg.sjf_aging_rate
    for x in reqs.values():
        window = (x.num_prompt_tokens + x.predicted_output_tokens) / rate  # type: ignore[operator]
        start_x = x.metrics.first_scheduled_time
        for y in reqs.values():
            if y.arrival_time > x.arrival_time + window:
                assert start_x <= y.metrics.first_scheduled_time, (  # type: ignore[operator]
                    f"{y.request_id} (arrived {y.arrival_time}) passed {x.request_id} "
                    f"(arrived {x.arrival_time}, window {window:.1f}s)"
                )


@SETTINGS
@given(scenarios("sjf"))
def test_learned_predictions_stay_within_bounds(scenario: tuple[SchedulerConfig, list[Spec]]) -> None:
    cfg, specs_ = scenario
    sched, reqs = Scheduler(cfg), _requests(specs_)
    _run(sched, specs_, reqs)
    for r in reqs.values():
        sp = r.sampling_params
        assert max(sp.min_tokens, 1) <= r.predicted_output_tokens <= sp.max_tokens  # type: ignore[operator]
    assert sched.predictor.error.count == len(reqs)


class _CheckedFairQueue(FairQueue):
    """FairQueue that asserts the VTC rules at every push and pop."""

    def push(self, request: Request) -> None:
        tenant = request.tenant
        others = {t: self.counter(t) for t in self.backlogged() if t != tenant}
        before, was_backlogged, last = self.counter(tenant), tenant in self.backlogged(), self._last_left
        super().push(request)
        after = self.counter(tenant)
        if was_backlogged:
            assert after == before
        else:
            floor = min(others.values()) if others else last
            assert after == pytest.approx(max(before, floor), rel=1e-12, abs=1e-9)

    def pop(self, now: float) -> Request:
        lowest = min(self.counter(t) for t in self.backlogged())
        req = super().pop(now)
        assert self.counter(req.tenant) == lowest, "admitted a tenant above the lowest counter"
        return req


@SETTINGS
@given(scenarios("fair"))
def test_vtc_counter_rules(scenario: tuple[SchedulerConfig, list[Spec]]) -> None:
    cfg, specs_ = scenario
    sched, reqs = Scheduler(cfg), _requests(specs_)
    queue = _CheckedFairQueue(sched.fairness_meter, cfg.tenant_weights)
    sched.waiting = queue
    seen: dict[str, float] = {}

    def counters_never_fall() -> None:
        for tenant in {r.tenant for r in reqs.values()}:
            c = queue.counter(tenant)
            assert c >= seen.get(tenant, 0.0) - 1e-9, f"counter of {tenant} fell"
            seen[tenant] = c

    _run(sched, specs_, reqs, counters_never_fall)
    expected: dict[str, float] = {}
    for r in reqs.values():  # each prompt token once, each output token once
        cost = r.num_prompt_tokens * cfg.fair_prompt_weight + r.num_output_tokens * cfg.fair_output_weight
        expected[r.tenant] = expected.get(r.tenant, 0.0) + cost
    assert {t: v for t, v in sched.fairness_meter.served.items() if v} == pytest.approx({t: v for t, v in expected.items() if v})


Job = tuple[int, int, str]  # (prompt tokens, max tokens, tenant)
JOBS = st.tuples(st.integers(1, 60), st.integers(1, 40))


@st.composite
def backlogged_pairs(draw: st.DrawFn) -> tuple[SchedulerConfig, list[Job]]:
    """Two tenants whose requests all arrive at once, each with more requests than one step
    can admit (`max_num_seqs`): both are backlogged at the first step and still after it, by
    construction, so every example measures a backlogged interval of at least two steps."""
    max_num_seqs = draw(st.integers(1, 8))
    a = draw(st.lists(JOBS, min_size=max_num_seqs + 1, max_size=16))
    b = draw(st.lists(JOBS, min_size=max_num_seqs + 1, max_size=16))
    tenants = ["a"] * len(a) + ["b"] * len(b)
    # Interleaved at random, or one tenant's whole backlog queued ahead of the other's.
    order = draw(st.permutations(tenants) | st.just(tenants) | st.just(tenants[::-1]))
    jobs = {"a": iter(a), "b": iter(b)}
    reqs = [(*next(jobs[t]), t) for t in order]
    block_size = draw(st.sampled_from([4, 8, 16]))
    longest = max(p + o for p, o, _ in reqs)
    cfg = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(8, 128)), max_num_seqs=max_num_seqs,
        max_model_len=longest, block_size=block_size,
        num_gpu_blocks=cdiv(longest, block_size) + draw(st.integers(0, 30)),
        scheduling_policy="fair",
        victim_policy=draw(st.sampled_from(VICTIM_POLICIES)),
        tenant_weights=draw(st.sampled_from([(), (("a", 2.0),), (("b", 3.0),)])),
    )
    return cfg, reqs


@SETTINGS
@given(backlogged_pairs())
def test_vtc_service_gap_within_bound_while_both_backlogged(
    scenario: tuple[SchedulerConfig, list[Job]],
) -> None:
    cfg, specs_ = scenario
    sched = Scheduler(cfg)
    queue = sched.waiting
    assert isinstance(queue, FairQueue)
    for i, (p, o, tenant) in enumerate(specs_):
        sched.add_request(make_request(f"q{i}", p, o, tenant=tenant))
    weights = dict(cfg.tenant_weights)
    largest = max(sched.fairness_meter.request_cost(p, o) for p, o, _ in specs_)
    w = MirrorWorker(cfg.block_size, cfg.num_gpu_blocks)

    def gap() -> float:
        served = sched.fairness_meter.served
        return served.get("a", 0.0) / weights.get("a", 1.0) - served.get("b", 0.0) / weights.get("b", 1.0)

    # The gap before the first step and after every step that began with both backlogged.
    gaps = [gap()]
    t = 0
    while set(queue.backlogged()) == {"a", "b"}:
        assert t < 3000, "livelock"
        plan = sched.schedule(now=float(t))
        sched.update_from_output(plan, w.execute(plan), now=float(t))
        gaps.append(gap())
        t += 1
    assert t >= 2, "the strategy must keep both tenants backlogged past the first step"
    assert max(gaps) - min(gaps) <= vtc_bound(cfg, largest, kv_term=True)
