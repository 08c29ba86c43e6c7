"""Objectives per request and the slo policy, by worked examples whose numbers are computed
by hand in the comments: where objectives come from, the least-slack order and the bounded
demotion of lost deadlines, the step held to the tightest TPOT, the most-slack victim, and
the first-token forecast behind the admission check."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from sched_driver import MirrorWorker, make_request

from scheduler import Scheduler, SchedulerConfig
from scheduler.forecast import first_token as forecast_first_token
from scheduler.queues import SLOQueue
from scheduler.request import Request
from scheduler.slo import (
    NO_SLO,
    SLO,
    SLOClasses,
    parse_slo,
    parse_slo_classes,
    slo_met,
    ttft_and_tpot,
)
from scheduler.step_cost import BatchShape


@dataclass(frozen=True)
class Cost:
    """Seconds: `step` per step plus `token` per computed token."""

    step: float = 0.0
    token: float = 0.01

    def __call__(self, b: BatchShape) -> float:
        return self.step + self.token * b.num_tokens


def _req(rid: str, prompt: int, arrival: float, ttft: float | None = None, tpot: float | None = None,
         max_tokens: int = 50) -> Request:
    r = make_request(rid, prompt, max_tokens, arrival=arrival)
    r.slo = SLO(ttft, tpot)
    return r


# ---- where objectives come from ------------------------------------------------------------

def test_a_request_s_objectives_win_then_its_tenant_then_its_priority_then_the_default() -> None:
    classes = SLOClasses(
        parse_slo("ttft=2000,tpot=150"),
        (*parse_slo_classes("user:batch=ttft=60000,tpot=none"), *parse_slo_classes("priority:1=tpot=50")),
    )
    assert classes.resolve(NO_SLO, "anyone", 0) == SLO(2.0, 0.15, "default")
    assert classes.resolve(NO_SLO, "anyone", 1) == SLO(2.0, 0.05, "priority:1")
    # the tenant's class clears the tpot objective ("none") over the priority's
    assert classes.resolve(NO_SLO, "batch", 1) == SLO(60.0, None, "user:batch")
    # the request's own ttft, the default's tpot
    assert classes.resolve(SLO(0.5), "anyone", 0) == SLO(0.5, 0.15, "request")
    assert SLOClasses().resolve(NO_SLO, "x", 0) == NO_SLO


@pytest.mark.parametrize("spec", ["ttft=0", "ttft=-5", "tpot=nan", "ttft=inf", "ttft=1,ttft=2", "latency=3", "ttft"])
def test_bad_objectives_are_refused_by_name(spec: str) -> None:
    with pytest.raises(ValueError, match="slo"):
        parse_slo(spec)


def test_classes_must_be_user_or_priority() -> None:
    for spec in ("tenant:x=ttft=5", "priority:high=ttft=5", "user:=ttft=5"):
        with pytest.raises(ValueError, match="slo class"):
            parse_slo_classes(spec)


def test_met_is_judged_per_objective() -> None:
    ttft, tpot = ttft_and_tpot(arrival=1.0, first_token=1.5, finished=2.5, num_output_tokens=11)
    assert (ttft, tpot) == (0.5, pytest.approx(0.1))
    assert slo_met(SLO(0.5, 0.1), ttft, tpot) == (True, True)
    assert slo_met(SLO(0.4, 0.09), ttft, tpot) == (False, False)
    assert slo_met(SLO(1.0), None, None) == (False, True)  # no first token: its TTFT was missed
    assert slo_met(NO_SLO, None, None) == (True, True)


# ---- the least-slack order ---------------------------------------------------------------

def test_waiting_requests_go_by_least_slack_and_lost_deadlines_wait_at_most_the_demotion() -> None:
    # prefill time 10 ms a token; demotion 10 s. Keys (the latest start):
    #   A: arrives 0,   100 tokens, ttft 3 s   -> 0 + 3 - 1.0   = 2.0
    #   B: arrives 0.5,  10 tokens, ttft 1 s   -> 0.5 + 1 - 0.1 = 1.4
    #   C: arrives 0,   no objective           -> 0 + 10        = 10.0 (late on arrival)
    #   D: arrives 0,    20 tokens, ttft 0.1 s -> 0.1 - 0.2 = -0.1: lost by t=1 -> 9.9
    q = SLOQueue(lambda n: 0.01 * n, demotion_s=10.0)
    a, b, c, d = (_req("A", 100, 0.0, 3.0), _req("B", 10, 0.5, 1.0), _req("C", 5, 0.0), _req("D", 20, 0.0, 0.1))
    for r in (a, b, c, d):
        q.push(r)
    assert [q.key(r, 1.0) for r in (a, b, c, d)] == [pytest.approx(k) for k in (2.0, 1.4, 10.0, 9.9)]
    assert q.peek(1.0) is b and q.num_demoted == 1  # D was found lost
    assert [q.pop(1.0).request_id for _ in range(4)] == ["B", "A", "D", "C"]
    # At t=10.5 D (9.9) and C (10.0) have yielded their 10 s: they rank ahead of a request
    # arriving now with a tight but meetable deadline (key >= now).
    for r in (c, d):
        q.push(r)
    e = _req("E", 10, 10.5, 0.5)  # key 10.5 + 0.5 - 0.1 = 10.9
    q.push(e)
    assert [q.pop(10.5).request_id for _ in range(3)] == ["D", "C", "E"]


def test_the_scheduler_admits_the_least_slack_first() -> None:
    cfg = SchedulerConfig(max_num_seqs=1, num_gpu_blocks=64, block_size=16, max_model_len=512,
                          scheduling_policy="slo", step_cost=Cost(), max_step_ms=0.0)
    s = Scheduler(cfg)
    for r in (_req("loose", 10, 0.0, 60.0), _req("none", 10, 0.0), _req("tight", 10, 0.2, 0.5)):
        s.add_request(r)
    plan = s.schedule(now=0.3)
    assert set(plan.num_scheduled_tokens) == {"tight"}


# ---- the step's target: the tightest TPOT among the decodes ----------------------------

def _decode_all(s: Scheduler, w: MirrorWorker, now: float = 0.0) -> None:
    while any(r.num_output_tokens == 0 for r in s.requests.values()):
        plan = s.schedule(now=now)
        s.update_from_output(plan, w.execute(plan), now=now)


def test_a_step_is_held_to_the_tightest_tpot_among_its_decodes() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=1024, num_gpu_blocks=256, block_size=16, max_model_len=1024,
                          scheduling_policy="slo", step_cost=Cost(step=0.01, token=0.001), max_step_ms=300.0,
                          min_prefill_share=0.0)
    s, w = Scheduler(cfg), MirrorWorker(16, 256)
    s.add_request(_req("batch", 16, 0.0, max_tokens=500))
    _decode_all(s, w)
    assert s.step_target() == pytest.approx(0.3)  # no decode has a TPOT objective
    s.add_request(_req("chat", 16, 0.0, tpot=0.05, max_tokens=500))
    s.add_request(_req("chat2", 16, 0.0, tpot=0.2, max_tokens=500))
    _decode_all(s, w)
    assert s.step_target() == pytest.approx(0.05)
    # A long prompt now gets chunks that keep the step within 50 ms: 10 ms + 1 ms a token
    # over 3 decodes + the chunk -> chunk <= 37, cut to the block boundary: 32 tokens.
    s.add_request(_req("long", 600, 0.0, max_tokens=5))
    plan = s.schedule(now=0.0)
    assert plan.num_scheduled_tokens["long"] == 32
    assert cfg.step_cost is not None


@pytest.mark.parametrize(("tpot", "chunk"), [
    # 60 decodes: 10 ms + 60 x 1 ms = 70 ms. Under a 100 ms objective they fit, so the
    # objective is firm: 70 + m <= 100 -> m <= 30, cut to the block boundary: 16 tokens.
    # (The prefill share's stretch would allow 70 / (1 - 0.5) = 140 ms: m <= 70 -> 64.)
    (0.1, 16),
    # Under a 50 ms objective the decodes alone are over it (lost for this step anyway):
    # the share's rule applies, 140 ms -> 64 tokens.
    (0.05, 64),
])
def test_a_tpot_objective_is_not_stretched_by_the_prefill_share_while_the_decodes_fit(tpot: float, chunk: int) -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=128, num_gpu_blocks=1024, block_size=16,
                          max_model_len=1024, scheduling_policy="slo", step_cost=Cost(step=0.01, token=0.001),
                          max_step_ms=300.0, min_prefill_share=0.5)
    s, w = Scheduler(cfg), MirrorWorker(16, 1024)
    for i in range(60):
        s.add_request(_req(f"chat{i}", 16, 0.0, tpot=tpot, max_tokens=500))
    _decode_all(s, w)
    assert s.step_objective() == pytest.approx(tpot)
    s.add_request(_req("long", 600, 0.0, max_tokens=5))
    plan = s.schedule(now=0.0)
    assert plan.num_scheduled_tokens["long"] == chunk


@dataclass(frozen=True)
class OverrunCost(Cost):
    """A cost model whose steps run `tail` x over its predictions at the tail."""

    tail: float = 1.0

    def overrun(self) -> float:
        return self.tail


@pytest.mark.parametrize(("tail", "chunk"), [
    # As in the first example: held to 50 ms, 10 + 3 decodes + m <= 50 -> m <= 37: 32 tokens.
    (1.0, 32),
    # Steps run 1.25x over their predictions at the tail: held to 50 / 1.25 = 40 ms,
    # 10 + 3 + m <= 40 -> m <= 27: one block.
    (1.25, 16),
])
def test_a_tpot_objective_is_shortened_by_the_cost_model_s_tail_overrun(tail: float, chunk: int) -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=1024, num_gpu_blocks=256, block_size=16, max_model_len=1024,
                          scheduling_policy="slo", step_cost=OverrunCost(step=0.01, token=0.001, tail=tail),
                          max_step_ms=300.0, min_prefill_share=0.0)
    s, w = Scheduler(cfg), MirrorWorker(16, 256)
    s.add_request(_req("batch", 16, 0.0, max_tokens=500))
    s.add_request(_req("chat", 16, 0.0, tpot=0.05, max_tokens=500))
    s.add_request(_req("chat2", 16, 0.0, tpot=0.2, max_tokens=500))
    _decode_all(s, w)
    assert s.step_objective() == pytest.approx(0.05 / tail)
    s.add_request(_req("long", 600, 0.0, max_tokens=5))
    plan = s.schedule(now=0.0)
    assert plan.num_scheduled_tokens["long"] == chunk


@pytest.mark.parametrize(("policy", "chat", "batch"), [
    # A step held to 50 ms: 10 ms + 1 ms a token. One decode and a 32-token chunk make 43 ms;
    # a second chunk would not fit. Under slo the chat's first chunk goes before the running
    # batch prompt's next one (the queue ranks the chat first: 1 s to its deadline against
    # 60 s); under FCFS the running prefill goes first and the chat waits a step.
    ("slo", 32, 0),
    ("fcfs", 0, 32),
])
def test_under_slo_an_urgent_arrival_s_chunk_goes_before_a_running_prefill_s(policy: str, chat: int, batch: int) -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=1024, num_gpu_blocks=256, block_size=16, max_model_len=1024,
                          scheduling_policy=policy, step_cost=Cost(step=0.01, token=0.001), max_step_ms=50.0,
                          min_prefill_share=0.0)
    s, w = Scheduler(cfg), MirrorWorker(16, 256)
    s.add_request(_req("decode", 16, 0.0, max_tokens=500))
    _decode_all(s, w)
    s.add_request(_req("batch", 600, 0.0, ttft=60.0, max_tokens=5))
    plan = s.schedule(now=0.0)
    assert plan.num_scheduled_tokens["batch"] == 32
    s.update_from_output(plan, w.execute(plan), now=0.0)
    s.add_request(_req("chat", 32, 0.0, ttft=1.0, max_tokens=5))
    plan = s.schedule(now=0.0)
    assert plan.num_scheduled_tokens.get("chat", 0) == chat
    assert plan.num_scheduled_tokens.get("batch", 0) == batch
    assert plan.num_scheduled_tokens["decode"] == 1




def test_under_slo_running_prefills_are_sized_least_slack_first() -> None:
    # The same 50 ms steps: one decode and one 32-token chunk. The batch prompt is admitted
    # first; the chat (64 tokens) after it, with its first chunk. Both are then running
    # prefills, the batch prompt first in the running order; the chat's next chunk goes
    # first, least slack first (1 s to its deadline against 60 s).
    cfg = SchedulerConfig(max_num_batched_tokens=1024, num_gpu_blocks=256, block_size=16, max_model_len=1024,
                          scheduling_policy="slo", step_cost=Cost(step=0.01, token=0.001), max_step_ms=50.0,
                          min_prefill_share=0.0)
    s, w = Scheduler(cfg), MirrorWorker(16, 256)
    s.add_request(_req("decode", 16, 0.0, max_tokens=500))
    _decode_all(s, w)

    def step() -> dict[str, int]:
        plan = s.schedule(now=0.0)
        s.update_from_output(plan, w.execute(plan), now=0.0)
        return plan.num_scheduled_tokens

    s.add_request(_req("batch", 600, 0.0, ttft=60.0, max_tokens=5))
    assert step()["batch"] == 32
    s.add_request(_req("chat", 64, 0.0, ttft=1.0, max_tokens=5))
    assert step().get("chat") == 32  # its first chunk, before the batch prompt's next
    assert [r.request_id for r in s.running] == ["decode", "batch", "chat"]
    assert not len(s.waiting)
    tokens = step()
    assert tokens.get("chat") == 32 and tokens.get("batch", 0) == 0 and tokens["decode"] == 1



@pytest.mark.parametrize(("policy", "chunk"), [
    # Nothing decodes. Under slo the step keeps its 50 ms: 10 ms + 1 ms a token, 40 tokens
    # fit, 32 at a block boundary; an arrival waits at most such a step. Under FCFS a step
    # without decodes takes the whole prompt (600 tokens, 610 ms) for throughput.
    ("slo", 32),
    ("fcfs", 600),
])
def test_under_slo_a_prefill_only_step_keeps_the_step_target(policy: str, chunk: int) -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=1024, num_gpu_blocks=256, block_size=16, max_model_len=1024,
                          scheduling_policy=policy, step_cost=Cost(step=0.01, token=0.001), max_step_ms=50.0,
                          min_prefill_share=0.5)
    s = Scheduler(cfg)
    s.add_request(_req("batch", 600, 0.0, ttft=60.0, max_tokens=5))
    plan = s.schedule(now=0.0)
    assert plan.num_scheduled_tokens["batch"] == chunk


def _step(s: Scheduler, w: MirrorWorker) -> set[str]:
    plan = s.schedule(now=0.0)
    s.update_from_output(plan, w.execute(plan), now=0.0)
    return set(plan.num_scheduled_tokens)


@dataclass(frozen=True)
class DecodeCost:
    """Seconds: `step` per step, `decode` per decode, `token` per prefill token."""

    step: float = 0.01
    decode: float = 0.01
    token: float = 0.0005

    def __call__(self, b: BatchShape) -> float:
        return self.step + self.decode * b.num_decode_tokens + self.token * b.num_prefill_tokens


@pytest.mark.parametrize(("policy", "tpot2", "per_step", "with_prompt", "chunk"), [
    # 10 ms a step + 10 ms a decode, held to the chat's 50 ms. The chat and a stream with a
    # 90 ms objective (under twice 50: a skipped step would miss it) decode every step:
    # 30 ms. The batch decodes (no TPOT objective) join while the step stays within 50 ms:
    # two a step, longest idle first, so each of the six decodes every third step. With a
    # prompt waiting they leave room for its guaranteed block (16 x 0.5 ms = 8 ms: 42 ms):
    # one joins (the first always does), and the prompt's chunk fills the rest to 50 ms,
    # 20 tokens cut to the block boundary: 16.
    ("slo", 0.09, 2, 1, 16),
    # A 100 ms objective meets a gap of two 50 ms steps: that stream takes turns too, and
    # three of the seven join each step (two with the prompt waiting).
    ("slo", 0.1, 3, 2, 16),
    # Under FCFS every running request decodes in every step (90 ms), and the prompt's
    # chunk fills the 300 ms target: 420 tokens cut to the block boundary: 416.
    ("fcfs", 0.09, 6, 6, 416),
])
def test_under_slo_decodes_without_a_tight_objective_take_turns_in_a_held_step(
        policy: str, tpot2: float, per_step: int, with_prompt: int, chunk: int) -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=1024, num_gpu_blocks=256, block_size=16, max_model_len=1024,
                          scheduling_policy=policy, step_cost=DecodeCost(), max_step_ms=300.0,
                          min_prefill_share=0.5)
    s, w = Scheduler(cfg), MirrorWorker(16, 256)
    s.add_request(_req("chat", 16, 0.0, tpot=0.05, max_tokens=500))
    s.add_request(_req("chat2", 16, 0.0, tpot=tpot2, max_tokens=500))
    batch = {f"batch{i}" for i in range(6)}
    for rid in sorted(batch):
        s.add_request(_req(rid, 16, 0.0, max_tokens=500))
    _decode_all(s, w)
    loose = batch | ({"chat2"} if policy == "slo" and tpot2 >= 0.1 else set())
    steps = [_step(s, w) for _ in range(6)]
    for step in steps:
        assert {"chat", "chat2"} - loose <= step  # the tight ones never sit out
        assert len(step & loose) == per_step
    turns = -(-len(loose) // per_step)  # steps until every loose decode has had its turn
    assert set().union(*steps[:turns]) >= loose
    s.add_request(_req("long", 600, 0.0, max_tokens=5))
    plan = s.schedule(now=0.0)
    assert len(set(plan.num_scheduled_tokens) & loose) == with_prompt
    assert plan.num_scheduled_tokens["long"] == chunk


def test_under_fcfs_the_target_stays_the_configured_one() -> None:
    cfg = SchedulerConfig(num_gpu_blocks=64, block_size=16, max_model_len=512, step_cost=Cost(), max_step_ms=300.0)
    s, w = Scheduler(cfg), MirrorWorker(16, 64)
    s.add_request(_req("chat", 16, 0.0, tpot=0.05))
    _decode_all(s, w)
    assert s.step_target() == pytest.approx(0.3)


# ---- victims: the most slack gives way -------------------------------------------------

def test_the_request_with_the_most_slack_is_preempted() -> None:
    # 12 blocks of 4 tokens; three requests growing to 11 blocks each run out of them. Slack
    # at t=1: chat (tpot 0.1) has its next token due at 1.0 + 0.1 * outputs; batch has no
    # objective (infinite slack); the oldest is never a victim under slack.
    cfg = SchedulerConfig(max_num_batched_tokens=64, num_gpu_blocks=12, block_size=4, max_model_len=64,
                          scheduling_policy="slo", step_cost=Cost(), max_step_ms=0.0)
    s, w = Scheduler(cfg), MirrorWorker(4, 12)
    s.add_request(_req("old", 4, 0.0, tpot=0.1, max_tokens=40))
    s.add_request(_req("batch", 4, 0.0, max_tokens=40))
    s.add_request(_req("chat", 4, 0.0, tpot=0.1, max_tokens=40))
    victims = []
    while not victims:
        plan = s.schedule(now=1.0)
        victims += list(s.last_preemptions)
        s.update_from_output(plan, w.execute(plan), now=1.0)
    assert victims and victims[0].victim == "batch"


# ---- the forecast and the admission check ----------------------------------------------

def test_the_first_token_forecast_adds_the_work_ahead_in_steps() -> None:
    # 10 ms a step + 1 ms a token, a 256-token budget, nothing running.
    cfg = SchedulerConfig(max_num_batched_tokens=256, num_gpu_blocks=256, block_size=16, max_model_len=1024,
                          step_cost=Cost(step=0.01, token=0.001), reject_unmeetable=True)
    s = Scheduler(cfg)
    alone = _req("alone", 100, 0.0, ttft=1.0)
    # one step of 100 tokens (0.11 s); nothing runs, so no plan is in flight ahead of it
    assert s.admission_check(alone, now=0.0) is None
    assert alone.predicted_ttft == pytest.approx(0.11)
    s.add_request(_req("ahead", 300, 0.0))
    late = _req("late", 100, 0.0, ttft=0.2)
    # 400 tokens: a full step of 256 (0.266 s) and one of 144 (0.154 s)
    wait = s.admission_check(late, now=0.0)
    assert late.predicted_ttft == pytest.approx(0.266 + 0.154)
    assert wait == pytest.approx(0.42 - 0.2)
    assert late.request_id not in s.requests  # the check changes nothing


def test_the_forecast_counts_the_decodes_that_join_a_held_step() -> None:
    # As in the take-turns example: 10 ms a step + 10 ms a decode + 0.5 ms a prefill token,
    # held to the chat's 50 ms. Of the six batch decodes, those that fit 50 ms less the
    # waiting prompt's block (8 ms) join: two (30, 40 ms; a third would make 50). A step is
    # then 40 ms of decodes + a 20-token chunk (10 ms). A 64-token prompt: three such steps
    # and one of 40 + 4 x 0.5 ms, after the plan in flight (the seven prompts: 10 + 112 x
    # 0.5 ms; none before it): 3 x 0.05 + 0.042 + 0.066 = 0.258 s. (Counting all seven
    # decodes, 80 ms, the share's rule would stretch the step to 160 ms: one step of 112 ms.)
    cfg = SchedulerConfig(max_num_batched_tokens=1024, num_gpu_blocks=256, block_size=16, max_model_len=1024,
                          scheduling_policy="slo", step_cost=DecodeCost(), max_step_ms=300.0,
                          min_prefill_share=0.5)
    s, w = Scheduler(cfg), MirrorWorker(16, 256)
    s.add_request(_req("chat", 16, 0.0, tpot=0.05, max_tokens=500))
    for i in range(6):
        s.add_request(_req(f"batch{i}", 16, 0.0, max_tokens=500))
    _decode_all(s, w)
    assert forecast_first_token(s, _req("new", 64, 0.0, ttft=1.0), 0.0) == pytest.approx(0.258)


def test_the_forecast_prices_prompts_past_their_cached_prefix() -> None:
    # 10 ms a step + 1 ms a token, a 256-token budget, 16-token blocks, nothing running.
    cfg = SchedulerConfig(max_num_batched_tokens=256, num_gpu_blocks=256, block_size=16, max_model_len=1024,
                          step_cost=Cost(step=0.01, token=0.001))
    s, w = Scheduler(cfg), MirrorWorker(16, 256)
    shared = [200 + i for i in range(320)]
    s.add_request(make_request("warm", 0, 1, prompt=shared))
    while s.has_unfinished_requests():  # its 20 full blocks stay cached once it is done
        plan = s.schedule(now=0.0)
        s.update_from_output(plan, w.execute(plan), now=0.0)
    s.add_request(make_request("ahead", 0, 8, prompt=[*shared, *range(600, 616)]))  # 16 to compute
    # the waiting request ahead computes 16 tokens, not 336: one step of 16 + 100 (0.126 s),
    # where 436 tokens would take a full step and one of 180 (0.456 s)
    assert forecast_first_token(s, make_request("other", 100, 8), now=0.0) == pytest.approx(0.01 + 0.116)
    # and an arrival that shares the prefix computes its own 32 tokens past it: 16 + 32
    assert forecast_first_token(s, make_request("turn", 0, 8, prompt=[*shared, *range(700, 732)]), now=0.0) \
        == pytest.approx(0.01 + 0.048)
    # a request asking for its prompt's logprobs takes no hit, so its forecast has none either
    whole = make_request("logprobs", 0, 8, prompt=[*shared, *range(700, 732)], prompt_logprobs=0)
    assert forecast_first_token(s, whole, now=0.0) == pytest.approx(0.266 + 0.01 + 0.112)


@pytest.mark.parametrize(("demotion_s", "first_token"), [(10.0, 0.266 * 3), (0.0, 0.266 * 3 + 0.074)])
def test_the_forecast_leaves_out_a_request_ahead_whose_deadline_is_lost_before_its_turn(
        demotion_s: float, first_token: float) -> None:
    # 10 ms a step + 1 ms a token (a prefill of n tokens: n ms), a 256-token budget.
    # Keys (latest starts): "long" 512 tokens due at 1.0 s: 0.488; "tight" 256 due at 0.77:
    # 0.514; the probe, 64 due at 2.0: 1.936. "long" takes two full steps (0.266 s each),
    # so at 0.532 "tight" has lost its deadline: demoted to 0.514 + demotion_s. With 10 s
    # that is behind the probe, whose 64 tokens go first in the third step, filled up with
    # 192 of "tight"'s (0.266 s): first token at 0.798. Without demotion "tight" keeps its
    # place: a third full step, then the probe's own (0.074 s).
    cfg = SchedulerConfig(max_num_batched_tokens=256, num_gpu_blocks=256, block_size=16, max_model_len=1024,
                          scheduling_policy="slo", slo_demotion_s=demotion_s, max_step_ms=0.0,
                          step_cost=Cost(step=0.01, token=0.001), reject_unmeetable=True)
    s, w = Scheduler(cfg), MirrorWorker(16, 256)
    s.add_request(_req("long", 512, 0.0, ttft=1.0, max_tokens=1))
    s.add_request(_req("tight", 256, 0.0, ttft=0.77, max_tokens=1))
    probe = _req("probe", 64, 0.0, ttft=2.0, max_tokens=2)
    assert s.admission_check(probe, now=0.0) is None
    assert probe.predicted_ttft == pytest.approx(first_token)
    # and so it runs, each step taking the time the cost model says
    s.add_request(probe)
    now = 0.0
    while probe.metrics.first_token_time is None:
        plan = s.schedule(now=now)
        now += cfg.step_cost.step + cfg.step_cost.token * sum(plan.num_scheduled_tokens.values())
        s.update_from_output(plan, w.execute(plan), now=now)
    assert probe.metrics.first_token_time == pytest.approx(first_token)


def _one_seat(max_tokens: int) -> tuple[Scheduler, MirrorWorker]:
    """One seat, held by "running" (16 tokens, predicted `max_tokens` outputs) after its
    prompt's step; 10 ms a step + 1 ms a token, 64 tokens a step, the check on."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, num_gpu_blocks=256, block_size=16,
                          max_model_len=1024, step_cost=Cost(step=0.01, token=0.001), output_len_predictor="max_tokens",
                          reject_unmeetable=True, max_step_ms=0.0)
    s, w = Scheduler(cfg), MirrorWorker(16, 256)
    s.add_request(_req("running", 16, 0.0, max_tokens=max_tokens))
    _decode_all(s, w)
    return s, w


