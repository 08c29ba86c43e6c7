"""Objectives in the simulator and the policy lab: per-request objectives from a trace reach
the scheduler's requests, attainment and forecasts are judged by `scheduler.slo` on runs
small enough to check by hand, refused clients retry and give up as counted, a refusal's
re-simulation leaves the run alone, and the two-class trace has the shape it claims."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from loadgen.sim.cli import main as simulate
from loadgen.sim.cost_model import BatchShape, CostModel, get_hardware, get_model_shape
from loadgen.sim.policy_lab import trace_pairs
from loadgen.sim.policy_traces import (
    BATCH_OUTPUT,
    BATCH_PROMPT,
    INTERACTIVE_OUTPUT,
    INTERACTIVE_PROMPT,
    TWO_CLASS_LOADS,
    at_rate,
    build_trace,
    decode_context,
    interactive_tpot_ms,
    two_class_slo_classes,
    two_class_workload,
)
from loadgen.sim.simulator import SimLimits, Simulator, retry_after_header, scheduler_request
from loadgen.sim.slo_metrics import slo_summary
from loadgen.workloads import WorkloadRequest, from_jsonl
from scheduler.config import SchedulerConfig
from scheduler.slo import NO_SLO, SLO, SLOClasses, parse_slo


@dataclass(frozen=True)
class StepCost:
    """Seconds a step takes: `step` plus `token` per computed token (the simulator's clock
    and, where given, the scheduler's step-cost model)."""

    step: float = 0.01
    token: float = 0.001

    def step_time(self, b: BatchShape) -> float:
        return self.step + self.token * b.num_tokens

    def __call__(self, b: BatchShape) -> float:
        return self.step_time(b)


def _run(config: SchedulerConfig, workload: list[WorkloadRequest], **kw: object) -> Simulator:
    return Simulator(config, StepCost(), overlap=False, check_integrity=True, **kw)  # type: ignore[arg-type]


# ---- objectives from the trace ---------------------------------------------------------------

def test_jsonl_objectives_and_user_reach_the_scheduler_s_requests(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    lines = [
        {"prompt_token_ids": [5] * 12, "output_len": 4, "slo_ttft_ms": 500, "slo_tpot_ms": 40, "user": "chat"},
        {"prompt_token_ids": [6] * 12, "output_len": 4, "slo_ttft_ms": 60000, "user": "batch"},
        {"prompt_token_ids": [7] * 12, "output_len": 4, "slo_tpot_ms": None},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    wl = from_jsonl(path)
    assert [(w.slo_ttft_ms, w.slo_tpot_ms, w.user) for w in wl] == [
        (500.0, 40.0, "chat"), (60000.0, None, "batch"), (None, None, None)]
    assert scheduler_request(wl[0]).slo == SLO(0.5, 0.04)
    assert scheduler_request(wl[1]).slo == SLO(60.0, None)
    assert scheduler_request(wl[2]).slo == NO_SLO
    # the server's default fills what a request leaves open; the class says where they came from
    config = SchedulerConfig(max_model_len=64, num_gpu_blocks=64, scheduling_policy="slo",
                             slo_classes=SLOClasses(parse_slo("ttft=2000,tpot=100")))
    result = _run(config, wl).run(wl)
    assert {s.request_id: s.slo for s in result.request_stats} == {
        "req-0": SLO(0.5, 0.04, "request"), "req-1": SLO(60.0, 0.1, "request"),
        "req-2": SLO(2.0, 0.1, "default")}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi", "slo_ttft_ms": -3}))
    with pytest.raises(ValueError, match="slo_ttft_ms"):
        from_jsonl(bad)


def test_simulate_reports_objectives_per_class(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_token_ids": [3] * 20, "output_len": 8, "user": u})
                              for u in ("chat", "batch", "chat")))
    code = simulate(["--dataset", "jsonl", "--dataset-path", str(path), "--num-prompts", "3", "--scheduling-policy", "slo",
                     "--slo-class", "user:chat=ttft=1000,tpot=50", "--slo-class", "user:batch=ttft=60000",
                     "--json"])
    assert code == 0
    slo = json.loads(capsys.readouterr().out)["slo"]
    assert set(slo["classes"]) == {"user:chat", "user:batch"}
    assert slo["classes"]["user:chat"]["requests"] == 2 and slo["classes"]["user:chat"]["tpot_slo_ms"] == 50
    assert slo["attainment"] == 1.0 and slo["ttft_forecast"]["scored"] == 3


# ---- attainment by hand --------------------------------------------------------------------------

def test_attainment_per_objective_and_class_on_a_hand_checked_run() -> None:
    """10 ms a step + 1 ms a token, one plan at a time. Step 1 at t=0 prefills A (10), B (20)
    and C (10): 50 ms, so every first token comes at t=0.05 and C (one output) is done.
    A and B decode at 12 ms a step: second tokens at 0.062, third (last) at 0.074.
    A: TTFT 0.05 <= 0.06, TPOT (0.074 - 0.05) / 2 = 0.012 <= 0.02: met.
    B: TTFT 0.05 > 0.02: missed (no TPOT objective). C: no objectives, finished: met."""
    wl = [WorkloadRequest("A", 0.0, 10, 3, slo_ttft_ms=60, slo_tpot_ms=20),
          WorkloadRequest("B", 0.0, 20, 3, slo_ttft_ms=20),
          WorkloadRequest("C", 0.0, 10, 1)]
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, num_gpu_blocks=64, max_step_ms=0.0)
    result = _run(config, wl).run(wl)
    assert result.duration == pytest.approx(0.074)
    s = slo_summary(result)
    assert (s["requests"], s["met"]) == (3, 2)
    assert s["attainment"] == pytest.approx(2 / 3)
    assert s["goodput"] == pytest.approx(2 / 0.074)
    assert s["ttft_attainment"] == 0.5 and s["tpot_attainment"] == 1.0  # over A and B; over A
    assert s["classes"]["request"]["attainment"] == 0.5
    assert s["classes"]["default"]["attainment"] == 1.0
    assert s["classes"]["request"]["ttft_p99_ms"] == pytest.approx(50)
    assert s["ttft_forecast"]["scored"] == 0  # no step-cost model: nothing was forecast


def test_an_unfinished_request_has_missed_its_objectives() -> None:
    wl = [WorkloadRequest("A", 0.0, 10, 50, slo_tpot_ms=1000), WorkloadRequest("B", 0.0, 10, 2)]
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, num_gpu_blocks=64, max_step_ms=0.0)
    s = slo_summary(Simulator(config, StepCost(), SimLimits(max_steps=5), overlap=False).run(wl))  # type: ignore[arg-type]
    assert (s["requests"], s["met"], s["tpot_attainment"]) == (2, 1, 0.0)


