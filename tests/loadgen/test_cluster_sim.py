"""The simulated cluster (`loadgen/sim/cluster.py`) and its routers (`loadgen/sim/routers.py`):
worked examples of each policy's choice, a run's bookkeeping, and the command end to end."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loadgen.sim import cluster_lab, routers
from loadgen.sim.cli import main as simulate
from loadgen.sim.routers import (
    ROUTERS,
    CacheAware,
    LeastLoad,
    PowerOfTwo,
    PredictedTTFT,
    PrefixHash,
    RoundRobin,
    cached_prefix_tokens,
    forecast_ttft,
)
from scheduler.config import SchedulerConfig
from scheduler.output import ModelRunnerOutput
from scheduler.request import Request
from scheduler.sampling import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.step_cost import BatchShape


def cost(batch: BatchShape) -> float:
    """2 ms a step and 10 us a token: a 1,000-token prefill costs 12 ms."""
    return 0.002 + 1e-5 * batch.num_tokens


@dataclass
class FakeReplica:
    sched: Scheduler = field(default_factory=lambda: Scheduler(
        SchedulerConfig(max_model_len=4096, num_gpu_blocks=512, step_cost=cost)))
    processed: int = 0


def request(rid: str, tokens: list[int], max_tokens: int = 8, at: float = 0.0) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), at)


def queue(replica: FakeReplica, count: int, prompt_len: int = 100, tag: str = "q") -> None:
    """`count` waiting requests of distinct `prompt_len`-token prompts."""
    for i in range(count):
        replica.sched.add_request(request(f"{tag}{id(replica)}-{i}", [1000 + i] * prompt_len))
        replica.processed += 1


def route(router: object, replicas: list[FakeReplica], req: Request, now: float = 0.0) -> int:
    """What the cluster does with a routed request: choose, then queue it there."""
    k = router.choose(req, replicas, now)  # type: ignore[attr-defined]
    replicas[k].sched.add_request(req)
    replicas[k].processed += 1
    return k


def test_round_robin_takes_replicas_in_turn() -> None:
    replicas = [FakeReplica() for _ in range(3)]
    rr = RoundRobin()
    picks = [route(rr, replicas, request(f"r{i}", [i + 5] * 10)) for i in range(7)]
    assert picks == [0, 1, 2, 0, 1, 2, 0]


def test_least_load_and_power_of_two_pick_the_less_loaded() -> None:
    replicas = [FakeReplica(), FakeReplica(), FakeReplica()]
    queue(replicas[0], 3)
    queue(replicas[1], 1)
    queue(replicas[2], 2)
    assert LeastLoad().choose(request("x", [7] * 10), replicas, 0.0) == 1
    # two replicas: power of two always samples both, so it must take the lighter one
    pair = replicas[:2]
    p2 = PowerOfTwo(seed=3)
    assert {p2.choose(request(f"y{i}", [7] * 10), pair, 0.0) for i in range(20)} == {1}
    # KV usage as the signal: replica 0 holds blocks once its queue is scheduled
    replicas[0].sched.schedule(0.0)
    assert LeastLoad("kv").choose(request("z", [7] * 10), pair, 0.0) == 1


def test_least_load_ties_go_to_the_fewest_routed_then_the_lowest_index() -> None:
    replicas = [FakeReplica(processed=5), FakeReplica(processed=2), FakeReplica(processed=2)]
    assert LeastLoad().choose(request("x", [7] * 10), replicas, 0.0) == 1


def test_cache_aware_keeps_a_shared_prefix_on_one_replica() -> None:
    replicas = [FakeReplica(), FakeReplica()]
    queue(replicas[0], 1, tag="warm")  # replica 1 is the least loaded
    ca = CacheAware()
    system = list(range(100, 196))  # 96 tokens: six whole pages
    first = route(ca, replicas, request("a", system + [1, 2, 3, 4]))
    assert first == 1  # nothing matched: the least loaded
    # 96 of 110 tokens match (87%): the replica that was sent the prefix, though it is
    # now the busier one
    assert route(ca, replicas, request("b", system + [9] * 14)) == 1
    # a prompt that shares only 32 of its 100 tokens (32%) goes to the least loaded
    assert route(ca, replicas, request("c", system[:32] + [8] * 68)) == 0


def test_cache_aware_falls_back_to_least_loaded_when_imbalanced() -> None:
    replicas = [FakeReplica(), FakeReplica()]
    ca = CacheAware()
    system = list(range(300, 364))
    assert route(ca, replicas, request("a", system + [1])) == 0
    queue(replicas[0], 39, tag="flood")  # 40 against 0: diff 40 > 32 and 40 > 1.1 x 0
    assert ca.imbalanced(replicas)
    assert route(ca, replicas, request("b", system + [2])) == 1


def test_prefix_hash_sends_a_prefix_home_unless_home_is_overloaded() -> None:
    replicas = [FakeReplica() for _ in range(4)]
    for i, r in enumerate(replicas):
        queue(r, 2, tag=f"base{i}-")
    ph = PrefixHash(4, prefix_tokens=32)
    prompt = list(range(500, 532))
    home = ph.home(prompt)
    # home at 2 of 8: within (8 + 1) / 4 x 1.25 = 2.81
    assert route(ph, replicas, request("a", prompt + [1])) == home
    # same first 32 tokens; home at 3 of 9: within (9 + 1) / 4 x 1.25 = 3.12
    assert route(ph, replicas, request("b", prompt + [2, 3])) == home
    # home at 4 of 10: over (10 + 1) / 4 x 1.25 = 3.44, so the least loaded (lowest index)
    assert route(ph, replicas, request("c", prompt + [4])) == (1 if home == 0 else 0)


def _serve(sched: Scheduler, req: Request) -> None:
    """Run `req` (max_tokens 1) to completion, leaving its prompt's blocks cached."""
    sched.add_request(req)
    plan = sched.schedule(0.0)
    sched.update_from_output(plan, ModelRunnerOutput(plan.step_id, {req.request_id: 1}), 0.1)
    assert not sched.has_unfinished_requests()