def test_a_full_batch_waits_for_the_first_running_request_to_finish() -> None:
    # one seat; the running request has 20 predicted outputs to go at 11 ms a decode step
    # (10 ms + 1 ms for its token... plus the chunk the backlog's steps carry).
    s, _ = _one_seat(21)
    probe = _req("probe", 32, 0.0, ttft=0.1)
    wait = s.admission_check(probe, now=0.0)
    # running: 20 outputs left, each a decode-only step (nothing new can prefill without a
    # seat): 0.011 s; then its own prefill, priced with the decodes as they run now
    decode = 0.01 + 0.001
    own = 0.01 + 0.001 * (1 + 32)
    # the plans in flight ahead of it: the last, the running request's prompt (as the
    # engine keeps it queued behind the one executing, none here)
    in_flight = 0.01 + 0.001 * 16
    assert probe.predicted_ttft == pytest.approx(20 * decode + own + in_flight)
    assert wait == pytest.approx(probe.predicted_ttft - 0.1)


def test_the_plans_in_flight_are_priced_as_planned() -> None:
    # One seat, held by "running"; a 500-token backlog waits for it. The engine keeps two
    # plans in flight: the one executing (half done on average) and the one queued behind
    # it, here the running request's prompt (16 tokens: 26 ms) and its first decode (11
    # ms). Pricing them as steps carrying a chunk of the backlog (74 ms each) would add
    # 87 ms: the backlog has no seat, and the plans hold none of it.
    s, w = _one_seat(11)
    plan = s.schedule(now=0.0)
    s.update_from_output(plan, w.execute(plan), now=0.0)
    s.add_request(_req("backlog", 500, 0.0, max_tokens=5))
    probe = _req("probe", 32, 0.0, ttft=1.0)
    s.admission_check(probe, now=0.0)
    # the prefill ahead and its own, 532 tokens in chunks of 63 beside the decode: eight
    # of 74 ms and one of 28 tokens (39 ms); then the plans in flight
    in_flight = 0.5 * (0.01 + 0.001 * 16) + (0.01 + 0.001)
    assert probe.predicted_ttft == pytest.approx(8 * 0.074 + 0.039 + in_flight)