# ---- refusals and retries -------------------------------------------------------------------------

def _one_seat(step_cost: StepCost | None = None) -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, max_model_len=512, num_gpu_blocks=64,
                           max_step_ms=0.0, step_cost=step_cost or StepCost(), reject_unmeetable=True,
                           output_len_predictor="max_tokens")


def _seat_holder() -> list[WorkloadRequest]:
    # R holds the only seat for 1 + 199 steps (~2.2 s); Q wants its first token within 0.5 s
    return [WorkloadRequest("R", 0.0, 16, 200), WorkloadRequest("Q", 0.1, 16, 4, slo_ttft_ms=500)]


def test_a_refused_client_retries_after_the_whole_second_retry_after() -> None:
    wl = _seat_holder()
    result = _run(_one_seat(), wl).run(wl)
    refusals = [r for r in result.refusals if r.request_id == "Q"]
    assert refusals, "Q cannot get R's seat within 0.5 s"
    first = refusals[0]
    assert (first.attempt, first.time, first.retried) == (0, 0.1, True)
    assert first.retry_after > 0 and first.retry_after_header == retry_after_header(first.retry_after)
    assert first.predicted_ttft == pytest.approx(first.retry_after + 0.5)
    # each retry comes the header's whole seconds after the refusal before it
    for before, after in zip(refusals, refusals[1:], strict=False):
        assert after.time == pytest.approx(before.time + before.retry_after_header)
        assert after.attempt == before.attempt + 1
    q = next(s for s in result.request_stats if s.request_id == "Q")
    assert q.retries == len(refusals) and q.sent == 0.1
    assert q.arrival_time == pytest.approx(refusals[-1].time + refusals[-1].retry_after_header)
    s = slo_summary(result)
    assert (s["refusals"], s["refused_requests"], s["gave_up"], s["admitted_after_retry"]) == (len(refusals), 1, 0, 1)
    assert s["classes"]["request"]["attainment"] == 0.0  # judged from the first send: > 2 s
    assert s["retry_met_ttft"] == 1.0  # the admitted retry met 0.5 s from its own arrival
    assert not result.unfinished


def test_a_client_out_of_retries_gives_up_and_is_a_failed_request() -> None:
    wl = _seat_holder()
    result = _run(_one_seat(), wl, max_retries=0).run(wl)
    assert [(r.request_id, r.retried) for r in result.refusals] == [("Q", False)]
    assert set(result.gave_up) == {"Q"} and result.gave_up["Q"].slo.ttft_s == 0.5
    rec = next(r for r in result.records if r.request_id == "Q")
    assert not rec.success and rec.error.startswith("refused")
    assert not result.unfinished  # the run served everything it admitted
    s = slo_summary(result)
    assert (s["requests"], s["met"], s["gave_up"]) == (2, 1, 1)