def test_predicted_ttft_picks_the_earlier_forecast() -> None:
    replicas = [FakeReplica(), FakeReplica()]
    queue(replicas[0], 3, prompt_len=2000)  # 6,000 tokens of prefill ahead
    queue(replicas[1], 1, prompt_len=2000)
    req = request("x", [42] * 500)
    ahead0, ahead1 = (forecast_ttft(r.sched, req, 0.0) for r in replicas)
    assert ahead1 < ahead0
    assert PredictedTTFT().choose(req, replicas, 0.0) == 1


def test_predicted_ttft_counts_the_prefix_cache_hit() -> None:
    replicas = [FakeReplica(), FakeReplica()]
    system = list(range(2000, 3024))  # 1,024 tokens
    _serve(replicas[1].sched, request("earlier", system + [7], max_tokens=1))
    queue(replicas[1], 1, prompt_len=200)  # replica 1 is also the busier one
    req = request("x", system + [5] * 64)
    pool = replicas[1].sched.kv.pool
    before = (list(pool.free_queue), dict(pool.cached), list(pool.ref_counts))
    assert cached_prefix_tokens(replicas[1].sched, req) == 1024
    assert (list(pool.free_queue), dict(pool.cached), list(pool.ref_counts)) == before
    cold, warm = (forecast_ttft(r.sched, req, 0.0) for r in replicas)
    # another step cost in the forecast's place, for the forecast only
    config = replicas[0].sched.config
    assert forecast_ttft(replicas[0].sched, req, 0.0, lambda b: 10 * cost(b)) == \
        pytest.approx(10 * cold)
    assert replicas[0].sched.config is config
    # cold prefills 1,088 tokens; warm 200 ahead + the 64 past the hit
    assert warm < cold
    assert PredictedTTFT().choose(req, replicas, 0.0) == 1


def _toy_args(*extra: str) -> object:
    return cluster_lab.build_parser().parse_args(
        ["--sessions-per-replica", "3", "--system-len", "64", "--user-len", "8:32",
         "--answer-len", "4:24", "--turns", "2:3", "--think-s", "0.5", "--session-rate", "4",
         "--num-gpu-blocks", "64", *extra])


@pytest.mark.parametrize("router", ROUTERS)
def test_every_request_finishes_once_on_one_replica_and_blocks_come_back(router: str) -> None:
    args = _toy_args()
    workload = cluster_lab.trace_at(args, 3, None, None)
    result = cluster_lab.run_cluster(args, 3, router, workload, check_integrity=True)
    ids = {w.request_id for w in workload}
    assert not result.unfinished and result.stop_reason == "done"
    assert set(result.assignment) == ids
    finished = [rid for rep in result.replicas for rid in rep.finished]
    assert sorted(finished) == sorted(ids)  # each exactly once
    for rep in result.replicas:
        assert {result.assignment[rid] for rid in rep.finished} <= {rep.index}
        assert rep.sched.kv.pool.num_used == 0
        rep.sched.check_integrity()
    assert all(r.success for r in result.records)
    summary = result.summary()
    assert sum(summary["routed_per_replica"]) == len(ids)
    assert 0.0 < summary["prefix_cache_hit_rate"] < 1.0


def test_multi_turn_turns_extend_the_previous_prompt_and_answer() -> None:
    shape = cluster_lab.MultiTurn(sessions=2, system_prompts=1, system_len=16,
                                  turns=(3, 3), user_len=(4, 4), answer_len=(5, 5))
    wl = cluster_lab.multi_turn_workload(shape, 1.0)
    turns = sorted((w for w in wl if w.request_id.startswith("s0-")), key=lambda w: w.arrival_time)
    assert [w.prompt_len for w in turns] == [20, 29, 38]
    first, second = (w.prompt_token_ids or [] for w in turns[:2])
    assert second[:20] == first and second[20:25] == [1] * 5
    other = next(w for w in wl if w.request_id == "s1-t0").prompt_token_ids or []
    assert other[:16] == first[:16]  # one system prompt, shared


