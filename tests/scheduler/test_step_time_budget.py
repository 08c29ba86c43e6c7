"""The step-time budget: prefill chunks shrink so that a step's predicted time stays within
the target while requests decode; nothing decoding keeps the token budget; decode-only
steps over the target are counted, not split; prefill always progresses; target 0 is
exactly the fixed-token scheduler. A fake linear cost function stands in for the model."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from sched_driver import EOS, MirrorWorker, drive, make_request

from common.arith import cdiv
from scheduler import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput
from scheduler.slo import SLO
from scheduler.step import StepBuilder
from scheduler.step_cost import BatchShape
from scheduler.step_time_budget import StepTimeBudget


@dataclass(frozen=True)
class FakeCost:
    """Linear "seconds" (any unit): per step, per request, per token, per KV token read, per swap block."""

    step: float = 10.0
    req: float = 1.0
    token: float = 0.5
    kv: float = 0.0
    swap: float = 0.0

    def __call__(self, b: BatchShape) -> float:
        return (self.step + self.req * b.num_reqs + self.token * b.num_tokens + self.kv * b.kv_tokens_read
                + self.swap * b.swap_blocks)


def _sched(target: float, cost: FakeCost = FakeCost(), **kw: object) -> Scheduler:
    base: dict[str, object] = dict(max_num_batched_tokens=512, num_gpu_blocks=256, block_size=16, max_model_len=1024,
                                   max_step_ms=target * 1e3, step_cost=cost, min_prefill_share=0.0)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))  # type: ignore[arg-type]


def _step(s: Scheduler, w: MirrorWorker) -> SchedulerOutput:
    plan = s.schedule(now=0.0)
    s.update_from_output(plan, w.execute(plan), now=0.0)
    s.check_integrity()
    return plan


def _decoding(s: Scheduler, w: MirrorWorker, n: int, prompt: int = 16) -> None:
    """n requests past their prefill, decoding with many tokens to go."""
    for i in range(n):
        s.add_request(make_request(f"d{i}", prompt, 500))
    while any(r.num_output_tokens == 0 for r in s.requests.values()):
        _step(s, w)


def test_chunk_shrinks_to_keep_the_step_within_the_target() -> None:
    # 4 decodes: 10 + 4 * 1 + 4 * 0.5 = 16; a chunk of m adds 1 + 0.5 m <= 60 - 16: m <= 86 -> 80 (5 blocks)
    s, w = _sched(60.0), MirrorWorker(16, 256)
    _decoding(s, w, 4)
    s.add_request(make_request("long", 400, 4))
    chunks = []
    while s.requests["long"].num_output_tokens == 0:
        plan = _step(s, w)
        assert {f"d{i}" for i in range(4)} <= set(plan.num_scheduled_tokens)  # no decode dropped
        chunks.append(plan.num_scheduled_tokens["long"])
    assert chunks == [80, 80, 80, 80, 80]
    assert s.stats().num_time_capped_chunks == 4  # the last one was the whole remainder


def test_nothing_decoding_keeps_the_whole_token_budget() -> None:
    s, w = _sched(20.0, max_num_batched_tokens=256), MirrorWorker(16, 256)
    s.add_request(make_request("long", 400, 4))
    assert _step(s, w).num_scheduled_tokens == {"long": 256}  # 10 + 1 + 128 >> 20: no decode, no cap
    assert s.stats().num_time_capped_chunks == 0


def test_decode_only_step_over_target_is_counted_not_split() -> None:
    s, w = _sched(5.0), MirrorWorker(16, 256)
    _decoding(s, w, 8)
    before = s.stats().num_decode_over_target
    for _ in range(3):
        assert len(_step(s, w).num_scheduled_tokens) == 8
    assert s.stats().num_decode_over_target == before + 3


def test_prefill_progresses_a_block_a_step_when_decodes_fill_it() -> None:
    s, w = _sched(5.0), MirrorWorker(16, 256)
    _decoding(s, w, 4)
    s.add_request(make_request("long", 100, 2))
    s.add_request(make_request("next", 40, 2))
    chunks, others = [], []
    while s.requests["long"].num_output_tokens == 0:
        plan = _step(s, w)
        chunks.append(plan.num_scheduled_tokens["long"])
        others.append(plan.num_scheduled_tokens.get("next", 0))
    assert chunks == [16, 16, 16, 16, 16, 16, 4]  # one block a step, then the remainder
    assert others == [0] * 7  # only one prefill gets the guaranteed block
    while s.requests.get("next") is not None and s.requests["next"].num_output_tokens == 0:
        _step(s, w)  # "next" follows once "long" is through


def test_prefill_share_lets_the_step_grow_with_its_decodes() -> None:
    # 8 decodes: 10 + 8 * 1 + 8 * 0.5 = 22, over the target 5. Share 0.5: the limit is 44, so a
    # chunk may add 1 + 0.5 m <= 22: m <= 42 -> 32 (2 blocks); without a share, one block.
    for share, first in ((0.0, 16), (0.5, 32), (0.75, 128)):  # 0.75: limit 88, m <= 130 -> 128
        s, w = _sched(5.0, min_prefill_share=share), MirrorWorker(16, 256)
        _decoding(s, w, 8)
        s.add_request(make_request("long", 400, 2))
        plan = _step(s, w)
        assert plan.num_scheduled_tokens["long"] == first
        assert len(plan.num_scheduled_tokens) == 9
        assert s.stats().step_time_limit == (22.0 / (1 - share) if share else 5.0)


def test_prefill_share_leaves_a_reachable_target_alone() -> None:
    # 4 decodes cost 16, well under (1 - 0.5) x 60: the limit stays the target, chunks as without a share
    s, w = _sched(60.0, min_prefill_share=0.5), MirrorWorker(16, 256)
    _decoding(s, w, 4)
    s.add_request(make_request("long", 400, 4))
    chunks = []
    while s.requests["long"].num_output_tokens == 0:
        chunks.append(_step(s, w).num_scheduled_tokens["long"])
    assert chunks == [80, 80, 80, 80, 80]
    assert s.stats().step_time_limit == 60.0


def test_prefill_share_limit_is_fixed_by_the_decodes_alone() -> None:
    """The limit is taken from the step's decodes at its first chunk; the chunks after it and
    any swap copies do not raise it."""
    budget = StepTimeBudget(5.0, FakeCost(swap=1.0), 16, prefill_share=0.5)
    budget.begin_step()
    step = StepBuilder(0, 512)
    step.shape = BatchShape()
    step.shape.add(1, 50, count=8)  # 22 -> limit 44
    assert budget.chunk(step, 0, 200, 200, num_blocks=4) == 32  # 4 swap blocks: 26 + 1 + 0.5 m <= 44: m <= 34
    assert budget.last_limit == 44.0
    step.shape.add(16, 0, False)
    assert budget.chunk(step, 0, 200, 200) == 16  # 31 + 1 + 0.5 m <= 44: m <= 24 -> 16, the same limit
    budget.begin_step()
    step.shape = BatchShape()
    step.shape.add(1, 50, count=2)  # 13 -> limit 26: 1 + 0.5 m <= 13: m <= 24 -> 16
    assert budget.chunk(step, 0, 200, 200) == 16
    assert budget.last_limit == 26.0


def test_capped_chunks_end_on_block_boundaries() -> None:
    """After an unaligned start (37 computed tokens), a capped chunk ends on a boundary."""
    budget = StepTimeBudget(40.0, FakeCost(), 16)
    step = StepBuilder(0, 512)
    step.shape = BatchShape()
    step.shape.add(1, 50, count=4)  # 4 decodes: 16; a chunk of m adds 1 + 0.5 m <= 24: m <= 46
    assert budget.chunk(step, 37, 200, 237) == 43  # 37 + 43 = 80; the next boundary, 96, needs 59
    assert budget.chunk(step, 37, 30, 67) == 30  # what fits whole is not cut
    assert budget.chunk(step, 0, 200, 200) == 32  # aligned: whole blocks
    tight = StepTimeBudget(17.0, FakeCost(), 16)
    assert tight.chunk(step, 37, 200, 237) == 11  # nothing fits: the one guaranteed chunk, to the boundary
    assert tight.chunk(step, 37, 200, 237) == 11  # not yet in the step (it did not fit): still guaranteed
    step.shape.add(11, 37, samples=False)  # the step holds it
    assert tight.chunk(step, 80, 200, 280) == 0  # a second prefill in the same step gets nothing
    step.shape = BatchShape()
    step.shape.add(1, 50, count=4)
    tight.begin_step()
    assert tight.chunk(step, 80, 5, 85) == 5  # a remainder shorter than a block runs whole


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_step_ms": -1.0, "step_cost": FakeCost()}, "max_step_ms"),
    ({"max_step_ms": float("nan"), "step_cost": FakeCost()}, "max_step_ms"),
    ({"max_step_ms": 100.0, "step_cost": FakeCost(), "min_prefill_share": 1.0}, "min_prefill_share"),
    ({"max_step_ms": 100.0, "step_cost": FakeCost(), "min_prefill_share": -0.1}, "min_prefill_share"),
])
def test_invalid_time_budget_config(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "limit"), [
    ({"max_step_ms": 100.0, "step_cost": FakeCost()}, 0.1),
    ({"max_step_ms": 100.0}, 0.0),  # nothing to predict a step's time with
    ({"max_step_ms": 100.0, "step_cost": FakeCost(), "enable_chunked_prefill": False,
      "max_num_batched_tokens": 4096}, 0.0),  # nothing to shrink
    ({"max_step_ms": 0.0, "step_cost": FakeCost()}, 0.0),
])
def test_the_budget_applies_with_a_cost_model_and_chunked_prefill(kwargs: dict[str, object], limit: float) -> None:
    assert SchedulerConfig(**kwargs).step_time_limit_s == limit  # type: ignore[arg-type]


# ---- target 0 is today's scheduler, exactly ---------------------------------------------

def _plans(config: SchedulerConfig, seed: int) -> list[SchedulerOutput]:
    rng = random.Random(seed)
    s, w = Scheduler(config), MirrorWorker(config.block_size, config.num_gpu_blocks)
    for i in range(12):
        s.add_request(make_request(f"r{i}", rng.randint(1, 300), rng.randint(1, 40), arrival=float(i)))
    plans: list[SchedulerOutput] = []
    drive(s, w, on_step=lambda _, p: plans.append(p), overlap=seed % 2 == 0)
    return plans


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(4))
def test_target_zero_plans_equal_a_scheduler_without_the_feature(mode: str, seed: int) -> None:
    base = SchedulerConfig(max_num_batched_tokens=128, num_gpu_blocks=40, block_size=16, max_model_len=400,
                           preemption_mode=mode, num_cpu_blocks=0 if mode == "recompute" else 20,
                           enable_prefix_caching=seed % 2 == 1)
    with_model = SchedulerConfig(**{**base.__dict__, "max_step_ms": 0.0, "step_cost": FakeCost()})
    reference, plans = _plans(base, seed), _plans(with_model, seed)
    assert len(reference) > 20 and plans == reference


# ---- properties over random workloads ---------------------------------------------------

@st.composite
def scenarios(draw: st.DrawFn) -> tuple[SchedulerConfig, list[tuple[int, int, int]], bool]:
    reqs = draw(st.lists(st.tuples(st.integers(1, 90), st.integers(1, 25), st.integers(0, 20)), min_size=1, max_size=12))
    bs = draw(st.sampled_from([4, 8, 16]))
    longest = max(p + m for p, m, _ in reqs)
    mode = draw(st.sampled_from(["recompute", "swap"]))
    cost = FakeCost(step=draw(st.sampled_from([0.0, 5.0])), req=1.0, token=draw(st.sampled_from([0.2, 1.0])),
                    kv=draw(st.sampled_from([0.0, 0.01])), swap=draw(st.sampled_from([0.0, 0.5])))
    cfg = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(8, 160)), max_num_seqs=draw(st.integers(1, 16)),
        max_model_len=longest, block_size=bs,
        num_gpu_blocks=max(cdiv(p + m, bs) for p, m, _ in reqs) + draw(st.integers(0, 20)),
        num_cpu_blocks=0 if mode == "recompute" else draw(st.integers(1, 40)), preemption_mode=mode,
        enable_prefix_caching=draw(st.booleans()), long_prefill_token_threshold=draw(st.sampled_from([0, 40])),
        max_step_ms=1e3 * draw(st.sampled_from([3.0, 12.0, 30.0, 80.0])), step_cost=cost,
        min_prefill_share=draw(st.sampled_from([0.0, 0.0, 0.3, 0.5])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "slo"])),
    )
    return cfg, reqs, draw(st.booleans())


def _plan_shape(plan: SchedulerOutput, w: MirrorWorker, prompt_len: dict[str, int]) -> tuple[BatchShape, BatchShape, list[int]]:
    """(the whole plan, its decodes alone, its prefill chunks) from the worker's view before it
    runs; a decode is a one-token computation that samples, as the scheduler counts them."""
    ctx = {d.req_id: d.num_computed_tokens for d in plan.scheduled_new_reqs}
    ctx.update((d.req_id, d.num_computed_tokens) for d in plan.scheduled_cached_reqs)
    whole, decodes, chunks = BatchShape(), BatchShape(), []
    for rid, n in plan.num_scheduled_tokens.items():
        known = w.requests[rid].num_tokens if rid in w.requests else prompt_len[rid]
        samples = ctx[rid] + n == known
        whole.add(n, ctx[rid], samples)
        if n == 1 and samples:
            decodes.add(1, ctx[rid])
        else:
            chunks.append(n)
    whole.swap_blocks = len(plan.swap_in) + len(plan.swap_out)
    return whole, decodes, chunks


@settings(max_examples=int(__import__("os").environ.get("STEPSERVE_HYPOTHESIS_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
# Under slo, two running prefills and room for one guaranteed chunk a step: the urgent one
# is sized first, runs out of blocks and preempts itself (the oldest is never the victim);
# the step's one chunk must then go to the oldest, or the two livelock.
@example((SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=3, max_model_len=49, block_size=8,
                          num_gpu_blocks=7, num_cpu_blocks=0, preemption_mode="recompute",
                          enable_prefix_caching=False, long_prefill_token_threshold=0, max_step_ms=3000.0,
                          step_cost=FakeCost(step=0.0, req=1.0, token=0.2, kv=0.0, swap=0.0),
                          min_prefill_share=0.0, scheduling_policy="slo"),
          [(3, 15, 4), (31, 18, 7), (1, 1, 0), (3, 15, 4), (29, 10, 6)], False))
def test_time_budget_holds_and_every_request_finishes(scenario: tuple[SchedulerConfig, list[tuple[int, int, int]], bool]) -> None:
    cfg, specs, overlap = scenario
    cost, share = cfg.step_cost, cfg.min_prefill_share
    assert cost is not None
    s = Scheduler(cfg)
    w = MirrorWorker(cfg.block_size, cfg.num_gpu_blocks, next_token=lambda rid, pos: EOS if pos % 29 == 0 else 900 + pos)
    reqs = {f"q{i}": make_request(f"q{i}", p, m, arrival=float(a), ignore_eos=i % 2 == 0) for i, (p, m, a) in enumerate(specs)}
    for i, r in enumerate(reqs.values()):  # under slo, steps are held to the tightest of these
        r.slo = SLO(None, (None, 2.0, 20.0)[i % 3])
    prompt_len = {rid: r.num_prompt_tokens for rid, r in reqs.items()}
    pending: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    over_decodes = 0
    t, last = 0, max(a for _, _, a in specs)
    while t <= last or s.has_unfinished_requests() or pending:
        assert t < 3000, "livelock: workload did not finish"
        for rid, (_, _, a) in zip(reqs, specs, strict=True):
            if a == t:
                s.add_request(reqs[rid])
        if t <= last or s.has_unfinished_requests():
            target = s.step_target() or 0.0  # the configured one, or under slo the tightest TPOT
            firm = s.step_objective() is not None
            plan = s.schedule(now=float(t))
            assert plan.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
            assert len(plan.num_scheduled_tokens) <= cfg.max_num_seqs
            whole, decodes, chunks = _plan_shape(plan, w, prompt_len)
            if decodes.num_reqs and cost(decodes) > target:
                over_decodes += 1
            # the step's limit: the target, or its decodes' time / (1 - share) where larger,
            # unless the target is a TPOT objective that the decodes alone fit within
            decode_s = cost(decodes) if decodes.num_reqs else 0.0
            limit = target if not share or not decode_s or (firm and decode_s <= target) else max(target, decode_s / (1 - share))
            if decodes.num_reqs and not plan.preempted_req_ids and cost(whole) > limit:
                # over the target only by the one guaranteed chunk of prefill progress (a step
                # that preempts may be: its swap-out copies come after the chunks were sized)
                assert len(chunks) <= 1 and all(c <= cfg.block_size for c in chunks), (chunks, cost(whole), limit)
                event("a step over the target by the guaranteed chunk" if chunks else "a decode-only step over the target")
            pending.append((plan, w.execute(plan)))
        if pending and (not overlap or len(pending) == 2 or not s.has_unfinished_requests()):
            s.update_from_output(*pending.pop(0), now=float(t))
        s.check_integrity()
        t += 1
    assert s.num_free_blocks == cfg.num_gpu_blocks and len(s.kv.host_free) == cfg.num_cpu_blocks
    assert all(r.is_finished for r in reqs.values())
    assert s.stats().num_decode_over_target == over_decodes
    event(f"chunks capped: {'some' if s.stats().num_time_capped_chunks else 'none'}")