def test_the_re_simulated_wait_matches_the_seat_s_release_and_leaves_the_run_alone() -> None:
    """Q (16 tokens, TTFT 0.5 s) can start once R's seat is free: R finishes at f, Q's
    prefill step then takes 10 + 16 ms, so Q sent at 0.1 + d meets its objective iff
    f + 0.026 <= 0.1 + d + 0.5: the wait that would have sufficed is f - 0.574, up to the
    bisection's resolution (half of 5% of the wait, ~40 ms here)."""
    wl = _seat_holder()
    plain = _run(_one_seat(), wl).run(wl)
    probed = _run(_one_seat(), wl, retry_after_every=0.0).run(wl)
    strip = [(r.request_id, r.attempt, r.time, r.retry_after) for r in plain.refusals]
    assert [(r.request_id, r.attempt, r.time, r.retry_after) for r in probed.refusals] == strip
    assert [(r.request_id, r.ttft, r.e2el) for r in probed.records] == [(r.request_id, r.ttft, r.e2el) for r in plain.records]
    finish = next(s.finished_time for s in plain.request_stats if s.request_id == "R")
    assert finish is not None
    first = probed.refusals[0]
    assert first.actual_wait is not None
    assert first.actual_wait == pytest.approx(finish - 0.574, abs=0.025 * first.actual_wait + 0.01)
    err = slo_summary(probed)["retry_after"]
    assert err["measured"] == len(probed.refusals) and err["median_rel_error"] is not None


def test_a_refusal_that_was_not_needed_counts_as_such() -> None:
    """A forecast that says no when the request would have made it: actual wait 0."""
    wl = [WorkloadRequest("A", 0.0, 16, 4, slo_ttft_ms=500)]

    class Pessimist(StepCost):
        def __call__(self, b: BatchShape) -> float:
            return 10.0  # the scheduler thinks every step takes 10 s

    config = _one_seat(step_cost=Pessimist())
    result = Simulator(config, StepCost(), overlap=False, max_retries=0,  # type: ignore[arg-type]
                       retry_after_every=0.0).run(wl)
    assert [r.actual_wait for r in result.refusals] == [0.0]
    ra = slo_summary(result)["retry_after"]
    assert ra["unneeded"] == 1 and ra["median_rel_error"] == math.inf


# ---- the two-class trace ---------------------------------------------------------------------------

def test_the_two_class_mix_has_the_classes_it_claims() -> None:
    wl = two_class_workload(4000, 10.0)
    interactive = [w for w in wl if w.user == "interactive"]
    batch = [w for w in wl if w.user == "batch"]
    assert len(interactive) + len(batch) == len(wl)
    assert abs(len(interactive) / len(wl) - 0.8) < 0.02
    assert all(INTERACTIVE_PROMPT[0] <= w.prompt_len <= INTERACTIVE_PROMPT[1]
               and INTERACTIVE_OUTPUT[0] <= w.output_len <= INTERACTIVE_OUTPUT[1] for w in interactive)
    assert all(BATCH_PROMPT[0] <= w.prompt_len <= BATCH_PROMPT[1]
               and BATCH_OUTPUT[0] <= w.output_len <= BATCH_OUTPUT[1] for w in batch)
    assert abs(wl[-1].arrival_time - len(wl) / 10.0) < 0.05 * len(wl) / 10.0  # Poisson at 10 req/s
    # the same requests at twice the rate
    fast = at_rate(wl, 2.0)
    assert [(w.prompt_len, w.output_len, w.user) for w in fast] == [(w.prompt_len, w.output_len, w.user) for w in wl]
    assert fast[-1].arrival_time == pytest.approx(wl[-1].arrival_time / 2)
    # the classes as the server resolves them
    classes = SLOClasses(parse_slo("ttft=2000,tpot=100"), tuple(e for c in two_class_slo_classes(35) for e in c))
    assert classes.resolve(NO_SLO, "interactive", 0) == SLO(1.0, 0.035, "user:interactive")
    assert classes.resolve(NO_SLO, "batch", 0) == SLO(60.0, None, "user:batch")