def test_cluster_command_sweeps_and_writes_table_json_and_plot(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    out = tmp_path / "cl"
    argv = ["cluster", "--sweep", "--replicas", "1,2", "--load", "0.8", "--router",
            "round_robin,predicted_ttft", "--sessions-per-replica", "3", "--system-len", "64",
            "--user-len", "8:32", "--answer-len", "4:24", "--turns", "2:3", "--think-s", "0.5",
            "--num-gpu-blocks", "64", "--out-dir", str(out), "--disable-tqdm"]
    assert simulate(argv) == 0
    table = capsys.readouterr().out
    assert "| 2 | 0.8 |" in table and "| predicted_ttft |" in table
    rows = json.loads((out / "cluster.json").read_text())
    assert [(r["replicas"], r["router"]) for r in rows] == [
        (1, "round_robin"), (1, "predicted_ttft"), (2, "round_robin"), (2, "predicted_ttft")]
    assert (out / "cluster.md").read_text().startswith("| replicas |")
    assert (out / "cluster.png").stat().st_size > 0


def test_unknown_router_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate(["cluster", "--router", "nearest"]) == 2
    assert "round_robin" in capsys.readouterr().err


def test_predicted_ttft_keeps_a_session_home_within_the_tolerance(
        monkeypatch: pytest.MonkeyPatch) -> None:
    replicas = [FakeReplica(), FakeReplica(), FakeReplica()]
    cached = {id(replicas[0].sched): 0, id(replicas[1].sched): 1024, id(replicas[2].sched): 512}
    forecasts: dict[int, float] = {}
    monkeypatch.setattr(routers, "cached_prefix_tokens", lambda sched, req: cached[id(sched)])
    monkeypatch.setattr(routers, "forecast_ttft",
                        lambda sched, req, now, cost=None: forecasts[id(sched)])
    router, req = PredictedTTFT(), request("x", [5] * 64)
    a, b, c = (id(r.sched) for r in replicas)
    forecasts.update({a: 0.100, b: 0.135, c: 0.120})  # home within 40 ms of the best
    assert router.choose(req, replicas, 0.0) == 1
    forecasts.update({a: 0.100, b: 0.150, c: 0.120})  # home 50 ms late: the next most cached
    assert router.choose(req, replicas, 0.0) == 2
    forecasts.update({a: 0.100, b: 0.150, c: 0.145})  # both late: the earliest
    assert router.choose(req, replicas, 0.0) == 0


def _capacity_args(*extra: str) -> argparse.Namespace:
    return cluster_lab.build_parser().parse_args(
        ["--sessions-per-replica", "12", "--system-len", "64", "--user-len", "8:32",
         "--answer-len", "4:24", "--turns", "2:3", "--think-s", "0.5",
         "--num-gpu-blocks", "64", *extra])


@pytest.mark.parametrize("knee", [0.3, 7.3, 9.9])
def test_goodput_capacity_bisects_to_the_highest_rate_meeting_the_attainment(
        monkeypatch: pytest.MonkeyPatch, knee: float) -> None:
    asked: list[float] = []

    def attainment(args: object, rate: float, slo: dict[str, float]) -> float:
        assert slo == {"ttft": 2000.0, "tpot": 100.0}  # the policy lab's SLO by default
        asked.append(rate)
        return 0.95 if rate <= knee else 0.85

    monkeypatch.setattr(cluster_lab, "attainment", attainment)
    monkeypatch.setattr(cluster_lab, "all_at_once_capacity", lambda args: 10.0)
    cap = cluster_lab.goodput_capacity(_capacity_args())
    assert knee / 1.02 <= cap <= knee
    assert asked[0] == 10.0 and len(asked) <= 16


def test_goodput_capacity_is_the_all_at_once_one_where_the_slo_never_binds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_lab, "attainment", lambda args, rate, slo: 1.0)
    monkeypatch.setattr(cluster_lab, "all_at_once_capacity", lambda args: 10.0)
    assert cluster_lab.goodput_capacity(_capacity_args()) == 10.0


def test_goodput_capacity_on_a_trace_meets_the_attainment_there() -> None:
    args = _capacity_args("--goodput", "ttft:20", "--capacity-attainment", "0.8")
    cap = cluster_lab.goodput_capacity(args)
    assert 0.0 < cap < cluster_lab.all_at_once_capacity(args)
    assert cluster_lab.attainment(args, cap, {"ttft": 20.0}) >= 0.8


def test_an_unreachable_slo_is_an_error_not_a_capacity(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["cluster", "--load", "0.9", "--goodput", "ttft:0.001", "--sessions-per-replica",
            "3", "--system-len", "64", "--user-len", "8:32", "--answer-len", "4:24",
            "--turns", "2:3", "--num-gpu-blocks", "64", "--disable-tqdm"]
    assert simulate(argv) == 2
    assert "meet the SLO ttft:0.001" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate(["cluster", "--capacity-attainment", "1.5"])
    assert "must be in (0, 1]" in capsys.readouterr().err