def test_a_request_admitted_ahead_holds_its_seat_until_its_predicted_outputs_are_done() -> None:
    # one seat: "running" has 10 predicted outputs to go, "ahead" waits with 5 to make
    s, _ = _one_seat(11)
    s.add_request(_req("ahead", 16, 0.0, max_tokens=5))
    probe = _req("probe", 32, 0.0, ttft=0.1)
    s.admission_check(probe, now=0.0)
    # the seat frees after 10 decode steps (11 ms each); "ahead" takes it for its 5 outputs;
    # then the probe's prefill (with the decode as it runs now), after the plan in flight
    decode = 0.01 + 0.001
    own = 0.01 + 0.001 * (1 + 32)
    in_flight = 0.01 + 0.001 * 16
    assert probe.predicted_ttft == pytest.approx((10 + 5) * decode + own + in_flight)


@pytest.mark.parametrize(("victim", "waits"), [("slack", False), ("newest", True)])
def test_under_the_slack_victim_policy_a_request_does_not_wait_for_blocks_that_would_yield(victim: str, waits: bool) -> None:
    # 30 blocks of 16: "old" (TPOT objective, the oldest: never a victim) holds 1, "batch"
    # (no objective: infinite slack) 16, 13 are free. A probe of 256 tokens needs 16.
    cfg = SchedulerConfig(max_num_batched_tokens=512, num_gpu_blocks=30, block_size=16, max_model_len=1024,
                          scheduling_policy="slo", victim_policy=victim, step_cost=Cost(step=0.01, token=0.001),
                          output_len_predictor="max_tokens", max_step_ms=0.0, reject_unmeetable=True)
    s, w = Scheduler(cfg), MirrorWorker(16, 30)
    s.add_request(_req("old", 16, 0.0, tpot=0.1, max_tokens=100))
    s.add_request(_req("batch", 256, 0.0, max_tokens=200))
    _decode_all(s, w)
    assert s.num_free_blocks == 13
    probe = _req("probe", 256, 0.0, ttft=1.0)
    s.admission_check(probe, now=0.0)
    decode = 0.01 + 0.001 * 2  # the two running decodes alone
    own = 0.01 + 0.001 * (2 + 256)  # its prefill riding with them
    in_flight = 0.01 + 0.001 * (16 + 256)  # the plan in flight: the two prompts
    if waits:  # newest: "old" finishes first (99 outputs to go) but frees too few; then batch's 199
        assert probe.predicted_ttft == pytest.approx(199 * decode + own + in_flight)
    else:  # slack: batch would be preempted for it (more slack than its 1 s less its prefill)
        assert probe.predicted_ttft == pytest.approx(own + in_flight)


def test_without_reject_unmeetable_nothing_is_refused() -> None:
    s = Scheduler(SchedulerConfig(step_cost=Cost(), num_gpu_blocks=64, block_size=16, max_model_len=512))
    assert s.admission_check(_req("x", 400, 0.0, ttft=0.001), now=0.0) is None


def test_reject_unmeetable_needs_a_cost_model() -> None:
    with pytest.raises(ValueError, match="reject_unmeetable"):
        SchedulerConfig(reject_unmeetable=True)


def test_a_full_queue_predicts_when_it_has_room() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=256, num_gpu_blocks=256, block_size=16, max_model_len=1024,
                          step_cost=Cost(step=0.01, token=0.001))
    s = Scheduler(cfg)
    for i in range(3):
        s.add_request(_req(f"w{i}", 200, float(i)))
    # the first two leave after 400 tokens: two steps (nothing runs: nothing in flight), the
    # second's 144 filled up to 256 with the third's first chunk: 0.266 + 0.266 s
    assert s.admission_wait(2, now=0.0) == pytest.approx(0.266 + 0.266)
    assert Scheduler(SchedulerConfig()).admission_wait(1, now=0.0) is None
    assert math.isfinite(s.admission_wait(3, now=0.0) or math.inf)