def test_the_interactive_tpot_objective_is_1_5x_a_full_batch_decode_step() -> None:
    # decode-weighted context: interactive 0.8 x 144 outputs at 288 + E[o^2]/2E[o] (86.5),
    # batch 0.2 x 640 outputs at 2560 + 358.4
    o_i2 = 144**2 + (225**2 - 1) / 12
    o_b2 = 640**2 + (769**2 - 1) / 12
    expect = (0.8 * 144 * (288 + o_i2 / 288) + 0.2 * 640 * (2560 + o_b2 / 1280)) / (0.8 * 144 + 0.2 * 640)
    assert decode_context() == pytest.approx(expect)
    cm = CostModel(get_model_shape("llama-3.1-8b"), get_hardware("a100"), 16)
    full = BatchShape()
    full.add(1, round(expect), count=128)
    assert interactive_tpot_ms(cm, 128) == 5 * round(1.5 * cm.step_time(full) * 1e3 / 5) == 35


def test_the_two_class_trace_loads_the_same_requests_and_runs_its_pairs() -> None:
    trace = build_trace("two-class", scale=0.02)
    cap = trace.capacity["two-class"]
    assert [p.label for p in trace.points] == list(TWO_CLASS_LOADS)
    assert [p.args.request_rate for p in trace.points] == [pytest.approx(float(x) * cap) for x in TWO_CLASS_LOADS]
    shapes = {tuple((w.prompt_len, w.output_len, w.user) for w in p.workload) for p in trace.points}
    assert len(shapes) == 1
    queues = ["fcfs", "slo", "fcfs-reject"]
    assert trace_pairs(trace, queues, ["newest"]) == [("fcfs", "newest"), ("slo", "slack")]
    # the refusing variants run at 1.5x only
    at = {p.label: trace_pairs(trace, queues, ["newest"], p) for p in trace.points}
    assert at["1.5"] == [("fcfs", "newest"), ("slo", "slack"), ("fcfs-reject", "newest")]
    assert all(pairs == at["0.6"] for label, pairs in at.items() if label != "1.5")
    below = build_trace("below-capacity", scale=0.02)
    assert {p.label.split("@")[0] for p in below.points} == set(below.capacity)
    assert {p.label.split("@")[1] for p in below.points} == {"0.6", "0.7", "0.8", "0.9"}


def test_the_report_judges_the_two_class_targets() -> None:
    from loadgen.sim.policy_report import _below_target, _two_class_target

    def row(queue: str, point: str, met: float, i_p99: float, b_tok: float, **extra: object) -> dict[str, object]:
        cls = {"attainment": met, "tpot_p99_ms": i_p99, "tpot_slo_ms": 35.0, "tpot_attainment": met,
               "longest_wait_s": 1.0, "tok_s": 1000.0, "out_tok_s_arriving": 100.0}
        batch = {**cls, "tok_s": b_tok, "attainment": 1.0}
        return {"trace": "two-class", "point": point, "queue": queue, "victim": "newest", "mode": "recompute",
                "slo_attainment": met, "unfinished": 0, "classes": {"user:interactive": cls, "user:batch": batch},
                "passing_margin_s": -10.0, "passing_bound_s": 0.2, **extra}

    rows = [row("fcfs", "1.2", 0.4, 45.0, 1000.0), row("slo", "1.2", 0.9, 39.0, 950.0),
            row("slo", "1.5", 0.95, 39.0, 900.0), row("slo-reject", "1.5", 0.95, 39.0, 900.0),
            row("fcfs", "1.5", 0.3, 45.0, 1000.0),
            row("fcfs-reject", "1.5", 0.28, 60.0, 1100.0, refusals=10, refused_requests=4, gave_up=1,
                retry_met_ttft=0.5, retry_after_measured=4, retry_after_error=0.25, retry_after_unneeded=1,
                retry_after_beyond=0, retry_after_error_when_needed=0.2, retry_after_signed_error_when_needed=-0.2,
                retry_after_median_s=1.0, actual_wait_median_s=1.2)]
    text = "\n".join(_two_class_target(rows, "recompute"))
    assert "40.0% -> 90.0% (2.25x, target >= 1.5x: met)" in text
    assert "45.0 -> 39.0 ms against its 35 ms objective (MISSED" in text
    assert "(0.95x, target >= 0.9x: met)" in text
    assert "starvation: NONE" in text
    assert "at 1.5x, slo:** refused nothing" in text
    assert "median relative error 25.0% (target <= 30%: met)" in text
    below = [{"trace": "below-capacity", "point": "mix@0.6", "queue": q, "victim": v, "mode": "recompute",
              "slo_attainment": a} for q, v, a in (("fcfs", "newest", 0.99), ("slo", "slack", 0.98))]
    assert "slo is worse than FCFS at 1 of 1 points (the largest shortfall: mix@0.6, -0.010)" in "\n".join(
        _below_target(below, "recompute"))
